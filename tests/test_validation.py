"""Validation before side effects: a put with a field of the wrong type or range is
refused naming the message and the field, and takes no queue offset (no hole); a get
with a bad argument is refused at the API; both storage modes, and the CommitLog alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.store import GetStatus, PutStatus, Store
from commitlog import AppendStatus, CommitLog, CommitLogConfig, InvalidInputError, Message

# Per field of a Message: values of the wrong type, or out of range.
WRONG: dict[str, list[Any]] = {
    "topic": [5, None, b"orders", ["orders"]],
    "queue_id": [1.0, True, "1", None, 2**40, [1]],
    "body": ["text", None, 5, ["x"], {"b": 1}],
    "tags": [7, None, b"tag", ["a"], 0],
    "keys": [7, None, b"key", ["a"], 0],
    "properties": [{"a": 1}, {1: "a"}, ["a"], None, "ab", {"a": b"x"}, 0],
    "flags": [-1, 2**32, 1.5, "1", None, True],
    "born_timestamp_ms": [-1, 2**64, 1.5, None, "1", False],
    "born_host": [
        ("1.2.3.4",),
        ("nope", 1),
        ("1.2.3.4", 70000),
        ("1.2.3.4", "80"),
        "1.2.3.4:80",
        None,
        ["1.2.3.4", 80],
        (1234, 5),
        ("1.2.3.4", -1),
    ],
    "reconsume_times": [-1, 2**32, 0.5, None, "0"],
}
FIELD_VALUES = [(f, v) for f, values in WRONG.items() for v in values]


def good(queue: int, i: int) -> Message:
    return Message("orders", queue, b"good-%d" % i, tags="T", keys=f"k{i}", properties={"p": "v"})


def bad_message(field: str, value: Any, queue: int) -> Message:
    m = good(queue, -1)
    setattr(m, field, value)
    return m


def expected_error(field: str) -> str:
    return "'born_host'" if field == "born_host" else repr(field)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=st.sampled_from(FIELD_VALUES), before=st.integers(0, 5), after=st.integers(0, 5), queue=st.integers(0, 3))
def test_a_wrong_field_is_refused_naming_it_and_leaves_no_hole(store: Store, case: tuple[str, Any], before: int,
                                                              after: int, queue: int) -> None:  # fmt: skip
    field, value = case
    probe = store.put_batch([good(queue, 0)])  # where the queue is now
    assert probe.ok
    end = store.end_offset
    batch = [good(queue, 1) for _ in range(before)] + [bad_message(field, value, queue)] + [good(queue, 2)] * after
    res = store.put_batch(batch)
    if field == "queue_id" and type(value) is int:  # an int, but no queue of the topic
        assert res.status is PutStatus.INVALID_QUEUE_ID, (value, res)
    else:
        assert res.status is PutStatus.INVALID_MESSAGE, (field, value, res)
        assert f"message {before} of {len(batch)}" in res.error and expected_error(field) in res.error
    assert store.end_offset == end  # nothing of the batch was written
    nxt = store.put_batch([good(queue, 3)])
    assert nxt.ok and nxt.queue_offsets == [probe.queue_offsets[0] + 1]  # dense: no offset was lost
    store.catch_up()
    got = store.get("orders", queue, probe.queue_offsets[0], 10)
    assert [r.body for r in got.messages] == [b"good-0", b"good-3"]


def test_every_wrong_field_is_refused_by_the_commitlog_alone(tmp_path: Path) -> None:
    """CommitLog.append without the store in front: the encoder checks before it takes
    queue offsets, so a refused batch leaves the queue-offset table as it was."""
    log = CommitLog.open(
        tmp_path, CommitLogConfig(segment_bytes=1 << 20, max_message_bytes=1 << 16), clean=True, checkpoint_offset=None
    )
    try:
        assert log.append([good(0, 0)]).ok
        for field, value in FIELD_VALUES:
            if field == "topic" and value is None:
                continue  # None is refused too; covered by the next line's kinds
            table = log.queue_offset_table()
            res = log.append([good(0, 1), good(1, 1), bad_message(field, value, 0)])
            assert res.status is AppendStatus.INVALID_MESSAGE, (field, value, res)
            assert "message 2 of 3" in res.error and expected_error(field) in res.error, res.error
            assert log.queue_offset_table() == table, (field, value)
        res = log.append([good(0, 2)])
        assert res.ok and res.queue_offsets == [1]
    finally:
        log.close()


# ----------------------------------------------------------------------- get
@pytest.mark.parametrize(
    ("args", "name"),
    [
        (("orders", 0, 0, 0), "max_messages"),
        (("orders", 0, 0, -3), "max_messages"),
        (("orders", 0, 0, 1.5), "max_messages"),
        (("orders", 0, 0, None), "max_messages"),
        (("orders", 0, "0", 10), "offset"),
        (("orders", 0, 1.0, 10), "offset"),
        (("orders", 0, None, 10), "offset"),
        (("orders", "0", 0, 10), "queue_id"),
        (("orders", True, 0, 10), "queue_id"),
        ((5, 0, 0, 10), "topic"),
        ((None, 0, 0, 10), "topic"),
    ],
)
def test_get_with_a_bad_argument_is_refused_naming_it(store: Store, args: tuple[Any, ...], name: str) -> None:
    store.put_batch([good(0, 0)])
    store.catch_up()
    for read in (store.get, store.read_raw):
        with pytest.raises(InvalidInputError, match=repr(name)):
            read(*args)
    with pytest.raises(InvalidInputError, match="'tags'"):
        store.get("orders", 0, 0, 10, tags="T")  # a string is not a set of tags (it would be its letters)
    with pytest.raises(InvalidInputError, match="'tags'"):
        store.get("orders", 0, 0, 10, tags=[1])
    with pytest.raises(InvalidInputError, match="'max_bytes'"):
        store.read_raw("orders", 0, 0, 10, max_bytes=0)
    got = store.get("orders", 0, 0, 1)  # the store still answers
    assert got.status is GetStatus.FOUND and len(got.messages) == 1


def test_get_at_a_negative_offset_is_a_result(store: Store) -> None:
    store.put_batch([good(0, 0)])
    store.catch_up()
    got = store.get("orders", 0, -5, 10)
    assert got.status is GetStatus.OFFSET_TOO_SMALL and got.next_offset == 0

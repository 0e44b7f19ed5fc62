"""Deduplication of retried batches (``broker/service/_dedup.py``): the look-back through
a queue's tail on a real store (found with the first try's offsets, not found, partly
found, the window's limits, other queues), the wait for the dispatcher, and the
broker's answer to SEND_MESSAGE with ``dedup`` (real broker, real sockets)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Iterator

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clmq.broker.service._dedup import (
    UNIQ_KEY,
    DedupLimits,
    PartlyStored,
    find_stored,
    find_stored_queues,
    place,
    visible_end,
    wait_visible,
)
from clmq.broker.store import Store
from clmq.client import RpcClient
from clmq.common import Message
from clmq.protocol import ErrorCode, RequestCode, encode_batch
from tests.conftest import small_config
from tests.service_helpers import Cluster

LIMITS = DedupLimits(window_ms=60_000, max_messages=1000, catch_up_timeout_ms=2000)


def keyed(topic: str, queue_id: int, keys: list[str]) -> list[Message]:
    return [Message(topic, queue_id, b"body of " + k.encode(), properties={UNIQ_KEY: k}) for k in keys]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store.open(small_config(tmp_path / "store")).start()
    s.create_topic("t", 2)
    yield s
    s.close()


def put(store: Store, msgs: list[Message]) -> tuple[list[int], list[int]]:
    result = store.put_batch(msgs)
    assert result.ok, result
    store.catch_up()
    return result.queue_offsets, result.commitlog_offsets


def now_of(store: Store) -> int:
    return store.get("t", 0, store.max_offset("t", 0) - 1, 1).messages[0].store_timestamp_ms


# ------------------------------------------------------------- the look-back
def test_a_stored_batch_is_found_with_its_first_offsets_among_others(store: Store) -> None:
    put(store, keyed("t", 0, [f"before-{i}" for i in range(300)]))  # more than one read chunk before it
    qoffs, coffs = put(store, keyed("t", 0, ["a", "b", "c"]))
    put(store, keyed("t", 0, [f"after-{i}" for i in range(300)]))
    found = find_stored(store, "t", 0, ["a", "b", "c"], LIMITS, now_of(store))
    assert found is not None
    assert (found.queue_offsets, found.commitlog_offsets) == (qoffs, coffs) == ([300, 301, 302], coffs)
    last = store.get("t", 0, 302, 1).messages[0]
    assert found.end_offset == last.commitlog_offset + last.size


def test_a_batch_not_stored_is_not_found_nor_one_in_another_queue(store: Store) -> None:
    put(store, keyed("t", 0, ["x", "y"]))
    put(store, keyed("t", 1, ["a", "b"]))
    now = now_of(store)
    assert find_stored(store, "t", 0, ["a", "b"], LIMITS, now) is None  # only in queue 1
    assert find_stored(store, "t", 0, ["z"], LIMITS, now) is None
    assert find_stored(store, "t", 1, ["a", "b"], LIMITS, now) is not None
    assert find_stored(store, "nope", 0, ["a"], LIMITS, now) is None  # no such queue: the append answers


def test_a_batch_found_in_part_gives_its_first_part_and_anything_else_is_refused(store: Store) -> None:
    qoffs, coffs = put(store, keyed("t", 0, ["a", "b", "c"]))
    now = now_of(store)
    for keys, count in ((["a", "b", "x"], 2), (["a", "b", "c", "d"], 3), (["a", "x", "y"], 1)):
        found = find_stored(store, "t", 0, keys, LIMITS, now)  # the first part: what a promoted follower holds
        assert found is not None and (found.queue_offsets, found.commitlog_offsets) == (qoffs[:count], coffs[:count])
    whole = find_stored(store, "t", 0, ["a", "c"], LIMITS, now)  # others between (written meanwhile): still whole
    assert whole is not None and whole.queue_offsets == [0, 2]
    for keys, why in (
        (["x", "b"], "message 1 is stored but its message 0 is not"),
        (["b", "a"], "not in the batch's order"),
    ):
        with pytest.raises(PartlyStored, match=why):
            find_stored(store, "t", 0, keys, LIMITS, now)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    size=st.integers(1, 6),
    data=st.data(),
)
def test_any_first_part_is_found_and_the_rest_placed_after_it(tmp_path: Path, size: int, data: st.DataObject) -> None:
    """A batch of ``size`` messages over two queues, stored in part (each queue's first
    messages, as a promoted follower may hold them), with other messages before, between
    and after: :func:`place` puts every found message at its stored offsets and marks
    exactly the others missing; once those are appended the batch is found whole."""
    s = Store.open(small_config(Path(tempfile.mkdtemp(dir=tmp_path)))).start()  # a fresh store per example
    try:
        s.create_topic("t", 2)
        qids = data.draw(st.lists(st.integers(0, 1), min_size=size, max_size=size))
        msgs = [keyed("t", q, [f"m{i}"])[0] for i, q in enumerate(qids)]
        cut = {q: data.draw(st.integers(0, qids.count(q))) for q in (0, 1)}
        put(s, keyed("t", 0, ["before"]))
        held = [m for q in (0, 1) for m in [m for m in msgs if m.queue_id == q][: cut[q]]]
        if held:
            put(s, held)
        put(s, keyed("t", data.draw(st.integers(0, 1)), ["after"]))
        keys = {q: [m.properties[UNIQ_KEY] for m in msgs if m.queue_id == q] for q in (0, 1)}
        where = place(qids, find_stored_queues(s, "t", keys, LIMITS, now_of_any(s)))
        if not held:
            assert where is None
            return
        assert where is not None
        assert [msgs[i].properties[UNIQ_KEY] for i in where.missing] == [
            m.properties[UNIQ_KEY] for m in msgs if m not in held
        ]
        rest = [msgs[i] for i in where.missing]
        appended = put(s, rest) if rest else ([], [])
        qoffs, _coffs = where.offsets(appended)
        for m, qoff in zip(msgs, qoffs):
            assert s.get("t", m.queue_id, qoff, 1).messages[0].properties[UNIQ_KEY] == m.properties[UNIQ_KEY]
        again = place(qids, find_stored_queues(s, "t", keys, LIMITS, now_of_any(s)))
        assert again is not None and not again.missing and again.offsets() == where.offsets(appended)
    finally:
        s.close()


def now_of_any(store: Store) -> int:
    return max(
        store.get("t", q, store.max_offset("t", q) - 1, 1).messages[0].store_timestamp_ms
        for q in (0, 1)
        if store.max_offset("t", q) > 0
    )


def test_the_look_back_stops_at_the_window_in_entries_and_in_time(store: Store) -> None:
    put(store, keyed("t", 0, ["old"]))
    put(store, keyed("t", 0, [f"m{i}" for i in range(50)]))
    now = now_of(store)
    assert find_stored(store, "t", 0, ["old"], DedupLimits(max_messages=51), now) is not None
    assert find_stored(store, "t", 0, ["old"], DedupLimits(max_messages=50), now) is None  # 50 newer ones fill it
    stamp = store.get("t", 0, 0, 1).messages[0].store_timestamp_ms
    assert find_stored(store, "t", 0, ["old"], DedupLimits(window_ms=1000), stamp + 1000) is not None
    assert find_stored(store, "t", 0, ["old"], DedupLimits(window_ms=1000), now + 1001) is None  # all older


# -------------------------------------------------------- dispatch and replication
async def test_the_check_waits_for_the_dispatcher_and_for_the_confirmed_offset(tmp_path: Path) -> None:
    store = Store.open(small_config(tmp_path / "store"))  # not started: nothing dispatches by itself
    try:
        store.create_topic("t", 1)
        assert store.put_batch(keyed("t", 0, ["a"])).ok
        assert visible_end(store) == -1 and not await wait_visible(store, 50)  # the dispatcher lags
        async with trio.open_nursery() as n:
            seen: list[bool] = []

            async def check() -> None:
                seen.append(await wait_visible(store, 10_000))

            n.start_soon(check)
            await trio.to_thread.run_sync(store.catch_up)
        assert seen == [True] and visible_end(store) == store.end_offset
        # Replication holds the confirmed offset back: the write is not visible yet.
        store.log.set_confirmed_offset(0)
        assert store.put_batch(keyed("t", 0, ["b"])).ok
        store.catch_up()
        assert not await wait_visible(store, 50)
        assert find_stored(store, "t", 0, ["b"], LIMITS, 2**62) is None  # why the wait matters
        store.log.set_confirmed_offset(None)
        store.catch_up()
        assert await wait_visible(store, 1000)
        assert find_stored(store, "t", 0, ["b"], LIMITS, now_of(store)) is not None
    finally:
        store.close()


# ------------------------------------------------------------------ the broker
async def test_the_broker_answers_a_stored_retry_with_its_first_offsets_and_appends_a_new_one(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    broker = await c.start_broker()
    await c.create_topic("t", 2)
    rpc = RpcClient(nursery)
    body = encode_batch(keyed("t", 1, ["k1", "k2"]))
    first = await rpc.request(broker.addr, RequestCode.SEND_MESSAGE, {"topic": "t"}, body)
    end = broker.store.end_offset
    again = await rpc.request(broker.addr, RequestCode.SEND_MESSAGE, {"topic": "t", "dedup": True}, body)
    assert again.fields["duplicate"] is True
    assert (again.fields["queue_offsets"], again.fields["commitlog_offsets"]) == (
        first.fields["queue_offsets"],
        first.fields["commitlog_offsets"],
    )
    assert broker.store.end_offset == end  # nothing appended
    new = await rpc.request(
        broker.addr, RequestCode.SEND_MESSAGE, {"topic": "t", "dedup": True}, encode_batch(keyed("t", 1, ["k3"]))
    )
    assert new.fields["queue_offsets"] == [2] and "duplicate" not in new.fields
    plain = await rpc.request(broker.addr, RequestCode.SEND_MESSAGE, {"topic": "t"}, body)  # no dedup asked: stored
    assert plain.fields["queue_offsets"] == [3, 4]
    await rpc.aclose()


async def test_a_dedup_field_of_the_wrong_type_is_a_malformed_request(nursery: trio.Nursery, tmp_path: Path) -> None:
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    broker = await c.start_broker()
    await c.create_topic("t", 1)
    rpc = RpcClient(nursery)
    body = encode_batch(keyed("t", 0, ["k"]))
    for bad in (1, "true", None, [True], {"x": 1}):
        reply = await rpc.request(
            broker.addr, RequestCode.SEND_MESSAGE, {"topic": "t", "dedup": bad}, body, check=False
        )
        assert reply.error_code == ErrorCode.MALFORMED_REQUEST and "dedup" in reply.error_text, (bad, reply)
    assert broker.store.end_offset == 0
    await rpc.aclose()


async def test_a_retried_multi_queue_request_is_answered_whole_or_appended_whole_or_refused(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """One request spanning queues is one append: its retry marked dedup is answered
    ``duplicate`` with every message's first offsets in request order (nothing
    appended); a request none of whose parts is stored is appended; one whose parts are
    stored in some queues and not in others is completed (the rest appended once); one
    stored out of its order is refused (not the request first sent)."""
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    broker = await c.start_broker()
    await c.create_topic("t", 3)
    rpc = RpcClient(nursery)
    await rpc.request(broker.addr, RequestCode.SEND_MESSAGE, {"topic": "t"}, encode_batch(keyed("t", 2, ["before"])))
    mixed = keyed("t", 0, ["a0"]) + keyed("t", 2, ["c0", "c1"]) + keyed("t", 1, ["b0"]) + keyed("t", 0, ["a1"])
    body = encode_batch(mixed)
    first = await rpc.request(broker.addr, RequestCode.SEND_MESSAGE, {"topic": "t"}, body)
    assert first.fields["queue_offsets"] == [0, 1, 2, 0, 1]
    end = broker.store.end_offset
    again = await rpc.request(broker.addr, RequestCode.SEND_MESSAGE, {"topic": "t", "dedup": True}, body)
    assert again.fields["duplicate"] is True
    assert again.fields["queue_offsets"] == first.fields["queue_offsets"]
    assert again.fields["commitlog_offsets"] == first.fields["commitlog_offsets"]
    assert broker.store.end_offset == end  # nothing appended
    fresh = encode_batch(keyed("t", 0, ["n0"]) + keyed("t", 1, ["n1"]))
    new = await rpc.request(broker.addr, RequestCode.SEND_MESSAGE, {"topic": "t", "dedup": True}, fresh)
    assert new.fields["queue_offsets"] == [2, 1] and "duplicate" not in new.fields
    # Queue 0's part stored, queue 1's not (a promoted follower may hold a request so): completed.
    half = encode_batch(keyed("t", 0, ["a0", "a1"]) + keyed("t", 1, ["never"]))
    done = await rpc.request(broker.addr, RequestCode.SEND_MESSAGE, {"topic": "t", "dedup": True}, half)
    assert done.fields["queue_offsets"] == [0, 1, 2] and done.fields["stored_before"] == 2
    assert done.fields["commitlog_offsets"][:2] == [first.fields["commitlog_offsets"][i] for i in (0, 4)]
    broker.store.catch_up()
    assert [r.body for r in broker.store.get("t", 1, 2, 10).messages] == [b"body of never"]
    swapped = encode_batch(keyed("t", 0, ["a1", "a0"]))  # stored, but not in this order: not the batch sent
    refused = await rpc.request(
        broker.addr, RequestCode.SEND_MESSAGE, {"topic": "t", "dedup": True}, swapped, check=False
    )
    assert refused.error_code == ErrorCode.INVALID_MESSAGE and "not in the batch's order" in refused.error_text
    await rpc.aclose()

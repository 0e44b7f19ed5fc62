"""Store.read_raw_many: the records of many queues read together answer exactly what the
per-queue loop of read_raw answers (StoreBase.read_raw_many), damage included."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any, Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clmq.broker.store import GetStatus, RawRead, Span, Store, StoreConfig
from clmq.broker.store._base import StoreBase
from clmq.commitlog import CommitLogConfig
from clmq.common import (
    HEADER_SIZE,
    OFF_COMMITLOG_OFFSET,
    OFF_QUEUE_ID,
    OFF_QUEUE_OFFSET,
    OFF_TOPIC_LEN,
    CorruptRecordError,
    Message,
)

TOPICS = {"t": 12, "a-longer-topic": 5}
TAGS = ["", "a", "b", "c"]


def _fill(s: Store, seed: int) -> None:
    """Queues interleaved in the log (records of one queue far apart or neighbours),
    some written alone in long runs (kept as file spans), sizes from tiny to 20 KiB."""
    rng = random.Random(seed)
    for topic, n in TOPICS.items():
        s.create_topic(topic, n)
    keys = [(t, q) for t, n in TOPICS.items() for q in range(n)]
    for _ in range(40):
        if rng.random() < 0.15:  # one queue alone: a log-contiguous run of 80 KiB or more
            t, q = rng.choice(keys)
            batch = [Message(t, q, os.urandom(1024), rng.choice(TAGS)) for _ in range(rng.randint(80, 120))]
        else:
            batch = []
            for _ in range(rng.randint(1, 60)):
                t, q = rng.choice(keys)
                size = rng.choice([rng.randint(0, 300), rng.randint(300, 3000), rng.randint(3000, 20_000)])
                batch.append(Message(t, q, os.urandom(size), rng.choice(TAGS)))
        s.put_batch(batch)
    s.catch_up()


def _open(path: Path, segment_bytes: int) -> Store:
    log = CommitLogConfig(segment_bytes=segment_bytes, max_message_bytes=32 * 1024)
    return Store.open(StoreConfig(path, log, cq_entries_per_file=50)).start()


@pytest.fixture(scope="module", params=[4 << 20, 128 << 10], ids=["segments-4MiB", "segments-128KiB"])
def filled(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    """A filled store; with 128 KiB segments many windows meet a segment end."""
    s = _open(tmp_path_factory.mktemp("many"), request.param)
    _fill(s, request.param)
    yield s
    s.close()


def _bytes(span: Span) -> bytes:
    if span.data is not None:
        return bytes(span.data)
    assert span.path is not None
    with open(span.path, "rb") as f:
        return os.pread(f.fileno(), span.length, span.position)


def _answer(res: RawRead | CorruptRecordError | None) -> Any:
    if res is None or isinstance(res, CorruptRecordError):
        return res if res is None else ("corrupt", str(res))
    return res.status, res.count, res.next_offset, res.min_offset, res.max_offset, b"".join(map(_bytes, res.spans))


def _both(s: Store, asks: list[Any], limits: tuple[int, int, int]) -> tuple[list[Any], list[Any]]:
    many = s.read_raw_many(asks, *limits)
    per_queue = StoreBase.read_raw_many(s, asks, *limits)
    return [_answer(r) for r in many], [_answer(r) for r in per_queue]


ask_st = st.tuples(
    st.sampled_from([(t, q) for t, n in TOPICS.items() for q in range(n + 1)]),  # q == n: no such queue
    st.integers(0, 140),
    st.one_of(st.none(), st.lists(st.sampled_from(TAGS), min_size=1, max_size=3)),
).map(lambda a: (a[0][0], a[0][1], a[1], a[2]))
limits_st = st.tuples(st.integers(1, 600), st.integers(1, 300), st.integers(1, 600_000))


@settings(max_examples=60, deadline=None)
@given(asks=st.lists(ask_st, max_size=40), limits=limits_st)
def test_many_queues_answer_what_the_per_queue_loop_answers(
    filled: Store, asks: list[Any], limits: tuple[int, int, int]
) -> None:
    many, per_queue = _both(filled, asks, limits)
    assert many == per_queue
    max_messages, max_per_queue, max_bytes = limits
    reads = [r for r in many if r is not None and r[0] is GetStatus.FOUND]
    assert sum(r[1] for r in reads) <= max_messages
    assert all(r[1] <= max_per_queue for r in reads)
    assert sum(len(r[5]) for r in reads) <= max_bytes or (len(reads) == 1 and reads[0][1] == 1)


def test_small_records_are_bytes_and_long_runs_stay_file_spans(tmp_path: Path) -> None:
    s = _open(tmp_path, 4 << 20)
    try:
        s.create_topic("t", 3)
        s.put_batch([Message("t", i % 2, b"x" * 1000) for i in range(40)])  # queues 0 and 1 interleaved
        s.put_batch([Message("t", 2, b"y" * 1000) for _ in range(100)])  # queue 2 alone: 100 KiB in a row
        s.catch_up()
        got = s.read_raw_many([("t", 0, 0, None), ("t", 1, 0, None), ("t", 2, 0, None)], 1000, 200, 1 << 20)
        assert [r.count for r in got if isinstance(r, RawRead)] == [20, 20, 100]
        interleaved, alone = got[:2], got[2]
        assert all(sp.data is not None for r in interleaved if isinstance(r, RawRead) for sp in r.spans)
        assert isinstance(alone, RawRead) and alone.spans and all(sp.path is not None for sp in alone.spans)
    finally:
        s.close()


def _checked_bytes(topic_len: int) -> list[int]:
    """Positions in a record whose damage the identity check must see."""
    fields = [
        (0, 8),
        (OFF_COMMITLOG_OFFSET, 8),
        (OFF_QUEUE_OFFSET, 8),
        (OFF_QUEUE_ID, 4),
        (OFF_TOPIC_LEN, 2),
        (HEADER_SIZE, topic_len),
    ]
    return [p for start, n in fields for p in range(start, start + n)]


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_a_damaged_record_is_reported_for_its_queue_as_by_the_per_queue_read(
    filled: Store, data: st.DataObject
) -> None:
    keys = [(t, q) for t, n in TOPICS.items() for q in range(n) if filled.max_offset(t, q) > 0]
    topic, qid = data.draw(st.sampled_from(keys))
    at = data.draw(st.integers(0, filled.max_offset(topic, qid) - 1))
    rec = filled.get(topic, qid, at, 1).messages[0]
    checked = data.draw(st.booleans())
    pos = data.draw(st.sampled_from(_checked_bytes(len(topic))) if checked else st.integers(0, rec.size - 1))
    asks = [(t, q, 0 if (t, q) != (topic, qid) else data.draw(st.integers(0, at)), None) for t, q in keys]
    asks = data.draw(st.permutations(asks))
    limits = (100_000, 1_000, 64 << 20)
    baseline = _both(filled, asks, limits)[0]
    where = filled.log.file_span(rec.commitlog_offset, rec.size)
    assert where is not None
    fd = os.open(where[0], os.O_RDWR)
    try:
        old = os.pread(fd, 1, where[1] + pos)
        os.pwrite(fd, bytes([old[0] ^ data.draw(st.integers(1, 255))]), where[1] + pos)
        many, per_queue = _both(filled, asks, limits)
    finally:
        os.pwrite(fd, old, where[1] + pos)
        os.close(fd)
    assert many == per_queue
    damaged = next(i for i, a in enumerate(asks) if a[:2] == (topic, qid))
    assert [r for i, r in enumerate(many) if i != damaged] == [r for i, r in enumerate(baseline) if i != damaged]
    if checked and asks[damaged][2] == at:
        assert many[damaged][0] == "corrupt" and f"offset {rec.commitlog_offset}" in many[damaged][1]

"""Small pulls of fresh records are read on the broker's event loop (issue 34, end-to-end
latency): a consumer at the head of its queues asks next from where the last answer
left them at their end, so what it reads was appended since, seconds ago at most (in
the page cache, its queue entries in memory). Such a pull of at most
``INLINE_MAX_QUEUES`` queues, each at most ``INLINE_MAX_BEHIND`` messages behind, skips
the hop to a read thread and back (two wake-ups, each waiting for the GIL on a busy
broker: about 1 ms of a delivery's 2-3 ms at 10k msgs/s); anything else is read in the
threads as before. Its answer is the threads' answer. A real broker on 127.0.0.1."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clmq.broker.service import Broker, _fetch
from clmq.broker.service._fetch import INLINE_MAX_BEHIND, INLINE_MAX_QUEUES, Fetch
from clmq.broker.service._read_threads import FreshPositions
from clmq.broker.store import Span
from clmq.client import RpcClient
from clmq.protocol import RequestCode, decode_records
from tests.service_helpers import Cluster, one_broker
from tests.test_consumer_many_queues import fill
from tests.waiting import await_until

QUEUES = 4
LONG_WAIT_MS = 20_000  # never reached by a test that passes


@pytest.fixture
async def cluster(nursery: trio.Nursery, tmp_path: Path) -> Cluster:
    return await one_broker(nursery, tmp_path)


async def pull(addr: str, asks: list[list[Any]], wait_ms: int = 0) -> tuple[list[list[Any]], list[bytes]]:
    async with trio.open_nursery() as n:
        rpc = RpcClient(n)
        reply = await rpc.request(
            addr, RequestCode.PULL_MESSAGES, {"queues": asks, "max_wait_ms": wait_ms}, timeout_ms=LONG_WAIT_MS + 5000
        )
        await rpc.aclose()
    return reply.fields["results"], [r.body for r in decode_records(reply.body, "test")]


def counts(broker: Broker) -> tuple[int, int]:
    """(pulls read on the event loop, pulls read in a read thread)."""
    stats = broker.handlers.readers.stats
    return stats.inline_pulls, stats.hot_pulls + stats.cold_pulls


async def stored(broker: Broker, topic: str, bodies: dict[int, list[bytes]]) -> None:
    await fill(broker.addr, topic, bodies)
    await trio.to_thread.run_sync(broker.store.catch_up)


async def caught_up(cluster: Cluster, topic: str, queues: int, each: int) -> Broker:
    """A topic whose queues hold ``each`` messages, pulled once to their end (which the
    broker remembers)."""
    await cluster.create_topic(topic, queues)
    broker = cluster.brokers["broker-a"]
    await stored(broker, topic, {q: [f"old-{q}-{i}".encode() for i in range(each)] for q in range(queues)})
    rows, _ = await pull(broker.addr, [[topic, q, 0, None] for q in range(queues)])
    assert [r[1] for r in rows] == [each] * queues
    return broker


async def test_the_next_pull_from_where_an_answer_caught_up_is_read_on_the_event_loop(cluster: Cluster) -> None:
    broker = await caught_up(cluster, "i", QUEUES, 3)
    await stored(broker, "i", {2: [b"new-0", b"new-1"], 3: [b"new-2"]})
    inline, threads = counts(broker)
    rows, bodies = await pull(broker.addr, [["i", q, 3, None] for q in range(QUEUES)])
    assert counts(broker) == (inline + 1, threads)
    assert bodies == [b"new-0", b"new-1", b"new-2"]
    assert [r[:3] for r in rows] == [["NO_MESSAGE", 3, 0], ["NO_MESSAGE", 3, 0], ["FOUND", 5, 2], ["FOUND", 4, 1]]
    # and the answer left every queue at its end again: the next one is inline too
    await stored(broker, "i", {0: [b"new-3"]})
    rows, bodies = await pull(broker.addr, [["i", q, r[1], None] for q, r in enumerate(rows)])
    assert bodies == [b"new-3"] and counts(broker) == (inline + 2, threads)


async def test_a_watch_woken_by_an_arrival_is_read_on_the_event_loop(cluster: Cluster) -> None:
    broker = await caught_up(cluster, "w", QUEUES, 2)
    inline, threads = counts(broker)
    waiting = broker.waiters.waiting
    answer: list[Any] = []

    async def watch() -> None:
        answer.append(await pull(broker.addr, [["w", q, 2, None] for q in range(QUEUES)], LONG_WAIT_MS))

    with trio.fail_after(15):
        async with trio.open_nursery() as n:
            n.start_soon(watch)
            await await_until(lambda: broker.waiters.waiting >= waiting + QUEUES, 10, "every queue watched")
            await stored(broker, "w", {1: [b"arrived"]})
    rows, bodies = answer[0]
    assert bodies == [b"arrived"] and rows[1][:3] == ["FOUND", 3, 1]
    # its look before the wait and its read after: both on the event loop
    assert counts(broker) == (inline + 2, threads)


@pytest.mark.parametrize("why", ["never pulled", "too far behind", "too many queues", "past the end"])
async def test_other_pulls_are_read_in_the_read_threads(cluster: Cluster, why: str) -> None:
    queues = INLINE_MAX_QUEUES + 1 if why == "too many queues" else QUEUES
    broker = await caught_up(cluster, "t", queues, 1)
    asks = [["t", q, 1, None] for q in range(queues)]
    if why == "never pulled":
        asks[0][2] = 0  # a position no answer left it at
    elif why == "too far behind":
        await stored(broker, "t", {0: [b"x"] * (INLINE_MAX_BEHIND + 1)})
    elif why == "past the end":
        asks[0][2] = 5  # not yet visible or overflow: told apart in a thread
    inline, threads = counts(broker)
    rows, _bodies = await pull(broker.addr, asks)
    assert counts(broker) == (inline, threads + 1)
    if why == "too far behind":
        assert rows[0][:3] == ["FOUND", INLINE_MAX_BEHIND + 2, INLINE_MAX_BEHIND + 1]


def _body(spans: list[Span]) -> bytes:
    out = b""
    for s in spans:
        if s.data is not None:
            out += s.data
        else:
            assert s.path is not None
            with open(s.path, "rb") as f:
                f.seek(s.position)
                out += f.read(s.length)
    return out


async def test_an_inline_read_answers_what_the_read_threads_answer(cluster: Cluster) -> None:
    """Over random small pulls (queues, offsets up to INLINE_MAX_BEHIND behind and at
    the end, limits of messages and bytes, tag filters): the same rows and records."""
    queues = 6
    await cluster.create_topic("h", queues)
    broker = cluster.brokers["broker-a"]
    sizes = {q: 10 * q + 5 for q in range(queues)}
    await stored(broker, "h", {q: [bytes([65 + q]) * (50 + 97 * i % 3000) for i in range(n)] for q, n in sizes.items()})
    fetch = Fetch(broker.ctx, broker.handlers.readers)

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        chosen=st.lists(st.integers(0, queues - 1), min_size=1, max_size=queues, unique=True),
        behind=st.lists(st.integers(0, INLINE_MAX_BEHIND), min_size=queues, max_size=queues),
        total=st.integers(1, 200),
        per_queue=st.integers(1, 64),
        max_bytes=st.integers(1, 100_000),
        tags=st.sampled_from([None, ["a"], []]),
    )
    def same(
        chosen: list[int], behind: list[int], total: int, per_queue: int, max_bytes: int, tags: list[str] | None
    ) -> None:
        asks: list[Any] = [["h", q, max(0, sizes[q] - behind[q]), tags] for q in chosen]
        rows, spans, found = trio.from_thread.run(fetch._read_inline, asks, total, per_queue, max_bytes, False)
        t_rows, t_spans, t_found = fetch._read(asks, total, per_queue, max_bytes)
        assert (rows, found) == (t_rows, t_found)
        assert _body(spans) == _body(t_spans)
        assert len(spans) <= 1  # the records copied into one piece (their pages are cached)

    await trio.to_thread.run_sync(same)  # the examples in a thread, each inline read on the event loop


async def test_an_inline_read_lets_other_tasks_run_once_it_held_the_loop_for_its_slice(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A produce request arriving meanwhile waits for about INLINE_SLICE_S of the read,
    not the whole pull's: here the slice is 0, so the read yields after every queue."""
    monkeypatch.setattr(_fetch, "INLINE_SLICE_S", 0.0)
    await cluster.create_topic("y", QUEUES)
    broker = cluster.brokers["broker-a"]
    await stored(broker, "y", {q: [b"m"] * 3 for q in range(QUEUES)})
    fetch = Fetch(broker.ctx, broker.handlers.readers)
    ran_between: list[int] = []
    done = trio.Event()

    async def other_task() -> None:
        while not done.is_set():
            ran_between.append(1)
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as n:
        n.start_soon(other_task)
        await trio.lowlevel.checkpoint()  # the other task is running
        before = len(ran_between)
        asks: list[Any] = [["y", q, 1, None] for q in range(QUEUES)]
        _rows, _spans, found = await fetch._read_inline(asks, 100, 10, 1 << 20, False)
        done.set()
    assert found == 2 * QUEUES
    # One yield per queue read; the other task runs in each yield's scheduling batch,
    # except perhaps the last (trio may run the reader first there, and the reader then
    # sets ``done`` before the other task's turn): CI-like load saw QUEUES - 1.
    assert len(ran_between) - before >= QUEUES - 1


def test_a_position_is_fresh_once_for_its_age() -> None:
    fresh = FreshPositions(max_age_s=5.0, memory=3)
    fresh.note([["t", 0, 4, None], ["t", 1, 0, None]], [["FOUND", 7, 3, 30, 7], ["FOUND", 2, 2, 20, 9]], now=100.0)
    assert not fresh.all_fresh([["t", 1, 2, None]], 101.0)  # left behind its end (max 9): not remembered
    assert fresh.all_fresh([["t", 0, 7, None]], 101.0)
    assert not fresh.all_fresh([["t", 0, 7, None]], 101.0)  # taken by the pull that asked
    fresh.note([["t", 0, 7, None]], [["NO_MESSAGE", 7, 0, 0, 7]], now=102.0)
    assert not fresh.all_fresh([["t", 0, 7, None]], 107.5)  # too old
    rows = [["SKIPPED", 3, 0, 0, -1], ["NO_QUEUE", 0, 0, 0, 0], ["CORRUPT", 3, 0, 0, 9, "bad"]]
    fresh.note([["t", q, 3, None] for q in range(3)], rows, now=110.0)
    assert not any(fresh.all_fresh([["t", q, o, None]], 110.0) for q in range(3) for o in (0, 3))


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.booleans(), st.integers(0, 3), st.integers(0, 3), st.integers(0, 3), st.floats(0, 3)),
        max_size=40,
    )
)
def test_fresh_positions_follow_a_model(ops: list[tuple[bool, int, int, int, float]]) -> None:
    """Notes and asks in any order against a dict model (memory large enough to keep
    all): an ask is fresh iff its queue was last left at its end at exactly that offset,
    within the age, and not asked since."""
    fresh = FreshPositions(max_age_s=2.0, memory=100)
    model: dict[tuple[str, int, int], float] = {}
    now = 0.0
    for is_note, q, offset, end, step in ops:
        now += step
        if is_note:
            row = ["FOUND", offset, 1, 10, max(offset, end)]
            fresh.note([["t", q, 0, None]], [row], now)
            if offset >= row[4]:
                model[("t", q, offset)] = now
        else:
            when = model.pop(("t", q, offset), None)
            assert fresh.all_fresh([["t", q, offset, None]], now) == (when is not None and now - when <= 2.0)

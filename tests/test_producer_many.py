"""``Producer.submit_many`` against a real broker in this process (real sockets; a
proxy decodes the requests): order per queue with single submits mixed in, each
message's own result, the batch size and buffer limits, oversize messages refused
alone, bad input refused with nothing buffered, the general path (tags, properties,
selectors), the asyncio and blocking facades; and its encoding against the general
encoder for any bodies (Hypothesis)."""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import random
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from clmq.client import (
    BatchTooLargeError,
    BlockingProducer,
    BufferFullError,
    Message,
    NoRouteError,
    Producer,
    SendError,
    SendFuture,
    SendFutures,
    SendResult,
    open_admin,
    open_asyncio_producer,
    open_producer,
)
from clmq.client.producer._encode import PLAIN_OVERHEAD_BYTES, MessageIds, encode_plain_run
from clmq.client.producer._many import COLLECTOR_PAUSE_MIN_MESSAGES, CollectorPaused, _span_cuts, parts
from clmq.client.producer._span import SPAN_PART_OF_BATCH
from clmq.protocol import encode_batch
from tests.service_helpers import Cluster, cluster_in_thread
from tests.test_accumulator import UNIQ_KEY, FrameProxy, decode_queues, settled, start, stored, to
from tests.waiting import await_until

KiB = 1024


async def test_round_robin_order_per_queue_and_each_message_its_result(nursery: trio.Nursery, tmp_path: Path) -> None:
    queues = 5
    _c, broker = await start(nursery, tmp_path, queues)
    proxy = await FrameProxy(broker.addr).start(nursery)
    # linger 200 ms: the calls' runs to a queue join one batch (a future per run)
    async with open_producer(broker_addrs=[proxy.addr], linger_ms=200) as p:
        calls: list[tuple[list[bytes], SendFutures]] = []
        singles = []
        called: list[SendFutures] = []
        with trio.fail_after(20):
            for k in range(4):
                bodies = [b"c%d-%d" % (k, i) for i in range(23)]
                futs = await p.submit_many("t", bodies)
                futs.add_done_callback(called.append)
                calls.append((bodies, futs))
                singles.append(await p.submit("t", b"s%d" % k, selector=to(k)))
            outcomes = [await futs.wait() for _b, futs in calls]
            await p.flush()
    assert [id(f) for f in called] == [id(f) for _b, f in calls]  # each call's callback, once
    keys_of = await stored(broker, queues)
    await settled(broker)
    for (bodies, futs), results in zip(calls, outcomes, strict=True):
        assert len(futs) == len(bodies) == len(results) and futs.done() and futs.exception() is None
        assert futs.failed() == 0
        first_queue = results[0].queue.queue_id  # type: ignore[union-attr]
        for i, (body, r) in enumerate(zip(bodies, results, strict=True)):
            assert isinstance(r, SendResult) and r.queue.queue_id == (first_queue + i) % queues
            assert futs[i].result() == r and futs[i - len(bodies)].result() == r
            [record] = broker.store.get("t", r.queue.queue_id, r.queue_offset, 1).messages
            assert record.body == body and record.properties[UNIQ_KEY] == r.uniq_keys[0]
    for q, keys in keys_of.items():  # per queue: in the order submitted
        submitted = [
            r.uniq_keys[0]
            for (_b, _f), results in zip(calls, outcomes, strict=True)
            for r in results
            if isinstance(r, SendResult) and r.queue.queue_id == q
        ]
        single_keys = {s.result().uniq_keys[0] for s in singles}
        assert [k for k in keys if k not in single_keys] == submitted
    assert max(len(set(decode_queues(f))) for _t, f in proxy.sends) > 1  # requests span queues


async def test_runs_keep_batch_max_bytes_and_an_oversize_message_fails_alone(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    _c, broker = await start(nursery, tmp_path, 2)
    proxy = await FrameProxy(broker.addr).start(nursery)
    limit = 8 * KiB
    async with open_producer(broker_addrs=[proxy.addr], batch_max_bytes=limit, buffer_max_bytes=64 * KiB) as p:
        await p.send("t", b"warm up", sharding_key="k")
        before = len(proxy.sends)
        bodies = [bytes([i]) * KiB for i in range(40)]
        bodies[17] = bytes(65 * KiB)  # larger than the whole buffer
        with trio.fail_after(20):
            results = await (await p.submit_many("t", bodies, sharding_key="k")).wait()
    assert isinstance(results[17], BatchTooLargeError) and "buffer_max_bytes=65,536" in str(results[17])
    ok = [r for r in results if isinstance(r, SendResult)]
    assert len(ok) == 39 and len({r.queue.queue_id for r in ok}) == 1  # one queue: the key's
    assert [r.queue_offset for r in ok] == list(range(ok[0].queue_offset, ok[0].queue_offset + 39))
    assert all(len(f.body) <= limit for _t, f in proxy.sends[before:])
    await settled(broker)
    got = broker.store.get("t", ok[0].queue.queue_id, ok[0].queue_offset, 100).messages
    assert [m.body for m in got] == [b for i, b in enumerate(bodies) if i != 17]


FULL_BUFFER: dict[str, Any] = {"linger_ms": 60_000, "buffer_max_bytes": 10 * KiB, "buffer_full": "raise"}


async def _overfill(p: Producer, bodies: list[bytes]) -> tuple[SendFutures, list[SendResult | SendError], int]:
    """One call of ``bodies`` into a producer opened with FULL_BUFFER (linger 60 s, so
    nothing is sent before the flush), flushed: its futures, its results, and how many
    were accepted, all before the first BufferFullError (every later one refused)."""
    futs = await p.submit_many("t", bodies)
    assert not futs.done()  # linger 60 s: buffered
    with trio.fail_after(20):
        await p.flush()
        assert futs.done()  # flush waited for the spans (and runs)
        results = await futs.wait()
    kinds = [type(r) for r in results]
    accepted = kinds.index(BufferFullError)
    assert kinds == [SendResult] * accepted + [BufferFullError] * (len(bodies) - accepted)
    return futs, results, accepted


async def test_a_full_buffer_fails_the_rest_of_the_call_as_results(nursery: trio.Nursery, tmp_path: Path) -> None:
    _c, broker = await start(nursery, tmp_path, 1)
    async with open_producer(broker_addrs=[broker.addr], **FULL_BUFFER) as p:
        futs, results, accepted = await _overfill(p, [bytes([i]) * KiB for i in range(30)])
    assert accepted >= 5 and futs.failed() == 30 - accepted
    assert "buffer_full='raise'" in str(results[-1])
    await settled(broker)
    assert [m.body[0] for m in broker.store.get("t", 0, 0, 100).messages] == list(range(accepted))


@pytest.mark.parametrize("queues", [3, 30])
async def test_a_full_buffer_fails_a_suffix_of_a_call_over_several_queues(
    nursery: trio.Nursery, tmp_path: Path, queues: int
) -> None:
    """Round robin over 3 or 30 queues (spans), a buffer of a third of the call: the
    messages refused are the first one refused and every later one, so resending
    ``bodies[first_failed:]`` stores each message once."""
    count = 30
    _c, broker = await start(nursery, tmp_path, queues)
    bodies = [bytes([i]) * KiB for i in range(count)]
    async with open_producer(broker_addrs=[broker.addr], **FULL_BUFFER) as p:
        _futs, results, accepted = await _overfill(p, bodies)
        assert accepted >= 1
        got_queues = [r.queue.queue_id for r in results[:accepted] if isinstance(r, SendResult)]
        assert got_queues == [(got_queues[0] + i) % queues for i in range(accepted)]  # round robin
        rest = accepted
        with trio.fail_after(20):
            while rest < count:  # resend what failed, by index
                again = await p.submit_many("t", bodies[rest:])
                await p.flush()
                ok = [isinstance(r, SendResult) for r in await again.wait()]
                assert ok[0] and ok == sorted(ok, reverse=True)  # some buffered, then a suffix refused
                rest += sum(ok)
    await settled(broker)
    got = [m.body[0] for q in range(queues) for m in broker.store.get("t", q, 0, 100).messages]
    assert sorted(got) == list(range(count))  # each once


@given(
    sizes=st.lists(st.integers(0, 3000), max_size=60),
    most=st.integers(1, 5000),
    size_max=st.integers(PLAIN_OVERHEAD_BYTES, 3000 + PLAIN_OVERHEAD_BYTES),
)
def test_a_call_is_reserved_in_consecutive_parts_of_at_most_a_share_of_the_buffer(
    sizes: list[int], most: int, size_max: int
) -> None:
    items = [bytes(n) for n in sizes]
    cut = parts(items, most, size_max)
    assert [i for r, _s in cut for i in r] == list(range(len(items)))  # every message, in order, once
    for r, size in cut:
        room = [PLAIN_OVERHEAD_BYTES + len(items[i]) for i in r]
        counted = [n for n in room if n <= size_max]  # one too large is refused alone: no room
        assert size == sum(counted)
        assert size <= most or len(counted) == 1
    assert len(cut) >= 1


def test_the_collector_pause_is_for_large_calls_and_leaves_the_collector_as_the_application_set_it() -> None:
    assert gc.isenabled()
    try:
        with CollectorPaused(COLLECTOR_PAUSE_MIN_MESSAGES - 1):
            assert gc.isenabled()  # a small call: not worth a process-wide pause
        with CollectorPaused(COLLECTOR_PAUSE_MIN_MESSAGES) as paused:
            assert not gc.isenabled()
            with paused.resumed():  # the call waits for room: others run
                assert gc.isenabled()
                gc.disable()  # the application, meanwhile
            assert not gc.isenabled()
        assert not gc.isenabled()  # left as the application set it
        with CollectorPaused(COLLECTOR_PAUSE_MIN_MESSAGES) as paused, paused.resumed():
            assert not gc.isenabled()
        assert not gc.isenabled()
        gc.enable()
        with CollectorPaused(COLLECTOR_PAUSE_MIN_MESSAGES) as paused:
            with paused.resumed():
                gc.disable()
                gc.enable()  # off and on again by the application: still ours to pause
            assert not gc.isenabled()
        assert gc.isenabled()
    finally:
        gc.enable()


async def test_bad_input_raises_and_buffers_nothing(nursery: trio.Nursery, tmp_path: Path) -> None:
    _c, broker = await start(nursery, tmp_path, 1)
    async with open_producer(broker_addrs=[broker.addr]) as p:
        with pytest.raises(TypeError, match="bodies must be a sequence of bytes"):
            await p.submit_many("t", "not a list")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"bodies\[1\] is a str, not bytes"):
            await p.submit_many("t", [b"ok", "text"])  # type: ignore[list-item]
        with pytest.raises(TypeError, match="topic must be a str"):
            await p.submit_many(7, [b"x"])  # type: ignore[arg-type]
        with pytest.raises(NoRouteError):
            await p.submit_many("no-such-topic", [b"x"])
        assert len(await p.submit_many("t", [])) == 0
        futs = await p.submit_many("t", [bytearray(b"from a bytearray")])
        with trio.fail_after(20):
            [r] = await futs.wait()
    assert isinstance(r, SendResult) and r.queue_offset == 0  # nothing before it was stored
    await settled(broker)
    assert broker.store.get("t", 0, 0, 10).messages[0].body == b"from a bytearray"


async def test_tags_properties_and_selectors_take_the_general_path(nursery: trio.Nursery, tmp_path: Path) -> None:
    _c, broker = await start(nursery, tmp_path, 3)
    async with open_producer(broker_addrs=[broker.addr]) as p:
        with trio.fail_after(20):
            tagged = await p.submit_many("t", [b"a", b"b"], tags="T", properties={"p": "v"}, selector=to(2))
            results = await tagged.wait()
    await settled(broker)
    for body, r in zip([b"a", b"b"], results, strict=True):
        assert isinstance(r, SendResult) and r.queue.queue_id == 2
        [m] = broker.store.get("t", 2, r.queue_offset, 1).messages
        assert (m.body, m.tags, m.properties["p"], m.properties[UNIQ_KEY]) == (body, "T", "v", r.uniq_keys[0])


def test_the_asyncio_and_blocking_producers_submit_many(tmp_path: Path) -> None:
    with cluster_in_thread(tmp_path) as cluster:
        _facades(cluster)


def _facades(cluster: Cluster) -> None:
    async def from_asyncio() -> list[SendResult | SendError]:
        async with open_asyncio_producer(cluster.ns) as p:
            with pytest.raises(TypeError):
                await p.submit_many("sync", [1])  # type: ignore[list-item]
            fut = await p.submit_many("sync", [b"a1", b"a2", b"a3"])
            return await asyncio.wait_for(fut, 20)

    got = asyncio.run(from_asyncio())
    assert [type(r) for r in got] == [SendResult] * 3
    with BlockingProducer(cluster.ns) as bp:
        with pytest.raises(TypeError):
            bp.submit_many("sync", "text")  # type: ignore[arg-type]
        results = bp.submit_many("sync", [b"b1", b"b2"]).result(20)
        missing = bp.submit_many("no-such-topic", [b"x"])
        with pytest.raises(NoRouteError):
            missing.result(20)
    assert [type(r) for r in results] == [SendResult] * 2
    _blocking_counts_each_message(cluster)


def _blocking_counts_each_message(cluster: Cluster) -> None:
    """A BlockingProducer left open counts every message of a ``submit_many`` call it
    still held, and each one that failed, in its close-time warnings (never silent)."""
    count = 30
    bp = BlockingProducer(cluster.ns, linger_ms=600_000, buffer_max_bytes=10 * KiB, buffer_full="raise")
    fut = bp.submit_many("sync", [bytes(KiB)] * count)
    assert bp._handoff.unanswered() == count
    with pytest.warns(ResourceWarning) as warned, _logged() as records:
        bp._finalizer()  # what the collector would call
    failed = sum(isinstance(r, SendError) for r in fut.result(20))
    assert 0 < failed < count
    assert f"closed by its finalizer: {count - failed} of {count} messages" in str(warned[0].message)
    assert [f"{failed} of the {count} messages it still held could not be sent" in r for r in records] == [True]
    assert bp._handoff.unanswered() == 0 and bp._handoff.failed == failed


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextmanager
def _logged() -> Iterator[list[str]]:
    handler = _Records()
    logger = logging.getLogger("clmq.producer")
    logger.addHandler(handler)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)


@settings(max_examples=200, deadline=None)
@given(
    queue_id=st.integers(0, 65_535),
    born_ms=st.integers(0, 2**63 - 1),
    bodies=st.lists(st.binary(max_size=300), min_size=1, max_size=8),
)
def test_a_run_is_encoded_as_the_general_encoder_encodes_its_messages(
    queue_id: int, born_ms: int, bodies: list[bytes]
) -> None:
    keys = MessageIds(True).many_keys(len(bodies))
    msgs = [
        Message("t", queue_id, b, properties={UNIQ_KEY: k}, born_timestamp_ms=born_ms) for b, k in zip(bodies, keys)
    ]
    assert encode_plain_run(queue_id, born_ms, keys, bodies) == encode_batch(msgs)


@given(counts=st.lists(st.integers(0, 50), max_size=10))
def test_many_keys_never_repeat_and_go_on_from_single_ones(counts: list[int]) -> None:
    ids = MessageIds(True)
    seen: list[str] = []
    for n in counts:
        seen += ids.many_keys(n)
        seen += ids.message("t", b"", "", "", None)[1]
    assert len(set(seen)) == len(seen) and all(len(k) == 32 for k in seen)


async def test_a_same_queue_retry_finds_its_queue_through_an_index_kept_while_routes_hold(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """``Targets._same_queue`` (a retry after an unknown outcome): the queue by group and
    queue id, from an index built once per routes list (not a scan per batch), built
    again when the routes change."""
    c, _broker = await start(nursery, tmp_path, 300)
    async with open_producer(broker_addrs=[_broker.addr]) as p:
        await p.send("t", b"routes")
        mqs = await p.routes.queues("t")
        wanted = mqs[257]
        found = await p.targets._same_queue(wanted, refresh=False)
        index = p.targets._indexed["t"][1]
        assert found == wanted and len(index) == 300
        assert await p.targets._same_queue(mqs[3], refresh=False) == mqs[3]
        assert p.targets._indexed["t"][1] is index  # kept: the routes did not change
        gone = wanted._replace(queue_id=300)
        assert await p.targets._same_queue(gone, refresh=False) is None
        await c.create_topic("t", 400)  # more queues: fresh routes, a fresh index
        assert await p.targets._same_queue(gone, refresh=True) == gone
        assert p.targets._indexed["t"][1] is not index and len(p.targets._indexed["t"][1]) == 400


# ------------------------------------------------------------------ spans: a call over many queues as one batch
async def test_a_call_over_many_queues_is_one_span_in_one_request_each_message_its_queue_and_result(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """300 queues, calls of 300 messages: each call is one batch (a span) sent in one
    request (messages of many queues, in the call's order), and each message's result
    names its own queue and offset; single submits in between keep their place per queue."""
    queues = 300
    _c, broker = await start(nursery, tmp_path, queues)
    proxy = await FrameProxy(broker.addr).start(nursery)
    async with open_producer(broker_addrs=[proxy.addr]) as p:
        await p.send("t", b"warm up", selector=to(0))
        before = len(proxy.sends)
        calls = []
        with trio.fail_after(20):
            for k in range(3):
                bodies = [b"%d-%d" % (k, i) for i in range(queues)]
                calls.append((bodies, await p.submit_many("t", bodies)))
                await p.submit("t", b"single %d" % k, selector=to(k))
            outcomes = [await futs.wait() for _b, futs in calls]
            await p.flush()
    spans = [decode_queues(f) for _t, f in proxy.sends[before:] if len(set(decode_queues(f))) > 1]
    assert len(spans) == 3 and all(sorted(qs) == list(range(queues)) for qs in spans)  # one request per call
    assert all(qs == [(qs[0] + i) % queues for i in range(queues)] for qs in spans)  # in the call's order
    await settled(broker)
    for (bodies, futs), results in zip(calls, outcomes, strict=True):
        assert futs.failed() == 0 and len({r.queue.queue_id for r in results if isinstance(r, SendResult)}) == queues
        for i, (body, r) in enumerate(zip(bodies, results, strict=True)):
            assert isinstance(r, SendResult) and futs[i].result() == r
            [record] = broker.store.get("t", r.queue.queue_id, r.queue_offset, 1).messages
            assert record.body == body and record.properties[UNIQ_KEY] == r.uniq_keys[0]


async def test_calls_over_two_brokers_make_a_span_per_broker(nursery: trio.Nursery, tmp_path: Path) -> None:
    """A topic over two brokers: a call's messages to each broker go as one span to
    it; each message is stored where its result says, in order per queue."""
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    brokers = {name: await c.start_broker(name) for name in ("broker-a", "broker-b")}
    await c.create_topic("t", 8)
    async with open_producer(c.ns) as p:
        with trio.fail_after(20):
            calls = [await p.submit_many("t", [b"%d-%d" % (k, i) for i in range(40)]) for k in range(5)]
            outcomes = [await futs.wait() for futs in calls]
    stored_keys: dict[tuple[str, int], list[str]] = {}
    for name, broker in brokers.items():
        await settled(broker)
        for q in range(8):
            stored_keys[(name, q)] = [m.properties[UNIQ_KEY] for m in broker.store.get("t", q, 0, 1000).messages]
    sent: dict[tuple[str, int], list[str]] = {}
    for k, results in enumerate(outcomes):
        for i, r in enumerate(results):
            assert isinstance(r, SendResult)
            where = (r.queue.broker_name, r.queue.queue_id)
            assert stored_keys[where][r.queue_offset] == r.uniq_keys[0]
            body = brokers[where[0]].store.get("t", where[1], r.queue_offset, 1).messages[0].body
            assert body == b"%d-%d" % (k, i)
            sent.setdefault(where, []).append(r.uniq_keys[0])
    assert {b for b, _q in sent} == set(brokers) and sent == {k: v for k, v in stored_keys.items() if v}


async def test_a_message_the_broker_refuses_fails_alone_and_the_rest_of_the_span_is_stored(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """The broker refuses a span's request (MESSAGE_TOO_LARGE, one of its messages):
    the span is split per queue and each queue's batch sent alone, so only the culprit's
    queue's messages fail; every other message is stored once, in its queue's order."""
    queues = 50
    _c, broker = await start(nursery, tmp_path, queues, max_message_bytes=2 * KiB)
    async with open_producer(broker_addrs=[broker.addr], linger_ms=50) as p:
        with trio.fail_after(20):
            bodies = [b"m%d" % i for i in range(queues)]
            bodies[17] = bytes(3 * KiB)  # under the producer's limits, over the broker's
            futs = await p.submit_many("t", bodies)
            later = await p.submit_many("t", [b"after %d" % i for i in range(queues)])
            results, after = await futs.wait(), await later.wait()
    assert [i for i, r in enumerate(results) if not isinstance(r, SendResult)] == [17]
    assert isinstance(results[17], SendError) and "MESSAGE_TOO_LARGE" in str(results[17])
    assert futs.failed() == 1 and isinstance(futs[17].exception(), SendError)
    assert all(isinstance(r, SendResult) for r in after)
    await settled(broker)
    for i, r in enumerate(results):
        if isinstance(r, SendResult):
            got = broker.store.get("t", r.queue.queue_id, 0, 10).messages
            assert [m.body for m in got] == [bodies[i], b"after %d" % i]  # once, before the later call's


@pytest.mark.parametrize("seed", [1, 2])
async def test_spans_keep_order_per_queue_and_exactly_once_when_connections_are_cut_at_random(
    nursery: trio.Nursery, tmp_path: Path, seed: int
) -> None:
    """Calls over 40 queues (and single submits among them) while a proxy cuts every
    connection at random moments: a failed span is retried per queue (with dedup), so
    every message is stored at most once, every acknowledged one is stored, and each
    queue holds its messages in the order submitted."""
    queues, rnd = 40, random.Random(seed)
    _c, broker = await start(nursery, tmp_path, queues)
    proxy = await FrameProxy(broker.addr).start(nursery)
    calls: list[SendFutures] = []
    singles: list[tuple[int, SendFuture]] = []
    submitted: dict[int, list[str]] = {q: [] for q in range(queues)}
    options: dict[str, Any] = {"linger_ms": 2, "send_timeout_ms": 2000, "retry_budget_ms": 30_000}
    async with open_producer(broker_addrs=[proxy.addr], retry_backoff_ms=5, **options) as p:
        await p.send("t", b"warm up", selector=to(0))
        done = trio.Event()

        with trio.fail_after(60):
            async with trio.open_nursery() as n:
                n.start_soon(proxy.cut_at_random, rnd, done)
                for k in range(60):
                    futs = await p.submit_many("t", [b"%d.%d" % (k, i) for i in range(rnd.randint(1, 90))])
                    calls.append(futs)
                    q = rnd.randrange(queues)
                    singles.append((q, await p.submit("t", b"single %d" % k, selector=to(q))))
                    await trio.sleep(0.003)  # let the cuts land among requests
                # No cuts while the last retries go: a dedup retry over 40 queues takes
                # longer than the gap between two cuts, and could be cut for its whole budget.
                done.set()
                await p.flush()
    everything = await stored(broker, queues)
    acked: set[str] = set()
    for futs in calls:
        assert futs.done()
        for r in futs.result():
            if isinstance(r, SendResult):
                acked.update(r.uniq_keys)
                submitted[r.queue.queue_id] += r.uniq_keys
    for _q, fut in singles:
        if fut.exception() is None:
            acked.update(fut.result().uniq_keys)
    for q, keys in everything.items():
        counts = Counter(keys)
        assert all(n == 1 for n in counts.values()), f"queue {q}: a message stored twice"
        mine = [k for k in keys if k in set(submitted[q])]
        assert mine == submitted[q], f"queue {q}: the calls' messages out of order or missing"
    assert acked <= {k for keys in everything.values() for k in keys}, "an acknowledged message is missing"
    retried = sum(bool(f.fields.get("dedup")) for _t, f in proxy.sends)
    assert retried > 0 and len(acked) > 1000, (retried, len(acked))


async def test_a_retry_with_no_other_group_to_go_to_keeps_its_queue_and_its_place(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """Messages placed round robin while their only broker is down fail to connect and
    are retried; with no other group to move to, each keeps the queue its first try
    chose (moved to another queue of the same broker, it went behind later messages
    there: the stopped-broker test above saw a queue out of order so)."""
    queues = 5
    c, broker = await start(nursery, tmp_path, queues)
    port = int(broker.addr.rpartition(":")[2])
    async with open_producer(
        broker_addrs=[broker.addr], linger_ms=0, retry_budget_ms=20_000, retry_backoff_max_ms=50
    ) as p:
        warm = await p.send("t", b"warm up")
        await c.stop_broker("broker-a")
        futs = [await p.submit("t", b"m%d" % i) for i in range(7)]
        await trio.sleep(0.3)  # Not a wait for an event: the retries must fail a few times first.
        broker = await c.start_broker("broker-a", port=port)  # same data directory and port
        with trio.fail_after(30):
            results = [await f.wait() for f in futs]
    first = (warm.queue.queue_id + 1) % queues
    assert [r.queue.queue_id for r in results] == [(first + i) % queues for i in range(7)]
    keys_of = await stored(broker, queues)
    for q, keys in keys_of.items():
        assert keys == [r.uniq_keys[0] for r in [warm, *results] if r.queue.queue_id == q], q


async def test_a_broker_stopped_mid_call_leaves_every_message_stored_once_in_order_or_failed(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """The broker stops while spans are buffered and in flight, and comes back on its
    port: each message of every call is stored once (in order per queue) or failed."""
    queues = 30
    c, broker = await start(nursery, tmp_path, queues)
    port = int(broker.addr.rpartition(":")[2])
    calls: list[SendFutures] = []
    refused = 0
    async with open_producer(c.ns, linger_ms=5, retry_budget_ms=20_000, send_timeout_ms=2000) as p:
        await p.send("t", b"warm up", selector=to(0))
        with trio.fail_after(60):
            for k in range(40):
                if k == 15:
                    await c.stop_broker("broker-a")
                if k == 25:
                    broker = await c.start_broker("broker-a", port=port)  # same data directory and port
                try:
                    calls.append(await p.submit_many("t", [b"%d.%d" % (k, i) for i in range(45)]))
                except NoRouteError:  # refused at once, nothing buffered: no route while the broker is away
                    refused += 1
                await trio.sleep(0.005)
            await p.flush()
    everything = await stored(broker, queues)
    ok = failed = 0
    per_queue: dict[int, list[str]] = {}
    for futs in calls:
        for r in futs.result():
            if isinstance(r, SendResult):
                ok += 1
                assert everything[r.queue.queue_id].count(r.uniq_keys[0]) == 1
                per_queue.setdefault(r.queue.queue_id, []).append(r.uniq_keys[0])
            else:
                assert isinstance(r, SendError)
                failed += 1
    assert ok >= 40 * 45 // 2 and len(calls) >= 20, (ok, failed, refused)
    for q, keys in everything.items():
        assert len(keys) == len(set(keys)), f"queue {q}: a message stored twice"
        acked = set(per_queue.get(q, []))
        assert [k for k in keys if k in acked] == per_queue.get(q, []), f"queue {q}: out of order"


def test_every_message_result_matches_what_the_broker_stored_in_order_per_queue(tmp_path: Path) -> None:
    """Hypothesis over queue counts, call sizes, body sizes, ``batch_max_bytes`` and
    single submits between the calls, against one real broker (a fresh topic per
    example): every message's result names the queue and offset where the broker
    stored it (its UNIQ_KEY and body), and each queue holds its messages in the order
    they were submitted."""
    with cluster_in_thread(tmp_path) as cluster:
        addr = cluster.brokers["broker-a"].addr
        topics = iter(range(1_000_000))

        @settings(max_examples=10, deadline=None)
        @given(
            queues=st.integers(1, 120),
            calls=st.lists(st.integers(1, 250), min_size=1, max_size=4),
            body_max=st.integers(0, 1500),
            batch_kib=st.integers(2, 48),
            singles=st.booleans(),
        )
        def check(queues: int, calls: list[int], body_max: int, batch_kib: int, singles: bool) -> None:
            topic = f"p{next(topics)}"
            trio.run(_calls_stored_as_answered, addr, topic, queues, calls, body_max, batch_kib * KiB, singles)

        check()


async def _calls_stored_as_answered(
    addr: str, topic: str, queues: int, calls: list[int], body_max: int, batch_max_bytes: int, singles: bool
) -> None:
    async with open_admin(broker_addrs=[addr]) as admin:
        await admin.create_topic(topic, queues, on=[addr])
        expected: dict[int, list[tuple[str, bytes]]] = {q: [] for q in range(queues)}
        async with open_producer(broker_addrs=[addr], batch_max_bytes=batch_max_bytes) as p:
            with trio.fail_after(30):
                sent: list[tuple[list[bytes], SendFutures, Any]] = []
                for k, count in enumerate(calls):
                    bodies = [bytes([k]) * ((i * 37 + k) % (body_max + 1)) + b"%d.%d" % (k, i) for i in range(count)]
                    futs = await p.submit_many(topic, bodies)
                    single = await p.submit(topic, b"single %d" % k, selector=to(k)) if singles else None
                    sent.append((bodies, futs, single))
                for k, (bodies, futs, single) in enumerate(sent):
                    for body, r in zip(bodies, await futs.wait(), strict=True):
                        assert isinstance(r, SendResult), r
                        expected[r.queue.queue_id].append((r.uniq_keys[0], body))
                    if single is not None:
                        r = await single.wait()
                        expected[r.queue.queue_id].append((r.uniq_keys[0], b"single %d" % k))
        for q, want in expected.items():
            got = await _read_queue(admin, topic, q, len(want))
            assert got == want, f"queue {q}: stored {len(got)}, answered {len(want)}, or not in the order submitted"


async def _read_queue(admin: Any, topic: str, queue_id: int, count: int) -> list[tuple[str, bytes]]:
    """The queue's first ``count`` messages (UNIQ_KEY, body), once dispatched."""
    got: list[tuple[str, bytes]] = []

    async def all_read() -> bool:
        got.extend((m.properties[UNIQ_KEY], m.body) for m in await admin.read_queue(topic, queue_id, len(got), 1000))
        return len(got) >= count

    await await_until(all_read, 10, f"queue {queue_id}'s messages")
    return got


@given(
    sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=80),
    brokers=st.lists(st.sampled_from(["a:1", "b:2"]), min_size=1, max_size=12),
    start=st.integers(0, 50),
    limit=st.integers(1, 6000),
    size_max=st.integers(PLAIN_OVERHEAD_BYTES, 3000 + PLAIN_OVERHEAD_BYTES),
)
def test_a_call_part_is_cut_into_consecutive_spans_of_one_broker_within_the_batch_limit(
    sizes: list[int], brokers: list[str], start: int, limit: int, size_max: int
) -> None:
    items = [bytes(n) for n in sizes]
    settings = SimpleNamespace(buffer_max_bytes=size_max)  # what check_size reads
    acc = SimpleNamespace(batch_max_bytes=limit, size_max_bytes=size_max, max_request_bytes=size_max, settings=settings)
    futs = SendFutures(len(items))
    one = len(set(brokers)) == 1
    cuts = _span_cuts(acc, items, brokers, one, start, range(len(items)), futs)  # type: ignore[arg-type]
    encoded = [PLAIN_OVERHEAD_BYTES + n for n in sizes]
    assert sorted(futs.refused) == [i for i, n in enumerate(encoded) if n > size_max]  # each refused alone
    covered = [i for a, b in cuts for i in range(a, b)]
    assert covered == [i for i in range(len(items)) if i not in futs.refused]  # the rest once, in order
    for a, b in cuts:
        assert b > a and all(i not in futs.refused for i in range(a, b))
        assert sum(encoded[a:b]) <= min(limit // SPAN_PART_OF_BATCH, size_max) or b - a == 1
        assert len({brokers[(start + i) % len(brokers)] for i in range(a, b)}) == 1


@given(first=st.integers(0, 2**64 - 10_000), counts=st.lists(st.integers(0, 9000), max_size=4))
def test_many_keys_are_the_producer_id_and_each_count_in_16_hex_digits(first: int, counts: list[int]) -> None:
    ids = MessageIds(True)
    ids._count = itertools.count(first)
    n = first
    for count in counts:
        assert ids.many_keys(count) == [f"{ids.producer_id}{i:016X}" for i in range(n, n + count)]
        n += count if count > 1 else 1  # a call of none or one still takes one count

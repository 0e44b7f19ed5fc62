"""The producer's accumulator (``client/_accumulator.py`` and its ``_send_*`` modules)
with a real broker in this process and real sockets: concurrent sends share requests,
``linger_ms`` and ``batch_max_bytes`` hold (seen by a proxy that decodes every request
frame on its way to the broker), the order per queue and exactly-once storage survive
connections cut at random points, the buffer's limit blocks or raises, a broker restart
leaves every future stored or failed (none lost, none stuck), and the settings are
checked."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Sequence

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from clmq.broker.service import Broker
from clmq.client import (
    BatchTooLargeError,
    BufferFullError,
    ClientError,
    Message,
    MessageQueue,
    NoRouteError,
    SendError,
    SendFuture,
    open_producer,
)
from clmq.client.producer._batch import Batch
from clmq.client.producer._encode import encode_one, encode_plain
from clmq.protocol import Frame, FrameDecoder, RequestCode, encode_batch
from tests.service_helpers import Cluster
from tests.waiting import await_until

UNIQ_KEY = "UNIQ_KEY"
KiB = 1024
Selector = Callable[[Sequence[MessageQueue], Message], MessageQueue]


def to(queue: int) -> Selector:
    return lambda mqs, _m: mqs[queue % len(mqs)]


class FrameProxy:
    """A TCP proxy in this process (real sockets) that decodes the requests going to the
    broker (``sends``: the time and frame of each SEND_MESSAGE) and their answers, and
    can cut every connection at once (``cut``), whatever is half sent in either
    direction."""

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self.sends: list[tuple[float, Frame]] = []
        self.addr = ""
        self._scopes: set[trio.CancelScope] = set()
        self._answered = trio.Event()  # a SEND_MESSAGE's answer went back since the last cut

    async def start(self, nursery: trio.Nursery) -> FrameProxy:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.addr = f"127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        nursery.start_soon(trio.serve_listeners, self._handle, listeners)
        return self

    def cut(self) -> None:
        for scope in list(self._scopes):
            scope.cancel()

    async def cut_at_random(self, rnd: random.Random, done: trio.Event) -> None:
        """Cut every connection at random moments until ``done``: 0 to 40 ms after a
        send's answer went back since the last cut, so that every cut lets one send
        through, however slow the machine. (Cuts 3 to 40 ms apart whatever got
        through stopped all progress in CI: on a loaded machine a reconnection and
        its request took longer than the gap, and sends spent their retry budgets.)"""
        while not done.is_set():
            self._answered = trio.Event()
            await first_of(self._answered, done)
            await trio.sleep(rnd.uniform(0, 0.04))  # a fault schedule, not a wait for an event
            self.cut()

    async def _handle(self, client: trio.SocketStream) -> None:
        try:
            upstream = await trio.open_tcp_stream(*self.target)
        except OSError:
            await client.aclose()
            return
        pending: set[int] = set()  # request ids of this connection's sends not answered yet
        with trio.CancelScope() as scope:
            self._scopes.add(scope)
            async with trio.open_nursery() as n:
                n.start_soon(self._pump, client, upstream, True, pending, n.cancel_scope)
                n.start_soon(self._pump, upstream, client, False, pending, n.cancel_scope)
        self._scopes.discard(scope)
        for s in (client, upstream):
            await s.aclose()

    async def _pump(
        self, src: trio.SocketStream, dst: trio.SocketStream, requests: bool, pending: set[int], done: trio.CancelScope
    ) -> None:
        decoder = FrameDecoder()
        try:
            while data := await src.receive_some(1 << 16):
                decoder.receive_data(data)
                answered = False
                while isinstance(event := decoder.next_event(), Frame):
                    if requests and event.code == RequestCode.SEND_MESSAGE:
                        self.sends.append((trio.current_time(), event))
                        pending.add(event.request_id)
                    elif not requests and event.request_id in pending:
                        pending.discard(event.request_id)
                        answered = True
                await dst.send_all(data)
                if answered:
                    self._answered.set()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        finally:
            done.cancel()  # one direction ended: the other goes too


async def first_of(*events: trio.Event) -> None:
    """Wait until any of ``events`` is set."""
    async with trio.open_nursery() as n:

        async def wait(e: trio.Event) -> None:
            await e.wait()
            n.cancel_scope.cancel()

        for e in events:
            n.start_soon(wait, e)


async def start(nursery: trio.Nursery, tmp_path: Path, queues: int, **settings: Any) -> tuple[Cluster, Broker]:
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    broker = await c.start_broker(**settings)
    await c.create_topic("t", queues)
    return c, broker


async def stored(broker: Broker, queues: int) -> dict[int, list[str]]:
    """Each queue's UNIQ_KEYs in stored order (once the queues show the whole log)."""
    await settled(broker)
    return {q: [r.properties[UNIQ_KEY] for r in broker.store.get("t", q, 0, 1_000_000).messages] for q in range(queues)}


async def settled(broker: Broker) -> None:
    """Until the queues show every acknowledged record (the dispatcher runs behind)."""
    await await_until(lambda: broker.store.dispatch_lag_bytes == 0, 10, "the dispatcher to catch up")


# ------------------------------------------------------------------ sharing
async def test_concurrent_sends_to_many_queues_share_requests(nursery: trio.Nursery, tmp_path: Path) -> None:
    _c, broker = await start(nursery, tmp_path, 100)
    proxy = await FrameProxy(broker.addr).start(nursery)
    async with open_producer(broker_addrs=[proxy.addr], linger_ms=50) as p:
        await p.send("t", b"warm up")  # routes and connection
        before = len(proxy.sends)
        results: dict[int, Any] = {}

        async def one(i: int) -> None:
            results[i] = await p.send("t", b"m%d" % i, selector=to(i))

        with trio.fail_after(20):
            async with trio.open_nursery() as n:
                for i in range(300):
                    n.start_soon(one, i)
    assert len(results) == 300
    assert len(proxy.sends) - before <= 10, f"{len(proxy.sends) - before} requests for 300 concurrent sends"
    assert max(len(set(decode_queues(f))) for _t, f in proxy.sends) > 1  # multi-queue requests
    await settled(broker)
    for i, r in results.items():
        assert r.queue.queue_id == i % 100
        [record] = broker.store.get("t", r.queue.queue_id, r.queue_offset, 1).messages
        assert record.body == b"m%d" % i and record.properties[UNIQ_KEY] == r.uniq_keys[0]


def decode_queues(frame: Frame) -> list[int]:
    from clmq.protocol import decode_batch

    return [m.queue_id for m in decode_batch(frame.body, "t", ("127.0.0.1", 0))]


# ------------------------------------------------------------------ linger, batch size
async def test_a_lone_message_waits_linger_ms_and_a_full_batch_does_not(nursery: trio.Nursery, tmp_path: Path) -> None:
    _c, broker = await start(nursery, tmp_path, 2)
    proxy = await FrameProxy(broker.addr).start(nursery)
    async with open_producer(broker_addrs=[proxy.addr], linger_ms=400) as p:
        await p.send("t", b"warm up")  # routes and connection: what follows is the linger alone
        submitted = trio.current_time()
        fut = await p.submit("t", b"alone", selector=to(0))
        assert not fut.done()
        with trio.fail_after(10):
            result = await fut.wait()
        sent_at = proxy.sends[-1][0]
        assert 0.3 <= sent_at - submitted < 5, sent_at - submitted
        assert result.queue_offset >= 0
    async with open_producer(broker_addrs=[proxy.addr], linger_ms=60_000, batch_max_bytes=8 * KiB) as p:
        await p.submit_batch("t", [b"warm up"])  # linger is 60 s: only a flush or a full batch sends
        await p.flush()
        before = len(proxy.sends)
        futs = [await p.submit("t", bytes(KiB), selector=to(1)) for _ in range(8)]  # > 8 KiB with headers
        with trio.fail_after(10):  # far below the linger: sent because the batch filled
            await futs[0].wait()
        assert len(proxy.sends) > before
        await p.flush()


async def test_no_request_exceeds_batch_max_bytes_and_a_larger_batch_goes_alone(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    _c, broker = await start(nursery, tmp_path, 3)
    proxy = await FrameProxy(broker.addr).start(nursery)
    limit = 8 * KiB
    async with open_producer(broker_addrs=[proxy.addr], batch_max_bytes=limit, linger_ms=20) as p:
        await p.send("t", b"warm up")
        start_at = len(proxy.sends)
        big = [bytes(KiB) for _ in range(20)]
        with trio.fail_after(20):
            futs = [await p.submit("t", bytes(700 + i % 300), selector=to(i)) for i in range(300)]
            big_fut = await p.submit_batch("t", big, selector=to(0))
            await p.flush()
        assert all(f.done() and f.exception() is None for f in [*futs, big_fut])
    sizes = [len(f.body) for _t, f in proxy.sends[start_at:]]
    big_size = len(encode_batch([Message("t", 0, b, properties={UNIQ_KEY: "k" * 32}) for b in big]))
    assert big_size > limit and big_size in sizes  # alone, whole
    assert all(s <= limit for s in sizes if s != big_size), sizes
    assert len(sizes) >= 300 * 700 // limit


async def test_a_batch_larger_than_the_buffer_is_refused_at_once(nursery: trio.Nursery, tmp_path: Path) -> None:
    _c, broker = await start(nursery, tmp_path, 1)
    async with open_producer(broker_addrs=[broker.addr], buffer_max_bytes=16 * KiB) as p:
        with pytest.raises(BatchTooLargeError, match="buffer_max_bytes=16,384"):
            await p.submit_batch("t", [bytes(KiB) for _ in range(20)])
        assert (await p.send("t", b"fine")).queue_offset == 0


# ------------------------------------------------------------------ buffer full
async def test_a_full_buffer_raises_or_blocks_until_room_or_its_limit(nursery: trio.Nursery, tmp_path: Path) -> None:
    _c, broker = await start(nursery, tmp_path, 1)
    options: dict[str, Any] = {"linger_ms": 60_000, "buffer_max_bytes": 10 * KiB}
    async with open_producer(broker_addrs=[broker.addr], buffer_full="raise", **options) as p:
        accepted = []
        with pytest.raises(BufferFullError, match=r"buffer_max_bytes=10,240 \(buffer_full='raise'\)") as full:
            for _ in range(100):
                accepted.append(await p.submit("t", bytes(KiB)))
        assert 5 <= len(accepted) < 10 and full.value.code is None and isinstance(full.value, SendError)
        await p.flush()
        assert all(f.exception() is None for f in accepted)
    async with open_producer(broker_addrs=[broker.addr], buffer_block_max_ms=300, **options) as p:
        accepted = []
        started = trio.current_time()
        with pytest.raises(BufferFullError, match="buffer_block_max_ms=300"):
            for _ in range(100):
                started = trio.current_time()
                accepted.append(await p.submit("t", bytes(KiB)))
        assert trio.current_time() - started >= 0.25
        # Blocked, then room: a flush answers what is buffered and the blocked submit goes on.
        late: list[SendFuture] = []

        async def blocked() -> None:
            late.append(await p.submit("t", bytes(KiB)))

        with trio.fail_after(20):
            async with trio.open_nursery() as n:
                n.start_soon(blocked)
                await trio.testing.wait_all_tasks_blocked()
                assert not late  # waiting for room
                await p.flush()
            await p.flush()
        assert all(f.exception() is None for f in accepted)
    await settled(broker)
    assert late and late[0].result().queue_offset == broker.store.max_offset("t", 0) - 1, (
        late[0].result(),
        [r.body[:4] for r in broker.store.get("t", 0, 0, 100).messages],
        len(accepted),
    )


# ------------------------------------------------------------------ order, cuts
@pytest.mark.parametrize("seed", [1, 2])
async def test_order_per_queue_and_exactly_once_when_connections_are_cut_at_random(
    nursery: trio.Nursery, tmp_path: Path, seed: int
) -> None:
    """Submits (single messages and batches) to a few queues from one task while a
    proxy cuts every connection at random moments (requests half sent, answers lost):
    every acknowledged message is stored once, and each queue holds its messages in
    the order submitted (those that failed for good, if stored, in their place too)."""
    queues, rnd = 4, random.Random(seed)
    _c, broker = await start(nursery, tmp_path, queues)
    proxy = await FrameProxy(broker.addr).start(nursery)
    submitted: dict[int, list[str]] = {q: [] for q in range(queues)}
    futures: list[tuple[int, SendFuture]] = []
    refused = 0
    async with open_producer(
        broker_addrs=[proxy.addr], linger_ms=2, send_timeout_ms=2000, retry_budget_ms=30_000, retry_backoff_ms=5
    ) as p:
        await p.send("t", b"warm up", selector=to(0), properties={UNIQ_KEY: "warm"})
        submitted[0].append("warm")
        done = trio.Event()

        with trio.fail_after(60):
            async with trio.open_nursery() as n:
                n.start_soon(proxy.cut_at_random, rnd, done)
                for i in range(600):
                    q = rnd.randrange(queues)
                    try:
                        if rnd.random() < 0.2:
                            msgs = [
                                Message("t", 0, b"%d.%d" % (i, j), properties={UNIQ_KEY: f"{i}.{j}"})
                                for j in range(rnd.randint(1, 4))
                            ]
                            futures.append((q, await p.submit_batch("t", msgs, selector=to(q))))
                            submitted[q] += [m.properties[UNIQ_KEY] for m in msgs]
                        else:
                            props = {UNIQ_KEY: f"{i}"}
                            futures.append((q, await p.submit("t", b"%d" % i, selector=to(q), properties=props)))
                            submitted[q].append(f"{i}")
                    except NoRouteError:  # a route look-up cut (older Routes gave up: not "unreachable")
                        refused += 1
                    if i % 10 == 0:
                        await trio.sleep(0.003)  # let the cuts land among requests
                await p.flush()
                done.set()
    acked: set[str] = set()
    for q, fut in futures:
        assert fut.done()
        if fut.exception() is None:
            r = fut.result()
            assert r.queue.queue_id == q
            acked.update(r.uniq_keys)
        else:
            assert isinstance(fut.exception(), SendError)
    everything = await stored(broker, queues)
    for q, keys in everything.items():
        counts = Counter(keys)
        assert all(counts[k] == 1 for k in keys), f"queue {q}: stored twice: {[k for k in keys if counts[k] > 1]}"
        order = {k: i for i, k in enumerate(submitted[q])}
        positions = [order[k] for k in keys]
        assert positions == sorted(positions), f"queue {q}: stored out of submission order"
    assert acked <= {k for keys in everything.values() for k in keys}, "an acknowledged message is missing"
    # What the failures said, should too few succeed (CI once saw 85 acknowledged after
    # 30 s, every other send at the end of its retry budget; never seen here since).
    why = Counter(str(f.exception())[:160] for _q, f in futures if f.exception() is not None).most_common(3)
    assert len(acked) > 300, (len(acked), refused, why, len(proxy.sends))
    retried = sum(bool(f.fields.get("dedup")) for _t, f in proxy.sends)
    print(
        f"cut test: {len(proxy.sends)} requests, {retried} dedup retries, {refused} refused, "
        f"{sum(f.exception() is not None for _q, f in futures)} failed, {len(acked)} acked"
    )
    assert retried > 0, "no cut hit a request in flight"


# ------------------------------------------------------------------ restart
async def test_a_broker_restart_leaves_every_future_stored_once_or_failed(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    queues = 4
    c, broker = await start(nursery, tmp_path, queues)
    port = int(broker.addr.rpartition(":")[2])
    futures: list[tuple[int, SendFuture]] = []
    refused = 0
    async with open_producer(c.ns, linger_ms=5, retry_budget_ms=20_000, send_timeout_ms=2000) as p:
        await p.send("t", b"warm up", selector=to(0))
        with trio.fail_after(60):
            for i in range(400):
                if i == 150:
                    await c.stop_broker("broker-a")  # messages buffered and in flight
                if i == 250:
                    broker = await c.start_broker("broker-a", port=port)  # same data directory and port
                try:
                    futures.append((i % queues, await p.submit("t", b"%d" % i, selector=to(i))))
                except ClientError:
                    refused += 1  # refused at once (no route while the broker is away)
                await trio.sleep(0.002)
            await p.flush()
    keys = await stored(broker, queues)
    ok = 0
    for q, fut in futures:
        assert fut.done(), "a future was left unresolved"
        error = fut.exception()
        if error is None:
            ok += 1
            r = fut.result()
            assert keys[q].count(r.uniq_keys[0]) == 1, "acknowledged but not stored exactly once"
        else:
            assert isinstance(error, SendError)
    assert ok >= 200, (ok, refused)
    for q, ks in keys.items():
        assert len(ks) == len(set(ks)), f"queue {q}: a message stored twice"


# ------------------------------------------------------------------ futures, settings, close
async def test_futures_callbacks_and_close_sends_what_is_buffered(nursery: trio.Nursery, tmp_path: Path) -> None:
    _c, broker = await start(nursery, tmp_path, 2)
    seen: list[SendFuture] = []
    async with open_producer(broker_addrs=[broker.addr], linger_ms=60_000) as p:
        fut = await p.submit("t", b"x", selector=to(1), callback=seen.append)
        assert not fut.done()
        with pytest.raises(RuntimeError, match="not done"):
            fut.result()
        batch = await p.submit_batch("t", [b"a", b"b"], selector=to(1))
    # leaving flushed them (linger 60 s)
    await settled(broker)
    assert seen == [fut] and fut.result().queue_offsets == [0] and batch.result().queue_offsets == [1, 2]
    assert [r.body for r in broker.store.get("t", 1, 0, 10).messages] == [b"x", b"a", b"b"]
    late: list[SendFuture] = []
    fut.add_done_callback(late.append)  # done already: called at once
    assert late == [fut]
    with pytest.raises(SendError, match="producer closed"):
        await p.submit("t", b"after close")


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("linger_ms", -1),
        ("batch_max_bytes", 0),
        ("max_in_flight", 0),
        ("buffer_max_bytes", -5),
        ("buffer_full", "drop"),
        ("buffer_block_max_ms", -1),
        ("send_timeout_ms", 0),
        ("max_in_flight", 1.5),
    ],
)
async def test_settings_are_checked_when_the_producer_is_made(setting: str, value: Any) -> None:
    with pytest.raises(ValueError, match=setting):
        async with open_producer(broker_addrs=["127.0.0.1:1"], **{setting: value}):
            pass


@settings(max_examples=200, deadline=None)
@given(
    body=st.binary(max_size=300),
    tags=st.text(max_size=20),
    keys=st.text(max_size=20),
    props=st.dictionaries(st.text(min_size=1, max_size=10), st.text(max_size=40), max_size=3),
    uniq=st.one_of(st.none(), st.text(alphabet="0123456789ABCDEF", min_size=32, max_size=32), st.text(max_size=40)),
    queue_id=st.integers(0, 2**31),
    born=st.integers(0, 2**62),
)
def test_the_single_message_encoding_is_the_batch_encoding(
    body: bytes, tags: str, keys: str, props: dict[str, str], uniq: str | None, queue_id: int, born: int
) -> None:
    if uniq is not None:
        props = {**props, UNIQ_KEY: uniq}
    m = Message("t", queue_id, body, tags, keys, props, born_timestamp_ms=born)
    assert encode_one(m) == encode_batch([m])


@settings(max_examples=200, deadline=None)
@given(
    body=st.binary(max_size=300),
    uniq=st.text(alphabet="0123456789ABCDEF", min_size=32, max_size=32),
    queue_id=st.integers(0, 2**31),
    retried_on=st.integers(0, 2**31),
    born=st.integers(0, 2**62),
)
def test_a_plain_message_is_encoded_and_made_again_as_it_was_submitted(
    body: bytes, uniq: str, queue_id: int, retried_on: int, born: int
) -> None:
    """A submit without tags, keys or properties is encoded by ``encode_plain`` and its
    batch keeps no Message: the one a retry's selector is given is made again, equal to
    the submitted one (on the queue it is encoded for)."""
    m = Message("t", queue_id, body, "", "", {UNIQ_KEY: uniq}, born_timestamp_ms=born)
    assert encode_plain(queue_id, born, uniq, body) == encode_batch([m])
    mq = MessageQueue("t", "b", queue_id, "127.0.0.1:1")
    asked_before, asked_after = (
        Batch("t", m, 1, (uniq,), encode_plain(queue_id, born, uniq, body), SendFuture(), mq, 0, None, None, True, True)
        for _ in range(2)
    )
    assert asked_before.first == m
    expected = Message("t", retried_on, body, "", "", {UNIQ_KEY: uniq}, born_timestamp_ms=born)
    for batch in (asked_before, asked_after):
        batch.encode_for(retried_on)
        assert b"".join(batch.chunks) == encode_batch([expected])
        assert batch.first == expected

"""Pulls while the consume queues lag the log (issue 14: never serve wrong data).

The store acknowledges a put once it is in the CommitLog (and fsynced, in sync mode);
its consume-queue entries are made afterwards by the dispatcher thread, and only up
to the log's confirmed offset (replication). Until then ``max_offset`` is below queue
offsets already assigned and acknowledged. A pull at such an offset must answer
"nothing yet" (and long-poll for it), never OFFSET_OVERFLOW: a consumer told
"overflow" moves its offset back to ``max_offset`` and reads (and commits) again what
it had. Only an offset beyond the next one the log will assign is an overflow.

The lag is made deterministic, not timed: dispatch is held either by the log's
confirmed offset (as replication lag holds it) or by stalling the dispatcher's round.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import trio

from clmq.broker.service import Broker
from clmq.broker.store import Store
from clmq.client import RpcClient, open_consumer
from clmq.common import Message
from clmq.protocol import FetchResult, RequestCode, decode_records, encode_batch
from tests.service_helpers import FAST_CONSUMER, Cluster
from tests.waiting import await_until

TOPIC = "lag"
VISIBLE = 3  # messages dispatched before the hold
HELD = 4  # messages acknowledged while dispatch is held (queue offsets 3..6)


def store_of(broker: Broker) -> Store:
    assert isinstance(broker.store, Store), "the lag exists in commitlog mode (partition mode shows puts at once)"
    return broker.store


class Hold:
    """Dispatch held while inside (``release`` ends it early): what is appended meanwhile
    is acknowledged, with its queue offsets, but not visible to pulls."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.held = False

    def __enter__(self) -> Hold:
        self.hold()
        self.held = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> None:
        if self.held:
            self.held = False
            self.unhold()

    def hold(self) -> None:
        raise NotImplementedError

    def unhold(self) -> None:
        raise NotImplementedError


class ConfirmedHeld(Hold):
    """Nothing past the log's current end is dispatched (replication's limit on dispatch)."""

    def hold(self) -> None:
        self.store.log.set_confirmed_offset(self.store.log.write_offset)

    def unhold(self) -> None:
        self.store.log.set_confirmed_offset(None)


class DispatcherStalled(Hold):
    """The dispatcher thread stuck before its next round (a slow dispatcher)."""

    def hold(self) -> None:
        self.store.dispatcher._round_lock.acquire()  # the round's lock: the thread waits for it

    def unhold(self) -> None:
        self.store.dispatcher._round_lock.release()
        self.store.dispatcher.wake()


HOLDS: dict[str, type[Hold]] = {"confirmed": ConfirmedHeld, "dispatcher": DispatcherStalled}


@pytest.fixture
async def cluster(nursery: trio.Nursery, tmp_path: Path) -> Cluster:
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    await c.start_broker("broker-a")
    await c.create_topic(TOPIC, 1)
    return c


async def send(rpc: RpcClient, addr: str, bodies: list[bytes]) -> list[int]:
    """One SEND_MESSAGE of ``bodies`` to queue 0; the queue offsets acknowledged."""
    reply = await rpc.request(
        addr, RequestCode.SEND_MESSAGE, {"topic": TOPIC}, encode_batch([Message(TOPIC, 0, b) for b in bodies])
    )
    assert reply.error_code == 0, reply.error_text
    offsets: list[int] = reply.fields["queue_offsets"]
    return offsets


async def pull(rpc: RpcClient, addr: str, code: int, offset: int, wait_ms: int = 0) -> tuple[str, int, list[int]]:
    """``(status, next offset, queue offsets of the records)`` of one pull of queue 0."""
    timeout_ms = wait_ms + 10_000
    if code == RequestCode.PULL_MESSAGE:
        fields: dict[str, Any] = {"topic": TOPIC, "queue_id": 0, "offset": offset, "max_wait_ms": wait_ms}
        reply = await rpc.request(addr, code, fields, timeout_ms=timeout_ms)
        status, nxt = reply.fields["status"], reply.fields["next_offset"]
    else:
        fields = {"queues": [[TOPIC, 0, offset, None]], "max_wait_ms": wait_ms}
        reply = await rpc.request(addr, code, fields, timeout_ms=timeout_ms)
        row = FetchResult.from_wire(reply.fields["results"][0])
        status, nxt = row.status.value, row.next_offset
    records = decode_records(reply.body) if reply.body else []
    return status, nxt, [r.queue_offset for r in records]


async def produce_held(cluster: Cluster, rpc: RpcClient) -> Broker:
    """VISIBLE messages dispatched (the caller holds dispatch next)."""
    broker = cluster.brokers["broker-a"]
    assert await send(rpc, broker.addr, [b"v%d" % i for i in range(VISIBLE)]) == list(range(VISIBLE))
    store_of(broker).catch_up()
    assert store_of(broker).max_offset(TOPIC, 0) == VISIBLE
    return broker


@pytest.mark.parametrize("hold", sorted(HOLDS))
@pytest.mark.parametrize("code", [RequestCode.PULL_MESSAGE, RequestCode.PULL_MESSAGES], ids=["pull", "fetch"])
async def test_a_pull_at_an_acknowledged_offset_not_yet_dispatched_waits_instead_of_overflowing(
    cluster: Cluster, code: int, hold: str
) -> None:
    """Every offset from the visible max up to the next one the log will assign answers
    NO_MESSAGE at once (offset unchanged) and long-polls until dispatched; one past that
    is a real OFFSET_OVERFLOW."""
    async with trio.open_nursery() as n:
        rpc = RpcClient(n)
        broker = await produce_held(cluster, rpc)
        store = store_of(broker)
        with HOLDS[hold](store):
            acked = await send(rpc, broker.addr, [b"h%d" % i for i in range(HELD)])
            assert acked == list(range(VISIBLE, VISIBLE + HELD))
            assert store.max_offset(TOPIC, 0) == VISIBLE  # acknowledged, not visible: the lag
            assigned_next = VISIBLE + HELD
            for offset in range(VISIBLE, assigned_next + 1):
                assert await pull(rpc, broker.addr, code, offset) == ("NO_MESSAGE", offset, []), offset
            for offset in (assigned_next + 1, assigned_next + 50):
                status, nxt, _ = await pull(rpc, broker.addr, code, offset)
                assert (status, nxt) == ("OFFSET_OVERFLOW", VISIBLE), offset

            answer: list[tuple[str, int, list[int]]] = []

            async def long_poll() -> None:
                answer.append(await pull(rpc, broker.addr, code, VISIBLE + 2, wait_ms=10_000))

            n.start_soon(long_poll)
            await await_until(lambda: broker.waiters.waiting >= 1, 10, "the long poll to wait on the broker")
            assert not answer
        with trio.fail_after(10):
            await await_until(lambda: answer, 10, "the long poll to answer once dispatched")
        assert answer == [("FOUND", assigned_next, [VISIBLE + 2, VISIBLE + 3])]
        await rpc.aclose()


@pytest.mark.parametrize("hold", sorted(HOLDS))
async def test_a_consumer_whose_committed_offset_is_not_yet_visible_neither_resets_nor_rereads(
    cluster: Cluster, hold: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A group's committed offset inside the lag (as after a restart while the queues
    catch up, or on a broker whose replication lags): the consumer starts there, waits,
    and reads exactly the messages after it, once dispatched; its committed offset
    never moves back."""
    group, committed = "g", VISIBLE + 2
    async with trio.open_nursery() as n:
        rpc = RpcClient(n)
        broker = await produce_held(cluster, rpc)
        store = store_of(broker)
        got: list[int] = []
        with HOLDS[hold](store) as held, caplog.at_level(logging.WARNING, logger="clmq.consumer"):
            await send(rpc, broker.addr, [b"h%d" % i for i in range(HELD)])
            reply = await rpc.request(
                broker.addr, RequestCode.COMMIT_OFFSET, {"group": group, "offsets": [[TOPIC, 0, committed]]}
            )
            assert reply.error_code == 0 and store.max_offset(TOPIC, 0) == VISIBLE < committed
            async with open_consumer(cluster.ns, group, {TOPIC: "*"}, **FAST_CONSUMER) as consumer:
                # It looked up its offset and asked: now its watch waits on the broker.
                await await_until(lambda: broker.waiters.waiting >= 1, 10, "the consumer to watch its queue")
                held.release()
                with trio.fail_after(10):
                    while len(got) < VISIBLE + HELD - committed:
                        got += [r.queue_offset for r in await consumer.receive()]
                consumer.ack()
                await consumer.commit()
                assert broker.offsets.query(group, TOPIC, 0) == VISIBLE + HELD
        assert got == list(range(committed, VISIBLE + HELD))
        assert not [r for r in caplog.records if "overflow" in r.getMessage()]
        await rpc.aclose()


@pytest.mark.parametrize("mode", ["commitlog", "partition-per-file"])
async def test_a_consumer_past_every_assigned_offset_moves_back_to_the_end_and_misses_nothing(
    nursery: trio.Nursery, tmp_path: Path, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A real overflow (a committed offset that the log never assigned: e.g. messages
    lost with async flush in a crash) still moves the consumer back to the queue's end,
    so that the messages that take those offsets next are read, not skipped."""
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    broker = await c.start_broker("broker-a", storage_mode=mode)
    await c.create_topic(TOPIC, 1)
    group = "g"
    async with trio.open_nursery() as n:
        rpc = RpcClient(n)
        await send(rpc, broker.addr, [b"v%d" % i for i in range(VISIBLE)])
        await rpc.request(broker.addr, RequestCode.COMMIT_OFFSET, {"group": group, "offsets": [[TOPIC, 0, 50]]})
        got: list[int] = []
        with caplog.at_level(logging.WARNING, logger="clmq.consumer"):
            async with open_consumer(c.ns, group, {TOPIC: "*"}, **FAST_CONSUMER) as consumer:
                await await_until(lambda: broker.waiters.waiting >= 1, 10, "the consumer to watch its queue")
                assert await send(rpc, broker.addr, [b"n%d" % i for i in range(2)]) == [VISIBLE, VISIBLE + 1]
                with trio.fail_after(10):
                    while len(got) < 2:
                        got += [r.queue_offset for r in await consumer.receive()]
        assert got == [VISIBLE, VISIBLE + 1]
        assert [r for r in caplog.records if "offset overflow" in r.getMessage()]
        await rpc.aclose()

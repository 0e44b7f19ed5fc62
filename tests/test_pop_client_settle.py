"""The POP consumer's ack, nack and extend against real brokers when things go wrong:
a broker that answers SYSTEM_BUSY while its POP state starts after a restart (acks
retried within retry_budget_ms, never raised, run() goes on); a change whose answer was
lost on the way back (the broker applied it) and whose retry is refused ("unknown",
never a status that says settled); records this consumer holds no receipt of
("expired", not "gone"); run() cancelled with acks of finished handlers queued (sent
before it returns)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from clmq.client import PopConsumer, Record, open_admin, open_pop_consumer
from clmq.client.pop._receipts import FORGET_AFTER_DEADLINE_MS
from tests.pop_helpers import FAST_POP, Popper
from tests.service_helpers import Cluster
from tests.test_client_failover import FAST as FAST_CLUSTER
from tests.test_client_failover import start_group
from tests.waiting import await_until

FAST = {"pop_wait_ms": 300, "route_refresh_interval_ms": 500}
TEST_TIMEOUT_S = 90  # each test's whole body, set-up included
STARTING_MS = 4000  # pop_revive_interval_ms of a restarted broker: SYSTEM_BUSY for about this long


async def receive(consumer: PopConsumer, want: int, timeout_s: float = 10) -> list[Record]:
    got: list[Record] = []
    with trio.fail_after(timeout_s):
        while len(got) < want:
            got += await consumer.receive()
    return got


async def pop_state(ns: list[str], group: str) -> dict[str, Any]:
    async with open_admin(ns) as admin:
        (pop,) = (await admin.describe_group(group))["pop"]
    return dict(pop)


async def restart(c: Cluster, port: int) -> None:
    """Stop broker-a and start it again on ``port``, slow to start its POP state."""
    await c.stop_broker("broker-a")
    await c.start_broker(port=port, **{**FAST_POP, "pop_revive_interval_ms": STARTING_MS})


@pytest.mark.slow
async def test_acks_while_a_restarted_broker_starts_its_pop_state_are_retried_not_raised(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """The reviewer's case: ack() right after the broker restarted answered SYSTEM_BUSY
    and raised; run() died with it. Now both acks are retried until the broker serves."""
    with trio.fail_after(TEST_TIMEOUT_S):  # every await bounded (a hang fails, naming where)
        c = Cluster(nursery, tmp_path)
        await c.start_nameserver()
        b = await c.start_broker(**FAST_POP)
        port = int(b.addr.rsplit(":", 1)[1])
        await c.create_topic("t", 1)
        async with open_admin(c.ns) as admin:
            await Popper(admin, b.addr).send("t", [b"by-hand", b"by-run"])
        one = {"invisible_time_ms": 60_000, "prefetch_max_messages": 1, "pops_in_flight": 1, "receive_max_messages": 1}
        with trio.fail_after(60):
            async with open_pop_consumer(c.ns, "g", {"t": "*"}, retry_budget_ms=20_000, **one, **FAST) as pc:
                (first,) = await receive(pc, 1)
                await restart(c, port)
                assert await pc.ack([first]) == ["ok"]
            handled: list[bytes] = []

            async def handler(record: Record) -> None:
                handled.append(bytes(record.body))
                await restart(c, port)  # its ack meets the broker starting

            async with open_pop_consumer(c.ns, "g", {"t": "*"}, retry_budget_ms=20_000, **one, **FAST) as pc2:
                assert await pc2.run(handler, max_messages=1) == 1
                assert (pc2.stats.acked, pc2.stats.unreachable) == (1, 0)
            assert handled == [b"by-run"]
            pop = await pop_state(c.ns, "g")
        assert sum(q["inflight"] for q in pop["queues"]) == 0
        assert all(q["settled_offset"] == q["max_offset"] == 2 for q in pop["queues"])


class CuttingProxy:
    """Forwards 127.0.0.1 connections to ``target``; after :meth:`cut_next`, the next
    bytes the target sends back are dropped and that connection closed (the request went
    through and was applied; its answer is lost)."""

    def __init__(self, target: str) -> None:
        self.target, self.addr, self.armed, self.cuts = target, "", False, 0

    async def serve(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.addr = f"127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        task_status.started()
        await trio.serve_listeners(self._one, listeners)

    def cut_next(self) -> None:
        self.armed = True

    async def _one(self, client: trio.SocketStream) -> None:
        host, port = self.target.rsplit(":", 1)
        try:
            upstream = await trio.open_tcp_stream(host, int(port))
        except OSError:
            await client.aclose()
            return
        async with client, upstream, trio.open_nursery() as n:
            n.start_soon(self._pump, client, upstream, False, n.cancel_scope)
            n.start_soon(self._pump, upstream, client, True, n.cancel_scope)

    async def _pump(self, src: trio.SocketStream, dst: trio.SocketStream, back: bool, scope: trio.CancelScope) -> None:
        try:
            async for data in src:
                if back and self.armed:
                    self.armed, self.cuts = False, self.cuts + 1
                    break
                await dst.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        scope.cancel()


async def test_a_change_applied_whose_answer_was_lost_is_unknown_never_settled(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """extend(): the broker applies the first try (a new handle), its answer is lost, the
    retry with the old handle is refused: "unknown" (was "expired", and a later ack
    said "gone" while the broker kept the message). Records without a receipt (dropped,
    forgotten long past their deadline) are "expired", never "gone"."""
    with trio.fail_after(TEST_TIMEOUT_S):  # every await bounded (a hang fails, naming where)
        c = Cluster(nursery, tmp_path)
        await c.start_nameserver()
        b = await c.start_broker(**FAST_POP)
        await c.create_topic("t", 1)
        async with open_admin(c.ns) as admin:
            await Popper(admin, b.addr).send("t", [b"slow", b"forgotten"])
        proxy = CuttingProxy(b.addr)
        await nursery.start(proxy.serve)
        # Long polls that answer nothing for long: the one answer cut is the change's.
        opts = {"invisible_time_ms": 30_000, "pop_wait_ms": 20_000, "route_refresh_interval_ms": 60_000}
        with trio.fail_after(30):
            async with open_pop_consumer(None, "g", {"t": "*"}, broker_addrs=proxy.addr, **opts) as pc:
                slow, forgotten = sorted(await receive(pc, 2), key=lambda r: r.queue_offset)
                proxy.cut_next()
                assert await pc.extend([slow], 60_000) == ["unknown"]
                assert (proxy.cuts, pc.stats.unknown, pc.stats.extended) == (1, 1, 0)
                assert pc.receipt(slow) is None
                assert await pc.ack([slow]) == ["expired"]  # not "gone": the broker still holds it
                receipt = pc.receipt(forgotten)
                assert receipt is not None
                assert pc.receipts.prune(receipt.deadline_ms + FORGET_AFTER_DEADLINE_MS + 1) == 1
                assert await pc.ack([forgotten]) == ["expired"]
            pop = await pop_state(c.ns, "g")
        assert pop["acked"] == 0 and sum(q["inflight"] for q in pop["queues"]) == 2, pop  # nothing settled


async def test_acks_of_finished_handlers_are_sent_when_run_is_cancelled(nursery: trio.Nursery, tmp_path: Path) -> None:
    """The last handler cancels run(): its ack (queued, not yet sent) and any on the way
    are still sent before run() returns; none comes back."""
    with trio.fail_after(TEST_TIMEOUT_S):  # every await bounded (a hang fails, naming where)
        c = Cluster(nursery, tmp_path)
        await c.start_nameserver()
        b = await c.start_broker(**FAST_POP)
        await c.create_topic("t", 1)
        async with open_admin(c.ns) as admin:
            await Popper(admin, b.addr).send("t", [b"m%d" % i for i in range(5)])
        handled: list[Record] = []
        with trio.fail_after(30):
            async with open_pop_consumer(c.ns, "g", {"t": "*"}, invisible_time_ms=30_000, **FAST) as pc:
                with trio.CancelScope() as scope:

                    async def handler(record: Record) -> None:
                        handled.append(record)
                        if len(handled) == 5:
                            scope.cancel()

                    await pc.run(handler)
                assert len(handled) == 5
                assert (pc.stats.acked, pc.in_flight) == (5, 0)
            pop = await pop_state(c.ns, "g")
        assert pop["acked"] == 5 and sum(q["inflight"] for q in pop["queues"]) == 0, pop


@pytest.mark.slow
async def test_one_busy_broker_leaves_the_other_brokers_statuses(nursery: trio.Nursery, tmp_path: Path) -> None:
    """broker-a starts its POP state for longer than retry_budget_ms: its record is
    "unreachable" (it comes back); broker-b's is "ok" in the same call (was: raised)."""
    with trio.fail_after(TEST_TIMEOUT_S):  # every await bounded (a hang fails, naming where)
        c = Cluster(nursery, tmp_path)
        await c.start_nameserver()
        a = await c.start_broker("broker-a", **FAST_POP)
        b = await c.start_broker("broker-b", **FAST_POP)
        port = int(a.addr.rsplit(":", 1)[1])
        await c.create_topic("t", 1)
        async with open_admin(c.ns) as admin:
            for broker in (a, b):
                await Popper(admin, broker.addr).send("t", [broker.config.broker_name.encode()])
        with trio.fail_after(60):
            async with open_pop_consumer(c.ns, "g", {"t": "*"}, retry_budget_ms=1000, **FAST) as pc:
                got = {bytes(r.body): r for r in await receive(pc, 2)}
                await restart(c, port)
                assert await pc.ack([got[b"broker-a"], got[b"broker-b"]]) == ["unreachable", "ok"]
                assert pc.receipt(got[b"broker-a"]) is not None  # kept: a later ack may still settle it
                assert (pc.stats.acked, pc.stats.unreachable) == (1, 1)


@pytest.mark.slow
async def test_pops_refused_while_too_few_replicas_are_in_sync_are_retried_not_raised(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """ack_mode sync, min_insync_replicas=2, the follower stopped: the POP's CK write is
    refused (NOT_ENOUGH_REPLICAS / REPLICATION_TIMEOUT). receive() raised it to the
    caller (and run() died with it); now the loop asks again, and once the follower is
    back the messages come and are acknowledged."""
    with trio.fail_after(TEST_TIMEOUT_S):
        c = Cluster(nursery, tmp_path)
        await c.start_nameserver()
        sync = {"ack_mode": "sync", "min_insync_replicas": 2, "replica_lag_max_ms": 500, **FAST_POP}
        lead, _ = await start_group(c, **sync)
        async with open_admin(c.ns) as admin:
            await Popper(admin, lead.addr).send("t", [b"x"], queue_id=0)
        await c.stop_broker("g1")
        await await_until(lambda: lead.replica.leader.isr.size() == 1, 15, "the ISR to shrink")  # type: ignore[union-attr]
        async with open_pop_consumer(c.ns, "g", {"t": "*"}, max_backoff_ms=200, **FAST) as pc:
            await await_until(lambda: pc.stats.pop_errors >= 2, 15, "POPs refused")
            await c.start_broker(
                "g", key="g1", broker_id=1, role="follower", leader_addr=lead.addr, **{**FAST_CLUSTER, **sync}
            )
            (record,) = await receive(pc, 1, timeout_s=30)  # (was: the refusal, raised)
            assert record.body == b"x"
            assert await pc.ack([record]) == ["ok"]


async def test_an_ack_of_more_records_than_one_request_may_carry_is_split(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """A broker taking at most 4 handles per ACK_MESSAGE / CHANGE_INVISIBLE_TIME: one
    ack() of 10 records and one extend() of 10 are each split into requests under it,
    and every record is answered ok (was: the whole call refused, "unreachable")."""
    with trio.fail_after(TEST_TIMEOUT_S):
        c = Cluster(nursery, tmp_path)
        await c.start_nameserver()
        b = await c.start_broker(**{**FAST_POP, "pop_max_handles_per_request": 4})
        await c.create_topic("t", 1)
        async with open_admin(c.ns) as admin:
            await Popper(admin, b.addr).send("t", [b"m%d" % i for i in range(10)])
        async with open_pop_consumer(c.ns, "g", {"t": "*"}, invisible_time_ms=30_000, **FAST) as pc:
            got = await receive(pc, 10)
            assert await pc.extend(got, 20_000) == ["ok"] * 10
            assert await pc.ack(got) == ["ok"] * 10
        pop = await pop_state(c.ns, "g")
        assert pop["acked"] == 10 and sum(q["inflight"] for q in pop["queues"]) == 0, pop

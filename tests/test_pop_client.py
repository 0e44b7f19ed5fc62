"""The POP consumer's API (client/pop/) against real brokers: receive and ack, nack
(delivered again with reconsume_times 1), extend (a slow message stays with its
member past its first invisible time), an ack after the invisible time (refused and
counted), run() with concurrent handlers, orderly POP with several members and a
failure, fairness with one hot queue; the same on asyncio and blocking; options
checked before anything connects."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from pathlib import Path
from typing import Any, Callable

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from clmq.client import (
    BlockingPopConsumer,
    ConsumeStatus,
    PopConsumer,
    PopConsumerOptions,
    Record,
    RpcClient,
    RpcError,
    open_admin,
    open_asyncio_pop_consumer,
    open_consumer,
    open_pop_consumer,
    open_producer,
)
from clmq.client.pop import Budget, failed_part, handle_lane
from clmq.client.pop._buffer import PopBuffer
from clmq.client.pop._receipts import FORGET_AFTER_DEADLINE_MS, Receipt, Receipts
from clmq.common import Message
from clmq.protocol import RequestCode, encode_batch
from tests.cli_helpers import free_port
from tests.service_helpers import Cluster, cluster_in_thread
from tests.test_client_failover import start_group
from tests.waiting import await_until

BROKER = {"pop_revive_interval_ms": 20}
TEST_TIMEOUT_S = 60  # each broker test's whole body (its own waits are shorter)
FAST = {"pop_wait_ms": 300, "route_refresh_interval_ms": 500}
ENTRIES: list[Callable[..., Any]] = [open_pop_consumer, open_asyncio_pop_consumer, BlockingPopConsumer]


@pytest.fixture
async def cluster(nursery: trio.Nursery, tmp_path: Path) -> Cluster:
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    await c.start_broker(**BROKER)
    return c


async def send(addr: str, topic: str, bodies: list[bytes], queue: int = 0) -> None:
    async with trio.open_nursery() as n:
        rpc = RpcClient(n)
        await rpc.request(
            addr, RequestCode.SEND_MESSAGE, {"topic": topic}, encode_batch([Message(topic, queue, b) for b in bodies])
        )
        await rpc.aclose()


async def receive(consumer: PopConsumer, want: int, timeout_s: float = 10) -> list[Record]:
    got: list[Record] = []
    with trio.fail_after(timeout_s):
        while len(got) < want:
            got += await consumer.receive()
    return got


def record(body: bytes, queue_id: int = 0, offset: int = 0, topic: str = "t") -> Record:
    return Record(topic, queue_id, offset, offset * 100, 100, body, "", "", {}, 0, 0, 0, ("", 0), ("", 0), 0)


# ---------------------------------------------------------------- no broker needed
@pytest.mark.parametrize("entry", ENTRIES, ids=lambda f: f.__name__)
def test_each_entry_names_every_option_with_its_type_and_default(entry: Callable[..., Any]) -> None:
    params = inspect.signature(entry).parameters
    for field in dataclasses.fields(PopConsumerOptions):
        param = params[field.name]
        assert param.kind is inspect.Parameter.KEYWORD_ONLY, (entry, field.name)
        assert param.annotation == field.type, (entry, field.name)
        assert param.default == field.default, (entry, field.name)


@pytest.mark.parametrize(
    "bad",
    [
        {"invisible_time_ms": 0},
        {"max_messages": 0},
        {"prefetch_max_messages": -1},
        {"handler_concurrency": 0},
        {"pop_wait_ms": -5},
        {"max_reconsume_times": 10_000},
        {"retry_delays_ms": ()},
        {"retry_delays_ms": (100, -1)},
        {"start_from": "middle"},
        {"orderly": "yes"},
        {"pop_max_bytes": 0},
    ],
    ids=lambda d: next(iter(d)),
)
def test_a_bad_option_is_a_value_error_naming_it_before_anything_connects(bad: dict[str, Any]) -> None:
    name = next(iter(bad))
    addr = f"127.0.0.1:{free_port()}"  # nothing listens: connecting would fail otherwise
    with pytest.raises(ValueError, match=name):
        BlockingPopConsumer(addr, "g", {"t": "*"}, **bad)

    async def trio_entry() -> None:
        async with open_pop_consumer(addr, "g", {"t": "*"}, **bad):
            raise AssertionError("opened")

    with pytest.raises(ValueError, match=name):
        trio.run(trio_entry)

    async def asyncio_entry() -> None:
        async with open_asyncio_pop_consumer(addr, "g", {"t": "*"}, **bad):
            raise AssertionError("opened")

    with pytest.raises(ValueError, match=name):
        asyncio.run(asyncio_entry())


@given(
    st.sampled_from(["invisible_time_ms", "max_messages", "prefetch_max_messages", "receive_max_messages"]),
    st.one_of(st.integers(max_value=0), st.floats(allow_nan=False), st.text(max_size=3), st.none()),
)
def test_a_limit_that_is_not_a_positive_integer_is_refused_by_name(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=name):
        PopConsumerOptions(**{name: value})  # type: ignore[arg-type]


@given(st.integers(1, 10**9), st.integers(1, 40))
def test_the_default_back_off_grows_with_the_attempt_and_then_stays(delay: int, attempt: int) -> None:
    opts = PopConsumerOptions(retry_delays_ms=(delay, delay * 2))
    assert opts.retry_delay_ms(attempt) == (delay if attempt == 1 else delay * 2)
    assert PopConsumerOptions().retry_delay_ms(attempt) == PopConsumerOptions().retry_delays_ms[min(attempt, 7) - 1]


@given(st.lists(st.integers(0, 10**7), max_size=30), st.integers(0, 2 * 10**7))
def test_receipts_long_past_their_deadline_are_forgotten_and_only_those(deadlines: list[int], now: int) -> None:
    receipts = Receipts()
    records = [record(b"r", 0, i) for i in range(len(deadlines))]
    for r, deadline in zip(records, deadlines):
        receipts.add(Receipt(r, "b", "a:1", f"h{r.queue_offset}", 1, deadline))
    forgotten = receipts.prune(now + FORGET_AFTER_DEADLINE_MS)
    assert forgotten == sum(1 for d in deadlines if d < now)
    assert [receipts.get(r) is not None for r in records] == [d >= now for d in deadlines]
    assert receipts.get(record(b"r")) is None  # an equal record is not the same record


@given(
    st.integers(1, 30),
    st.lists(st.tuples(st.integers(1, 8), st.integers(0, 8), st.booleans()), min_size=1, max_size=40),
)
def test_run_hands_exactly_max_messages_to_handlers_whatever_the_lanes(
    most: int, lanes: list[tuple[int, int, bool]]
) -> None:
    """Lanes (orderly batches) taken while there is room, each handled up to its failure
    (the rest handed back, its room given back), finishing in any order: never more
    than ``most`` handled or being handled (the real runs above end at exactly it)."""
    budget, running, offset = Budget(most), [], 0
    for size, fail_at, finish_first in lanes:
        if budget.finished():
            break
        if not budget.full():
            lane, extra = budget.take([record(b"x", 0, offset + i) for i in range(size)])
            offset += size
            assert lane and len(lane) + len(extra) == size
            running.append((len(lane), min(fail_at + 1, len(lane))))
        if running and (finish_first or budget.full()):
            budget.done(*running.pop(0))
        assert budget.handled + budget.busy <= most and budget.busy >= 0
    while running:
        budget.done(*running.pop())
    assert budget.handled <= most and budget.busy == 0


def test_open_consumer_in_pop_mode_points_to_the_pop_consumer() -> None:
    async def main() -> None:
        async with open_consumer(f"127.0.0.1:{free_port()}", "g", {"t": "*"}, mode="pop"):  # type: ignore[arg-type]
            raise AssertionError("opened")

    with pytest.raises(ValueError, match="open_pop_consumer"):
        trio.run(main)


@given(st.lists(st.tuples(st.integers(0, 3), st.sampled_from(["a", "b"])), max_size=40), st.integers(1, 10))
@settings(deadline=None)
def test_orderly_takes_whole_queue_batches_in_order(arrivals: list[tuple[int, str]], most: int) -> None:
    """Records of queues arriving interleaved: each take holds whole queue batches (a
    queue's buffered records together, in arrival order), the first one always."""

    async def main() -> None:
        buffer = PopBuffer(1000)
        for i, (queue, broker) in enumerate(arrivals):
            buffer.fill(0, broker, [record(b"x", queue, i)])
        taken: list[list[tuple[str, Record]]] = []
        while buffer.records:
            before = list(buffer.records)
            out = buffer.take(most, whole_queues=True)
            keys = {(n, r.queue_id) for n, r in before if any(r is o for o in out)}
            for key in keys:  # every buffered record of a taken queue was taken, in order
                assert [r for n, r in before if (n, r.queue_id) == key] == [r for r in out if _key(before, r) == key]
            assert out and (len(out) <= most or len(keys) == 1)
            taken.append([(n, r) for n, r in before if any(r is o for o in out)])
        assert sum(len(t) for t in taken) == len(arrivals)

    trio.run(main)


def test_room_freed_goes_to_the_loop_that_waited_first() -> None:
    """A loop whose POP came back and that asks again at once does not overtake a loop of
    another broker waiting for room (that broker would never be popped from)."""

    async def main() -> None:
        buffer = PopBuffer(4)
        order: list[str] = []
        assert await buffer.reserve(4) == 4  # broker a's POP in flight holds all the room

        async def b() -> None:
            got = await buffer.reserve(4)
            order.append(f"b:{got}")
            await trio.lowlevel.checkpoint()  # b's POP ...
            buffer.fill(got, "b", [])  # ... came back

        with trio.fail_after(5):  # (before the fix: a took the room again, b waited for ever)
            async with trio.open_nursery() as n:
                n.start_soon(b)
                await trio.testing.wait_all_tasks_blocked()
                buffer.fill(4, "a", [])  # a's POP came back empty, and a asks again at once
                order.append(f"a:{await buffer.reserve(4)}")
        assert order == ["b:4", "a:4"]

    trio.run(main)


def _key(before: list[tuple[str, Record]], r: Record) -> tuple[str, int]:
    return next((n, x.queue_id) for n, x in before if x is r)


@given(st.lists(st.booleans(), min_size=1, max_size=12), st.booleans())
@settings(deadline=None)
def test_a_lane_acks_what_succeeded_and_hands_back_the_failed_part(verdicts: list[bool], orderly: bool) -> None:
    """A lane's records in order: each success acknowledged; orderly, the first failure
    stops the lane and hands back it and the rest with its delay; otherwise a failure
    hands back that record alone (a lane of one message)."""
    lane = [record(str(i).encode(), 0, i) for i in range(len(verdicts))]
    acked: list[Record] = []
    nacked: list[tuple[list[Record], int | None]] = []

    async def judge_one(r: Record) -> bool:
        return verdicts[r.queue_offset]

    async def ack(records: Any) -> None:
        acked.extend(records)

    async def nack(records: Any, delay: int | None) -> None:
        nacked.append((list(records), delay))

    handled = trio.run(lambda: handle_lane(lane, judge_one, ack, nack, orderly=orderly, delay_of=lambda r: 777))
    first_failure = verdicts.index(False) if False in verdicts else len(verdicts)
    assert acked == lane[:first_failure]
    assert handled == min(first_failure + 1, len(lane))
    if first_failure < len(lane):
        assert nacked == [(failed_part(lane, first_failure, orderly), 777 if orderly else None)]
        assert nacked[0][0] == (lane[first_failure:] if orderly else [lane[first_failure]])
    else:
        assert nacked == []


# ---------------------------------------------------------------- a real broker, trio
async def test_receive_ack_nack_and_an_ack_after_the_invisible_time(cluster: Cluster) -> None:
    with trio.fail_after(TEST_TIMEOUT_S):  # every await bounded (a hang fails, naming where)
        await cluster.create_topic("pt", 2)
        addr = cluster.brokers["broker-a"].addr
        await send(addr, "pt", [b"a", b"b"], 0)
        await send(addr, "pt", [b"c"], 1)
        async with open_pop_consumer(cluster.ns, "g", {"pt": "*"}, invisible_time_ms=1500, **FAST) as c:
            got = {r.body: r for r in await receive(c, 3)}
            assert sorted(got) == [b"a", b"b", b"c"]
            assert all(r.reconsume_times == 0 for r in got.values())
            assert await c.ack([got[b"a"]]) == ["ok"]
            # no receipt left here: not known settled ("gone" is the broker's word), so "expired"
            assert await c.ack([got[b"a"]]) == ["expired"]
            assert await c.nack([got[b"b"]], delay_ms=0) == ["ok"]
            (again,) = await receive(c, 1)
            assert (again.body, again.reconsume_times, again.queue_offset) == (b"b", 1, got[b"b"].queue_offset)
            assert await c.ack([again]) == ["ok"]
            # c is never acknowledged in time: it comes back (to this member: the only one)
            late = got[b"c"]
            (back,) = await receive(c, 1)
            assert (back.body, back.reconsume_times) == (b"c", 1)
            assert await c.ack([late]) == ["expired"]  # its invisible time had passed: refused
            assert c.stats.ack_expired == 2
            assert await c.ack([back]) == ["ok"]
            assert (c.stats.acked, c.stats.nacked, c.stats.redelivered) == (3, 1, 2)
            assert c.in_flight == 0
        async with open_admin(cluster.ns) as admin:
            (pop,) = (await admin.describe_group("g"))["pop"]
        assert (pop["acked"], pop["ack_expired"]) == (3, 1)  # the broker counted the refused ack too
        assert sum(q["inflight"] for q in pop["queues"]) == 0


async def test_closing_hands_back_what_was_popped_and_never_handed_out(cluster: Cluster) -> None:
    """Member a took 20 into its buffer and handed out 1; closed, the other 19 go to
    member b at once, long before their 30 s invisible time."""
    with trio.fail_after(TEST_TIMEOUT_S):  # every await bounded (a hang fails, naming where)
        await cluster.create_topic("cl", 1)
        await send(cluster.brokers["broker-a"].addr, "cl", [b"m%d" % i for i in range(20)])
        opts = {"invisible_time_ms": 30_000, "prefetch_max_messages": 20, "max_messages": 20, **FAST}
        async with open_pop_consumer(cluster.ns, "g", {"cl": "*"}, receive_max_messages=1, **opts) as a:
            (first,) = await a.receive()
            with trio.fail_after(10):
                while len(a.buffer.records) < 19:
                    await a.buffer.arrival()
            assert await a.ack([first]) == ["ok"]
        assert a.stats.released == 19
        async with open_pop_consumer(cluster.ns, "g", {"cl": "*"}, **opts) as b:
            got = await receive(b, 19, timeout_s=5)
        assert sorted(r.body for r in got) == sorted(b"m%d" % i for i in range(1, 20))
        assert {r.reconsume_times for r in got} == {1}  # handed back: a delivery of its own was counted


async def test_a_broker_that_restarts_or_joins_is_popped_from(cluster: Cluster) -> None:
    with trio.fail_after(TEST_TIMEOUT_S):  # every await bounded (a hang fails, naming where)
        await cluster.create_topic("moving", 1)
        a = cluster.brokers["broker-a"]
        port = int(a.addr.rsplit(":", 1)[1])
        await send(a.addr, "moving", [b"before"])
        async with open_pop_consumer(cluster.ns, "g", {"moving": "*"}, invisible_time_ms=5000, **FAST) as c:
            (before,) = await receive(c, 1)
            assert await c.ack([before]) == ["ok"]
            await cluster.stop_broker("broker-a")  # its POP loop meets a closed connection: retried with back-off
            a = await cluster.start_broker("broker-a", port=port, **BROKER)
            await send(a.addr, "moving", [b"after restart"])
            (after,) = await receive(c, 1, timeout_s=15)
            assert after.body == b"after restart"
            assert await c.ack([after]) == ["ok"]
            b = await cluster.start_broker("broker-b", **BROKER)  # a new broker with the topic: found by the routes
            async with open_admin(cluster.ns) as admin:
                await admin.create_topic("moving", 1, on=[b.addr])
            await cluster.wait_routed("moving", {"broker-a", "broker-b"})
            await send(b.addr, "moving", [b"on b"])
            (on_b,) = await receive(c, 1, timeout_s=15)  # (broker-a's loops could once keep all the room)
            assert on_b.body == b"on b" and c.receipt(on_b).broker_name == "broker-b"  # type: ignore[union-attr]
            assert await c.ack([on_b]) == ["ok"]
            assert c.stats.pop_errors >= 1


async def test_a_pop_the_broker_refuses_for_good_is_raised_by_receive(nursery: trio.Nursery, tmp_path: Path) -> None:
    with trio.fail_after(TEST_TIMEOUT_S):  # every await bounded (a hang fails, naming where)
        c = Cluster(nursery, tmp_path)
        await c.start_nameserver()
        await c.start_broker(pop_invisible_time_max_ms=1000, **BROKER)
        await c.create_topic("pt", 1)
        async with open_pop_consumer(c.ns, "g", {"pt": "*"}, invisible_time_ms=5000, max_backoff_ms=100, **FAST) as con:
            for _ in range(2):  # raised once per refusal: asked again (an operator may fix it), refused again
                with trio.fail_after(10), pytest.raises(RpcError, match="MALFORMED_REQUEST"):
                    await con.receive()
            assert con.stats.pop_errors >= 2


async def test_extend_keeps_a_slow_message_with_its_member(cluster: Cluster) -> None:
    with trio.fail_after(TEST_TIMEOUT_S):  # every await bounded (a hang fails, naming where)
        await cluster.create_topic("slow", 1)
        await send(cluster.brokers["broker-a"].addr, "slow", [b"slow"])
        opts = {"invisible_time_ms": 1000, **FAST}
        async with (
            open_pop_consumer(cluster.ns, "g", {"slow": "*"}, client_id="a", **opts) as a,
            open_pop_consumer(cluster.ns, "g", {"slow": "*"}, client_id="b", **opts) as b,
        ):
            with trio.fail_after(10):
                holder, (msg,) = await first_receive(a, b)
            other = b if holder is a else a
            first_deadline = holder.receipt(msg).deadline_ms  # type: ignore[union-attr]
            old_handle = holder.receipt(msg).handle  # type: ignore[union-attr]
            assert await holder.extend([msg], 4000) == ["ok"]
            assert holder.receipt(msg).handle != old_handle  # type: ignore[union-attr]
            assert holder.receipt(msg).deadline_ms > first_deadline + 2000  # type: ignore[union-attr]
            # past the first deadline (by a second) the other member gets nothing
            with trio.move_on_after(2.0):
                extra = await other.receive()
                raise AssertionError(f"the extended message went to the other member: {extra}")
            assert await holder.ack([msg]) == ["ok"]  # under its new handle
            assert holder.stats.extended == 1 and holder.stats.ack_expired == 0


async def first_receive(*consumers: PopConsumer) -> tuple[PopConsumer, list[Record]]:
    """The first of ``consumers`` to receive something, and what it received."""
    got: list[tuple[PopConsumer, list[Record]]] = []
    async with trio.open_nursery() as nursery:

        async def one(c: PopConsumer) -> None:
            got.append((c, await c.receive()))
            nursery.cancel_scope.cancel()

        for c in consumers:
            nursery.start_soon(one, c)
    return got[0]


async def test_run_hands_messages_to_concurrent_handlers_and_retries_failures(cluster: Cluster) -> None:
    with trio.fail_after(TEST_TIMEOUT_S):  # every await bounded (a hang fails, naming where)
        await cluster.create_topic("work", 2)
        addr = cluster.brokers["broker-a"].addr
        for q in (0, 1):
            await send(addr, "work", [f"{q}-{i}".encode() for i in range(20)], q)
        done: dict[bytes, int] = {}
        running, most_at_once = [0], [0]

        async def handler(r: Record) -> ConsumeStatus:
            running[0] += 1
            most_at_once[0] = max(most_at_once[0], running[0])
            await trio.lowlevel.checkpoint()
            await trio.lowlevel.checkpoint()
            running[0] -= 1
            if r.body.endswith(b"7") and r.reconsume_times == 0:
                raise RuntimeError("a handler failure: delivered again")
            if r.body.endswith(b"3") and r.reconsume_times == 0:
                return ConsumeStatus.RECONSUME_LATER
            done[r.body] = done.get(r.body, 0) + 1
            return ConsumeStatus.SUCCESS

        opts = {"invisible_time_ms": 3000, "retry_delays_ms": (0,), "handler_concurrency": 4, **FAST}
        async with open_pop_consumer(cluster.ns, "g", {"work": "*"}, **opts) as c:
            with trio.fail_after(20):
                handled = await c.run(handler, max_messages=40 + 8)  # 8 failed first attempts (x3, x7 in 2 queues)
            assert handled == 48
            assert sorted(done) == sorted(f"{q}-{i}".encode() for q in (0, 1) for i in range(20))
            assert set(done.values()) == {1}
            assert 1 < most_at_once[0] <= 4
            assert (c.stats.acked, c.stats.nacked) == (40, 8)  # run() returns once its batched acks are answered
            assert c.in_flight == 0


async def test_orderly_pop_handles_each_queue_in_order_across_members_and_a_failure(cluster: Cluster) -> None:
    with trio.fail_after(TEST_TIMEOUT_S):  # every await bounded (a hang fails, naming where)
        await cluster.create_topic("ord", 2)
        addr = cluster.brokers["broker-a"].addr
        for q in (0, 1):
            await send(addr, "ord", [f"{q}-{i:02d}".encode() for i in range(30)], q)
        succeeded: dict[int, list[int]] = {0: [], 1: []}
        attempts: dict[tuple[int, int], int] = {}
        everything = trio.Event()

        def handler(r: Record) -> ConsumeStatus:
            key = (r.queue_id, r.queue_offset)
            attempts[key] = attempts.get(key, 0) + 1
            if key == (0, 5) and attempts[key] == 1:
                return ConsumeStatus.RECONSUME_LATER  # queue 0 stops here: 5 and what follows come back in order
            succeeded[r.queue_id].append(r.queue_offset)
            if sum(len(v) for v in succeeded.values()) == 60:
                everything.set()
            return ConsumeStatus.SUCCESS

        opts = {"invisible_time_ms": 3000, "retry_delays_ms": (100,), "orderly": True, "max_messages": 4, **FAST}
        async with trio.open_nursery() as n:
            for i in range(3):
                c = await n.start(_running, cluster.ns, "og", {"ord": "*"}, handler, {"client_id": f"m{i}", **opts})
            with trio.fail_after(20):
                await everything.wait()
            n.cancel_scope.cancel()
        assert succeeded == {0: list(range(30)), 1: list(range(30))}, (succeeded, attempts)
        assert attempts[0, 5] == 2
        del c


async def _running(
    ns: list[str],
    group: str,
    subs: dict[str, str],
    handler: Any,
    opts: dict[str, Any],
    task_status: trio.TaskStatus[PopConsumer] = trio.TASK_STATUS_IGNORED,
) -> None:
    async with open_pop_consumer(ns, group, subs, **opts) as c:
        task_status.started(c)
        await c.run(handler)


async def test_a_hot_queue_does_not_starve_another(cluster: Cluster) -> None:
    """Queue 0 holds a backlog of 3000; a message sent to queue 1 after the consumer
    started arrives long before the backlog is through. Every await is bounded (the
    consumer's close too): this test once hung until pytest's timeout at teardown (a
    CK write waiting, shielded, on the append lane the teardown had stopped:
    tests/test_append_lane_stop.py)."""
    with trio.fail_after(TEST_TIMEOUT_S):  # every await bounded (a hang fails, naming where)
        await cluster.create_topic("hot", 2)
        addr = cluster.brokers["broker-a"].addr
        for start in range(0, 3000, 500):
            await send(addr, "hot", [f"h{i}".encode() for i in range(start, start + 500)], 0)
        async with open_pop_consumer(cluster.ns, "g", {"hot": "*"}, max_messages=16, **FAST) as c:
            first = await receive(c, 1)
            await c.ack(first)
            await send(addr, "hot", [b"cold"], 1)
            hot_after = 0
            with trio.fail_after(10):
                while True:
                    records = await c.receive()
                    await c.ack(records)
                    if any(r.queue_id == 1 for r in records):
                        break
                    hot_after += len(records)
        assert hot_after < 500, f"{hot_after} messages of the hot queue came before queue 1's"


# ---------------------------------------------------------------- asyncio and blocking
def test_the_asyncio_pop_consumer(tmp_path: Path) -> None:
    with cluster_in_thread(tmp_path, **BROKER) as cluster:
        addr = cluster.brokers["broker-a"].addr
        trio.run(send, addr, "sync", [b"a", b"b", b"c", b"d"], 0)

        async def main() -> None:
            opts = {"invisible_time_ms": 2000, **FAST}
            async with open_asyncio_pop_consumer(cluster.ns, "ag", {"sync": "*"}, **opts) as c:
                got: dict[bytes, Record] = {}
                while len(got) < 4:
                    got.update({r.body: r for r in await asyncio.wait_for(c.receive(), 10)})
                assert await c.ack([got[b"a"]]) == ["ok"]
                assert await c.extend([got[b"b"]], 5000) == ["ok"]
                assert await c.nack([got[b"c"], got[b"d"]], delay_ms=0) == ["ok", "ok"]
                again: dict[bytes, Record] = {}
                while len(again) < 2:
                    again.update({r.body: r for r in await asyncio.wait_for(c.receive(), 10)})
                assert {r.reconsume_times for r in again.values()} == {1}
                assert await c.ack([got[b"b"]]) == ["ok"]  # extended: acknowledged under its new handle
                seen: list[bytes] = []

                async def handler(r: Record) -> None:
                    await asyncio.sleep(0)
                    seen.append(r.body)

                assert await c.nack(list(again.values()), delay_ms=0) == ["ok", "ok"]
                assert await asyncio.wait_for(c.run(handler, max_messages=2), 10) == 2
                assert sorted(seen) == [b"c", b"d"]
                assert c.stats.extended == 1 and c.stats.ack_expired == 0

        asyncio.run(main())


def test_the_blocking_pop_consumer(tmp_path: Path) -> None:
    with cluster_in_thread(tmp_path, **BROKER) as cluster:
        addr = cluster.brokers["broker-a"].addr
        trio.run(send, addr, "sync", [f"b{i}".encode() for i in range(10)], 1)
        opts: dict[str, Any] = {"invisible_time_ms": 1000, **FAST}
        with BlockingPopConsumer(cluster.ns, "bg", {"sync": "*"}, **opts) as c:
            first = c.receive(timeout_s=10)
            assert first
            assert c.ack(first[:1]) == ["ok"]
            rest = first[1:]
            while len(rest) < 9:
                rest += c.receive(timeout_s=10)
            assert c.nack(rest[:1], delay_ms=0) == ["ok"]
            (nacked,) = c.receive(timeout_s=10)  # at once: no delay
            assert (nacked.body, nacked.reconsume_times) == (rest[0].body, 1)
            assert c.ack([nacked]) == ["ok"]
            back: dict[bytes, Record] = {}  # rest[1:] are never acknowledged: they come back after their invisible time
            while len(back) < 8:
                back.update((r.body, r) for r in c.receive(timeout_s=10))
            assert sorted(back) == sorted(r.body for r in rest[1:])
            assert {r.reconsume_times for r in back.values()} == {1}
            assert c.ack([rest[1]]) == ["expired"]  # delivered again since: this delivery's time had passed
            assert c.stats.ack_expired == 1
            assert c.nack(list(back.values()), delay_ms=0) == ["ok"] * 8
            seen: list[tuple[bytes, int]] = []

            def handler(r: Record) -> None:
                seen.append((r.body, r.reconsume_times))

            assert c.run(handler, max_messages=8, poll_timeout_s=10) == 8
            assert sorted(b for b, _ in seen) == sorted(back)
            assert {t for _, t in seen} == {2}
            assert c.stats.acked == 10


async def test_pops_and_acks_follow_the_group_to_its_new_leader(nursery: trio.Nursery, tmp_path: Path) -> None:
    """A replicated group's leader is demoted by a promotion: the POP loop meets
    NOT_LEADER and goes on at the new leader; an ack of a message popped before goes
    there too and is taken; nothing acknowledged is delivered again."""
    with trio.fail_after(TEST_TIMEOUT_S):  # every await bounded (a hang fails, naming where)
        c = Cluster(nursery, tmp_path)
        await c.start_nameserver()
        # sync acks: an ACK record is held by both replicas before the ack is answered (with async
        # replication a promotion may lose the last acks: the documented at-least-once window)
        lead, follower = await start_group(c, ack_mode="sync", min_insync_replicas=2, replica_lag_max_ms=5000, **BROKER)
        async with open_producer(c.ns) as p:
            for i in range(20):
                await p.send("t", b"before %d" % i, sharding_key=str(i))
            opts = {"invisible_time_ms": 1500, **FAST}
            async with open_pop_consumer(c.ns, "pg", {"t": "*"}, **opts) as consumer:
                got = await receive(consumer, 20)
                held, done = got[0], got[1:]
                assert await consumer.ack(done) == ["ok"] * 19
                async with open_admin(c.ns) as admin:
                    await admin.promote(follower.addr)
                await await_until(lambda: lead.replica.role == "follower", 10, "the old leader to step down")
                assert await consumer.ack([held]) == ["ok"]  # popped at the old leader, settled at the new one
                for i in range(20):
                    await p.send("t", b"after %d" % i, sharding_key=str(i))
                after = await receive(consumer, 20, timeout_s=20)
                assert sorted(r.body for r in after) == sorted(b"after %d" % i for i in range(20))
                assert await consumer.ack(after) == ["ok"] * 20
                assert {consumer.receipt(r) for r in after} == {None}
                with trio.move_on_after(2.5):  # past every invisible time: nothing acknowledged comes back
                    extra = await consumer.receive()
                    raise AssertionError(f"delivered again: {[r.body for r in extra]}")


async def test_tags_and_the_dead_letters_through_the_client(cluster: Cluster) -> None:
    """Only the subscribed tags are popped; a message nacked past max_reconsume_times goes
    to %DLQ%<group> and is not delivered again."""
    with trio.fail_after(TEST_TIMEOUT_S):  # every await bounded (a hang fails, naming where)
        await cluster.create_topic("tagged", 1)
        addr = cluster.brokers["broker-a"].addr
        async with trio.open_nursery() as n:
            rpc = RpcClient(n)
            batch = [
                Message("tagged", 0, b"%s-%d" % (t.encode(), i), tags=t) for i in range(3) for t in ("A", "B", "C")
            ]
            await rpc.request(addr, RequestCode.SEND_MESSAGE, {"topic": "tagged"}, encode_batch(batch))
            await rpc.aclose()
        opts = {"invisible_time_ms": 2000, "max_reconsume_times": 1, **FAST}
        async with open_pop_consumer(cluster.ns, "dg", {"tagged": "A || C"}, **opts) as c:
            got = await receive(c, 6)
            assert sorted(r.body for r in got) == sorted(b"%s-%d" % (t, i) for i in range(3) for t in (b"A", b"C"))
            assert await c.ack(got[1:]) == ["ok"] * 5
            poison = got[0]
            assert await c.nack([poison], delay_ms=0) == ["ok"]
            (again,) = await receive(c, 1)
            assert (again.body, again.reconsume_times) == (poison.body, 1)
            assert await c.nack([again], delay_ms=0) == ["ok"]  # past max_reconsume_times (1): a dead letter
            async with open_admin(cluster.ns) as admin:

                async def dead() -> list[Any]:
                    return await admin.dead_letters("dg")

                (letter,) = await await_until(dead, 10, "the dead letter")
            assert letter.record.body == poison.body
            with trio.move_on_after(0.5):  # settled as a dead letter: not delivered again
                extra = await c.receive()
                raise AssertionError(f"delivered again: {extra}")


def test_orderly_run_on_asyncio_and_blocking_stops_a_queue_at_its_failure(tmp_path: Path) -> None:
    """Each facade's run(): a queue's batch handled in order, the failed message and the
    rest of its batch handed back together and handled again in order."""
    with cluster_in_thread(tmp_path, **BROKER) as cluster:
        addr = cluster.brokers["broker-a"].addr
        opts: dict[str, Any] = {"orderly": True, "retry_delays_ms": (50,), "invisible_time_ms": 3000, **FAST}
        for queue in (0, 1):
            trio.run(send, addr, "sync", [b"%d-%d" % (queue, i) for i in range(12)], queue)
        seen: dict[str, list[tuple[int, int, int]]] = {"asyncio": [], "blocking": []}

        def handler_for(kind: str) -> Callable[[Record], ConsumeStatus | None]:
            def handler(r: Record) -> ConsumeStatus | None:
                seen[kind].append((r.queue_id, r.queue_offset, r.reconsume_times))
                return ConsumeStatus.RECONSUME_LATER if (r.queue_offset, r.reconsume_times) == (3, 0) else None

            return handler

        async def on_asyncio() -> int:
            async with open_asyncio_pop_consumer(cluster.ns, "oa", {"sync": "*"}, **opts) as c:
                return await asyncio.wait_for(c.run(handler_for("asyncio"), max_messages=26), 15)

        assert asyncio.run(on_asyncio()) == 26  # 24 messages, 2 failed once (offset 3 of each queue)
        with BlockingPopConsumer(cluster.ns, "ob", {"sync": "*"}, **opts) as c:
            assert c.run(handler_for("blocking"), max_messages=26, poll_timeout_s=10) == 26
    for kind, handled in seen.items():
        for queue in (0, 1):
            mine = [(o, t) for q, o, t in handled if q == queue]
            done = [o for o, t in mine if (o, t) != (3, 0)]
            assert done == list(range(12)), (kind, queue, mine)  # in queue order, the failed one again first
            assert (3, 1) in mine, (kind, queue, mine)

"""The clients from asyncio (trio's guest mode inside the asyncio loop), end to end
against a real name server and broker (run by trio in a thread of their own), and one
scenario run through all three facades (trio, asyncio, blocking) with the same results."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator

import pytest
import trio
import trio.testing

from clmq.client import (
    AsyncioConsumer,
    BlockingConsumer,
    BlockingProducer,
    ConnectionFailed,
    NoRouteError,
    Record,
    SendResult,
    open_admin,
    open_asyncio_admin,
    open_asyncio_consumer,
    open_asyncio_producer,
    open_consumer,
    open_producer,
    shard,
)
from clmq.client._asyncio import _RUNS
from clmq.protocol.auth import AclBinding, AclFilter
from tests.service_helpers import FAST_CONSUMER, Cluster, cluster_in_thread

TIMEOUT_S = 20


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A name server and a broker with topic "sync" (2 queues), in a thread of their own."""
    with cluster_in_thread(tmp_path) as c:
        yield c


async def receive_at_least(consumer: AsyncioConsumer, count: int) -> list[Record]:
    got: list[Record] = []
    async with asyncio.timeout(TIMEOUT_S):
        while len(got) < count:
            got += await consumer.receive()
    return got


def test_asyncio_produce_consume_and_admin(cluster: Cluster) -> None:
    """Every kind of call from asyncio: admin, send, send_batch, send_oneway, receive,
    ack, commit, assignment, errors; several clients share the loop's one trio run."""

    async def main() -> None:
        async with open_asyncio_admin(cluster.ns) as admin, open_asyncio_producer(cluster.ns) as p:
            assert await admin.create_topic("made", 3) == [cluster.brokers["broker-a"].addr]
            assert (await admin.list_topics())["made"] == {"broker-a": 3}
            assert [q["queue_id"] for q in await admin.describe_topic("made")] == [0, 1, 2]
            assert [b["broker_name"] for b in await admin.leaders()] == ["broker-a"]
            # Users and ACLs (kept, though this broker enforces nothing without auth_enabled).
            assert await admin.add_user("amy", "pw", mechanisms=["SCRAM-SHA-256"], iterations=4096) == ["broker-a"]
            assert await admin.list_users() == {"amy": ["SCRAM-SHA-256"]}
            grant = AclBinding.from_json(["TOPIC", "made", "LITERAL", "User:amy", "*", "READ", "ALLOW"])
            assert await admin.create_acls([grant]) == ["broker-a"]
            assert await admin.describe_acls() == [grant]
            assert await admin.delete_acls(AclFilter(principal="User:amy")) == [grant]
            assert await admin.delete_user("amy") == ["broker-a"]
            singles = [await p.send("sync", b"m%d" % i, tags="T", sharding_key="k") for i in range(5)]
            assert [r.queue_offset for r in singles] == [0, 1, 2, 3, 4]
            assert len({r.queue for r in singles}) == 1
            batch = await p.send_batch("sync", [b"b0", b"b1"], sharding_key="k")
            assert batch.queue_offsets == [5, 6]
            await p.send_oneway("sync", b"oneway", sharding_key="k")
            async with open_asyncio_consumer(cluster.ns, "ag", {"sync": "*"}, **FAST_CONSUMER) as c:
                got = await receive_at_least(c, 8)
                assert [r.body for r in got] == [b"m0", b"m1", b"m2", b"m3", b"m4", b"b0", b"b1", b"oneway"]
                assert [mq.queue_id for mq in c.assignment()] == [0, 1] and c.errors == {}
                c.ack()
                await c.commit()
            assert (await admin.describe_group("ag"))["lag"] == 0
            assert await admin.list_groups() == ["ag"]
            assert len(_RUNS) == 1  # one guest run for the loop's clients
        assert not _RUNS  # ended with the last client

    asyncio.run(main())


def test_asyncio_errors_are_the_trio_errors(cluster: Cluster) -> None:
    """A failing call raises the same class with the same text as with trio."""
    dead = "127.0.0.1:1"

    async def failures(
        send: Callable[..., Awaitable[Any]], status: Callable[[str], Awaitable[Any]]
    ) -> list[tuple[type, str]]:
        out = []
        for call in (lambda: send("nope", b"x"), lambda: status(dead)):
            with pytest.raises(Exception) as e:
                await call()
            out.append((type(e.value), str(e.value)))
        return out

    async def with_trio() -> list[tuple[type, str]]:
        async with open_producer(cluster.ns) as p, open_admin(cluster.ns) as a:
            return await failures(p.send, a.replica_status)

    async def with_asyncio() -> list[tuple[type, str]]:
        async with open_asyncio_producer(cluster.ns) as p, open_asyncio_admin(cluster.ns) as a:
            return await failures(p.send, a.replica_status)

    expected = trio.run(with_trio)
    assert [t for t, _ in expected] == [NoRouteError, ConnectionFailed]
    assert asyncio.run(with_asyncio()) == expected


def test_cancelling_an_asyncio_call_cancels_its_trio_task_and_loses_nothing(cluster: Cluster) -> None:
    """``receive`` on an empty topic, cancelled by a timeout: its trio task ends; the
    message sent afterwards is received by the next call."""

    async def main() -> None:
        async with (
            open_asyncio_producer(cluster.ns) as p,
            open_asyncio_consumer(cluster.ns, "cg", {"sync": "*"}, **FAST_CONSUMER) as c,
        ):
            run = _RUNS[asyncio.get_running_loop()]
            assert run._nursery is not None
            tasks_before = len(run._nursery.child_tasks)
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.3):
                    await c.receive()

            async def trio_tasks_once_settled() -> int:
                await (
                    trio.testing.wait_all_tasks_blocked()
                )  # the cancelled receive has run by now (it was cancelled first)
                assert run._nursery is not None
                return len(run._nursery.child_tasks) - 1  # not counting this one

            assert await run.call(trio_tasks_once_settled) == tasks_before  # the trio side of the call ended too
            await p.send("sync", b"after")
            assert [r.body for r in await receive_at_least(c, 1)] == [b"after"]

    asyncio.run(main())


def test_asyncio_submit_flush_callbacks_on_the_loop(cluster: Cluster) -> None:
    """submit returns asyncio futures resolved after flush; callbacks run on the loop's
    thread; a failure fails its future with the trio producer's error class."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        called: list[tuple[bool, int | None]] = []
        async with open_asyncio_producer(cluster.ns, linger_ms=50) as p:
            futs = [
                await p.submit(
                    "sync",
                    b"s%d" % i,
                    sharding_key="k",
                    callback=lambda f: called.append((asyncio.get_running_loop() is loop, f.result().queue_offset)),
                )
                for i in range(50)
            ]
            futs.append(await p.submit_batch("sync", [b"x", b"y"], sharding_key="k"))
            bad = await p.submit("nope", b"x")
            await p.flush()
            assert all(f.done() for f in futs) and bad.done()
            assert [f.result().queue_offset for f in futs] == list(range(51))
            assert futs[-1].result().queue_offsets == [50, 51]
            assert isinstance(bad.exception(), NoRouteError)  # refused by the trio side: fails the future
            await asyncio.sleep(0)  # done callbacks are scheduled on the loop
            assert called == [(True, i) for i in range(50)]

    asyncio.run(main())


# ------------------------------------------------------------------ one scenario, three facades
class _Api:
    """What the scenario needs of a facade, as async calls."""

    send: Callable[..., Awaitable[SendResult]]
    send_batch: Callable[..., Awaitable[SendResult]]
    submit: Callable[..., Awaitable[Callable[[], SendResult]]]  # returns the result's getter (valid after flush)
    flush: Callable[[], Awaitable[None]]
    consume: Callable[[int], Awaitable[list[Record]]]


async def scenario(api: _Api) -> tuple[list[tuple[int, list[int]]], dict[int, list[bytes]]]:
    """Sends, a batch, and submits with sharding keys; then every message read back.
    Returns each call's (queue id, offsets) and each queue's bodies in order."""
    results = [await api.send("sync", b"send-%d" % i, sharding_key=f"k{i % 3}") for i in range(6)]
    results.append(await api.send_batch("sync", [b"batch-0", b"batch-1"], sharding_key="k1"))
    getters = [await api.submit("sync", b"submit-%d" % i, sharding_key=f"k{i % 3}") for i in range(30)]
    await api.flush()
    results += [get() for get in getters]
    records = await api.consume(6 + 2 + 30)
    per_queue: dict[int, list[bytes]] = {}
    for r in sorted(records, key=lambda r: (r.queue_id, r.queue_offset)):
        per_queue.setdefault(r.queue_id, []).append(r.body)
    return [(r.queue.queue_id, r.queue_offsets) for r in results], per_queue


@contextlib.asynccontextmanager
async def trio_api(ns: list[str]) -> AsyncIterator[_Api]:
    api = _Api()
    async with open_producer(ns) as p:

        async def submit(*a: Any, **k: Any) -> Callable[[], SendResult]:
            return (await p.submit(*a, **k)).result

        async def consume(n: int) -> list[Record]:
            got: list[Record] = []
            async with open_consumer(ns, "three", {"sync": "*"}, **FAST_CONSUMER) as c:
                with trio.fail_after(TIMEOUT_S):
                    while len(got) < n:
                        got += await c.receive()
            return got

        api.send, api.send_batch, api.submit, api.flush, api.consume = p.send, p.send_batch, submit, p.flush, consume
        yield api


@contextlib.asynccontextmanager
async def asyncio_api(ns: list[str]) -> AsyncIterator[_Api]:
    api = _Api()
    async with open_asyncio_producer(ns) as p:

        async def submit(*a: Any, **k: Any) -> Callable[[], SendResult]:
            return (await p.submit(*a, **k)).result

        async def consume(n: int) -> list[Record]:
            async with open_asyncio_consumer(ns, "three", {"sync": "*"}, **FAST_CONSUMER) as c:
                return await receive_at_least(c, n)

        api.send, api.send_batch, api.submit, api.flush, api.consume = p.send, p.send_batch, submit, p.flush, consume
        yield api


@contextlib.asynccontextmanager
async def blocking_api(ns: list[str]) -> AsyncIterator[_Api]:
    """The blocking calls, called from a coroutine (blocking it: fine in a test)."""
    api = _Api()
    with BlockingProducer(ns) as p:

        async def send(*a: Any, **k: Any) -> SendResult:
            return p.send(*a, **k)

        async def send_batch(*a: Any, **k: Any) -> SendResult:
            return p.send_batch(*a, **k)

        async def submit(*a: Any, **k: Any) -> Callable[[], SendResult]:
            fut = p.submit(*a, **k)
            return lambda: fut.result(timeout=0)

        async def flush() -> None:
            p.flush()

        async def consume(n: int) -> list[Record]:
            got: list[Record] = []
            with BlockingConsumer(ns, "three", {"sync": "*"}, **FAST_CONSUMER) as c:
                for _ in range(TIMEOUT_S * 10):
                    got += c.poll(0.1)
                    if len(got) >= n:
                        break
            return got

        api.send, api.send_batch, api.submit, api.flush, api.consume = send, send_batch, submit, flush, consume
        yield api


def _run_scenario(facade: str, ns: list[str]) -> tuple[list[tuple[int, list[int]]], dict[int, list[bytes]]]:
    opener = {"trio": trio_api, "asyncio": asyncio_api, "blocking": blocking_api}[facade]

    async def main() -> tuple[list[tuple[int, list[int]]], dict[int, list[bytes]]]:
        async with opener(ns) as api:
            return await scenario(api)

    return trio.run(main) if facade == "trio" else asyncio.run(main())


def _expected() -> tuple[list[tuple[int, list[int]]], dict[int, list[bytes]]]:
    """What the scenario must give on a fresh broker with topic "sync" of 2 queues."""
    next_offset = {0: 0, 1: 0}
    per_queue: dict[int, list[bytes]] = {0: [], 1: []}
    calls = [([b"send-%d" % i], f"k{i % 3}") for i in range(6)] + [([b"batch-0", b"batch-1"], "k1")]
    calls += [([b"submit-%d" % i], f"k{i % 3}") for i in range(30)]
    results = []
    for bodies, key in calls:
        q = shard(key, 2)
        results.append((q, list(range(next_offset[q], next_offset[q] + len(bodies)))))
        next_offset[q] += len(bodies)
        per_queue[q] += bodies
    return results, {q: b for q, b in per_queue.items() if b}


@pytest.mark.parametrize("facade", ["trio", "asyncio", "blocking"])
def test_one_scenario_gives_the_same_results_through_every_facade(facade: str, cluster: Cluster) -> None:
    assert _run_scenario(facade, cluster.ns) == _expected()


# ------------------------------------------------------------------ the blocking facade's new calls
def test_blocking_submit_flush_and_producer_options(cluster: Cluster) -> None:
    """submit gives concurrent.futures futures, resolved by flush; a refusal fails its
    future with the trio producer's error; the producer's options pass through."""
    called: list[int] = []
    with BlockingProducer(cluster.ns, linger_ms=20, batch_max_bytes=64 * 1024) as p:
        futs = [
            p.submit("sync", b"b%d" % i, sharding_key="k", callback=lambda f: called.append(f.result().queue_offset))
            for i in range(20)
        ]
        futs.append(p.submit_batch("sync", [b"x", b"y"], sharding_key="k"))
        bad = p.submit("nope", b"x")
        p.flush()
        assert [f.result(timeout=0).queue_offset for f in futs] == list(range(21))
        assert futs[-1].result(timeout=0).queue_offsets == [20, 21]
        assert isinstance(bad.exception(timeout=0), NoRouteError)  # refused by the trio side: fails the future
        with pytest.raises(NoRouteError):  # and send raises it
            p.send("nope", b"x")
        assert sorted(called) == list(range(20))
    with pytest.raises(ValueError, match="buffer_full"):
        BlockingProducer(cluster.ns, buffer_full="sometimes")


def test_a_full_handoff_makes_submit_wait_and_keeps_the_order(cluster: Cluster) -> None:
    """``handoff_max_bytes`` of 1: every message waits for the one before to be handed
    over (the bounded path); all arrive, in order, through both facades."""
    count = 200

    async def with_asyncio() -> list[int]:
        async with open_asyncio_producer(cluster.ns, handoff_max_bytes=1) as p:
            futs = [await p.submit("sync", b"a%d" % i, sharding_key="a") for i in range(count)]
            await p.flush()
            return [f.result().queue_offset for f in futs]

    assert asyncio.run(with_asyncio()) == list(range(count))
    with BlockingProducer(cluster.ns, handoff_max_bytes=1) as p:
        futs = [p.submit("sync", b"b%d" % i, sharding_key="b") for i in range(count)]
        p.flush()
        first = futs[0].result(timeout=0).queue_offset
        assert [f.result(timeout=0).queue_offset for f in futs] == list(range(first, first + count))
    with pytest.raises(ValueError, match="handoff_max_bytes"):
        BlockingProducer(cluster.ns, handoff_max_bytes=0)


def test_the_asyncio_and_blocking_clients_schedule_and_cancel(cluster: Cluster) -> None:
    """delay_ms / deliver_at through both facades, and the admin's cancel."""

    async def main() -> list[str]:
        async with open_asyncio_admin(cluster.ns) as admin, open_asyncio_producer(cluster.ns) as p:
            soon = await p.send("sync", b"async-soon", delay_ms=200, sharding_key="s")
            later = await p.send_batch("sync", [b"never"], delay_ms=60_000, sharding_key="s")
            cancelled = await admin.cancel_message(later.msg_ids[0])
            return [soon.msg_ids[0], cancelled.state]

    soon_id, state = asyncio.run(main())
    assert state == "cancelled" and "@" in soon_id
    with BlockingProducer(cluster.ns) as p:
        p.send("sync", b"blocking-soon", deliver_at=int(time.time() * 1000) + 200, sharding_key="s")
        with pytest.raises(ValueError):
            p.send("sync", b"x", delay_ms=5, deliver_at=5)
    with BlockingConsumer(cluster.ns, "sched", {"sync": "*"}, **FAST_CONSUMER) as c:
        got: list[bytes] = []
        deadline = time.monotonic() + TIMEOUT_S
        while len(got) < 2 and time.monotonic() < deadline:
            got += [r.body for r in c.poll(1.0)]
    assert sorted(got) == [b"async-soon", b"blocking-soon"]

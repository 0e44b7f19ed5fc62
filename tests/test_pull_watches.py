"""PULL_MESSAGES that may wait (a consumer's watches of its idle queues, issue 34): a
watch whose queues are all at their end is not read before it waits (the
broker's ``unread_watches``) and answers the first arrival; any other watch is read
first and answers at once what there is, as before. A real broker on 127.0.0.1."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import trio

from clmq.broker.service import Broker
from clmq.client import RpcClient
from clmq.protocol import RequestCode, decode_records
from tests.service_helpers import Cluster, one_broker
from tests.test_consumer_many_queues import fill
from tests.waiting import await_until

QUEUES = 40
LONG_WAIT_MS = 20_000  # never reached by a test that passes


@pytest.fixture
async def cluster(nursery: trio.Nursery, tmp_path: Path) -> Cluster:
    return await one_broker(nursery, tmp_path)


def unread(broker: Broker) -> int:
    return broker.handlers.readers.stats.unread_watches


async def pull(addr: str, asks: list[list[Any]], wait_ms: int) -> tuple[list[list[Any]], list[bytes]]:
    async with trio.open_nursery() as n:
        rpc = RpcClient(n)
        reply = await rpc.request(
            addr, RequestCode.PULL_MESSAGES, {"queues": asks, "max_wait_ms": wait_ms}, timeout_ms=LONG_WAIT_MS + 5000
        )
        await rpc.aclose()
    return reply.fields["results"], [r.body for r in decode_records(reply.body, "test")]


async def test_a_watch_of_queues_at_their_end_waits_unread_and_answers_the_first_arrival(cluster: Cluster) -> None:
    await cluster.create_topic("w", QUEUES)
    broker = cluster.brokers["broker-a"]
    await fill(broker.addr, "w", {q: [b"old"] * (q % 3) for q in range(QUEUES)})
    await trio.to_thread.run_sync(broker.store.catch_up)
    before, waiting = unread(broker), broker.waiters.waiting
    asks = [["w", q, q % 3, None] for q in range(QUEUES)]
    answer: list[Any] = []

    async def watch() -> None:
        answer.append(await pull(broker.addr, asks, LONG_WAIT_MS))

    with trio.fail_after(15):
        async with trio.open_nursery() as n:
            n.start_soon(watch)
            await await_until(lambda: broker.waiters.waiting >= waiting + QUEUES, 10, "every queue watched")
            assert unread(broker) == before + 1  # not read before its wait
            await fill(broker.addr, "w", {17: [b"new"]})
    rows, bodies = answer[0]
    assert bodies == [b"new"]
    assert [r[:3] for r in rows if r[2]] == [["FOUND", 17 % 3 + 1, 1]]
    assert all(r[0] == "NO_MESSAGE" for i, r in enumerate(rows) if i != 17)
    assert broker.waiters.waiting == waiting


async def test_a_watch_with_any_queue_behind_is_read_and_answered_at_once(cluster: Cluster) -> None:
    """Queues asked below their end (the others at it), over random choices of them:
    answered without waiting, with exactly those queues' messages, and no watch left
    behind."""
    await cluster.create_topic("b", QUEUES)
    broker = cluster.brokers["broker-a"]
    await fill(broker.addr, "b", {q: [f"{q}-{i}".encode() for i in range(2)] for q in range(QUEUES)})
    await trio.to_thread.run_sync(broker.store.catch_up)
    rng = random.Random(34)
    choices = [[0], [QUEUES - 1], list(range(QUEUES))]
    choices += [rng.sample(range(QUEUES), rng.randint(1, 5)) for _ in range(9)]
    for behind in choices:
        before, waiting = unread(broker), broker.waiters.waiting
        asks = [["b", q, 0 if q in behind else 2, None] for q in range(QUEUES)]
        with trio.fail_after(10):  # well before the wait would run out
            rows, bodies = await pull(broker.addr, asks, LONG_WAIT_MS)
        assert sorted(bodies) == sorted(f"{q}-{i}".encode() for q in behind for i in range(2))
        assert [i for i, r in enumerate(rows) if r[0] == "FOUND"] == sorted(behind)
        assert unread(broker) == before and broker.waiters.waiting == waiting

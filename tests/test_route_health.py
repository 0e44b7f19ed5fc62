"""A broker whose store failed stays in the routes, marked unhealthy: producers skip
it, consumers keep reading what it acknowledged (its reads still work). Two real
brokers with sync flush; one fails through an injected fsync error."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from clmq.client import RpcClient, SendError, open_admin, open_consumer, open_producer
from clmq.common import Message
from clmq.protocol import ErrorCode, RequestCode, encode_batch
from tests.faults import inject
from tests.service_helpers import FAST_CONSUMER, Cluster
from tests.test_validation import fsync_fails, sync_cluster
from tests.waiting import await_until


async def fail_store(c: Cluster, name: str) -> None:
    """Fail the broker's store (a produce whose fsync fails) and wait until the name
    server lists it unhealthy."""
    broker = c.brokers[name]
    async with trio.open_nursery() as n:
        rpc = RpcClient(n)
        with inject(fsync_fails(name)) as faults:
            body = encode_batch([Message("f", 0, b"lost")])
            reply = await rpc.request(broker.addr, RequestCode.SEND_MESSAGE, {"topic": "f"}, body, check=False)
            assert faults.fired and reply.error_code == ErrorCode.STORE_FAILED
        await rpc.aclose()
    async with open_admin(c.ns) as admin:

        async def listed_unhealthy() -> bool:
            return any(b["broker_name"] == name and b["healthy"] is False for b in await admin.brokers())

        await await_until(listed_unhealthy, 10, f"the name server to list {name} as unhealthy")


async def test_routes_keep_an_unhealthy_broker_marked_for_consumers(nursery: trio.Nursery, tmp_path: Path) -> None:
    c = await sync_cluster(nursery, tmp_path, "broker-a", "broker-b")
    async with open_producer(c.ns) as p:
        acked = [await p.send("f", b"before %d" % i) for i in range(12)]
    assert {r.queue.broker_name for r in acked} == {"broker-a", "broker-b"} and all(r.durable for r in acked)
    await fail_store(c, "broker-a")
    async with trio.open_nursery() as n:
        rpc = RpcClient(n)
        route = await rpc.request(c.ns[0], RequestCode.GET_ROUTE, {"topic": "f"})
        health = {b["broker_name"]: (b["healthy"], bool(b["failure"])) for b in route.fields["brokers"]}
        assert health == {"broker-a": (False, True), "broker-b": (True, False)}
        await rpc.aclose()
    # The producer sends only to the healthy broker.
    async with open_producer(c.ns, retries=0) as p:
        after = [await p.send("f", b"after %d" % i) for i in range(8)]
    assert {r.queue.broker_name for r in after} == {"broker-b"}
    # A consumer reads every acknowledged message, the failed broker's too.
    want = {b"before %d" % i for i in range(12)} | {b"after %d" % i for i in range(8)}
    got: set[bytes] = set()
    async with open_consumer(c.ns, "g", {"f": "*"}, **FAST_CONSUMER) as consumer:
        with trio.move_on_after(10):
            while not want <= got:
                got |= {r.body for r in await consumer.receive()}
    assert want <= got, f"missing: {sorted(want - got)}"


async def test_a_producer_with_no_healthy_broker_names_them(nursery: trio.Nursery, tmp_path: Path) -> None:
    c = await sync_cluster(nursery, tmp_path, "broker-a", "broker-b")
    await fail_store(c, "broker-a")
    await fail_store(c, "broker-b")
    async with open_producer(c.ns, retries=1) as p:
        with pytest.raises(SendError) as e:
            await p.send("f", b"nowhere")
    assert e.value.code == ErrorCode.STORE_FAILED
    assert "STORE_FAILED" in str(e.value) and "broker-a" in str(e.value) and "broker-b" in str(e.value)

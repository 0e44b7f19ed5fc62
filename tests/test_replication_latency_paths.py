"""The path of a sync-replicated write on the follower (issue 34's replicated latency):
where a chunk is appended, and what an acknowledgement still promises after the thread
hops were cut. Real brokers in this process (real sockets and files)."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from clmq.common import Message
from clmq.protocol import RequestCode
from clmq.protocol.transport import RpcClient
from tests.service_helpers import Cluster
from tests.test_replication import in_sync, send_raw, start_group

SYNC3 = {"ack_mode": "sync", "min_insync_replicas": 3}


@pytest.mark.parametrize("replica_ack", ["written", "flushed"])
async def test_a_sync_ack_means_every_follower_holds_the_write_as_replica_ack_says(
    nursery: trio.Nursery, tmp_path: Path, replica_ack: str
) -> None:
    """At the moment the producer has its answer, every follower's log holds the
    write (``written``) or has fsynced it (``flushed``), for small chunks appended on
    the follower's event loop and large ones appended in a thread alike."""
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    lead, fs = await start_group(c, 2, {"replica_ack": replica_ack}, **SYNC3)
    async with trio.open_nursery() as n:
        rpc = RpcClient(n)
        await rpc.request(lead.addr, RequestCode.CREATE_TOPIC, {"topic": "t", "queue_count": 4})
        await in_sync(lead, 2)
        for i, size in enumerate([10, 1024, 20_000, 100, 60_000, 1024]):
            reply = await send_raw(rpc, lead.addr, "t", [Message("t", i % 4, b"y" * size)])
            assert reply.error_code == 0, reply.error_text
            end = lead.store.log.write_offset
            for f in fs:
                held = f.store.log.durable_offset if replica_ack == "flushed" else f.store.log.write_offset
                assert held >= end, (f.config.broker_id, held, end)
        await rpc.aclose()

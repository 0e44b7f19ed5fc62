"""A retried batch only partly stored: a follower copies whole records, not whole
batches, so a follower promoted while catching up can hold the first part of a batch
(docs/replication.md, "Producers and replication"). The producer's retry marked
``dedup`` then completes the batch: the messages found keep their offsets, the rest is
appended once. Real brokers in this process (real sockets, real files)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio

from clmq.broker.service import Broker
from clmq.client import RpcClient
from clmq.common import Message
from clmq.protocol import RequestCode, encode_batch
from tests.service_helpers import Cluster
from tests.test_dedup import keyed
from tests.waiting import await_until

FAST = {"replica_metadata_interval_ms": 100, "replica_fetch_wait_ms": 200, "replica_retry_ms": 100}
BODY_BYTES = 1024
# About two records a fetch (the follower asks that much; the leader throttles a follower
# catching up by more than that), the second chunk about 0.7 s after the first.
CHUNKED = {**FAST, "replica_fetch_max_bytes": 2600, "replica_catchup_bytes_per_s": 3000}


def batch(keys: list[str], queue_id: int = 0) -> list[Message]:
    return [
        Message("t", queue_id, k.encode().ljust(BODY_BYTES, b"."), properties=m.properties)
        for k, m in zip(keys, keyed("t", queue_id, keys))
    ]


def stored_keys(broker: Broker, queue_id: int) -> list[str]:
    broker.store.catch_up()
    res = broker.store.get("t", queue_id, 0, 1000)
    return [r.properties["UNIQ_KEY"] for r in res.messages]


async def send(rpc: RpcClient, addr: str, msgs: list[Message], **fields: Any) -> Any:
    return await rpc.request(addr, RequestCode.SEND_MESSAGE, {"topic": "t", **fields}, encode_batch(msgs), check=False)


async def test_a_follower_promoted_with_part_of_a_batch_completes_it_on_the_producers_retry(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """The follower catches up in chunks of about two records (``replica_fetch_max_bytes``),
    throttled by the leader (``replica_catchup_bytes_per_s``), so it holds the first part of
    an 8-message batch when the leader stops. Promoted, it answers the producer's retry
    with the whole batch, each message stored once and in order."""
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    lead = await c.start_broker("g", key="g0", broker_id=0, **CHUNKED)
    await c.create_topic("t", 1)
    rpc = RpcClient(nursery)
    keys = [f"k{i}" for i in range(8)]
    first = await send(rpc, lead.addr, batch(keys))
    assert first.error_code == 0 and first.fields["queue_offsets"] == list(range(8)), first
    f = await c.start_broker("g", key="g1", broker_id=1, role="follower", leader_addr=lead.addr, **CHUNKED)
    await await_until(
        lambda: f.store.log.write_offset > 0 and f.store.topics.queue_count("t") == 1, 10, "the first chunk copied"
    )
    c.scopes["g0"].cancel()  # the leader dies: its throttled answers never go out
    with trio.fail_after(15):
        await c.stopped["g0"].wait()
    held = stored_keys(f, 0)
    assert 0 < len(held) < len(keys) and held == keys[: len(held)], held  # the case: a first part only
    promoted = await rpc.request(f.addr, RequestCode.PROMOTE, {"force": True})
    assert promoted.fields["role"] == "leader"
    retry = await send(rpc, f.addr, batch(keys), dedup=True)
    assert retry.error_code == 0, retry
    assert retry.fields["queue_offsets"] == list(range(8))
    assert retry.fields["stored_before"] == len(held) and "duplicate" not in retry.fields
    assert stored_keys(f, 0) == keys
    again = await send(rpc, f.addr, batch(keys), dedup=True)  # now whole: a plain duplicate
    assert again.fields["duplicate"] is True and again.fields["queue_offsets"] == list(range(8))
    assert again.fields["commitlog_offsets"] == retry.fields["commitlog_offsets"]
    assert stored_keys(f, 0) == keys
    await rpc.aclose()

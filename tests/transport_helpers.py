"""Shared pieces of the tests that speak the wire protocol to a server directly: a
broker with one topic, a pipelined exchange of raw frames on one new connection, and a
sync-flush store with an append lane (no server) for the answers that wait for fsync."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import trio

from clmq.broker.service import Broker
from clmq.broker.service._append import AppendLane
from clmq.broker.store import Store, StoreConfig
from clmq.commitlog import CommitLogConfig, FlushMode
from clmq.protocol import FLAG_ONEWAY, NEED_DATA, Frame, FrameDecoder, encode_frame
from tests.service_helpers import Cluster

EXCHANGE_TIMEOUT_S = 30
LANE_BUDGET_BYTES = 1 << 20


async def broker_with_topic(nursery: trio.Nursery, tmp_path: Path, topic: str, queues: int, **settings: Any) -> Broker:
    """A name server and one broker (``settings``: its own) serving ``topic``."""
    cluster = Cluster(nursery, tmp_path)
    await cluster.start_nameserver()
    broker = await cluster.start_broker("broker-a", **settings)
    await cluster.create_topic(topic, queues)
    return broker


async def exchange(addr: str, frames: list[Frame]) -> dict[int, Frame]:
    """Send ``frames`` on one new connection in one write (as a client with that many
    requests in flight does once its socket is busy) and read every reply (one-way
    requests get none); by request id, each request answered at most once."""
    host, port = addr.rsplit(":", 1)
    expected = sum(1 for f in frames if not f.flags & FLAG_ONEWAY)
    decoder = FrameDecoder(64 << 20)  # a pull's reply may carry many records
    replies: dict[int, Frame] = {}
    async with await trio.open_tcp_stream(host, int(port)) as stream:
        await stream.send_all(b"".join(encode_frame(f) for f in frames))
        with trio.fail_after(EXCHANGE_TIMEOUT_S):
            while len(replies) < expected:
                data = await stream.receive_some(1 << 16)
                assert data, "the broker closed the connection"
                decoder.receive_data(data)
                while (event := decoder.next_event()) is not NEED_DATA:
                    assert isinstance(event, Frame) and event.request_id not in replies
                    replies[event.request_id] = event
    return replies


@contextmanager
def sync_flush_lane(root: Path, topic: str) -> Iterator[tuple[Store, AppendLane]]:
    """A started sync-flush store under ``root`` holding ``topic`` (one queue), and an
    append lane on it; the caller runs the lane's loops. The store is closed after."""
    log = CommitLogConfig(flush_mode=FlushMode.SYNC, segment_bytes=1 << 20, max_message_bytes=4096)
    store = Store.open(StoreConfig(root, log)).start()
    try:
        store.create_topic(topic, 1)
        yield store, AppendLane(store, LANE_BUDGET_BYTES)
    finally:
        store.close()

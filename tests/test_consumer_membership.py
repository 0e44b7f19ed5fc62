"""A consumer's share of its group when the group's member list cannot be read: real
name server, real broker (stopped without unregistering, so that it is still routed),
two real consumers."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import trio

from clmq.client import open_consumer
from clmq.nameserver import NameServerConfig
from clmq.nameserver import serve as serve_nameserver
from tests.service_helpers import FAST_CONSUMER, Cluster
from tests.waiting import await_until

QUEUES = 8
ROUTED_FOR_MS = 60_000  # the name server keeps the silent broker's routes this long (the test's window)


async def test_a_member_that_cannot_list_its_group_keeps_its_share(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two members split a topic's queues; their broker stops answering while the name
    server still routes it: neither member takes the whole topic (which would read the
    other's queues twice once the broker is back), each keeps its half."""
    c = Cluster(nursery, tmp_path)
    c.nameserver = await nursery.start(
        serve_nameserver, NameServerConfig(listen_port=0, broker_expiry_ms=ROUTED_FOR_MS, scan_interval_ms=100)
    )
    await c.start_broker("broker-a", client_expiry_ms=30_000)
    await c.create_topic("t", QUEUES)
    caplog.set_level(logging.WARNING, logger="clmq.consumer")
    async with (
        open_consumer(c.ns, "g", {"t": "*"}, **FAST_CONSUMER) as a,
        open_consumer(c.ns, "g", {"t": "*"}, **FAST_CONSUMER) as b,
    ):
        await await_until(
            lambda: len(a.assignment()) == len(b.assignment()) == QUEUES // 2, 20, "the queues split in two"
        )
        before = set(a.assignment())
        c.scopes["broker-a"].cancel()  # gone without unregistering: still routed
        await c.stopped["broker-a"].wait()
        await await_until(
            lambda: set(a.assignment()) != before or "cannot list the members" in caplog.text,
            20,
            "a rebalance of a while its group's broker is silent",
        )
        assert set(a.assignment()) == before

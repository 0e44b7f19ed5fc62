"""``clmq bench compare --via broker``: the storage-mode comparison end to end.

The same cases as the in-process comparison (size, queues, traffic pattern, flush), but
each runs a fresh ``clmq broker --storage-mode ...`` process and clmq's client sends the
batches over loopback: one request carries 256 messages for the case's queues, exactly
the batches the in-process case appends. The broker's open descriptors are sampled
during the case and its peak memory read at the end, from ``/proc``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import trio

from clmq.client import open_admin
from clmq.common import Message
from clmq.protocol import RequestCode, encode_batch
from clmq.protocol.transport import RpcClient

from .cases import BATCH, Case, Figures, queue_sequence
from .e2e import BrokerProcess

SENDERS = 4  # requests in flight at once (they share group commits under sync flush)


def run_case_via_broker(case: Case) -> Figures:
    broker = BrokerProcess(Path(case.root), case.flush, storage_mode=case.mode)
    try:
        return trio.run(_drive, broker, case)
    finally:
        broker.stop()


def _fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def _peak_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


async def _drive(broker: BrokerProcess, case: Case) -> Figures:
    async with open_admin(broker_addrs=[broker.addr]) as admin:
        await admin.create_topic("bench", case.queues, on=[broker.addr])
    body = b"x" * case.size
    n_batches = max(128, -(-case.queues // BATCH))
    seq = queue_sequence(case.pattern, case.queues, n_batches * BATCH)
    batches = [
        encode_batch([Message("bench", q, body, "TagA") for q in seq[i * BATCH : (i + 1) * BATCH]])
        for i in range(n_batches)
    ]
    latencies: list[float] = []
    fds = [_fds(broker.proc.pid)]
    sent = [0]
    async with trio.open_nursery() as nursery:
        rpc = RpcClient(nursery)
        deadline = time.perf_counter() + case.seconds

        async def sender(k: int) -> None:
            while time.perf_counter() < deadline:
                t0 = time.perf_counter()
                await rpc.request(
                    broker.addr, RequestCode.SEND_MESSAGE, {"topic": "bench"}, batches[k % n_batches], timeout_ms=30_000
                )
                latencies.append(time.perf_counter() - t0)
                sent[0] += BATCH
                k += SENDERS

        async def sample_fds() -> None:
            while True:
                await trio.sleep(0.1)
                fds.append(_fds(broker.proc.pid))

        began = time.perf_counter()
        async with trio.open_nursery() as inner:
            inner.start_soon(sample_fds)
            async with trio.open_nursery() as senders:
                for k in range(SENDERS):
                    senders.start_soon(sender, k)
            inner.cancel_scope.cancel()
        elapsed = time.perf_counter() - began
        await rpc.aclose()
        nursery.cancel_scope.cancel()
    lat = sorted(latencies) or [0.0]
    return Figures(
        sent[0] / elapsed,
        sent[0] * case.size / elapsed / 1e6,
        lat[len(lat) // 2] * 1000,
        lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000,
        max(fds),
        _peak_rss_mb(broker.proc.pid),
    )

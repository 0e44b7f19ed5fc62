"""What ``clmq bench delay`` does against one broker process: plain against scheduled
send rates, scheduling a bulk of pending messages, and the lateness of the ones that
come due while the bulk is pending; the broker's memory from ``/proc``.

Everything goes through the public client (``open_producer``, ``send_batch`` with
``delay_ms`` / ``deliver_at``, ``open_consumer``, ``Admin.broker_info``)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import trio

from clmq.client import ClientError, Producer, Record, open_admin, open_consumer
from clmq.common import PROP_DELIVER_AT

from .cpu import cpu_seconds

ENQUEUE_WAIT_S = 60.0  # after scheduling: how long the timer may take to count them all as pending
ENQUEUE_POLL_S = 0.1  # how often BROKER_INFO is asked meanwhile (a counter of another process: no event)
DRAIN_GRACE_S = 15.0  # after the window: how long the consumer may take to get its last messages
WARMUP_BATCHES = 20  # plain batches sent before the memory baseline (buffers, connections, code paths)
GROUP = "bench-delay"


def wall_ms() -> float:
    return time.time() * 1000


def proc_memory(pid: int) -> dict[str, int]:
    """VmRSS and its anonymous part (RssAnon: the heap, not the mapped log files) of a
    process, in bytes; empty if it is gone."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "RssAnon", "RssFile"):
                    out[key] = int(value.split()[0]) * 1024  # kB
    except OSError:
        pass
    return out


async def send_rate(
    p: Producer, topic: str, bodies: list[bytes], senders: int, seconds: float, delay_ms: float | None, broker_pid: int
) -> dict[str, float]:
    """``senders`` tasks each calling ``send_batch(topic, bodies, delay_ms=...)`` in a loop
    for ``seconds``: messages stored per second, how many failed, and the CPU time per
    message of this process and of the broker's (where a slower kind spends it)."""
    sent, failed = [0], [0]
    deadline = time.perf_counter() + seconds

    async def sender() -> None:
        while time.perf_counter() < deadline:
            try:
                await p.send_batch(topic, bodies, delay_ms=delay_ms)
            except ClientError:  # counted, as a user would log it
                failed[0] += len(bodies)
            else:
                sent[0] += len(bodies)

    t0, client0, broker0 = time.perf_counter(), time.process_time(), cpu_seconds(broker_pid)
    async with trio.open_nursery() as nursery:
        for _ in range(senders):
            nursery.start_soon(sender)
    per = 1e6 / max(1, sent[0])
    return {
        "msgs_per_s": sent[0] / (time.perf_counter() - t0),
        "sent": sent[0],
        "failed": failed[0],
        "client_cpu_us_per_msg": (time.process_time() - client0) * per,
        "broker_cpu_us_per_msg": (cpu_seconds(broker_pid) - broker0) * per,
    }


@dataclass
class Bulk:
    """``pending`` messages in batches of ``batch``, due evenly over
    ``[start_ms, start_ms + spread_ms)``: batch k at ``start_ms + k * spread_ms / batches``."""

    pending: int
    batch: int
    start_ms: float
    spread_ms: float

    @property
    def batches(self) -> int:
        return -(-self.pending // self.batch)

    def due(self, k: int) -> int:
        return int(self.start_ms + k * self.spread_ms / self.batches)

    def size(self, k: int) -> int:
        return min(self.batch, self.pending - k * self.batch)

    def expected(self, from_ms: float, to_ms: float) -> int:
        """Messages due in ``[from_ms, to_ms]``."""
        return sum(self.size(k) for k in range(self.batches) if from_ms <= self.due(k) <= to_ms)


async def schedule(p: Producer, topic: str, bulk: Bulk, body: bytes, senders: int) -> dict[str, float]:
    """Send the bulk (``deliver_at`` per batch) with ``senders`` batches in flight."""
    ks = iter(range(bulk.batches))
    failed = [0]

    async def sender() -> None:
        for k in ks:  # one shared iterator: each batch sent once
            try:
                await p.send_batch(topic, [body] * bulk.size(k), deliver_at=bulk.due(k))
            except ClientError:
                failed[0] += bulk.size(k)

    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(senders):
            nursery.start_soon(sender)
    elapsed = time.perf_counter() - t0
    return {"schedule_s": elapsed, "schedule_msgs_per_s": bulk.pending / elapsed, "schedule_failed": failed[0]}


def _counted(info: dict[str, Any]) -> int:
    return int(info["timer_pending"]) + int(info["timer_delivered"])


async def wait_enqueued(addr: str, at_least: int) -> dict[str, Any]:
    """BROKER_INFO once the timer counts ``at_least`` messages pending or delivered (or
    after ``ENQUEUE_WAIT_S``: the last answer, whatever it says)."""
    async with open_admin(broker_addrs=[addr]) as admin:
        with trio.move_on_after(ENQUEUE_WAIT_S):
            # a counter in another process: no event to wait for
            while _counted(info := await admin.broker_info(addr)) < at_least:  # noqa: ASYNC110
                await trio.sleep(ENQUEUE_POLL_S)
            return info
        return await admin.broker_info(addr)


async def broker_info(addr: str) -> dict[str, Any]:
    async with open_admin(broker_addrs=[addr]) as admin:
        return await admin.broker_info(addr)


@dataclass
class Window:
    """The measured window of a precision case: the lateness of every message due in it."""

    from_ms: float
    to_ms: float
    expected: int
    lateness_ms: list[float] = field(default_factory=list)
    before: int = 0  # messages due before the window, read and not counted
    info_at_start: dict[str, Any] = field(default_factory=dict)

    def take(self, records: list[Record], now_ms: float) -> None:
        for r in records:
            due = int(r.properties.get(PROP_DELIVER_AT, "0"))
            if self.from_ms <= due <= self.to_ms:
                self.lateness_ms.append(now_ms - due)
            elif due < self.from_ms:
                self.before += 1


async def measure_window(addr: str, topic: str, window: Window) -> None:
    """A consumer group member reads ``topic`` until every message due in the window
    has come (or ``DRAIN_GRACE_S`` after it); the broker's figures at its start."""

    async def info_at_start() -> None:
        await trio.sleep(max(0.0, (window.from_ms - wall_ms()) / 1000))
        window.info_at_start = await broker_info(addr)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(info_at_start)
        async with open_consumer(None, GROUP, {topic: "*"}, broker_addrs=[addr]) as c:
            with trio.move_on_after(max(0.0, (window.to_ms - wall_ms()) / 1000) + DRAIN_GRACE_S):
                while len(window.lateness_ms) < window.expected:
                    records = await c.receive()
                    window.take(records, wall_ms())


async def warm_up(p: Producer, topic: str, bodies: list[bytes]) -> None:
    """Plain sends, so that the memory baseline has the broker's buffers and code warm."""
    for _ in range(WARMUP_BATCHES):
        await p.send_batch(topic, bodies)


def memory_figures(
    before: dict[str, int], after: dict[str, int], info: dict[str, Any], info0: dict[str, Any]
) -> dict[str, Any]:
    """Bytes per pending message: the broker's RSS growth (and its anonymous part's),
    and the timer's own account (``timer_memory_bytes``). On a slow machine some messages
    may come due before ``info`` is read: they are enqueued, no longer pending."""
    pending = int(info["timer_pending"]) - max(0, int(info0["timer_pending"]))

    def per(key: str) -> float:
        return (after.get(key, 0) - before.get(key, 0)) / pending if pending > 0 else math.nan

    return {
        "pending_counted": pending,  # held by the timer then (some may have come due already)
        "enqueued_counted": _counted(info) - max(0, _counted(info0)),  # every message the timer took
        "rss_before_bytes": before.get("VmRSS", 0),
        "rss_after_bytes": after.get("VmRSS", 0),
        "rss_anon_before_bytes": before.get("RssAnon", 0),
        "rss_anon_after_bytes": after.get("RssAnon", 0),
        "rss_bytes_per_pending": per("VmRSS"),
        "rss_anon_bytes_per_pending": per("RssAnon"),
        "rss_file_bytes_per_pending": per("RssFile"),
        "timer_memory_bytes": int(info["timer_memory_bytes"]),
        "timer_memory_bytes_per_pending": int(info["timer_memory_bytes"]) / pending if pending > 0 else math.nan,
    }

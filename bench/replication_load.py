"""The client side of ``clmq bench replication``: producing through ``clmq.client.open_producer``
with many sends in flight (optionally paced to a rate), and what is sampled meanwhile
(CPU of every process, the leader's view of its followers' lag)."""

from __future__ import annotations

import bisect
import itertools
import math
import os
import resource
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import trio

from clmq.client import MessageQueue, NoRouteError, Producer, SendError, open_admin, open_producer
from clmq.common import Message

from .replication_cluster import Group

READY_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class LoadSpec:
    topic: str
    size_bytes: int
    batch_messages: int
    senders: int
    warmup_s: float
    seconds: float
    rate_msgs_per_s: float = 0.0  # 0: as fast as the senders go
    max_bytes: int = 0  # stop once this many bytes are acknowledged (0: no limit)
    lag_sample_ms: int = 0  # sample the followers' lag this often during the window (0: not at all)


@dataclass
class Window:
    """What completed inside the measured window (warm-up excluded)."""

    messages: int = 0
    errors: int = 0
    latencies_ms: list[float] = field(default_factory=list)
    seconds: float = 0.0
    cpu_s: dict[str, float] = field(default_factory=dict)  # process -> CPU seconds in the window
    lag: dict[int, list[tuple[float, int, int]]] = field(default_factory=dict)  # follower -> [(age ms, lag_ms, bytes)]
    total_bytes: int = 0  # acknowledged over the whole run, warm-up included
    queues_written: set[int] = field(default_factory=set)  # distinct queues written in the window


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` percentile (0 < q <= 100); NaN for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    return float(s[max(0, math.ceil(q / 100 * len(s)) - 1)])


def _client_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _cpu_snapshot(group: Group) -> dict[str, float]:
    return {"client": _client_cpu_s(), **{s.name: s.cpu_seconds() for s in group.services()}}


async def prepare(group: Group, topic: str, queues: int, followers: int) -> None:
    """Create the topic on the leader, then wait until every follower is in sync and the
    name server routes the topic's queues (so that the measurement starts on a ready group)."""
    assert group.leader is not None and group.nameserver is not None
    leader = group.leader.addr
    async with open_admin([group.nameserver.addr]) as admin:
        await admin.create_topic(topic, queues, on=[leader])
        with trio.fail_after(READY_TIMEOUT_S):
            while True:
                rows = (await admin.replica_status(leader))["replicas"]
                if len(rows) == followers and all(r["in_sync"] for r in rows):
                    break
                await trio.sleep(0.05)
    async with open_producer([group.nameserver.addr]) as producer:
        with trio.fail_after(READY_TIMEOUT_S):
            while await _routed(producer, topic) < queues:  # noqa: ASYNC110 - polling another process
                await trio.sleep(0.1)


async def _routed(producer: Producer, topic: str) -> int:
    """How many of the topic's queues the name server routes (0 before the leader registers it)."""
    try:
        return len(await producer.routes.queues(topic, refresh=True))
    except NoRouteError:
        return 0


async def produce(group: Group, spec: LoadSpec) -> Window:
    """Produce by ``spec`` through the public client; figures of the window after the warm-up."""
    assert group.nameserver is not None
    window = Window()
    async with open_producer([group.nameserver.addr], send_timeout_ms=30_000, retries=0) as producer:
        began = trio.current_time()
        start, end = began + spec.warmup_s, began + spec.warmup_s + spec.seconds
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_cpu_probe, group, window, start, end)
            if spec.lag_sample_ms:
                nursery.start_soon(_lag_probe, group, window, spec.lag_sample_ms, start, end)
            slots = iter(range(1 << 62))
            async with trio.open_nursery() as senders:
                for _ in range(spec.senders):
                    senders.start_soon(_sender, producer, spec, window, slots, (began, start, end))
            nursery.cancel_scope.cancel()  # the probes, if the senders stopped early (max_bytes)
        window.seconds = min(trio.current_time(), end) - start
    return window


def _round_robin(mqs: Sequence[MessageQueue], _first: Message) -> MessageQueue:
    """Plain round robin. (The producer's default pick scanned every queue per send, ~5 ms
    at 10,000 queues, when these figures were first taken; kept so that they stay comparable.)"""
    return mqs[next(_turn) % len(mqs)]


_turn = itertools.count()


async def _sender(
    producer: Producer, spec: LoadSpec, window: Window, slots: Any, times: tuple[float, float, float]
) -> None:
    began, start, end = times
    body = os.urandom(spec.size_bytes)
    period = spec.batch_messages / spec.rate_msgs_per_s if spec.rate_msgs_per_s else 0.0
    while trio.current_time() < end and not (spec.max_bytes and window.total_bytes >= spec.max_bytes):
        if period:
            await trio.sleep_until(began + next(slots) * period)
        now_ms = int(time.time() * 1000)  # a real client builds and encodes every batch it sends
        msgs = [Message(spec.topic, 0, body, "TagA", born_timestamp_ms=now_ms) for _ in range(spec.batch_messages)]
        t0 = trio.current_time()
        try:
            result = await producer.send_batch(spec.topic, msgs, selector=_round_robin)
        except SendError:
            window.errors += start <= trio.current_time() <= end
            continue
        done = trio.current_time()
        window.total_bytes += spec.batch_messages * spec.size_bytes
        if start <= done <= end:  # completions inside the window: no bias from sends in flight at its edges
            window.messages += spec.batch_messages
            window.latencies_ms.append((done - t0) * 1000)
            window.queues_written.add(result.queue.queue_id)


async def _cpu_probe(group: Group, window: Window, start: float, end: float) -> None:
    await trio.sleep_until(start)
    before = _cpu_snapshot(group)
    try:
        await trio.sleep_until(end)
    finally:  # also when cancelled: the senders can finish (and cancel this) in the same tick as ``end``
        after = _cpu_snapshot(group)
        window.cpu_s = {k: after[k] - before.get(k, 0.0) for k in after}


async def _lag_probe(group: Group, window: Window, every_ms: int, start: float, end: float) -> None:
    """Sample REPLICA_STATUS of the leader: per follower, the age of the oldest byte it
    lacks (from this probe's history of the leader's end), the leader's own ``lag_ms``
    (time since the follower was last caught up: it includes idle time in a long-polled
    fetch) and the bytes behind."""
    assert group.leader is not None
    ends: list[int] = []  # the leader's end offset at each sample (never decreasing)
    times: list[float] = []
    async with open_admin(broker_addrs=[group.leader.addr]) as admin:
        await trio.sleep_until(start)
        while trio.current_time() < end:
            status = await admin.replica_status(group.leader.addr)
            now = trio.current_time()
            ends.append(int(status["end_offset"]))
            times.append(now)
            for r in status["replicas"]:
                held = int(r["acked_offset"])
                # the first sample whose end was past what the follower holds: its missing bytes existed since then
                i = bisect.bisect_right(ends, held)
                age_ms = (now - times[i]) * 1000 if i < len(ends) else 0.0
                window.lag.setdefault(int(r["broker_id"]), []).append((age_ms, int(r["lag_ms"]), int(r["lag_bytes"])))
            await trio.sleep(every_ms / 1000)


async def wait_caught_up(group: Group, follower_addr: str, poll_ms: int) -> dict[str, float]:
    """Time an empty follower's copy of the leader's (idle) log: seconds from now to its
    first byte and to its log end equal to the leader's; the bytes copied."""
    assert group.leader is not None
    t0 = time.perf_counter()
    async with open_admin(broker_addrs=[group.leader.addr, follower_addr]) as admin:
        target = int((await admin.replica_status(group.leader.addr))["end_offset"])
        first_s, first_end = math.nan, 0
        with trio.fail_after(600):
            while True:
                end = int((await admin.replica_status(follower_addr))["end_offset"])
                now = time.perf_counter() - t0
                if end > 0 and math.isnan(first_s):
                    first_s, first_end = now, end
                if end >= target:
                    return {
                        "target_bytes": target,
                        "first_byte_s": first_s,
                        "first_end_bytes": first_end,
                        "done_s": now,
                    }
                await trio.sleep(poll_ms / 1000)

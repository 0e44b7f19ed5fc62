"""What a ``clmq bench e2e`` case sends and what it measured (shared by the public and
the raw clients of the benchmark)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import trio

from clmq.client import open_consumer
from clmq.protocol.transport import ClientSecurity

from .cpu import cpu_seconds

CONSUME_TIMEOUT_S = 300  # a consumer that has not read everything back by then: the case fails
CHECK_CLOCK_EVERY = 64  # messages between two looks at the clock in a timed case


@dataclass(frozen=True)
class Load:
    """A produce case: ``size``-byte messages to a topic of ``queues`` queues, for
    ``seconds`` (the timed case) or ``total`` messages (the sparse case)."""

    topic: str
    size: int
    queues: int
    seconds: float | None = None
    total: int | None = None
    producers: int = 4  # raw: concurrent batch senders
    batch: int = 256  # raw: messages per request

    def more(self, sent: int, deadline: float) -> bool:
        """Whether to send more after ``sent`` messages (timed: ``deadline`` in perf_counter s)."""
        if self.total is not None:
            return sent < self.total
        return time.perf_counter() < deadline

    def next_count(self, sent: int, most: int) -> int:
        """How many to send before the next check: at most ``most``, and what the total leaves."""
        return most if self.total is None else min(most, self.total - sent)


@dataclass
class Produced:
    sent: int  # messages the client was asked to send
    failed: int  # of those, reported failed (SendError); the rest are stored
    elapsed_s: float  # first send to the last answer (the final flush included)
    call: str  # what the client called, e.g. "submit" or "send_to"


@dataclass
class Consumed:
    messages: int
    overall_msgs_per_s: float  # opening the consumer to closing it: joining, look-ups and commits included
    fetch_msgs_per_s: float  # first batch to the last (Kafka's fetch.nMsg.sec)
    first_batch_s: float  # opening the consumer to its first batch


class ProcessCpu:
    """CPU seconds (user + system) used by a process since this object was made: the
    broker's from its CPU-time clock (:func:`bench.cpu.cpu_seconds`), this process's from :func:`time.process_time`.
    Less noisy than wall time on a shared machine."""

    def __init__(self, pid: int | None = None) -> None:
        self.pid = pid
        self.start = self._now()

    def _now(self) -> float:
        if self.pid is None:
            return time.process_time()
        return cpu_seconds(self.pid)

    def used_s(self) -> float:
        return self._now() - self.start


async def consume(
    addr: str, topic: str, expected: int, security: ClientSecurity | None = None, **options: Any
) -> Consumed:
    """A consumer group member (``options``: ConsumerOptions; none: the defaults) reads
    the topic from the earliest offsets until it has ``expected`` messages (``security``:
    TLS, a login; None: the client's default)."""
    t0 = time.perf_counter()
    got, first, last = 0, 0.0, 0.0
    async with open_consumer(None, "bench", {topic: "*"}, broker_addrs=[addr], security=security, **options) as c:
        with trio.move_on_after(CONSUME_TIMEOUT_S) as timeout:
            got += len(await c.receive())
            first = time.perf_counter()
            while got < expected:
                got += len(await c.receive())
            last = time.perf_counter()
    if timeout.cancelled_caught:
        raise RuntimeError(f"the consumer read {got:,} of {expected:,} messages in {CONSUME_TIMEOUT_S} s")
    overall = got / (time.perf_counter() - t0)
    return Consumed(got, overall, got / max(last - first, 1e-9), first - t0)

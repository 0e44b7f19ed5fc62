"""``clmq bench e2e --api public`` and ``--api public-batches``: exactly what a user of
the client writes, with its default options.

- ``public``: ``async with open_producer(broker_addrs=[addr]) as p``, then per message
  ``await p.submit(topic, body, selector=...)`` (message i to queue i mod Q, so that the
  case spreads over every queue), ``await p.flush()`` at the end; the producer's
  accumulator makes the requests. Until the client has ``submit`` this falls back to the
  ``public-batches`` shape (said in the JSON's ``producer_call``).
- ``public-many``: per window of 1,000 messages one ``submit_many(topic, bodies)``
  (round robin: message i to queue i mod Q), ``flush`` at the end.
- ``public-batches``: issue 17's first measurement: per window of 1,000 messages, one
  ``send_batch`` per queue that the window touches, all at once.
- consume: ``open_consumer(None, group, {topic: "*"}, broker_addrs=[addr])`` with default
  options, ``receive()`` until every message is read.
- latency: one ``await p.send(...)`` per message, each its own task, issued at a fixed
  rate; each timed from its call to its answer.
"""

from __future__ import annotations

import collections
import os
import time
from typing import Callable, Sequence

import trio

from clmq.client import ClientError, Message, MessageQueue, Producer, SendFuture, SendFutures, open_producer
from clmq.protocol.transport import ClientSecurity

from .e2e_load import CHECK_CLOCK_EVERY, Consumed, Load, Produced, consume

WINDOW = 1000  # public-batches: messages per window

Selector = Callable[[Sequence[MessageQueue], Message], MessageQueue]


def _at(queue: int) -> Selector:
    """A selector for queue ``queue`` (the topic's queues are sorted by queue id)."""
    return lambda mqs, _msg: mqs[queue % len(mqs)]


async def produce_public(addr: str, load: Load, security: ClientSecurity | None = None) -> Produced:
    """Per message ``submit``, then ``flush``; failures counted by a done callback."""
    body = os.urandom(load.size)
    selectors = [_at(q) for q in range(load.queues)]
    failed = [0]

    def done(fut: SendFuture) -> None:
        if fut.exception() is not None:
            failed[0] += 1

    async with open_producer(broker_addrs=[addr], security=security) as p:
        sent, t0 = 0, time.perf_counter()
        deadline = t0 + (load.seconds or 0.0)
        while load.more(sent, deadline):
            for _ in range(load.next_count(sent, CHECK_CLOCK_EVERY)):
                await p.submit(load.topic, body, selector=selectors[sent % load.queues], callback=done)
                sent += 1
        await p.flush()
        elapsed = time.perf_counter() - t0
    return Produced(sent, failed[0], elapsed, "submit")


async def produce_many(addr: str, load: Load, security: ClientSecurity | None = None) -> Produced:
    """Per window of 1,000 messages one ``submit_many`` (round robin over the topic's
    queues: message i to queue i mod Q, as in ``public``), ``flush`` at the end;
    failures counted from the windows' futures as they complete."""
    body = os.urandom(load.size)
    window = [body] * WINDOW
    async with open_producer(broker_addrs=[addr], security=security) as p:
        sent, failed, t0 = 0, 0, time.perf_counter()
        deadline = t0 + (load.seconds or 0.0)
        pending: collections.deque[SendFutures] = collections.deque()
        while load.more(sent, deadline):
            count = load.next_count(sent, WINDOW)
            pending.append(await p.submit_many(load.topic, window if count == WINDOW else window[:count]))
            sent += count
            while pending and pending[0][-1].done() and pending[0].done():
                failed += pending.popleft().failed()
        await p.flush()
        elapsed = time.perf_counter() - t0
        failed += sum(futs.failed() for futs in pending)
    return Produced(sent, failed, elapsed, "submit_many")


async def produce_batches(addr: str, load: Load, security: ClientSecurity | None = None) -> Produced:
    """Per window of 1,000 messages, one ``send_batch`` per queue it touches, concurrently."""
    body = os.urandom(load.size)
    selectors = [_at(q) for q in range(load.queues)]
    async with open_producer(broker_addrs=[addr], security=security) as p:
        return await _windows(p, load, body, selectors)


async def _windows(p: Producer, load: Load, body: bytes, selectors: list[Selector]) -> Produced:
    sent, failed = 0, [0]
    t0 = time.perf_counter()
    deadline = t0 + (load.seconds or 0.0)

    async def send(queue: int, bodies: list[bytes]) -> None:
        try:
            await p.send_batch(load.topic, bodies, selector=selectors[queue])
        except ClientError:  # SendError, NoRouteError: counted, as a user would log them
            failed[0] += len(bodies)

    while load.more(sent, deadline):
        per_queue: dict[int, list[bytes]] = {}
        count = load.next_count(sent, WINDOW)
        for i in range(sent, sent + count):
            per_queue.setdefault(i % load.queues, []).append(body)
        async with trio.open_nursery() as nursery:
            for queue, bodies in per_queue.items():
                nursery.start_soon(send, queue, bodies)
        sent += count
    return Produced(sent, failed[0], time.perf_counter() - t0, "send_batch")


async def consume_public(addr: str, topic: str, expected: int, security: ClientSecurity | None = None) -> Consumed:
    return await consume(addr, topic, expected, security)


async def latency_public(addr: str, topic: str, rate: int, seconds: float, queues: int) -> tuple[list[float], int]:
    """``rate`` sends a second for ``seconds``, message i to queue i mod ``queues``,
    each ``await p.send`` its own task; each successful one's time from its call to its
    answer, in ms, and how many failed (SendError: e.g. no answer within
    ``send_timeout_ms``). Timed from the call, not from when it was due: trio's sleeps
    wake up to a millisecond late, which would be the benchmark's, not the client's;
    a slow answer does not delay later sends (each is its own task), so a slow client
    still shows in the figures."""
    body = os.urandom(1024)
    selectors = [_at(q) for q in range(queues)]
    lat: list[float] = []
    failed = [0]
    async with open_producer(broker_addrs=[addr]) as p:
        await p.send(topic, body)  # routes and connection: the steady state is measured

        async def one(i: int) -> None:
            t = time.perf_counter()
            try:
                await p.send(topic, body, selector=selectors[i % queues])
            except ClientError:
                failed[0] += 1
                return
            lat.append((time.perf_counter() - t) * 1000)

        start = trio.current_time()
        async with trio.open_nursery() as senders:
            for i in range(int(seconds * rate)):
                due = start + i / rate
                if due > trio.current_time():
                    await trio.sleep_until(due)
                senders.start_soon(one, i)
    return lat, failed[0]

"""``clmq bench e2e --api raw``: batches encoded by the benchmark and sent with
``Producer.send_to`` (no accumulator, no retries), several requests in flight; read back
by a consumer with large pulls. The transport and the broker at their best, against which
the public API's figures are compared."""

from __future__ import annotations

import os
import time

import trio

from clmq.client import MessageQueue, Producer, Routes
from clmq.common import Message
from clmq.protocol import encode_batch
from clmq.protocol.transport import ClientSecurity, RpcClient

from .e2e_load import Consumed, Load, Produced, consume

# The consumer's options in raw mode (the figures before issue 17 were made with them).
RAW_CONSUMER_OPTIONS: dict[str, object] = {"pull_batch": 1024, "buffered_batches": 256}


async def produce_raw(addr: str, load: Load, security: ClientSecurity | None = None) -> Produced:
    """Timed case: ``load.producers`` senders, each request ``load.batch`` messages of
    one queue, the queues round robin. Fixed total (the sparse case): message i to queue
    i mod ``load.queues``, each request ``load.batch`` consecutive messages (so it spans
    up to that many queues): a request per queue would be ``queues`` requests of
    ``total / queues`` messages, a measure of the cost per request instead."""
    async with trio.open_nursery() as nursery:
        rpc = RpcClient(nursery, security=security)
        producer = Producer(rpc, Routes(rpc, [], broker_addrs=[addr]))
        mqs = await producer.routes.queues(load.topic)
        body = os.urandom(load.size)
        sent = [0]
        deadline = time.perf_counter() + (load.seconds or 0.0)

        async def sender(k: int) -> None:
            i = k
            while load.more(sent[0], deadline):
                count = load.next_count(sent[0], load.batch)
                sent[0] += count
                now = int(time.time() * 1000)  # a real client encodes every batch it sends
                if load.total is None:
                    mq = mqs[i % len(mqs)]
                    i += load.producers
                    msgs = [Message(load.topic, mq.queue_id, body, "TagA", born_timestamp_ms=now) for _ in range(count)]
                else:
                    first = sent[0] - count
                    mq = mqs[first % len(mqs)]
                    msgs = [
                        Message(load.topic, j % load.queues, body, "TagA", born_timestamp_ms=now)
                        for j in range(first, first + count)
                    ]
                await producer.send_to(mq, encode_batch(msgs), count)

        t0 = time.perf_counter()
        async with trio.open_nursery() as senders:
            for k in range(load.producers):
                senders.start_soon(sender, k)
        elapsed = time.perf_counter() - t0
        await rpc.aclose()
        nursery.cancel_scope.cancel()
    return Produced(sent[0], 0, elapsed, "send_to")


async def consume_raw(addr: str, topic: str, expected: int, security: ClientSecurity | None = None) -> Consumed:
    return await consume(addr, topic, expected, security, **RAW_CONSUMER_OPTIONS)


async def latency_raw(addr: str, topic: str, rate: int, seconds: float, batch: int = 10) -> tuple[list[float], int]:
    """Send ``batch`` messages every ``batch / rate`` seconds, each send its own task;
    each send's round trip in ms."""
    lat: list[float] = []
    async with trio.open_nursery() as nursery:
        rpc = RpcClient(nursery)
        producer = Producer(rpc, Routes(rpc, [], broker_addrs=[addr]))
        mqs: list[MessageQueue] = await producer.routes.queues(topic)
        body = os.urandom(1024)

        async def one(mq: MessageQueue) -> None:
            t = time.perf_counter()
            data = encode_batch([Message(topic, mq.queue_id, body) for _ in range(batch)])
            await producer.send_to(mq, data, batch)
            lat.append((time.perf_counter() - t) * 1000)

        period, n = batch / rate, int(seconds * rate / batch)
        start = trio.current_time()
        async with trio.open_nursery() as senders:
            for i in range(n):
                await trio.sleep_until(start + i * period)
                senders.start_soon(one, mqs[i % len(mqs)])
        await rpc.aclose()
        nursery.cancel_scope.cancel()
    return lat, 0  # no failures: one would end the case

"""The client side of ``clmq bench kafka``, run as its own process so that the client's
CPU does not compete with the broker's inside one interpreter:
``python -m clmq.bench.kafka_load '<spec as JSON>'``.

The process connects and warms up (metadata, one message sent, or the consumer made),
prints ``ready``, waits for a line on stdin, runs the load, then prints one line of
JSON (its figures) and exits. The benchmark reads the broker's CPU between ``ready`` and
the result, so that neither the client's start-up nor its imports are counted.

Clients (``spec["client"]``):

- ``kafka``: librdkafka through ``confluent_kafka``: ``Producer.produce(topic, value,
  partition=i % P)`` per message (acks=all, ``linger.ms`` from the spec, ``batch.size``
  1 MB, no compression, not idempotent, delivery reports only for errors), ``flush()``
  at the end; ``Consumer`` in a group, ``subscribe`` then ``consume(10000, 0.5)``.
- ``native``: clmq's public trio client: ``open_producer(broker_addrs=[addr],
  linger_ms=...)`` and per message ``await p.submit(topic, body, selector=queue i mod Q,
  callback=...)`` then ``flush()`` (``submit_batch``: one ``submit_batch`` per queue of
  each window of 1,000 messages); ``open_consumer`` with default options and
  ``receive()``.

Roles (``spec["role"]``): ``produce`` (``messages`` messages, or for ``seconds``),
``consume`` (until ``expected`` messages) and ``latency`` (``rate`` messages a second
for ``seconds``, each timed from its call to its acknowledgement).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Callable

WINDOW = 1000  # native submit_batch: messages per window
CHECK_CLOCK_EVERY = 256  # messages between two looks at the clock
CONSUME_TIMEOUT_S = 120.0


def _handshake() -> None:
    print("ready", flush=True)
    sys.stdin.readline()


def _percentiles(lat_ms: list[float]) -> dict[str, float]:
    s = sorted(lat_ms) or [float("nan")]
    return {
        "p50_ms": s[len(s) // 2],
        "p99_ms": s[max(0, int(len(s) * 0.99) - 1)],
        "max_ms": s[-1],
    }


def _more(spec: dict[str, Any], sent: int, deadline: float) -> bool:
    if spec.get("seconds"):
        return time.perf_counter() < deadline
    return sent < int(spec["messages"])


# ------------------------------------------------------------------ librdkafka
def _kafka_producer(spec: dict[str, Any], **extra: Any) -> Any:
    import confluent_kafka as ck

    conf = {
        "bootstrap.servers": spec["bootstrap"],
        "acks": "all",
        "linger.ms": spec["linger_ms"],
        "batch.size": 1_000_000,
        "compression.type": "none",
        "enable.idempotence": False,
        "queue.buffering.max.messages": 1_000_000,
        "queue.buffering.max.kbytes": 1_048_576,
        **extra,
    }
    producer = ck.Producer(conf)
    producer.list_topics(spec["topic"], timeout=30)
    producer.produce(spec["topic"], b"w" * spec["size"], partition=0)  # connection and first request
    if producer.flush(30):
        raise RuntimeError("the warm-up message was not delivered")
    return producer


def kafka_produce(spec: dict[str, Any]) -> dict[str, Any]:
    failed = [0]

    def on_error(err: Any, _msg: Any) -> None:  # only errors are reported (delivery.report.only.error)
        if err is not None:
            failed[0] += 1

    producer = _kafka_producer(spec, **{"delivery.report.only.error": True, "on_delivery": on_error})
    topic, body, partitions = spec["topic"], os.urandom(spec["size"]), int(spec["partitions"])
    produce, poll = producer.produce, producer.poll
    _handshake()
    c0 = time.process_time()
    t0 = time.perf_counter()
    deadline = t0 + float(spec.get("seconds") or 0)
    sent = 0
    while _more(spec, sent, deadline):
        n = CHECK_CLOCK_EVERY if spec.get("seconds") else min(CHECK_CLOCK_EVERY, int(spec["messages"]) - sent)
        for i in range(sent, sent + n):
            while True:
                try:
                    produce(topic, body, partition=i % partitions)
                    break
                except BufferError:  # the local queue is full: wait for deliveries
                    poll(0.001)
        sent += n
        poll(0)
    left = producer.flush(120)
    elapsed = time.perf_counter() - t0
    return {
        "sent": sent,
        "failed": failed[0] + left,
        "elapsed_s": elapsed,
        "client_cpu_s": time.process_time() - c0,
        "warmup": 1,
    }


def kafka_consume(spec: dict[str, Any]) -> dict[str, Any]:
    import confluent_kafka as ck

    consumer = ck.Consumer(
        {
            "bootstrap.servers": spec["bootstrap"],
            "group.id": spec["group"],
            "auto.offset.reset": "earliest",
            "enable.auto.commit": True,
        }
    )
    expected = int(spec["expected"])
    _handshake()
    c0 = time.process_time()
    t0 = time.perf_counter()
    consumer.subscribe([spec["topic"]])
    got, first, last = 0, 0.0, 0.0
    deadline = t0 + CONSUME_TIMEOUT_S
    while got < expected and time.perf_counter() < deadline:
        batch = consumer.consume(10_000, 0.5)
        if not batch:
            continue
        if not first:
            first = time.perf_counter()
        errors = [m.error() for m in batch if m.error() is not None]
        if errors:
            raise RuntimeError(f"consumer error: {errors[0]}")
        got += len(batch)
        last = time.perf_counter()
    cpu = time.process_time() - c0
    consumer.close()
    return _consumed(got, expected, t0, first, last, cpu)


def _consumed(got: int, expected: int, t0: float, first: float, last: float, cpu: float) -> dict[str, Any]:
    if got < expected:
        raise RuntimeError(f"the consumer read {got:,} of {expected:,} messages")
    return {
        "consumed": got,
        "elapsed_s": last - t0,
        "fetch_s": max(last - first, 1e-9),
        "first_s": first - t0,
        "client_cpu_s": cpu,
    }


def kafka_latency(spec: dict[str, Any]) -> dict[str, Any]:
    lat_ms: list[float] = []
    failed = [0]

    def report(err: Any, msg: Any) -> None:
        if err is not None:
            failed[0] += 1
        else:
            lat_ms.append(msg.latency() * 1000)  # librdkafka's own: produce() to the acknowledgement

    producer = _kafka_producer(spec, on_delivery=report)
    producer.poll(0)
    lat_ms.clear()
    topic, body, partitions, rate = spec["topic"], os.urandom(spec["size"]), int(spec["partitions"]), spec["rate"]
    total = int(rate * spec["seconds"])
    _handshake()
    c0 = time.process_time()
    start = time.perf_counter()
    for i in range(total):
        due = start + i / rate
        while (now := time.perf_counter()) < due:
            producer.poll(min(due - now, 0.001))
        producer.produce(topic, body, partition=i % partitions)
        producer.poll(0)
    left = producer.flush(60)
    return {
        "sent": total,
        "answered": len(lat_ms),
        "failed": failed[0] + left,
        "client_cpu_s": time.process_time() - c0,
        "warmup": 1,
        **_percentiles(lat_ms),
    }


# ------------------------------------------------------------------ clmq's own client
def native_produce(spec: dict[str, Any]) -> dict[str, Any]:
    import trio

    from clmq.client import Message, MessageQueue, SendFuture, open_producer

    queues = int(spec["partitions"])
    body = os.urandom(spec["size"])

    def at(q: int) -> Callable[[Any, Message], MessageQueue]:
        return lambda mqs, _msg: mqs[q % len(mqs)]

    selectors = [at(q) for q in range(queues)]
    failed = [0]

    def done(fut: SendFuture) -> None:
        if fut.exception() is not None:
            failed[0] += 1

    async def main() -> dict[str, Any]:
        async with open_producer(broker_addrs=[spec["addr"]], linger_ms=spec["linger_ms"]) as p:
            await p.send(spec["topic"], body, selector=selectors[0])  # routes and connection
            await trio.to_thread.run_sync(_handshake)
            c0 = time.process_time()
            t0 = time.perf_counter()
            deadline = t0 + float(spec.get("seconds") or 0)
            sent = 0
            batch_failed = [0]
            if spec["api"] == "submit":
                while _more(spec, sent, deadline):
                    n = CHECK_CLOCK_EVERY if spec.get("seconds") else min(CHECK_CLOCK_EVERY, spec["messages"] - sent)
                    for i in range(sent, sent + n):
                        await p.submit(spec["topic"], body, selector=selectors[i % queues], callback=done)
                    sent += n
            else:  # submit_batch: per window, one batch per queue it touches
                while _more(spec, sent, deadline):
                    n = WINDOW if spec.get("seconds") else min(WINDOW, spec["messages"] - sent)
                    per_queue: dict[int, int] = {}
                    for i in range(sent, sent + n):
                        per_queue[i % queues] = per_queue.get(i % queues, 0) + 1
                    for q, count in per_queue.items():

                        def batch_done(fut: SendFuture, count: int = count) -> None:
                            if fut.exception() is not None:
                                batch_failed[0] += count

                        await p.submit_batch(spec["topic"], [body] * count, selector=selectors[q], callback=batch_done)
                    sent += n
            await p.flush()
            elapsed = time.perf_counter() - t0
            cpu = time.process_time() - c0
        return {
            "sent": sent,
            "failed": failed[0] + batch_failed[0],
            "elapsed_s": elapsed,
            "client_cpu_s": cpu,
            "warmup": 1,
        }

    result: dict[str, Any] = trio.run(main)
    return result


def native_consume(spec: dict[str, Any]) -> dict[str, Any]:
    import trio

    from clmq.client import open_consumer

    expected = int(spec["expected"])

    async def main() -> dict[str, Any]:
        await trio.to_thread.run_sync(_handshake)
        c0 = time.process_time()
        t0 = time.perf_counter()
        got, first, last = 0, 0.0, 0.0
        async with open_consumer(None, spec["group"], {spec["topic"]: "*"}, broker_addrs=[spec["addr"]]) as c:
            with trio.move_on_after(CONSUME_TIMEOUT_S):
                while got < expected:
                    got += len(await c.receive())
                    if not first:
                        first = time.perf_counter()
                    last = time.perf_counter()
        return _consumed(got, expected, t0, first, last, time.process_time() - c0)

    result: dict[str, Any] = trio.run(main)
    return result


def native_latency(spec: dict[str, Any]) -> dict[str, Any]:
    import trio

    from clmq.client import Message, MessageQueue, SendFuture, open_producer

    queues, rate, body = int(spec["partitions"]), spec["rate"], os.urandom(spec["size"])
    total = int(rate * spec["seconds"])

    def at(q: int) -> Callable[[Any, Message], MessageQueue]:
        return lambda mqs, _msg: mqs[q % len(mqs)]

    selectors = [at(q) for q in range(queues)]
    lat_ms: list[float] = []
    failed = [0]

    async def main() -> dict[str, Any]:
        async with open_producer(broker_addrs=[spec["addr"]], linger_ms=spec["linger_ms"]) as p:
            await p.send(spec["topic"], body, selector=selectors[0])
            await trio.to_thread.run_sync(_handshake)
            c0 = time.process_time()
            start = trio.current_time()
            for i in range(total):
                due = start + i / rate
                if due > trio.current_time():
                    await trio.sleep_until(due)
                t = time.perf_counter()

                def done(fut: SendFuture, t: float = t) -> None:
                    if fut.exception() is not None:
                        failed[0] += 1
                    else:
                        lat_ms.append((time.perf_counter() - t) * 1000)

                await p.submit(spec["topic"], body, selector=selectors[i % queues], callback=done)
            await p.flush()
            cpu = time.process_time() - c0
        return {
            "sent": total,
            "answered": len(lat_ms),
            "failed": failed[0],
            "client_cpu_s": cpu,
            "warmup": 1,
            **_percentiles(lat_ms),
        }

    result: dict[str, Any] = trio.run(main)
    return result


ROLES: dict[tuple[str, str], Callable[[dict[str, Any]], dict[str, Any]]] = {
    ("kafka", "produce"): kafka_produce,
    ("kafka", "consume"): kafka_consume,
    ("kafka", "latency"): kafka_latency,
    ("native", "produce"): native_produce,
    ("native", "consume"): native_consume,
    ("native", "latency"): native_latency,
}


def main() -> None:
    spec = json.loads(sys.argv[1])
    result = ROLES[(spec["client"], spec["role"])](spec)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

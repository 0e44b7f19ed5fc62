"""``clmq bench trace``: what message traces cost, issue 32 (aim: at most 10 % of
throughput).

One fresh ``clmq broker`` process with ``trace_enabled`` (async flush, its own data
directory, ``%TRACE%`` created at start); the clients run in this process through the
public trio client, as an application would.

- Produce: ``--senders`` tasks each calling ``send`` of one ``--size-bytes`` body at a
  time (the accumulator batches what is in flight), through a producer opened with
  ``trace=False`` and one with ``trace=True`` (a ``sent`` event per message, written to
  ``%TRACE%`` in the background), for ``--seconds`` each, alternated for ``--runs``
  runs (their order swapped every other run).
- Consume: ``--consume-messages`` stored beforehand, read whole by a fresh group per
  run with ``receive()`` (each batch acknowledged by the next call), with ``trace=False``
  and ``trace=True`` (``delivered`` and ``acked`` events per message), alternated.

Medians per kind, the traced / untraced ratio per run and its median; the traced
clients' event counts (written, dropped: a full buffer drops rather than slows).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import trio

from clmq.client import ClientError, open_admin, open_consumer, open_producer

from .cpu import cpu_seconds
from .delay import _broker
from .e2e import BrokerProcess
from .trace_report import aims, markdown, plot, summary

TOPIC = "trace-bench"
CONSUME_TOPIC = "trace-consume"
WARMUP_S = 0.5  # of each kind of send before the measured runs
FILL_BATCH_MESSAGES = 500  # send_batch size while filling the consume topic
CONSUME_MAX_S = 120.0  # one consume run gives up after this
KINDS = ("untraced", "traced")


def add_command(bench_sub: Any) -> None:
    """Add ``clmq bench trace`` to the parser."""
    p = bench_sub.add_parser("trace", help="message traces: produce and consume rates with tracing on and off")
    a = p.add_argument
    a("--size-bytes", type=int, default=100, help="message body size (default 100)")
    a("--senders", type=int, default=64, help="produce: sends in flight (default 64)")
    a("--queues", type=int, default=8, help="queues of the topics (default 8)")
    a("--seconds", type=float, default=3.0, help="produce: seconds per measured run (default 3)")
    a("--consume-messages", type=int, default=200_000, help="consume: messages read per run (default 200000)")
    a("--runs", type=int, default=5, help="runs of each kind, alternated (default 5)")
    a("--settle-seconds", type=float, default=2.0, help="os.sync(), then idle this long before the broker (default 2)")
    a("--json", type=Path, default=None, help="every figure as JSON")
    a("--markdown", type=Path, default=None, help="also write the tables and the aims as Markdown here")
    a("--plot", type=Path, default=None, help="draw the figures here (matplotlib)")
    p.set_defaults(func=cmd_bench_trace)


def _traced(kind: str) -> dict[str, Any]:
    return {"trace": kind == "traced"}


def _counts(client: Any) -> dict[str, int]:
    tracer = getattr(client, "tracer", None) or getattr(getattr(client, "state", None), "tracer", None)
    return tracer.dispatcher.counts() if tracer is not None else {}


async def produce_rate(addr: str, kind: str, body: bytes, senders: int, seconds: float, pid: int) -> dict[str, Any]:
    """``senders`` tasks sending one message at a time for ``seconds`` (after a warm-up
    on the same producer): messages stored per second and CPU per message."""
    sent, failed = [0], [0]
    async with open_producer(broker_addrs=[addr], **_traced(kind)) as p:

        async def sender(deadline: float, count: bool) -> None:
            while time.perf_counter() < deadline:
                try:
                    await p.send(TOPIC, body)
                except ClientError:
                    failed[0] += count
                else:
                    sent[0] += count

        for measured, length in ((False, WARMUP_S), (True, seconds)):
            deadline = time.perf_counter() + length
            t0, client0, broker0 = time.perf_counter(), time.process_time(), cpu_seconds(pid)
            async with trio.open_nursery() as nursery:
                for _ in range(senders):
                    nursery.start_soon(sender, deadline, measured)
        elapsed = time.perf_counter() - t0
        client_cpu, broker_cpu = time.process_time() - client0, cpu_seconds(pid) - broker0
    per = 1e6 / max(1, sent[0])
    return {
        "msgs_per_s": sent[0] / elapsed,
        "sent": sent[0],
        "failed": failed[0],
        "client_cpu_us_per_msg": client_cpu * per,
        "broker_cpu_us_per_msg": broker_cpu * per,
        "trace_events": _counts(p),
    }


async def consume_rate(addr: str, kind: str, group: str, messages: int, pid: int) -> dict[str, Any]:
    """A fresh group reads ``messages`` from the start: messages per second."""
    got = 0
    t0, client0, broker0 = time.perf_counter(), time.process_time(), cpu_seconds(pid)
    async with open_consumer(None, group, {CONSUME_TOPIC: "*"}, broker_addrs=[addr], **_traced(kind)) as c:
        with trio.move_on_after(CONSUME_MAX_S):
            while got < messages:
                got += len(await c.receive())
        c.ack()
        elapsed = time.perf_counter() - t0
        client_cpu, broker_cpu = time.process_time() - client0, cpu_seconds(pid) - broker0
    per = 1e6 / max(1, got)
    return {
        "msgs_per_s": got / elapsed,
        "received": got,
        "client_cpu_us_per_msg": client_cpu * per,
        "broker_cpu_us_per_msg": broker_cpu * per,
        "trace_events": _counts(c),
    }


async def _fill(addr: str, n: int, body: bytes) -> None:
    async with open_producer(broker_addrs=[addr]) as p:
        for start in range(0, n, FILL_BATCH_MESSAGES):
            await p.send_batch(CONSUME_TOPIC, [body] * min(FILL_BATCH_MESSAGES, n - start))


async def _all(broker: BrokerProcess, args: argparse.Namespace, report: Callable[[str], None]) -> dict[str, Any]:
    addr, pid = broker.addr, broker.proc.pid
    body = os.urandom(args.size_bytes)
    async with open_admin(broker_addrs=[addr]) as admin:
        await admin.create_topic(TOPIC, args.queues, on=[addr])
        await admin.create_topic(CONSUME_TOPIC, args.queues, on=[addr])
    await _fill(addr, args.consume_messages, body)
    samples: list[dict[str, Any]] = []
    for r in range(args.runs):
        for kind in KINDS if r % 2 == 0 else KINDS[::-1]:
            s = await produce_rate(addr, kind, body, args.senders, args.seconds, pid)
            samples.append({"run": r, "case": "produce", "kind": kind, **s})
            report(_line(r, args.runs, "produce", kind, s))
        for kind in KINDS if r % 2 == 0 else KINDS[::-1]:
            s = await consume_rate(addr, kind, f"trace-bench-{kind}-{r}", args.consume_messages, pid)
            samples.append({"run": r, "case": "consume", "kind": kind, **s})
            report(_line(r, args.runs, "consume", kind, s))
    async with open_admin(broker_addrs=[addr]) as admin:
        info = await admin.broker_info(addr)
        trace_records = sum(q["max_offset"] - q["min_offset"] for q in await admin.describe_topic("%TRACE%"))
    return {"summary": summary(samples), "samples": samples, "trace_records": trace_records, "broker": info}


def _line(r: int, runs: int, case: str, kind: str, s: dict[str, Any]) -> str:
    events = s["trace_events"]
    extra = (
        f", trace events written {events.get('written', 0):,}, dropped {events.get('dropped', 0):,}" if events else ""
    )
    return (
        f"run {r + 1}/{runs}: {case} {kind}: {s['msgs_per_s']:,.0f} msgs/s, CPU per message: client "
        f"{s['client_cpu_us_per_msg']:.1f} us, broker {s['broker_cpu_us_per_msg']:.1f} us{extra}"
    )


def run_all(args: argparse.Namespace, report: Callable[[str], None]) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="clmq-bench-trace-"))
    old = os.environ.get("CLMQ_TRACE_ENABLED")
    os.environ["CLMQ_TRACE_ENABLED"] = "true"  # the broker process's setting (its environment)
    try:
        broker = _broker(root, args.settle_seconds)
        if old is None:
            del os.environ["CLMQ_TRACE_ENABLED"]
        else:
            os.environ["CLMQ_TRACE_ENABLED"] = old
        try:
            figures = trio.run(_all, broker, args, report)
        finally:
            broker.stop()
    finally:
        subprocess.run(["rm", "-rf", str(root)], check=False)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"}
    result: dict[str, Any] = {
        "settings": settings,
        "machine": {"cpus": os.cpu_count(), "load_after": os.getloadavg()},
        **figures,
    }
    result["aims"] = aims(result)
    return result


def cmd_bench_trace(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .report import save
    from .results import draw

    console = Console(soft_wrap=True)
    result = run_all(args, lambda line: console.print(line, highlight=False))
    save(result, markdown(result), args.json, args.markdown, console)  # args.json: --json, else in --out-dir
    if args.plot is not None:
        draw(plot, result, args.plot, console)
    return 0

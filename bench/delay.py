"""``clmq bench delay``: what scheduled (delayed) messages cost, issue 20.

Each part starts a fresh ``clmq broker`` process (``e2e.BrokerProcess``, async flush,
its own data directory); the clients run in this process through the public client.

- Scheduling throughput: ``--senders`` tasks calling ``send_batch`` of ``--batch``
  bodies of ``--size-bytes``, plain and with ``delay_ms=--schedule-delay-ms`` (far enough
  ahead that nothing is delivered meanwhile), for ``--seconds`` each, alternated for
  ``--runs`` runs on one broker (their order swapped every other run); medians, and the
  scheduled / plain ratio.
- Delivery precision and memory, once per ``--pending`` count on a fresh broker: the
  count is scheduled (``deliver_at`` per batch) evenly over ``--spread-seconds``,
  starting after a lead long enough for the scheduling to end first (estimated from
  the measured scheduled rate); the broker's VmRSS (``/proc/<pid>/status``) and
  BROKER_INFO's ``timer_memory_bytes`` before and after give the bytes per pending
  message; then a consumer group reads the real topic, and the lateness of every
  message due in the ``--measure-seconds`` window (receive time - ``DELIVER_AT_MS``),
  while almost all of the count is still pending, gives p50 and p99.
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

from clmq.client import open_admin, open_producer

from .commands import _ints
from .delay_load import (
    Bulk,
    Window,
    broker_info,
    measure_window,
    memory_figures,
    proc_memory,
    schedule,
    send_rate,
    wait_enqueued,
    wall_ms,
    warm_up,
)
from .delay_report import aims, markdown, plot, throughput_summary
from .e2e import BrokerProcess
from .replication_load import percentile

TOPIC = "delayed"
WARM_TOPIC = "warm"
WARMUP_S = 0.5  # of each kind of send before the measured runs
LEAD_RATE_SHARE = 0.5  # the lead assumes scheduling at half the rate measured (a margin for a noisy machine)
WINDOW_AFTER_ENQUEUED_MS = 1000  # the window starts at least this long after the timer counted the bulk


def add_command(bench_sub: Any) -> None:
    """Add ``clmq bench delay`` to the parser."""
    p = bench_sub.add_parser(
        "delay", help="scheduled messages: send rate, delivery lateness, memory per pending message"
    )
    a = p.add_argument
    a("--size-bytes", type=int, default=100, help="message body size (default 100)")
    a("--batch", type=int, default=200, help="messages per send_batch (default 200)")
    a("--senders", type=int, default=4, help="send_batch calls in flight (default 4)")
    a("--queues", type=int, default=8, help="queues of the real topic (default 8)")
    a("--seconds", type=float, default=3.0, help="throughput: seconds per measured send run (default 3)")
    a("--runs", type=int, default=5, help="throughput: runs of plain and scheduled, alternated; medians (default 5)")
    a(
        "--schedule-delay-ms",
        type=int,
        default=600_000,
        help="throughput: delay_ms of the scheduled sends (default 10 min)",
    )
    a(
        "--pending",
        type=_ints,
        default=[10_000, 1_000_000],
        help="precision and memory: messages pending, one case per count, comma-separated (default 10000,1000000; "
        "the aims are judged at the largest)",
    )
    a(
        "--spread-seconds",
        type=float,
        default=300.0,
        help="the pending messages come due evenly over this (default 300)",
    )
    a("--measure-seconds", type=float, default=20.0, help="the lateness window, from the first due (default 20)")
    a(
        "--lead-seconds",
        type=float,
        default=3.0,
        help="the first due: this long after scheduling starts, plus the time scheduling should take (default 3)",
    )
    a("--settle-seconds", type=float, default=2.0, help="os.sync(), then idle this long before each broker (default 2)")
    a("--json", type=Path, default=None, help="every figure as JSON")
    a("--markdown", type=Path, default=None, help="also write the tables and the aims as Markdown here")
    a("--plot", type=Path, default=None, help="draw the figures here (matplotlib)")
    p.set_defaults(func=cmd_bench_delay)


def _broker(root: Path, settle_s: float) -> BrokerProcess:
    os.sync()  # the previous broker's dirty pages must not share this one's disk
    time.sleep(settle_s)
    return BrokerProcess(root, "async")


async def _create(addr: str, queues: int) -> None:
    async with open_admin(broker_addrs=[addr]) as admin:
        await admin.create_topic(TOPIC, queues, on=[addr])
        await admin.create_topic(WARM_TOPIC, 1, on=[addr])


async def _throughput(
    broker: BrokerProcess, args: argparse.Namespace, report: Callable[[str], None]
) -> list[dict[str, Any]]:
    addr, pid = broker.addr, broker.proc.pid
    await _create(addr, args.queues)
    bodies = [os.urandom(args.size_bytes)] * args.batch
    delay = {"plain": None, "scheduled": args.schedule_delay_ms}
    samples = []
    async with open_producer(broker_addrs=[addr]) as p:
        for kind in delay:  # connections, routes, the %TIMER% topic's creation
            await send_rate(p, TOPIC, bodies, args.senders, WARMUP_S, delay[kind], pid)
        for r in range(args.runs):
            for kind in ("plain", "scheduled") if r % 2 == 0 else ("scheduled", "plain"):
                s = await send_rate(p, TOPIC, bodies, args.senders, args.seconds, delay[kind], pid)
                samples.append({"run": r, "kind": kind, **s})
                report(
                    f"run {r + 1}/{args.runs}: {kind}: {s['msgs_per_s']:,.0f} msgs/s, CPU per message: client "
                    f"{s['client_cpu_us_per_msg']:.1f} us, broker {s['broker_cpu_us_per_msg']:.1f} us"
                    + (f", {s['failed']:,} failed" if s["failed"] else "")
                )
    return samples


def throughput(args: argparse.Namespace, root: Path, report: Callable[[str], None]) -> dict[str, Any]:
    broker = _broker(root, args.settle_seconds)
    try:
        samples = trio.run(_throughput, broker, args, report)
    finally:
        broker.stop()
    return throughput_summary(samples)


async def _precision(broker: BrokerProcess, args: argparse.Namespace, pending: int, rate: float) -> dict[str, Any]:
    addr, body = broker.addr, os.urandom(args.size_bytes)
    await _create(addr, args.queues)
    async with open_producer(broker_addrs=[addr]) as p:
        await warm_up(p, WARM_TOPIC, [body] * args.batch)
        info0, mem0 = await broker_info(addr), proc_memory(broker.proc.pid)
        lead_s = args.lead_seconds + pending / max(1.0, rate * LEAD_RATE_SHARE)
        bulk = Bulk(pending, args.batch, wall_ms() + lead_s * 1000, args.spread_seconds * 1000)
        sched = await schedule(p, TOPIC, bulk, body, args.senders)
    info1 = await wait_enqueued(addr, pending)
    mem1 = proc_memory(broker.proc.pid)
    start = max(wall_ms() + WINDOW_AFTER_ENQUEUED_MS, bulk.start_ms)
    end = start + args.measure_seconds * 1000
    window = Window(start, end, bulk.expected(start, end))
    await measure_window(addr, TOPIC, window)
    lat = window.lateness_ms
    return {
        "pending": pending,
        "lead_s": lead_s,
        **sched,
        "pending_at_window": int(window.info_at_start.get("timer_pending", -1)),
        "window_from_first_due_s": (start - bulk.start_ms) / 1000,
        "expected": window.expected,
        "samples": len(lat),
        "missing": window.expected - len(lat),
        "read_before_window": window.before,
        "p50_ms": percentile(lat, 50),
        "p90_ms": percentile(lat, 90),
        "p99_ms": percentile(lat, 99),
        "max_ms": max(lat, default=float("nan")),
        "min_ms": min(lat, default=float("nan")),
        "memory": memory_figures(mem0, mem1, info1, info0),
        "delivered_at_end": int((await broker_info(addr))["timer_delivered"]),
    }


def precision(
    args: argparse.Namespace, root: Path, pending: int, rate: float, report: Callable[[str], None]
) -> dict[str, Any]:
    """One precision and memory case on a fresh broker: its figures."""
    broker = _broker(root, args.settle_seconds)
    try:
        row: dict[str, Any] = trio.run(_precision, broker, args, pending, rate)
    finally:
        broker.stop()
    m = row["memory"]
    report(
        f"{pending:,} pending: scheduled in {row['schedule_s']:.1f} s ({row['schedule_msgs_per_s']:,.0f} msgs/s); "
        f"lateness of {row['samples']:,} of {row['expected']:,} due in the window "
        f"({row['pending_at_window']:,} pending "
        f"then): p50 {row['p50_ms']:.0f} ms, p99 {row['p99_ms']:.0f} ms, max {row['max_ms']:.0f} ms; memory per "
        f"pending: VmRSS {m['rss_bytes_per_pending']:.1f} B, RssAnon {m['rss_anon_bytes_per_pending']:.1f} B, "
        f"timer_memory_bytes {m['timer_memory_bytes_per_pending']:.1f} B"
    )
    return row


def run_all(args: argparse.Namespace, report: Callable[[str], None]) -> dict[str, Any]:
    """Throughput first (its scheduled rate sets the precision cases' lead), then one
    precision case per pending count."""
    root = Path(tempfile.mkdtemp(prefix="clmq-bench-delay-"))
    try:
        t = throughput(args, root, report)
        rows = [precision(args, root, n, t["scheduled_msgs_per_s"], report) for n in args.pending]
    finally:
        subprocess.run(["rm", "-rf", str(root)], check=False)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"}
    result: dict[str, Any] = {
        "settings": settings,
        "machine": {"cpus": os.cpu_count(), "load_after": os.getloadavg()},
        "throughput": t,
        "precision": rows,
    }
    result["aims"] = aims(result)
    return result


def cmd_bench_delay(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .report import save
    from .results import draw

    console = Console(soft_wrap=True)
    result = run_all(args, lambda line: console.print(line, highlight=False))
    save(result, markdown(result), args.json, args.markdown, console)
    if args.plot is not None:
        draw(plot, result, args.plot, console)
    return 0

"""``clmq bench latency``: open-loop latency under load, issue 34.

Each case starts fresh processes (``replication_cluster.Group``): a name server and a
broker (``broker``, ``e2e``) or a leader with two followers, ``ack_mode = "sync"`` and
``min_insync_replicas = 3`` (``replicated``), with the case's ``flush_mode``. The load
runs in processes of its own (``latency_load``), never in the broker's nor in this one:
``--producers`` producer processes share the case's rate (producer ``k`` of ``P`` sends
messages ``k, k+P, ...``), message ``i`` due at ``t0 + i / rate``, sent through the
public client's ``submit`` once due whatever the answers (open loop), and timed from
its *intended* send time to its acknowledgement: a late generator or a stalled broker
counts (no coordinated omission). The ``e2e`` case adds a long-polling consumer group
member in a process of its own, timing each message from its intended send time to
the ``receive()`` that returned it. Histograms are HdrHistograms (µs, 3 digits) merged
across processes; the first ``--warmup-seconds`` are left out of them (not out of the
per-second timeline). Figures in ``latency_report``.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import trio

from clmq.client import open_admin
from clmq.common import ClmqError

from .latency_floor import measure_floor
from .latency_procs import LoadProcess
from .latency_report import KINDS, aims, combine, markdown, plot, timeline_path
from .replication_cluster import Group
from .replication_load import prepare

TOPIC = "latency"
GROUP = "latency-bench"
GO_LEAD_NS = 300_000_000  # t0 is this far after "go" is sent, so that every process has it first
READY_MAX_S = 60.0  # load processes are ready (connected, probe answered) within this
RESULT_MARGIN_S = 60.0  # a load process reports within the run's length plus the answer wait plus this
DEFAULT_PER_PRODUCER_MSGS_PER_S = 12_500  # --producers 0: one producer process per this much of the rate


def _list(kind: Callable[[str], Any], allowed: tuple[str, ...] = ()) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        try:
            values = [kind(x.strip().replace("_", "")) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}") from None
        bad = [v for v in values if (allowed and v not in allowed) or (not allowed and v <= 0)]
        if not values or bad:
            choices = f"choose among {', '.join(allowed)}" if allowed else "expected values > 0"
            raise argparse.ArgumentTypeError(f"{text!r}: {choices}")
        return values

    return parse


def add_command(bench_sub: Any) -> None:
    """Add ``clmq bench latency`` to the parser."""
    p = bench_sub.add_parser("latency", help="open-loop latency under load: p50/p99/p99.9/max, over time")
    a = p.add_argument
    a("--rates", type=_list(int), default=[1_000, 10_000, 50_000], help="msgs/s (default 1000,10000,50000)")
    a("--flush", type=_list(str, ("async", "sync")), default=["async", "sync"], help="flush modes (default both)")
    a(
        "--cases",
        type=_list(str, KINDS),
        default=list(KINDS),
        help="broker: one broker; replicated: a leader and 2 followers, sync acks, min_insync_replicas 3; e2e: one "
        "broker and a long-polling consumer, send to deliver (default all three)",
    )
    a("--e2e-rates", type=_list(int), default=[10_000], help="the e2e case's rates (default 10000)")
    a("--seconds", type=float, default=15.0, help="measured seconds per case (default 15)")
    a("--warmup-seconds", type=float, default=3.0, help="load before the measured window (default 3)")
    a("--message-bytes", type=int, default=1024, help="message body size, at least 16 (default 1024)")
    a("--queues", type=int, default=8, help="queues of the topic; sends go round robin (default 8)")
    a(
        "--producers",
        type=int,
        default=0,
        help=f"producer processes per case (default 0: one per {DEFAULT_PER_PRODUCER_MSGS_PER_S:,} msgs/s of the rate)",
    )
    a("--ack-max-seconds", type=float, default=30.0, help="wait this long for the last answers (default 30)")
    a(
        "--behind-max-seconds",
        type=float,
        default=5.0,
        help="a producer process still this far behind at the schedule's end stops sending; the rest is counted "
        "as not sent, the case incomplete (default 5: a saturated generator cannot stretch the run)",
    )
    a("--settle-seconds", type=float, default=1.0, help="os.sync(), then idle this long before a case (default 1)")
    a(
        "--floor-seconds",
        type=float,
        default=3.0,
        help="before each sync-flush case, measure the disk's floor (back-to-back group commits at its rate, no "
        "broker) this long (default 3; 0: not measured)",
    )
    a("--json", type=Path, default=None, help="every figure as JSON")
    a("--markdown", type=Path, default=None, help="also write the table and the aims as Markdown here")
    a("--plot", type=Path, default=None, help="summary plot here; the latency-over-time plot beside it (-timeline)")
    p.set_defaults(func=cmd_bench_latency)


def cases(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every case of the run, rate by rate, the flush modes alternated within a kind."""
    out = []
    for rate in sorted(set(args.rates) | (set(args.e2e_rates) if "e2e" in args.cases else set())):
        for kind in args.cases:
            if rate not in (args.e2e_rates if kind == "e2e" else args.rates):
                continue
            for flush in args.flush:
                producers = args.producers or max(1, math.ceil(rate / DEFAULT_PER_PRODUCER_MSGS_PER_S))
                out.append({"kind": kind, "flush": flush, "rate": rate, "producers": producers})
    return out


def _settings(case: dict[str, Any]) -> dict[str, Any]:
    settings: dict[str, Any] = {"broker_name": "bench", "flush_mode": case["flush"], "register_interval_ms": 500}
    if case["kind"] == "replicated":
        settings.update(ack_mode="sync", min_insync_replicas=3)
    return settings


def _spec(args: argparse.Namespace, case: dict[str, Any], addr: str, **fields: Any) -> dict[str, Any]:
    return {
        "addr": addr,
        "topic": TOPIC,
        "rate": case["rate"],
        "producers": case["producers"],
        "warmup_s": args.warmup_seconds,
        "seconds": args.seconds,
        "message_bytes": args.message_bytes,
        "ack_max_s": args.ack_max_seconds,
        "behind_max_s": args.behind_max_seconds,
        **fields,
    }


async def _stalls(addr: str) -> dict[str, Any]:
    """The broker's stall figures from BROKER_INFO (its fields named ``*stall*``: the
    loop stall detector's count, longest, per task kind, the most recent), if it has any."""
    try:
        async with open_admin(broker_addrs=[addr]) as admin:
            info = await admin.broker_info(addr)
    except (ClmqError, trio.TooSlowError) as e:  # too busy to answer: the figures go on without them
        return {"error": repr(e)}
    return {k: v for k, v in info.items() if "stall" in k.lower()}


def _during(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The stall fields after the load, with the stalls counted while it ran (from ``go``
    to the last result) beside the totals since the broker started."""
    if "loop_stalls" not in after:
        return after
    kinds = before.get("loop_stalls_by_task") or {}
    during = {k: n - kinds.get(k, 0) for k, n in (after.get("loop_stalls_by_task") or {}).items()}
    return {
        **after,
        "loop_stalls_during_load": after["loop_stalls"] - before.get("loop_stalls", 0),
        # mostly off CPU: the OS preempted the loop thread (a busy machine), not the broker's own work
        "loop_stalls_off_cpu_during_load": after.get("loop_stalls_off_cpu", 0) - before.get("loop_stalls_off_cpu", 0),
        "loop_stalls_by_task_during_load": {k: n for k, n in during.items() if n},
    }


async def _drive(args: argparse.Namespace, case: dict[str, Any], group: Group) -> dict[str, Any]:
    """Start the load processes, run the schedule, collect every process's results."""
    assert group.leader is not None
    addr = group.leader.addr
    await prepare(group, TOPIC, args.queues, len(group.followers))
    procs: list[LoadProcess] = []
    try:
        if case["kind"] == "e2e":
            spec = _spec(args, case, addr, role="consumer", name="consumer", group=GROUP)
            spec["deliver_max_s"] = args.warmup_seconds + args.seconds + args.behind_max_seconds + READY_MAX_S
            spec["deliver_max_s"] += args.ack_max_seconds
            procs.append(await LoadProcess.start(spec))
        for k in range(case["producers"]):
            procs.append(await LoadProcess.start(_spec(args, case, addr, role="producer", name=f"p{k}", index=k)))
        for proc in procs:
            await proc.expect("ready")
        return await _run(args, group, procs)
    finally:
        for proc in procs:
            proc.close()


async def _run(args: argparse.Namespace, group: Group, procs: list[LoadProcess]) -> dict[str, Any]:
    assert group.leader is not None
    stalls0 = await _stalls(group.leader.addr)
    cpu0 = {s.name: s.cpu_seconds() for s in group.services()}
    t0 = time.monotonic_ns() + GO_LEAD_NS
    for proc in procs:
        await proc.send(f"go {t0}")
    max_s = GO_LEAD_NS / 1e9 + args.warmup_seconds + args.seconds + args.behind_max_seconds
    max_s += args.ack_max_seconds + RESULT_MARGIN_S
    producers = [p for p in procs if p.name != "consumer"]
    docs = [await p.result(max_s) for p in producers]
    consumer = None
    if len(procs) > len(producers):
        await procs[0].send(f"expect {sum(d['acked'] for d in docs)}")
        consumer = await _consumer_result(procs[0], args.ack_max_seconds)
    cpu = {s.name: s.cpu_seconds() - cpu0[s.name] for s in group.services()}
    return {
        "producers": docs,
        "consumer": consumer,
        "t0_ns": t0,
        "service_cpu_s": cpu,
        "stalls": _during(stalls0, await _stalls(group.leader.addr)),
    }


async def _consumer_result(consumer: LoadProcess, wait_s: float) -> dict[str, Any]:
    """The consumer's results once it has every message, or what it has after ``wait_s``."""
    with trio.move_on_after(wait_s):
        return await consumer.result(wait_s + 1)
    await consumer.send("stop")
    return await consumer.result(READY_MAX_S)


def run_case(args: argparse.Namespace, root: Path, case: dict[str, Any]) -> dict[str, Any]:
    """One case on fresh processes."""
    os.sync()
    time.sleep(args.settle_seconds)
    group = Group(Path(tempfile.mkdtemp(prefix="case-", dir=root)), _settings(case))
    try:
        group.start(2 if case["kind"] == "replicated" else 0)
        raw = trio.run(_drive, args, case, group)
    finally:
        problems = group.stop()
    return combine(case, raw, args, problems)


def _one_line(error: BaseException) -> str:
    """The error in one line (a service's traceback: its first and last lines)."""
    lines = [ln.strip() for ln in f"{type(error).__name__}: {error}".splitlines() if ln.strip()]
    return lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"


def run_all(args: argparse.Namespace, report: Callable[[str], None]) -> dict[str, Any]:
    """Every case, one after the other; the results document."""
    results, failed, floors = [], [], []
    with tempfile.TemporaryDirectory(prefix="clmq-bench-latency-") as root:
        for case in cases(args):
            floor = _floor(args, Path(root), case, report)
            try:
                r = run_case(args, Path(root), case)
            except Exception as e:  # one case that could not run (e.g. a broker too busy to answer) spoils only itself
                failed.append({**case, "error": _one_line(e), "error_detail": f"{type(e).__name__}: {e}"})
                report(f"{case['kind']} {case['flush']} {case['rate']:,}/s: FAILED: {failed[-1]['error_detail']}")
                continue
            if floor is not None:
                r["disk_floor"] = floor
                floors.append({"kind": case["kind"], **floor})
            results.append(r)
            report(_line(r))
    settings = {k: v for k, v in vars(args).items() if k not in ("func", "json", "markdown", "plot", "out_dir")}
    return {
        "bench": "latency",
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in settings.items()},
        "cpus": os.cpu_count(),
        "cases": results,
        "failed_cases": failed,
        "disk_floor": floors,
        "aims": aims(results),
    }


def _floor(
    args: argparse.Namespace, root: Path, case: dict[str, Any], report: Callable[[str], None]
) -> dict[str, Any] | None:
    """The disk's floor (``latency_floor``) right before a sync-flush case, at its rate:
    the disk's slow spells come and go, so each case gets its own."""
    if args.floor_seconds <= 0 or case["flush"] != "sync":
        return None
    f = measure_floor(root, args.floor_seconds, case["rate"], args.message_bytes)
    w = f["floor"]
    report(
        f"the disk's floor before {case['kind']} sync {case['rate']:,}/s (no broker): p50 {w['p50_ms']} "
        f"p99 {w['p99_ms']} p99.9 {w['p99_9_ms']} max {w['max_ms']} ms ({f['fdatasyncs']:,} fdatasyncs)"
    )
    return f


def _line(r: dict[str, Any]) -> str:
    ack, e2e = r["ack"], r.get("e2e") or {}
    text = (
        f"{r['kind']:<10} {r['flush']:<5} {r['rate']:>6,}/s x{r['producers']}: achieved {r['achieved_msgs_per_s']:,.0f}"
        f"/s, ack p50 {ack['p50_ms']} p99 {ack['p99_ms']} p99.9 {ack['p99_9_ms']} max {ack['max_ms']} ms,"
        f" acked {r['acked']:,}/{r['scheduled']:,}"
    )
    if e2e:
        text += f"; e2e p99 {e2e['p99_ms']} max {e2e['max_ms']} ms, delivered {r['delivered']:,}"
    return text


def cmd_bench_latency(args: argparse.Namespace) -> int:
    """``clmq bench latency``."""
    from rich.console import Console

    from .report import save
    from .results import draw

    if args.message_bytes < 16:
        print("clmq bench latency: --message-bytes must be at least 16 (the header of each message)")
        return 2
    console = Console(soft_wrap=True)
    result = run_all(args, lambda line: console.print(line, highlight=False))
    save(result, markdown(result), args.json, args.markdown, console)
    if args.plot is not None:
        draw(plot, result, args.plot, console)
        if timeline_path(args.plot).exists():
            console.print(f"latency over time: {timeline_path(args.plot)}")
    return 0 if all(r["complete"] for r in result["cases"]) and not result["failed_cases"] else 1

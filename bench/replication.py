"""``clmq bench replication``: what leader/follower replication costs, in one run.

Every case starts fresh processes: a name server, the leader and each follower are
separate ``python -m broker.cli`` processes with their own data directories and
settings files; the producing client runs in this process (``clmq.client.open_producer``,
``--senders`` batches in flight). Measured:

- produce throughput and ack latency for 0, 1 and 2 followers, ``ack_mode`` async and
  sync (sync with ``min_insync_replicas = 1 + followers``: every replica holds each
  write), over each ``--queues`` count (one topic);
- the single broker's own sync-flush throughput (``flush_mode = "sync"``, no followers),
  the reference of the aim "sync replication to 2 followers >= 0.5 x sync flush";
- the followers' lag (the leader's view, sampled every ``--lag-sample-ms``) while
  producing at half the single broker's async rate, with 2 followers;
- the catch-up of an empty follower joining a leader that holds ``--catchup-mb``.

The CPU seconds of every process in each measured window are reported: all of them
share this machine's cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import trio

from .replication_cluster import Group
from .replication_load import LoadSpec, Window, percentile, prepare, produce, wait_caught_up

TOPIC = "bench"


def _ints(text: str) -> list[int]:
    return [int(x.replace("_", "")) for x in text.split(",") if x]


def _cpus(text: str) -> set[int] | None:
    return set(_ints(text)) if text else None


def add_command(bench_sub: Any) -> None:
    """Add ``replication`` to the ``clmq bench`` parser."""
    p = bench_sub.add_parser("replication", help="leader/follower replication: throughput, ack latency, lag, catch-up")
    a = p.add_argument
    a("--queues", type=_ints, default=[1, 10_000], help="queue counts of the topic (default 1,10000)")
    a("--followers", type=_ints, default=[0, 1, 2], help="follower counts (default 0,1,2)")
    a("--ack-modes", default="async,sync", help="ack modes (default async,sync)")
    a("--size-bytes", type=int, default=1024, help="message size (default 1024)")
    a("--batch-messages", type=int, default=256, help="messages per send (default 256, as clmq bench e2e)")
    a("--senders", type=int, default=8, help="sends in flight at once (default 8)")
    a("--seconds", type=float, default=5.0, help="measured seconds per case (default 5)")
    a("--warmup-seconds", type=float, default=1.0, help="producing before each case's window (default 1)")
    a("--runs", type=int, default=3, help="runs of every case; medians are reported (default 3)")
    a("--lag-seconds", type=float, default=8.0, help="measured seconds of the lag case (0: skip it)")
    a(
        "--lag-warmup-seconds",
        type=float,
        default=3.0,
        help="producing before the lag window (default 3: a new follower's first second has one-off costs)",
    )
    a("--lag-followers", type=int, default=2, help="followers in the lag case (default 2)")
    a("--lag-sample-ms", type=int, default=10, help="how often the leader's view of lag is sampled (default 10)")
    a("--catchup-mb", type=float, default=512.0, help="log the empty follower copies, MB (0: skip; default 512)")
    a(
        "--catchup-bytes-per-s",
        type=int,
        default=256 << 20,
        help="the replica_catchup_bytes_per_s setting (0: unlimited; default 256 MiB/s, the broker's default)",
    )
    a("--settle-seconds", type=float, default=2.0, help="os.sync(), then idle this long before each case (default 2)")
    a("--client-cpus", type=_cpus, default=None, help="pin this process to these CPUs, e.g. 0 (default: not pinned)")
    a("--broker-cpus", type=_cpus, default=None, help="pin the services to these CPUs, e.g. 1 (default: not pinned)")
    a("--profile-dir", type=Path, default=None, help="run every broker under cProfile, profiles written here")
    a("--dir", type=Path, default=None, help="where the data directories go (default: a temporary directory)")
    a("--json", type=Path, default=None, help="where to write every figure as JSON")
    a("--markdown", type=Path, default=None, help="also write the tables as Markdown here")
    a("--plot", type=Path, default=None, help="draw the plot here (needs matplotlib)")
    p.set_defaults(func=cmd_bench_replication)


def _settings(args: argparse.Namespace, ack: str, followers: int, flush: str) -> dict[str, Any]:
    return {
        "broker_name": "bench",
        "ack_mode": ack,
        "min_insync_replicas": 1 + followers if ack == "sync" else 1,
        "flush_mode": flush,
        "register_interval_ms": 500,
        "replica_catchup_bytes_per_s": args.catchup_bytes_per_s,
    }


def _spec(args: argparse.Namespace, seconds: float, **kw: Any) -> LoadSpec:
    return LoadSpec(TOPIC, args.size_bytes, args.batch_messages, args.senders, args.warmup_seconds, seconds, **kw)


def _group(args: argparse.Namespace, root: Path, settings: dict[str, Any]) -> Group:
    os.sync()  # the previous case's dirty pages and deleted files must not share this case's disk
    time.sleep(args.settle_seconds)
    return Group(Path(tempfile.mkdtemp(prefix="case-", dir=root)), settings, args.broker_cpus, args.profile_dir)


def _run_group(group: Group, followers: int, queues: int, spec: LoadSpec, report: Callable[[str], None]) -> Window:
    try:
        group.start(followers)
        trio.run(prepare, group, TOPIC, queues, followers)
        return trio.run(produce, group, spec)
    finally:
        for problem in group.stop():
            report(f"[yellow]{problem}")


def _cpu_pct(w: Window) -> dict[str, float]:
    return {k: round(v / w.seconds * 100, 1) for k, v in w.cpu_s.items()} if w.seconds > 0 else {}


def _figures(w: Window, size: int) -> dict[str, Any]:
    rate = w.messages / w.seconds if w.seconds > 0 else 0.0
    return {
        "msgs_per_s": rate,
        "mb_per_s": rate * size / 1e6,
        "p50_ms": percentile(w.latencies_ms, 50),
        "p99_ms": percentile(w.latencies_ms, 99),
        "errors": w.errors,
        "queues_written": len(w.queues_written),
        "cpu_pct": _cpu_pct(w),
    }


def throughput_case(
    args: argparse.Namespace,
    root: Path,
    queues: int,
    followers: int,
    ack: str,
    flush: str,
    report: Callable[[str], None],
) -> dict[str, Any]:
    """One produce case as fast as the senders go: its figures."""
    group = _group(args, root, _settings(args, ack, followers, flush))
    w = _run_group(group, followers, queues, _spec(args, args.seconds), report)
    row = {
        "queues": queues,
        "followers": followers,
        "ack_mode": ack,
        "flush_mode": flush,
        **_figures(w, args.size_bytes),
    }
    report(
        f"{queues:,} queues, {followers} followers, ack {ack}, flush {flush}: {row['msgs_per_s']:,.0f} msgs/s, "
        f"p50 {row['p50_ms']:.1f} ms, p99 {row['p99_ms']:.1f} ms, errors {w.errors}, CPU % {row['cpu_pct']}"
    )
    return row


def lag_case(
    args: argparse.Namespace, root: Path, queues: int, rate: float, report: Callable[[str], None]
) -> dict[str, Any]:
    """``--lag-followers`` followers, async acks, producing at ``rate``: how far behind they are
    (the age of the oldest byte a follower lacks, in ms; the bytes it lacks)."""
    followers = args.lag_followers
    group = _group(args, root, _settings(args, "async", followers, "async"))
    spec = dataclasses.replace(
        _spec(args, args.lag_seconds, rate_msgs_per_s=rate, lag_sample_ms=args.lag_sample_ms),
        warmup_s=args.lag_warmup_seconds,
    )
    w = _run_group(group, followers, queues, spec, report)
    age = [a for rows in w.lag.values() for a, _, _ in rows]
    row = {
        "queues": queues,
        "followers": followers,
        "target_msgs_per_s": rate,
        **_figures(w, args.size_bytes),
        "lag_p50_ms": percentile(age, 50),
        "lag_p99_ms": percentile(age, 99),
        "lag_max_ms": max(age, default=math.nan),
        "leader_lag_ms_p99": percentile([float(m) for rows in w.lag.values() for _, m, _ in rows], 99),
        "lag_p50_bytes": percentile([float(b) for rows in w.lag.values() for _, _, b in rows], 50),
        "lag_p99_bytes": percentile([float(b) for rows in w.lag.values() for _, _, b in rows], 99),
        "per_follower": {
            str(f): {
                "p50_ms": percentile([a for a, _, _ in rows], 50),
                "p99_ms": percentile([a for a, _, _ in rows], 99),
                "samples": len(rows),
            }
            for f, rows in sorted(w.lag.items())
        },
    }
    report(
        f"lag, {queues:,} queues at {rate:,.0f} msgs/s (got {row['msgs_per_s']:,.0f}): p50 {row['lag_p50_ms']:.0f} ms, "
        f"p99 {row['lag_p99_ms']:.0f} ms, p99 {row['lag_p99_bytes'] / 1e3:,.0f} kB ({len(age)} samples)"
    )
    return row


def catchup_case(args: argparse.Namespace, root: Path, report: Callable[[str], None]) -> dict[str, Any]:
    """Fill a lone leader with ``--catchup-mb``, then time an empty follower's copy."""
    group = _group(args, root, _settings(args, "async", 0, "async"))
    spec = _spec(args, 3600.0, max_bytes=int(args.catchup_mb * 1e6))
    try:
        group.start(0)
        trio.run(prepare, group, TOPIC, 16, 0)
        trio.run(produce, group, spec)
        t0 = time.perf_counter()
        follower = group.add_follower(1)
        started_s = time.perf_counter() - t0
        t = trio.run(wait_caught_up, group, follower.addr, 5)
    finally:
        for problem in group.stop():
            report(f"[yellow]{problem}")
    copy_s = t["done_s"] - t["first_byte_s"]
    from_listening = t["target_bytes"] / 1e6 / t["done_s"]
    # Timed from the first byte seen (the follower's join and first fetch excluded), unless
    # the whole log arrived between two polls: then from the follower listening.
    row = {
        "log_mb": t["target_bytes"] / 1e6,
        "catchup_bytes_per_s_setting": args.catchup_bytes_per_s,
        "process_start_s": started_s,
        "first_byte_s": t["first_byte_s"],
        "done_s": t["done_s"],
        "copy_s": copy_s,
        "mb_per_s": (t["target_bytes"] - t["first_end_bytes"]) / 1e6 / copy_s if copy_s > 0 else from_listening,
        "mb_per_s_from_listening": from_listening,
    }
    report(
        f"catch-up of {row['log_mb']:,.0f} MB: {row['mb_per_s']:,.0f} MB/s from the first byte "
        f"({row['mb_per_s_from_listening']:,.0f} MB/s from the follower listening; process start {started_s:.2f} s)"
    )
    return row


def _median_rows(rows: list[dict[str, Any]], key: tuple[str, ...]) -> list[dict[str, Any]]:
    """Rows with equal ``key`` fields merged: the median of every number (and of every
    number one dict deep, e.g. CPU shares)."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in key), []).append(r)
    return [_median_of(g) for g in groups.values()]


def _median_of(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in rows[0].items():
        if isinstance(v, float) or (
            isinstance(v, int) and not isinstance(v, bool) and k != "queues" and k != "followers"
        ):
            out[k] = statistics.median(r[k] for r in rows)
        elif isinstance(v, dict) and all(isinstance(x, (int, float)) for x in v.values()):
            out[k] = {kk: statistics.median(r[k].get(kk, 0.0) for r in rows) for kk in v}
        else:
            out[k] = v
    return out


def _with_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    def rate(q: int, f: int, ack: str, flush: str) -> float:
        found = [
            r["msgs_per_s"]
            for r in rows
            if (r["queues"], r["followers"], r["ack_mode"], r["flush_mode"]) == (q, f, ack, flush)
        ]
        return float(found[0]) if found and found[0] else float("nan")

    for r in rows:
        r["vs_0_followers"] = r["msgs_per_s"] / rate(r["queues"], 0, r["ack_mode"], "async")
        r["vs_sync_flush"] = r["msgs_per_s"] / rate(r["queues"], 0, "async", "sync")
    return rows


def _aims(result: dict[str, Any]) -> list[dict[str, Any]]:
    aims = []
    for r in result["throughput"]:
        if r["followers"] == 2 and r["ack_mode"] == "sync" and r["flush_mode"] == "async":
            aims.append(
                {
                    "aim": f"sync replication to 2 followers >= 0.5 x single broker sync flush "
                    f"({r['queues']:,} queues)",
                    "value": r["vs_sync_flush"],
                    "target": 0.5,
                    "met": r["vs_sync_flush"] >= 0.5,
                }
            )
    for r in result["lag"]:
        aims.append(
            {
                "aim": f"follower lag p99 < 100 ms at half the single broker's async rate ({r['queues']:,} queues)",
                "value": r["lag_p99_ms"],
                "target": 100.0,
                "met": r["lag_p99_ms"] < 100.0,
            }
        )
    c = result["catchup"]
    if c:
        aims.append(
            {
                "aim": "catch-up of an empty follower >= 100 MB/s",
                "value": c["mb_per_s"],
                "target": 100.0,
                "met": c["mb_per_s"] >= 100.0,
            }
        )
    return aims


def _one_run(args: argparse.Namespace, root: Path, report: Callable[[str], None]) -> dict[str, Any]:
    rows = []
    for q in args.queues:
        rows.append(throughput_case(args, root, q, 0, "async", "sync", report))  # the single broker's sync flush
        rows += [
            throughput_case(args, root, q, f, ack, "async", report)
            for f in args.followers
            for ack in args.ack_modes.split(",")
        ]
    lag = []
    for q in args.queues if args.lag_seconds else []:
        base = [
            r["msgs_per_s"]
            for r in rows
            if (r["queues"], r["followers"], r["ack_mode"], r["flush_mode"]) == (q, 0, "async", "async")
        ]
        if base:
            lag.append(lag_case(args, root, q, base[0] / 2, report))
    catchup = catchup_case(args, root, report) if args.catchup_mb else None
    return {"throughput": rows, "lag": lag, "catchup": catchup}


def pressure() -> dict[str, float]:
    """The kernel's pressure stall figures (share of the last 60 s some task waited for
    CPU or I/O, in %): how busy the machine was besides this benchmark."""
    out = {}
    for kind in ("cpu", "io"):
        try:
            with open(f"/proc/pressure/{kind}") as f:
                out[f"{kind}_some_avg60_pct"] = float(f.readline().split()[2].split("=")[1])
        except (OSError, IndexError, ValueError):
            pass
    return out


def _summary(args: argparse.Namespace, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The settings, the machine, and the medians of the runs (every run kept too)."""
    settings = {
        k: (sorted(v) if isinstance(v, set) else str(v) if isinstance(v, Path) else v)
        for k, v in vars(args).items()
        if k != "func"
    }
    machine = {
        "cpus": os.cpu_count(),
        "client_cpus": sorted(os.sched_getaffinity(0)),
        "broker_cpus": sorted(args.broker_cpus) if args.broker_cpus else "not pinned",
        "load_after": os.getloadavg(),
        "pressure_after": pressure(),
    }
    key = ("queues", "followers", "ack_mode", "flush_mode")
    throughput = _with_ratios(_median_rows([x for run in runs for x in run["throughput"]], key))
    lag = _median_rows([x for run in runs for x in run["lag"]], ("queues",))
    catchup = _median_of([run["catchup"] for run in runs]) if args.catchup_mb else None
    return {
        "settings": settings,
        "machine": machine,
        "throughput": throughput,
        "lag": lag,
        "catchup": catchup,
        "runs": runs,
    }


def run_all(args: argparse.Namespace, report: Callable[[str], None]) -> dict[str, Any]:
    """Every case ``--runs`` times; medians, ratios and the aims."""
    if args.client_cpus:
        os.sched_setaffinity(0, args.client_cpus)
    root = Path(args.dir or tempfile.mkdtemp(prefix="clmq-bench-repl-"))
    root.mkdir(parents=True, exist_ok=True)
    load_before, pressure_before = os.getloadavg(), pressure()
    runs = []
    for r in range(args.runs):
        report(f"[bold]run {r + 1}/{args.runs}[/] (load {os.getloadavg()[0]:.1f}, pressure {pressure()})")
        runs.append(_one_run(args, root, report))
    result = _summary(args, runs)
    result["machine"].update(load_before=load_before, pressure_before=pressure_before)
    result["aims"] = _aims(result)
    if not args.dir and not any(root.iterdir()):
        root.rmdir()  # every case removes its own directories
    return result


def cmd_bench_replication(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .replication_report import print_tables, save

    console = Console(width=200)  # the tables are wide; a narrower terminal wraps them
    result = run_all(args, lambda line: console.print(line, highlight=False))
    print_tables(result, console)
    save(result, args, console)
    return 0

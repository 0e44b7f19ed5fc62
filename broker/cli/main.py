"""The ``clmq`` command line."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from ._services import add_commands
from .bench.e2e import add_command as add_bench_e2e
from .bench.spark import add_command as add_bench_spark
from .export import add_command as add_export

console = Console()


def _ints(text: str) -> list[int]:
    return [int(x.replace("_", "")) for x in text.split(",") if x]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="clmq", description="clmq: a message broker built on one CommitLog.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="store demo: append to a local store, restart it, read the queues back")
    demo.add_argument("--data-dir", type=Path, default=Path("clmq-data"), help="store directory (default ./clmq-data)")
    demo.add_argument("--messages", type=int, default=100_000, help="messages to append (default 100000)")
    demo.add_argument("--queues", type=int, default=16, help="queues in the demo topic (default 16)")
    demo.set_defaults(func=cmd_demo)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    store = bench_sub.add_parser("store", help="storage engine: append, dispatch, rebuild, read-back")
    store.add_argument("--dir", type=Path, default=None, help="where to create stores (default: a temporary dir)")
    store.add_argument("--sizes", type=_ints, default=[100, 1024], help="message sizes in bytes (default 100,1024)")
    store.add_argument("--queues", type=_ints, default=[1, 1000, 10000], help="queue counts (default 1,1000,10000)")
    store.add_argument("--flush", default="async,sync", help="flush modes (default async,sync)")
    store.add_argument("--seconds", type=float, default=3.0, help="seconds per append case (default 3)")
    store.add_argument("--runs", type=int, default=3, help="runs per case; medians are reported (default 3)")
    store.add_argument("--batch", type=int, default=256, help="messages per append batch (default 256)")
    store.add_argument("--rebuild-messages", type=int, default=1_000_000, help="store size for the rebuild case (0: skip)")
    store.add_argument("--scale-queues", type=int, default=100_000, help="queues in the scale case (0: skip)")
    store.add_argument("--json", type=Path, default=Path("bench-store.json"), help="where to write the JSON")
    store.add_argument("--markdown", type=Path, default=None, help="also write the tables as Markdown here")
    store.set_defaults(func=cmd_bench_store)

    cmp_ = bench_sub.add_parser("compare", help="commit-log mode against partition-per-file mode, same workload")
    cmp_.add_argument("--dir", type=Path, default=None, help="where to create stores (default: a temporary dir)")
    cmp_.add_argument("--sizes", type=_ints, default=[100, 1024], help="message sizes in bytes (default 100,1024)")
    cmp_.add_argument("--queues", type=_ints, default=[1, 16, 256, 1000, 10000], help="queue counts")
    cmp_.add_argument("--huge", action="store_true", help="also run 100,000 queues")
    cmp_.add_argument("--patterns", default="round-robin,skewed", help="traffic patterns (default both)")
    cmp_.add_argument("--flush", default="async,sync", help="flush modes (default async,sync)")
    cmp_.add_argument("--seconds", type=float, default=2.0, help="seconds per case (default 2)")
    cmp_.add_argument("--runs", type=int, default=3, help="runs; medians are reported (default 3)")
    cmp_.add_argument("--json", type=Path, default=Path("bench-compare.json"), help="where to write the JSON")
    cmp_.add_argument("--plot", type=Path, default=Path("bench-compare.png"), help="where to draw the plot")
    cmp_.add_argument("--markdown", type=Path, default=None, help="also write the table as Markdown here")
    cmp_.add_argument(
        "--via",
        choices=["store", "broker"],
        default="store",
        help="store: append in-process (default); broker: send the same batches to a broker process per case over loopback",
    )
    cmp_.set_defaults(func=cmd_bench_compare)

    add_bench_e2e(bench_sub)
    add_commands(sub)
    # The Spark commands define arguments only; pyspark loads when they run.
    add_bench_spark(bench_sub)
    add_export(sub)
    return parser


def cmd_demo(args: argparse.Namespace) -> int:
    from broker.store import Store, StoreConfig
    from commitlog import Message

    cfg = StoreConfig(args.data_dir)
    with Store.open(cfg).start() as store:
        store.create_topic("demo", args.queues)
        before = sum(store.max_offset("demo", q) for q in range(args.queues))
        t0 = time.perf_counter()
        for start in range(0, args.messages, 1000):
            batch = [Message("demo", (start + i) % args.queues, b"hello %d" % (start + i), tags="TagA")
                     for i in range(min(1000, args.messages - start))]  # fmt: skip
            res = store.put_batch(batch)
            if not res.ok:
                console.print(f"[red]append failed: {res.status.value}: {res.error}")
                return 1
        elapsed = time.perf_counter() - t0
        console.print(f"appended {args.messages:,} messages over {args.queues} queues in {elapsed:.2f} s "
                      f"({args.messages / elapsed:,.0f} msgs/s) to {args.data_dir}/")  # fmt: skip
    with Store.open(cfg) as store:  # reopen: everything is still there
        table = Table(title=f"topic 'demo' after a restart ({args.data_dir})")
        for col in ("queue", "min offset", "max offset", "last message"):
            table.add_column(col)
        total = 0
        for q in range(args.queues):
            hi = store.max_offset("demo", q)
            total += hi
            last = store.get("demo", q, hi - 1, 1).messages if hi else []
            table.add_row(str(q), str(store.min_offset("demo", q)), str(hi), last[0].body.decode() if last else "-")
        console.print(table)
        console.print(f"{total - before:,} new messages read back; {total:,} in the store")
    return 0


def cmd_bench_store(args: argparse.Namespace) -> int:
    from .bench.store import run_all, write_json

    root = args.dir or Path(tempfile.mkdtemp(prefix="clmq-bench-", dir="."))
    result = run_all(root, sizes=args.sizes, queue_counts=args.queues, flushes=args.flush.split(","),
                     seconds=args.seconds, runs=args.runs, batch=args.batch,
                     rebuild_messages=args.rebuild_messages, scale_queues=args.scale_queues,
                     report=lambda s: console.print(f"[dim]{s}"), save=lambda r: write_json(r, args.json))  # fmt: skip
    _print_store_tables(result)
    if args.markdown:
        from .bench.report import store_markdown

        args.markdown.write_text(store_markdown(result))
    console.print(f"JSON written to {args.json}")
    return 0


def cmd_bench_compare(args: argparse.Namespace) -> int:
    from .bench.compare import compare, plot

    root = args.dir or Path(tempfile.mkdtemp(prefix="clmq-bench-", dir="."))
    queues = args.queues + ([100_000] if args.huge else [])
    result = compare(root, sizes=args.sizes, queue_counts=queues, patterns=args.patterns.split(","),
                     flushes=args.flush.split(","), seconds=args.seconds, runs=args.runs,
                     report=lambda s: console.print(f"[dim]{s}"), via=args.via)  # fmt: skip
    args.json.write_text(json.dumps(result, indent=2))
    plot(result, args.plot)
    _print_compare_table(result)
    if args.markdown:
        from .bench.report import compare_markdown

        args.markdown.write_text(compare_markdown(result))
    console.print(f"JSON written to {args.json}, plot to {args.plot}")
    return 0


def _print_compare_table(result: dict[str, Any]) -> None:
    table = Table(title=f"commit-log (CL) vs partition-per-file (PPF), batches of {result['batch']}, "
                        f"median of {result['runs']} runs")  # fmt: skip
    for col in (
        "size B",
        "queues",
        "pattern",
        "flush",
        "CL msgs/s",
        "PPF msgs/s",
        "CL/PPF",
        "CL MB/s",
        "PPF MB/s",
        "CL p50/p99 ms",
        "PPF p50/p99 ms",
        "CL fds",
        "PPF fds",
        "CL MB rss",
        "PPF MB rss",
    ):
        table.add_column(col, justify="right")
    for r in result["rows"]:
        cl, pp = r["commitlog"], r["partition-per-file"]
        table.add_row(str(r["size"]), f"{r['queues']:,}", r["pattern"], r["flush"], f"{cl['msgs_per_s']:,.0f}",
                      f"{pp['msgs_per_s']:,.0f}", f"{r['ratio']:.2f}", f"{cl['mb_per_s']:.1f}", f"{pp['mb_per_s']:.1f}",
                      f"{cl['p50_ms']:.1f}/{cl['p99_ms']:.1f}", f"{pp['p50_ms']:.1f}/{pp['p99_ms']:.1f}",
                      f"{cl['max_open_fds']:.0f}", f"{pp['max_open_fds']:.0f}", f"{cl['peak_rss_mb']:.0f}",
                      f"{pp['peak_rss_mb']:.0f}")  # fmt: skip
    Console(width=max(console.width, 200)).print(table)


def _print_store_tables(result: dict[str, Any]) -> None:
    table = Table(title=f"append (batches of {result['batch']}, median of {result['runs']} runs)")
    for col in ("size B", "queues", "flush", "msgs/s", "MB/s", "max dispatch lag MB", "catch-up ms"):
        table.add_column(col, justify="right")
    for r in result["append"]:
        table.add_row(str(r["size"]), f"{r['queues']:,}", r["flush"], f"{r['msgs_per_s']:,.0f}", f"{r['mb_per_s']:.1f}",
                      f"{r['max_dispatch_lag_mb']:.1f}", f"{r['catch_up_ms']:.0f}")  # fmt: skip
    console.print(table)
    rb = result.get("rebuild")
    if rb:
        _print_rebuild(rb)
    for r in result["read"]:
        console.print(f"read-back over {r['queues']:,} queues (pulls of 32): {r['msgs_per_s']:,.0f} msgs/s")
    sc = result.get("scale")
    if sc:
        console.print(
            f"{sc['queues']:,} queues x 3 messages: append {sc['append_msgs_per_s']:,.0f} msgs/s, reopen "
            f"{sc['reopen_s']:.2f} s, read-back {sc['read_msgs_per_s']:,.0f} msgs/s, at most {sc['max_open_fds']} "
            f"descriptors open (max_open_files={sc['max_open_files_setting']})"
        )


def _print_rebuild(rb: dict[str, Any]) -> None:
    console.print(
        f"rebuild of {rb['queues']:,} consume queues for {rb['messages']:,} messages ({rb['log_mb']:.0f} MB of log): "
        f"{rb['rebuild_s']:.2f} s, of which re-dispatch {rb['redispatch_s']:.2f} s "
        f"({rb['redispatch_records_per_s']:,.0f} records/s) and writing new queue files {rb['queue_files_s']:.2f} s"
    )
    console.print(
        f"recovery without a checkpoint: {rb['recovery_s']:.2f} s, of which CRC validation of the whole log "
        f"{rb['log_validation_s']:.2f} s ({rb['log_validation_records_per_s']:,.0f} records/s)"
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # fmt: skip
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

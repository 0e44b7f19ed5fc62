"""``clmq bench store`` and ``clmq bench compare``: their arguments, and the tables
they print. The other benchmarks register themselves from their own modules (each one
imported only when it runs: ``BENCHMARKS`` in ``broker/cli/main.py``)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

console = Console(soft_wrap=True)


def _ints(text: str) -> list[int]:
    return [int(x.replace("_", "")) for x in text.split(",") if x]


def _body_range(text: str) -> tuple[int, int]:
    """``MIN,MAX`` body bytes, 0 <= MIN <= MAX."""
    parts = _ints(text)
    if len(parts) != 2 or not 0 <= parts[0] <= parts[1]:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX with 0 <= MIN <= MAX, got {text!r}")
    return parts[0], parts[1]


def plot_available() -> bool:
    """Whether the plotting extra (``clmq[bench]``: matplotlib) is installed."""
    return importlib.util.find_spec("matplotlib") is not None


def add_store(bench_sub: Any) -> None:
    """Add ``clmq bench store`` to the ``clmq bench`` parser."""
    store = bench_sub.add_parser("store", help="storage engine: append, dispatch, rebuild, read-back")
    store.add_argument("--dir", type=Path, default=None, help="where to create stores (default: a temporary dir)")
    store.add_argument("--sizes", type=_ints, default=[100, 1024], help="message sizes in bytes (default 100,1024)")
    store.add_argument("--queues", type=_ints, default=[1, 1000, 10000], help="queue counts (default 1,1000,10000)")
    store.add_argument("--flush", default="async,sync", help="flush modes (default async,sync)")
    store.add_argument("--seconds", type=float, default=3.0, help="seconds per append case (default 3)")
    store.add_argument("--runs", type=int, default=3, help="runs per case; medians are reported (default 3)")
    store.add_argument("--batch", type=int, default=256, help="messages per append batch (default 256)")
    store.add_argument(
        "--rebuild-messages", type=int, default=1_000_000, help="store size for the rebuild case (0: skip)"
    )
    store.add_argument("--scale-queues", type=int, default=100_000, help="queues in the scale case (0: skip)")
    store.add_argument(
        "--rebuild-varied-body-bytes",
        type=_body_range,
        default=None,
        metavar="MIN,MAX",
        help="also rebuild a store whose body sizes vary record to record, uniform in [MIN, MAX] bytes",
    )
    store.add_argument("--json", type=Path, default=None, help="where to write the JSON")
    store.add_argument("--markdown", type=Path, default=None, help="also write the tables as Markdown here")
    store.set_defaults(func=cmd_bench_store)


def add_compare(bench_sub: Any) -> None:
    """Add ``clmq bench compare`` to the ``clmq bench`` parser."""
    cmp_ = bench_sub.add_parser("compare", help="commit-log mode against partition-per-file mode, same workload")
    cmp_.add_argument("--dir", type=Path, default=None, help="where to create stores (default: a temporary dir)")
    cmp_.add_argument("--sizes", type=_ints, default=[100, 1024], help="message sizes in bytes (default 100,1024)")
    cmp_.add_argument("--queues", type=_ints, default=[1, 16, 256, 1000, 10000], help="queue counts")
    cmp_.add_argument("--huge", action="store_true", help="also run 100,000 queues")
    cmp_.add_argument("--patterns", default="round-robin,skewed", help="traffic patterns (default both)")
    cmp_.add_argument("--flush", default="async,sync", help="flush modes (default async,sync)")
    cmp_.add_argument("--seconds", type=float, default=2.0, help="seconds per case (default 2)")
    cmp_.add_argument("--runs", type=int, default=3, help="runs; medians are reported (default 3)")
    cmp_.add_argument("--json", type=Path, default=None, help="where to write the JSON")
    cmp_.add_argument("--plot", type=Path, default=None, help="where to draw the plot")
    cmp_.add_argument("--markdown", type=Path, default=None, help="also write the table as Markdown here")
    cmp_.add_argument(
        "--via",
        choices=["store", "broker"],
        default="store",
        help="store: append in-process (default); "
        "broker: send the same batches to a broker process per case over loopback",
    )
    cmp_.set_defaults(func=cmd_bench_compare)


def cmd_bench_store(args: argparse.Namespace) -> int:
    from .results import draw, plot_store
    from .store import run_all, write_json

    root = args.dir or Path(tempfile.mkdtemp(prefix="clmq-bench-data-", dir=args.out_dir))
    result = run_all(
        root,
        sizes=args.sizes,
        queue_counts=args.queues,
        flushes=args.flush.split(","),
        seconds=args.seconds,
        runs=args.runs,
        batch=args.batch,
        rebuild_messages=args.rebuild_messages,
        scale_queues=args.scale_queues,
        report=lambda s: console.print(f"[dim]{s}"),
        save=lambda r: write_json(r, args.json),
        rebuild_varied=args.rebuild_varied_body_bytes,
    )
    _print_store_tables(result)
    if args.markdown:
        from .report import store_markdown

        args.markdown.write_text(store_markdown(result))
    console.print(f"JSON written to {args.json}")
    draw(plot_store, result, args.plot, console)
    return 0


def cmd_bench_compare(args: argparse.Namespace) -> int:
    from .compare import compare, plot

    root = args.dir or Path(tempfile.mkdtemp(prefix="clmq-bench-data-", dir=args.out_dir))
    queues = args.queues + ([100_000] if args.huge else [])
    result = compare(
        root,
        sizes=args.sizes,
        queue_counts=queues,
        patterns=args.patterns.split(","),
        flushes=args.flush.split(","),
        seconds=args.seconds,
        runs=args.runs,
        report=lambda s: console.print(f"[dim]{s}"),
        via=args.via,
    )
    args.json.write_text(json.dumps(result, indent=2))
    plotted = plot_available()
    if plotted:
        plot(result, args.plot)
    else:
        console.print("[yellow]no plot: it needs matplotlib (pip install 'clmq[bench]')")
    _print_compare_table(result)
    if args.markdown:
        from .report import compare_markdown

        args.markdown.write_text(compare_markdown(result))
    console.print(f"JSON written to {args.json}" + (f", plot to {args.plot}" if plotted else ""))
    return 0


def _print_compare_table(result: dict[str, Any]) -> None:
    table = Table(
        title=f"commit-log (CL) vs partition-per-file (PPF), batches of {result['batch']}, "
        f"median of {result['runs']} runs"
    )
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
        table.add_row(
            str(r["size"]),
            f"{r['queues']:,}",
            r["pattern"],
            r["flush"],
            f"{cl['msgs_per_s']:,.0f}",
            f"{pp['msgs_per_s']:,.0f}",
            f"{r['ratio']:.2f}",
            f"{cl['mb_per_s']:.1f}",
            f"{pp['mb_per_s']:.1f}",
            f"{cl['p50_ms']:.1f}/{cl['p99_ms']:.1f}",
            f"{pp['p50_ms']:.1f}/{pp['p99_ms']:.1f}",
            f"{cl['max_open_fds']:.0f}",
            f"{pp['max_open_fds']:.0f}",
            f"{cl['peak_rss_mb']:.0f}",
            f"{pp['peak_rss_mb']:.0f}",
        )
    Console(width=max(console.width, 200)).print(table)


def _print_store_tables(result: dict[str, Any]) -> None:
    table = Table(title=f"append (batches of {result['batch']}, median of {result['runs']} runs)")
    for col in ("size B", "queues", "flush", "msgs/s", "MB/s", "max dispatch lag MB", "catch-up ms"):
        table.add_column(col, justify="right")
    for r in result["append"]:
        table.add_row(
            str(r["size"]),
            f"{r['queues']:,}",
            r["flush"],
            f"{r['msgs_per_s']:,.0f}",
            f"{r['mb_per_s']:.1f}",
            f"{r['max_dispatch_lag_mb']:.1f}",
            f"{r['catch_up_ms']:.0f}",
        )
    console.print(table)
    rb = result.get("rebuild")
    if rb:
        _print_rebuild(rb)
    if result.get("rebuild_varied"):
        _print_rebuild(result["rebuild_varied"])
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
        f"rebuild of {rb['queues']:,} consume queues for {rb['messages']:,} messages of "
        f"{rb.get('body_bytes', '100')} B bodies ({rb['log_mb']:.0f} MB of log): "
        f"{rb['rebuild_s']:.2f} s, of which re-dispatch {rb['redispatch_s']:.2f} s "
        f"({rb['redispatch_records_per_s']:,.0f} records/s) and writing new queue files {rb['queue_files_s']:.2f} s"
    )
    console.print(
        f"recovery without a checkpoint: {rb['recovery_s']:.2f} s, of which CRC validation of the whole log "
        f"{rb['log_validation_s']:.2f} s ({rb['log_validation_records_per_s']:,.0f} records/s)"
    )

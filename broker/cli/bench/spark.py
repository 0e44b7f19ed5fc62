"""``clmq bench spark``: the clmq data source against Spark reading Parquet of the same rows.

For each body size (``--sizes``, default 200, 600 and 4096 bytes) one run builds a store,
exports it to Parquet (that Parquet is the comparison's input), warms both readers up,
then runs every workload ``--runs`` times alternately:

- **full**: every row and column materialised (``write.format("noop")``);
- **narrow**: ``count``, ``max(queue_offset)`` and the sum of body lengths per queue
  (clmq through a user schema with ``body_length``; also through the default schema);
- **export**: ``clmq export`` to Parquet against Spark copying the Parquet (``--export-runs``).

Figures are medians; ratios compare medians of the same run; CPU per row is the JVM's and
its Python workers' CPU time (from /proc) divided by rows.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from spark_connector import spark_available

from .spark_cases import Meter, export_cases, run_alternating, scan_cases

SIZES = (200, 600, 4096)
MAX_BODY_BYTES_PER_SIZE = 1 << 30  # bodies per size at most: 4 KiB bodies get fewer rows


def add_command(bench_sub: Any) -> None:
    p = bench_sub.add_parser("spark", help="the clmq Spark source and export against Parquet (needs clmq[spark])")
    p.add_argument("--messages", type=int, default=1_000_000,
                   help="rows per size (default 1,000,000; fewer where bodies would pass 1 GiB)")  # fmt: skip
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="body sizes in bytes (default 200,600,4096)")
    p.add_argument("--queues", type=int, default=16, help="queues of the topic (default 16)")
    p.add_argument("--runs", type=int, default=5, help="runs of each scan; medians are reported (default 5)")
    p.add_argument("--export-runs", type=int, default=3, help="runs of each export (default 3; 0: none)")
    p.add_argument("--master", default="local[2]", help="Spark master (default local[2])")
    p.add_argument("--dir", type=Path, default=None, help="scratch directory (default: a temporary one)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--markdown", type=Path, default=None)
    p.set_defaults(func=cmd_bench_spark)


def build_store(path: Path, messages: int, size: int, queues: int) -> int:
    """A store of ``messages`` messages; returns the log's size in bytes."""
    from broker.store import Store, StoreConfig
    from commitlog import CommitLogConfig, Message

    with Store.open(StoreConfig(path, CommitLogConfig(segment_bytes=256 << 20))).start() as store:
        store.create_topic("bench", queues)
        for start in range(0, messages, 1024):
            # random bodies: Parquet gets no help from compression that real payloads would not give
            batch = [Message("bench", (start + i) % queues, os.urandom(size), tags="TagA", keys=f"k{start + i}")
                     for i in range(min(1024, messages - start))]  # fmt: skip
            res = store.put_batch(batch)
            if not res.ok:
                raise RuntimeError(f"append failed: {res.status.value}: {res.error}")
        return store.end_offset


def run_size(spark: Any, root: Path, messages: int, size: int, args: argparse.Namespace,
             report: Callable[[str], None]) -> dict[str, Any]:  # fmt: skip
    """Every workload at one body size."""
    from spark_connector import export

    store, parquet = root / f"store-{size}", root / f"parquet-{size}"
    t0 = time.perf_counter()
    log_bytes = build_store(store, messages, size, args.queues)
    report(f"{size} B: {messages:,} messages, {log_bytes / 1e6:,.0f} MB of log, built in {time.perf_counter() - t0:.1f} s")
    export(spark, {"path": str(store)}, "parquet", str(parquet), "overwrite")
    meter = Meter(spark)
    samples = run_alternating(meter, scan_cases(spark, store, parquet), args.runs, report, messages)
    if args.export_runs:
        samples |= run_alternating(meter, export_cases(spark, store, parquet, root), args.export_runs, report, messages)
    cases = {name: s.summary(messages) for name, s in samples.items()}
    out = {"body_bytes": size, "messages": messages, "log_bytes": log_bytes,
           "parquet_bytes": sum(p.stat().st_size for p in parquet.rglob("*.parquet")), "cases": cases,
           "samples_s": {name: s.wall_s for name, s in samples.items()}}  # fmt: skip

    def ratio(a: str, b: str) -> float | None:
        return cases[a]["rows_per_s"] / cases[b]["rows_per_s"] if a in cases and b in cases else None

    out["ratios"] = {"full": ratio("clmq_full", "parquet_full"), "narrow": ratio("clmq_narrow", "parquet_narrow"),
                     "narrow_default_schema": ratio("clmq_narrow_default_schema", "parquet_narrow"),
                     "export": ratio("clmq_export", "parquet_copy")}  # fmt: skip
    shutil.rmtree(store, ignore_errors=True)
    shutil.rmtree(parquet, ignore_errors=True)
    return out


def run(root: Path, args: argparse.Namespace, report: Callable[[str], None]) -> dict[str, Any]:
    from spark_connector import spark_session

    sizes = [int(s) for s in str(args.sizes).split(",") if s.strip()]
    spark = spark_session(args.master, "clmq bench spark")
    try:
        results = [run_size(spark, root, min(args.messages, max(1, MAX_BODY_BYTES_PER_SIZE // s)), s, args, report)
                   for s in sizes]  # fmt: skip
    finally:
        spark.stop()
    return {"master": args.master, "queues": args.queues, "runs": args.runs, "export_runs": args.export_runs,
            "cores": os.cpu_count(), "sizes": results}  # fmt: skip


def cmd_bench_spark(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .report import save
    from .results import draw, plot_spark
    from .spark_report import markdown

    if not spark_available():
        Console().print("[red]clmq bench spark needs Spark: pip install 'clmq[spark]' (and a Java runtime)")
        return 2
    console = Console()
    root = args.dir or Path(tempfile.mkdtemp(prefix="clmq-bench-spark-", dir=args.out_dir))
    try:
        result = run(root, args, lambda s: console.print(f"[dim]{s}"))
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    save(result, markdown(result), args.json, args.markdown, console)
    draw(plot_spark, result, args.plot, console)
    return 0

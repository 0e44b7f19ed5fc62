"""``clmq bench spark``: the data source's scan against Spark reading Parquet, same rows.

One run builds a store of ``--messages`` messages, exports it to Parquet once (timed:
that is ``clmq export``'s work), then scans both alternately ``--runs`` times with
``write.format("noop")`` (every row materialised, nothing written). Figures are medians;
the ratio compares the two scans of the same run set.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from spark_connector import spark_available


def add_command(bench_sub: Any) -> None:
    p = bench_sub.add_parser("spark", help="Spark scan of the clmq data source against Parquet (needs clmq[spark])")
    p.add_argument("--messages", type=int, default=1_000_000, help="messages in the store (default 1,000,000)")
    p.add_argument("--size", type=int, default=200, help="body bytes (default 200)")
    p.add_argument("--queues", type=int, default=16, help="queues of the topic (default 16)")
    p.add_argument("--runs", type=int, default=5, help="scans of each kind; medians are reported (default 5)")
    p.add_argument("--master", default="local[2]", help="Spark master (default local[2])")
    p.add_argument("--dir", type=Path, default=None, help="scratch directory (default: a temporary one)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--markdown", type=Path, default=None)
    p.set_defaults(func=cmd_bench_spark)


def build_store(path: Path, messages: int, size: int, queues: int) -> int:
    """A store of ``messages`` messages; returns the log's size in bytes."""
    import os

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


def _timed(action: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    action()
    return time.perf_counter() - t0


def run(root: Path, messages: int, size: int, queues: int, runs: int, master: str,
        report: Callable[[str], None]) -> dict[str, Any]:  # fmt: skip
    from spark_connector import export, spark_session

    store_dir, parquet_dir = root / "store", root / "parquet"
    t0 = time.perf_counter()
    log_bytes = build_store(store_dir, messages, size, queues)
    report(
        f"store: {messages:,} messages of {size} B, {log_bytes / 1e6:,.0f} MB of log, built in {time.perf_counter() - t0:.1f} s"
    )
    spark = spark_session(master, "clmq bench spark")
    try:
        clmq = spark.read.format("clmq").load(str(store_dir))
        clmq.limit(1).collect()  # start the Python workers once, outside the timings
        summary = export(spark, {"path": str(store_dir)}, "parquet", str(parquet_dir), "overwrite")
        report(f"export to Parquet: {summary.rows:,} rows in {summary.seconds:.2f} s ({summary.rows_per_s:,.0f} rows/s)")
        parquet = spark.read.parquet(str(parquet_dir))
        samples: dict[str, list[float]] = {"clmq": [], "parquet": [], "clmq_narrow": []}
        narrow = (
            spark.read.format("clmq").schema("topic string, queue_id int, queue_offset bigint, body binary").load(str(store_dir))
        )
        for r in range(runs):
            for name, df in (("clmq", clmq), ("parquet", parquet), ("clmq_narrow", narrow))[:: 1 if r % 2 == 0 else -1]:
                # A pyspark DataFrame: Any, as spark_connector types it (only it may import pyspark).
                def scan(df: Any = df) -> None:  # this iteration's frame, not the loop's latest
                    df.write.format("noop").mode("overwrite").save()

                seconds = _timed(scan)
                samples[name].append(seconds)
                report(f"run {r + 1}/{runs} {name:>11}: {messages / seconds:,.0f} rows/s")
    finally:
        spark.stop()
    parquet_bytes = sum(p.stat().st_size for p in parquet_dir.rglob("*.parquet"))
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {
        "messages": messages, "body_bytes": size, "queues": queues, "runs": runs, "master": master,
        "log_bytes": log_bytes, "parquet_bytes": parquet_bytes,
        "clmq_rows_per_s": messages / med["clmq"], "clmq_mb_per_s": log_bytes / med["clmq"] / 1e6,
        "clmq_narrow_rows_per_s": messages / med["clmq_narrow"],
        "parquet_rows_per_s": messages / med["parquet"], "parquet_mb_per_s": parquet_bytes / med["parquet"] / 1e6,
        "parquet_over_clmq": med["clmq"] / med["parquet"],
        "export_seconds": summary.seconds, "export_rows_per_s": summary.rows_per_s,
        "samples_s": samples,
    }  # fmt: skip


def markdown(r: dict[str, Any]) -> str:
    return "\n".join([
        f"| scan ({r['master']}, {r['messages']:,} rows of {r['body_bytes']} B) | rows/s | MB/s |",
        "|---|---:|---:|",
        f"| clmq data source, all 13 columns | {r['clmq_rows_per_s']:,.0f} | {r['clmq_mb_per_s']:,.0f} (log) |",
        f"| clmq data source, 4 columns (`.schema(...)`) | {r['clmq_narrow_rows_per_s']:,.0f} | |",
        f"| Parquet, same rows | {r['parquet_rows_per_s']:,.0f} | {r['parquet_mb_per_s']:,.0f} (files) |",
        "",
        f"Parquet / clmq scan time ratio: **{r['parquet_over_clmq']:.2f}x**. "
        f"Export to Parquet: {r['export_seconds']:.1f} s ({r['export_rows_per_s']:,.0f} rows/s).",
        "",
    ])  # fmt: skip


def cmd_bench_spark(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .report import save
    from .results import draw, plot_spark

    if not spark_available():
        Console().print("[red]clmq bench spark needs Spark: pip install 'clmq[spark]' (and a Java runtime)")
        return 2

    console = Console()
    root = args.dir or Path(tempfile.mkdtemp(prefix="clmq-bench-spark-", dir=args.out_dir))
    try:
        result = run(root, args.messages, args.size, args.queues, args.runs, args.master,
                     lambda s: console.print(f"[dim]{s}"))  # fmt: skip
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    save(result, markdown(result), args.json, args.markdown, console)
    draw(plot_spark, result, args.plot, console)
    return 0

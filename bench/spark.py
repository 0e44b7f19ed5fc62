"""``clmq bench spark``: the clmq data source against Spark reading Parquet of the same rows.

For each body size (``--sizes``, default 200, 600 and 4096 bytes) one run builds a store,
exports it to Parquet (that Parquet is the comparison's input), warms both readers up,
then runs every workload ``--runs`` times alternately:

- **full**: every row and column materialised (``write.format("noop")``);
- **narrow**: ``count``, ``max(queue_offset)`` and the sum of body lengths per queue
  (clmq through a user schema with ``body_length``; also through the default schema);
- **export**: ``clmq export`` to Parquet against Spark copying the Parquet (``--export-runs``);
- with ``--kafka-jars`` (Spark's Kafka source and its dependencies): a ``clmq broker``
  process with a Kafka listener serves the same store, and Spark's own Kafka source
  reads its topic as the full scan and the narrow aggregate (``kafka_*``), alternated with
  the rest. Those rows include the broker encoding every stored message as Kafka record
  batches; the broker's CPU is reported apart (``broker_cpu_us_per_row``).

Figures are medians; ratios compare medians of the same run; CPU per row is the JVM's and
its Python workers' CPU time (from /proc) divided by rows.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from clmq.spark_connector import spark_available

from .spark_cases import KAFKA_OPTIONS, Meter, export_cases, index_cases, kafka_cases, run_alternating, scan_cases

SIZES = (200, 600, 4096)
MAX_BODY_BYTES_PER_SIZE = 1 << 30  # bodies per size at most: 4 KiB bodies get fewer rows
SEGMENT_BYTES = 256 << 20  # the store's commit-log segments (the broker serving it is told the same)
KAFKA_JARS_ENV = "CLMQ_BENCH_SPARK_KAFKA_JARS"
TOPIC = "bench"


def add_command(bench_sub: Any) -> None:
    p = bench_sub.add_parser("spark", help="the clmq Spark source and export against Parquet (needs clmq[spark])")
    p.add_argument(
        "--messages",
        type=int,
        default=1_000_000,
        help="rows per size (default 1,000,000; fewer where bodies would pass 1 GiB)",
    )
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="body sizes in bytes (default 200,600,4096)")
    p.add_argument("--queues", type=int, default=16, help="queues of the topic (default 16)")
    p.add_argument("--runs", type=int, default=5, help="runs of each scan; medians are reported (default 5)")
    p.add_argument("--export-runs", type=int, default=3, help="runs of each export (default 3; 0: none)")
    p.add_argument(
        "--index-queues",
        type=int,
        default=1000,
        help="queues of the store read by index and by scan (default 1,000; 0: skip)",
    )
    p.add_argument("--master", default="local[2]", help="Spark master (default local[2])")
    p.add_argument("--driver-memory", default="4g", help="the Spark driver's heap (default 4g)")
    p.add_argument("--dir", type=Path, default=None, help="scratch directory (default: a temporary one)")
    p.add_argument("--json", type=Path, default=None, help="where to write the JSON (default: in --out-dir)")
    p.add_argument("--markdown", type=Path, default=None, help="also write the tables as Markdown here")
    p.add_argument(
        "--kafka-jars",
        metavar="CLASSPATH",
        default=os.environ.get(KAFKA_JARS_ENV) or None,
        help="colon-separated jars of Spark's Kafka source (spark-sql-kafka-0-10, spark-token-provider-kafka-0-10, "
        "kafka-clients, commons-pool2; scripts/_java_deps.sh writes such a classpath to "
        f"build/java-deps/spark-kafka-*.classpath): also read the store through a broker's Kafka listener "
        f"(default: ${KAFKA_JARS_ENV}, else not)",
    )
    p.set_defaults(func=cmd_bench_spark)


def kafka_jars(classpath: str | None) -> list[str]:
    """The jars of ``--kafka-jars`` (none without it); every one must exist."""
    jars = [j for j in (classpath or "").split(os.pathsep) if j.strip()]
    missing = [j for j in jars if not Path(j).is_file()]
    if missing:
        raise ValueError(f"--kafka-jars: no such file: {', '.join(missing)}")
    return jars


def build_store(path: Path, messages: int, size: int, queues: int) -> int:
    """A store of ``messages`` messages; returns the log's size in bytes."""
    from clmq.broker.store import Store, StoreConfig
    from clmq.commitlog import CommitLogConfig
    from clmq.common import Message

    with Store.open(StoreConfig(path, CommitLogConfig(segment_bytes=SEGMENT_BYTES))).start() as store:
        store.create_topic(TOPIC, queues)
        for start in range(0, messages, 1024):
            # random bodies: Parquet gets no help from compression that real payloads would not give
            batch = [
                Message(TOPIC, (start + i) % queues, os.urandom(size), tags="TagA", keys=f"k{start + i}")
                for i in range(min(1024, messages - start))
            ]
            res = store.put_batch(batch)
            if not res.ok:
                raise RuntimeError(f"append failed: {res.status.value}: {res.error}")
        return store.end_offset


def run_size(
    spark: Any, root: Path, messages: int, size: int, args: argparse.Namespace, report: Callable[[str], None]
) -> dict[str, Any]:
    """Every workload at one body size."""
    from clmq.spark_connector import export

    # a broker's data directory (dir/data): a broker can serve it through its Kafka listener
    store, parquet = root / f"store-{size}" / "data", root / f"parquet-{size}"
    t0 = time.perf_counter()
    log_bytes = build_store(store, messages, size, args.queues)
    report(
        f"{size} B: {messages:,} messages, {log_bytes / 1e6:,.0f} MB of log, built in {time.perf_counter() - t0:.1f} s"
    )
    export(spark, {"path": str(store)}, "parquet", str(parquet), "overwrite")
    from clmq.spark_connector import parse_profile

    profile = parse_profile(str(store))
    actions = scan_cases(spark, store, parquet, root / f"replay-{size}")
    broker = None
    if args.kafka_jars:
        from .kafka import KafkaBroker

        broker = KafkaBroker(root, "async", data=store, env={"CLMQ_SEGMENT_BYTES": str(SEGMENT_BYTES)})
    try:
        if broker is not None:
            report(f"{size} B: broker with a Kafka listener on {broker.bootstrap} serving the store")
            actions |= kafka_cases(spark, broker.bootstrap, TOPIC, messages)
        meter = Meter(spark, broker.cpu_s if broker is not None else None)
        samples = run_alternating(meter, actions, args.runs, report, messages)
    finally:
        if broker is not None:
            broker.stop(remove=False)
    meter = Meter(spark)
    if args.export_runs:
        samples |= run_alternating(meter, export_cases(spark, store, parquet, root), args.export_runs, report, messages)
    cases = {name: s.summary(messages) for name, s in samples.items()}
    out = {
        "body_bytes": size,
        "messages": messages,
        "log_bytes": log_bytes,
        "parquet_bytes": sum(p.stat().st_size for p in parquet.rglob("*.parquet")),
        "cases": cases,
        "samples_s": {name: s.wall_s for name, s in samples.items()},
        "parse_ns_per_row": profile,
    }

    def ratio(a: str, b: str) -> float | None:
        return cases[a]["rows_per_s"] / cases[b]["rows_per_s"] if a in cases and b in cases else None

    out["ratios"] = {
        "full": ratio("clmq_full", "parquet_full"),
        "replay": ratio("arrow_replay_full", "parquet_full"),
        "full_no_crc": ratio("clmq_full_no_crc", "parquet_full"),
        "narrow_no_crc": ratio("clmq_narrow_no_crc", "parquet_narrow"),
        "narrow": ratio("clmq_narrow", "parquet_narrow"),
        "narrow_default_schema": ratio("clmq_narrow_default_schema", "parquet_narrow"),
        "export": ratio("clmq_export", "parquet_copy"),
    }
    if broker is not None:
        out["ratios"] |= {
            "kafka_full": ratio("kafka_full", "parquet_full"),
            "kafka_full_over_clmq": ratio("kafka_full", "clmq_full"),
            "kafka_narrow": ratio("kafka_narrow", "parquet_narrow"),
            "kafka_narrow_over_clmq": ratio("kafka_narrow", "clmq_narrow_default_schema"),
        }
    for scratch in (store.parent, parquet, root / f"replay-{size}"):
        shutil.rmtree(scratch, ignore_errors=True)
    return out


def run_index(
    spark: Any, root: Path, messages: int, args: argparse.Namespace, report: Callable[[str], None]
) -> dict[str, Any]:
    """The index path over every queue of a many-queue store, against the scan."""
    store = root / "store-index"
    log_bytes = build_store(store, messages, 600, args.index_queues)
    report(f"index: {messages:,} messages of 600 B over {args.index_queues:,} queues, {log_bytes / 1e6:,.0f} MB of log")
    cases = index_cases(spark, store, args.index_queues)
    samples = run_alternating(Meter(spark), cases, args.runs, report, messages)
    few_rows = messages * 10 // args.index_queues
    out = {name: s.summary(few_rows if name.startswith("auto") else messages) for name, s in samples.items()}
    shutil.rmtree(store, ignore_errors=True)
    return {
        "queues": args.index_queues,
        "messages": messages,
        "body_bytes": 600,
        "cases": out,
        "index_over_scan": out["index_all_queues"]["rows_per_s"] / out["scan_all_queues"]["rows_per_s"],
    }


def measure(root: Path, args: argparse.Namespace, report: Callable[[str], None]) -> dict[str, Any]:
    sizes = [int(s) for s in str(args.sizes).split(",") if s.strip()]
    jars = kafka_jars(args.kafka_jars)
    spark = session(args.master, args.driver_memory, jars)
    try:
        results = [
            run_size(spark, root, min(args.messages, max(1, MAX_BODY_BYTES_PER_SIZE // s)), s, args, report)
            for s in sizes
        ]
        index = run_index(spark, root, args.messages, args, report) if args.index_queues else None
    finally:
        spark.stop()
    return {
        "master": args.master,
        "queues": args.queues,
        "runs": args.runs,
        "export_runs": args.export_runs,
        "cores": os.cpu_count(),
        "sizes": results,
        "index": index,
        "kafka": {"jars": [Path(j).name for j in jars], "options": KAFKA_OPTIONS} if jars else None,
    }


def session(master: str, driver_memory: str, jars: list[str]) -> Any:
    """The bench's SparkSession; with ``jars`` on its classpath (``spark.jars``, given to
    spark-submit as PySpark starts the JVM: spark_connector's builder sets no jars)."""
    from clmq.spark_connector import spark_session

    if not jars:
        return spark_session(master, "clmq bench spark", driver_memory=driver_memory)
    before = os.environ.get("PYSPARK_SUBMIT_ARGS")
    conf = shlex.quote("spark.jars=" + ",".join(jars))
    os.environ["PYSPARK_SUBMIT_ARGS"] = f"--conf {conf} {before or 'pyspark-shell'}"
    try:
        return spark_session(master, "clmq bench spark", driver_memory=driver_memory)
    finally:
        if before is None:
            del os.environ["PYSPARK_SUBMIT_ARGS"]
        else:
            os.environ["PYSPARK_SUBMIT_ARGS"] = before


def cmd_bench_spark(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .report import save
    from .results import draw, plot_spark
    from .spark_report import markdown

    if not spark_available():
        Console().print("[red]clmq bench spark needs Spark: pip install 'clmq[spark]' (and a Java runtime)")
        return 2
    console = Console(soft_wrap=True)
    try:
        kafka_jars(args.kafka_jars)
    except ValueError as e:
        Console().print(f"[red]{e}")
        return 2
    root = args.dir or Path(tempfile.mkdtemp(prefix="clmq-bench-spark-", dir=args.out_dir))
    try:
        result = measure(root, args, lambda s: console.print(f"[dim]{s}"))
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    save(result, markdown(result), args.json, args.markdown, console)
    draw(plot_spark, result, args.plot, console)
    return 0

"""The workloads of ``clmq bench spark``, each run the same way on the clmq source and on
Parquet of the same rows, and the CPU they cost (the JVM and its Python workers).

Pyspark objects are typed ``Any`` here: only spark_connector may import pyspark.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

# The narrow aggregate: what a query over offsets and body lengths needs. clmq gets the
# columns as a user schema (Spark passes no column pruning to Python sources), with
# body_length so that no body is copied; Parquet reads its two columns.
NARROW_SCHEMA = "queue_id int, queue_offset bigint, body_length int"


def process_tree_cpu_s(root_pid: int) -> float:
    """User + system CPU seconds of ``root_pid`` and every live descendant (the Spark JVM
    and the Python workers it forks), from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        parent[int(name)] = int(fields[1])
        cpu[int(name)] = (int(fields[11]) + int(fields[12])) / tick
    tree, frontier = {root_pid}, [root_pid]
    while frontier:
        frontier = [p for p, pp in parent.items() if pp in frontier and p not in tree]
        tree.update(frontier)
    return sum(cpu.get(p, 0.0) for p in tree)


@dataclass
class Samples:
    """Wall seconds and CPU seconds of each run of one case."""

    wall_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)
    broker_cpu_s: list[float] = field(default_factory=list)  # with a broker: its process's CPU

    def summary(self, rows: int) -> dict[str, float]:
        wall, cpu = statistics.median(self.wall_s), statistics.median(self.cpu_s)
        out = {"rows_per_s": rows / wall, "cpu_us_per_row": cpu * 1e6 / rows, "median_s": wall}
        if self.broker_cpu_s:
            out["broker_cpu_us_per_row"] = statistics.median(self.broker_cpu_s) * 1e6 / rows
        return out


class Meter:
    """Times actions and the CPU the Spark processes spent on them."""

    def __init__(self, spark: Any, broker_cpu_s: Callable[[], float] | None = None) -> None:
        self.jvm_pid = int(spark.sparkContext._gateway.proc.pid)  # local masters: the JVM is our child
        self.broker_cpu_s = broker_cpu_s  # a broker process's CPU seconds so far, when one serves a case

    def measure(self, action: Callable[[], Any], into: Samples) -> float:
        broker0 = self.broker_cpu_s() if self.broker_cpu_s else 0.0
        cpu0, t0 = process_tree_cpu_s(self.jvm_pid), time.perf_counter()
        action()
        wall = time.perf_counter() - t0
        into.wall_s.append(wall)
        into.cpu_s.append(process_tree_cpu_s(self.jvm_pid) - cpu0)
        if self.broker_cpu_s:
            into.broker_cpu_s.append(self.broker_cpu_s() - broker0)
        return wall


def scan_cases(spark: Any, store: Path, parquet: Path, replay: Path) -> dict[str, Callable[[], Any]]:
    """Every row and column materialised (``noop`` writes), and the narrow aggregate;
    ``replay`` holds the same rows as Arrow files (the transfer's ceiling, see _replay)."""
    from clmq.spark_connector import register_replay, write_replay_files

    write_replay_files(str(store), str(replay))
    register_replay(spark)
    clmq = spark.read.format("clmq").load(str(store))
    unchecked = spark.read.format("clmq").option("checkCrc", "false").load(str(store))
    arrow = spark.read.format("clmq_arrow_replay").load(str(replay))
    narrow = spark.read.format("clmq").schema(NARROW_SCHEMA).load(str(store))
    narrow_unchecked = spark.read.format("clmq").schema(NARROW_SCHEMA).option("checkCrc", "false").load(str(store))
    pq = spark.read.parquet(str(parquet))
    return {
        "clmq_full": noop(clmq),
        "clmq_full_no_crc": noop(unchecked),
        "arrow_replay_full": noop(arrow),
        "parquet_full": noop(pq),
        "clmq_narrow": aggregate(narrow, "body_length"),
        "clmq_narrow_no_crc": aggregate(narrow_unchecked, "body_length"),
        "clmq_narrow_default_schema": aggregate(clmq, "length(body)"),
        "parquet_narrow": aggregate(pq, "length(body)"),
    }


def noop(df: Any) -> Callable[[], Any]:
    """Every row and column of ``df`` materialised."""
    return lambda: df.write.format("noop").mode("overwrite").save()


def aggregate(df: Any, length: str) -> Callable[[], Any]:
    """The narrow aggregate: per queue the count, the last offset and the sum of ``length``."""
    # SQL expressions: only spark_connector imports pyspark (its functions included)
    narrow = df.selectExpr("queue_id", "queue_offset", f"{length} AS n")
    return lambda: narrow.groupBy("queue_id").agg({"*": "count", "queue_offset": "max", "n": "sum"}).collect()


# Spark's Kafka source, one batch read of what is there. Only fetch.max.wait.ms differs from
# its defaults: Spark keeps a consumer per partition between queries, and each kept consumer
# has a fetch in flight at the partition's end (the Java consumer sends the next fetch before
# it returns records); a broker holds that fetch until fetch.max.wait.ms (500 ms by default,
# Kafka's as clmq's), and the next query's first poll of that partition waits for it. A
# read in a fresh session never waits so; repeated runs would (0.5 s per partition and run).
KAFKA_OPTIONS = {"startingOffsets": "earliest", "endingOffsets": "latest", "kafka.fetch.max.wait.ms": "10"}


def kafka_frame(spark: Any, bootstrap: str, topic: str) -> Any:
    """Spark's Kafka source over ``topic`` (needs its jars on the session's classpath)."""
    return (
        spark.read.format("kafka")
        .option("kafka.bootstrap.servers", bootstrap)
        .option("subscribe", topic)
        .options(**KAFKA_OPTIONS)
        .load()
    )


def kafka_cases(spark: Any, bootstrap: str, topic: str, rows: int) -> dict[str, Callable[[], Any]]:
    """The full scan and the narrow aggregate of Spark's Kafka source through a broker's
    Kafka listener (the broker encodes stored messages as Kafka record batches); first
    checks that it reads ``rows`` rows."""
    df = kafka_frame(spark, bootstrap, topic)
    got = df.count()
    if got != rows:
        raise RuntimeError(f"Spark's Kafka source read {got:,} rows of {topic!r}, not {rows:,}")
    # the Kafka source reads whole records whatever the query uses: no narrower schema to give it
    narrow = df.selectExpr("partition AS queue_id", "offset AS queue_offset", "value")
    return {"kafka_full": noop(df), "kafka_narrow": aggregate(narrow, "length(value)")}


def index_cases(spark: Any, store: Path, queues: int) -> dict[str, Callable[[], Any]]:
    """Every queue of a many-queue store read through its consume queues (readPath=index)
    against the scan, and a few of its queues (auto: the index path)."""
    import json

    def read(**options: str) -> Callable[[], Any]:
        return noop(spark.read.format("clmq").options(**options).load(str(store)))

    few = json.dumps({"bench": list(range(0, queues, max(1, queues // 10)))[:10]})
    return {
        "scan_all_queues": read(readPath="scan"),
        "index_all_queues": read(readPath="index"),
        "auto_10_queues": read(queues=few),
    }


def export_cases(spark: Any, store: Path, parquet: Path, scratch: Path) -> dict[str, Callable[[], Any]]:
    """``clmq export`` to Parquet against Spark copying the same rows Parquet to Parquet."""
    from clmq.spark_connector import export

    def clmq_export() -> None:
        out = scratch / "export-out"
        export(spark, {"path": str(store)}, "parquet", str(out), "overwrite")
        shutil.rmtree(out, ignore_errors=True)

    def parquet_copy() -> None:
        out = scratch / "copy-out"
        spark.read.parquet(str(parquet)).write.mode("overwrite").parquet(str(out))
        shutil.rmtree(out, ignore_errors=True)

    return {"clmq_export": clmq_export, "parquet_copy": parquet_copy}


def run_alternating(
    meter: Meter, cases: dict[str, Callable[[], Any]], runs: int, report: Callable[[str], None], rows: int
) -> dict[str, Samples]:
    """Each case once to warm up (a cold JVM's first scan is ~3x slower), then ``runs``
    rounds, the order reversed every other round so neither side always goes first."""
    for action in cases.values():
        action()
    samples = {name: Samples() for name in cases}
    names = list(cases)
    for r in range(runs):
        for name in names if r % 2 == 0 else names[::-1]:
            wall = meter.measure(cases[name], samples[name])
            report(f"run {r + 1}/{runs} {name:>28}: {rows / wall:,.0f} rows/s")
    return samples

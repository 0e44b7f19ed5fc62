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

    def summary(self, rows: int) -> dict[str, float]:
        wall, cpu = statistics.median(self.wall_s), statistics.median(self.cpu_s)
        return {"rows_per_s": rows / wall, "cpu_us_per_row": cpu * 1e6 / rows, "median_s": wall}


class Meter:
    """Times actions and the CPU the Spark processes spent on them."""

    def __init__(self, spark: Any) -> None:
        self.jvm_pid = int(spark.sparkContext._gateway.proc.pid)  # local masters: the JVM is our child

    def measure(self, action: Callable[[], Any], into: Samples) -> float:
        cpu0, t0 = process_tree_cpu_s(self.jvm_pid), time.perf_counter()
        action()
        wall = time.perf_counter() - t0
        into.wall_s.append(wall)
        into.cpu_s.append(process_tree_cpu_s(self.jvm_pid) - cpu0)
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

    def noop(df: Any) -> Callable[[], Any]:
        return lambda: df.write.format("noop").mode("overwrite").save()

    def aggregate(df: Any, length: str) -> Callable[[], Any]:
        # SQL expressions: only spark_connector imports pyspark (its functions included)
        narrow = df.selectExpr("queue_id", "queue_offset", f"{length} AS n")
        return lambda: narrow.groupBy("queue_id").agg({"*": "count", "queue_offset": "max", "n": "sum"}).collect()

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


def index_cases(spark: Any, store: Path, queues: int) -> dict[str, Callable[[], Any]]:
    """Every queue of a many-queue store read through its consume queues (readPath=index)
    against the scan, and a few of its queues (auto: the index path)."""
    import json

    def noop(**options: str) -> Callable[[], Any]:
        df = spark.read.format("clmq").options(**options).load(str(store))
        return lambda: df.write.format("noop").mode("overwrite").save()

    few = json.dumps({"bench": list(range(0, queues, max(1, queues // 10)))[:10]})
    return {
        "scan_all_queues": noop(readPath="scan"),
        "index_all_queues": noop(readPath="index"),
        "auto_10_queues": noop(queues=few),
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

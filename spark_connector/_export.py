"""Bulk export of queues into Parquet, JSON or CSV with Spark (``clmq export`` runs it).

A local Spark (``local[*]``) by default, or any ``--master``. The command shows the
tasks' progress while the job runs and ends with a summary: rows, body bytes, time,
and any corrupt records skipped (``--on-corrupt skip``).
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

FORMATS = ("parquet", "json", "csv")


@dataclass
class ExportSummary:
    rows: int
    body_bytes: int
    seconds: float
    output: str
    format: str
    corrupt_skipped: int = 0

    @property
    def rows_per_s(self) -> float:
        return self.rows / max(self.seconds, 1e-9)


def spark_session(master: str, app: str = "clmq export") -> Any:
    """A SparkSession whose Python workers run this interpreter (so they find clmq)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master(master).appName(app).config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false").getOrCreate())  # fmt: skip
    spark.sparkContext.setLogLevel("ERROR")
    from ._source import register

    register(spark)
    return spark


def export(spark: Any, options: dict[str, str], fmt: str, output: str, mode: str = "errorifexists",
           body_as: str | None = None, progress: bool = False) -> ExportSummary:  # fmt: skip
    """Read with ``format("clmq")`` and ``options``, write ``fmt`` to ``output``."""
    from pyspark.sql import Observation
    from pyspark.sql import functions as F

    from ._scan import read_corrupt_log

    corrupt_dir = None
    if options.get("onCorrupt") == "skip":
        corrupt_dir = options["corruptRecordsLog"] = tempfile.mkdtemp(prefix="clmq-corrupt-")
    started = time.perf_counter()
    df = spark.read.format("clmq").options(**options).load()
    obs = Observation("clmq_export")
    df = df.observe(obs, F.count(F.lit(1)).alias("rows"), F.coalesce(F.sum(F.length("body")), F.lit(0)).alias("bytes"))
    body_as = body_as or ("base64" if fmt == "csv" else "raw")
    if body_as != "raw":
        df = df.withColumn("body", F.base64("body") if body_as == "base64" else F.col("body").cast("string"))
    if fmt == "csv":
        df = df.withColumn("properties", F.to_json("properties"))
    writer = df.write.mode(mode).format(fmt)
    if fmt == "csv":
        writer = writer.option("header", "true")
    if progress:
        with _Progress(spark):
            writer.save(output)
    else:
        writer.save(output)
    seconds = time.perf_counter() - started
    got = obs.get
    skipped = read_corrupt_log(corrupt_dir)["records"] if corrupt_dir else 0
    return ExportSummary(int(got["rows"]), int(got["bytes"]), seconds, output, fmt, skipped)


class _Progress:
    """Polls Spark's status tracker from a thread and draws the tasks' progress."""

    def __init__(self, spark: Any) -> None:
        self.tracker = spark.sparkContext.statusTracker()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _Progress:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(5)

    def _run(self) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        seen: dict[int, tuple[int, int]] = {}
        with Progress(TextColumn("exporting"), BarColumn(), MofNCompleteColumn(), TextColumn("tasks"),
                      TimeElapsedColumn(), transient=False) as bar:  # fmt: skip
            task = bar.add_task("export", total=None)
            while not self.stop.wait(0.25):
                for sid in self.tracker.getActiveStageIds():
                    info = self.tracker.getStageInfo(sid)
                    if info is not None:
                        seen[sid] = (info.numCompletedTasks, info.numTasks)
                done, total = sum(d for d, _ in seen.values()), sum(t for _, t in seen.values())
                bar.update(task, completed=done, total=total or None)
            bar.update(task, completed=sum(t for _, t in seen.values()))

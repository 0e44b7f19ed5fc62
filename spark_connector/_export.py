"""Bulk export of queues into Parquet, JSON or CSV with Spark (``clmq export`` runs it).

A local Spark (``local[*]``) by default, or any ``--master``. The export reads a
consistent snapshot: every selected queue's ``[start, end)`` is resolved when it starts
(:mod:`._manifest`) and written next to the data as ``_clmq_manifest.json``, which a later
export continues from (``since_manifest``). While the job runs, a progress bar shows the
rows written, rows/s and the time remaining; the summary gives rows, body bytes, time,
the manifest, and any corrupt records skipped (``--on-corrupt skip``).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

from ._manifest import Snapshot, remove_manifest, resolve_snapshot, write_manifest

FORMATS = ("parquet", "json", "csv")
PROGRESS_POLL_S = 0.25  # how often the progress bar asks Spark's status store
PROGRESS_JOIN_S = 5.0  # at most this long to stop the progress thread (a status call in flight)


@dataclass
class ExportSummary:
    rows: int
    body_bytes: int
    seconds: float
    output: str
    format: str
    corrupt_skipped: int = 0
    manifest: dict[str, Any] | None = None  # None: several brokers (no manifest, see _manifest)
    manifest_path: str | None = None

    @property
    def rows_per_s(self) -> float:
        return self.rows / max(self.seconds, 1e-9)


DRIVER_MEMORY = "2g"  # Spark's 1g default runs out writing Parquet of 4 KiB bodies


def spark_session(master: str, app: str = "clmq export", driver_memory: str = DRIVER_MEMORY) -> Any:
    """A SparkSession whose Python workers run this interpreter (so they find clmq).
    ``driver_memory`` is the JVM's heap (with a local master, where the tasks run too)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master(master)
        .appName(app)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.memory", driver_memory)
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    from ._source import register

    register(spark)
    return spark


def export(
    spark: Any,
    options: dict[str, str],
    fmt: str,
    output: str,
    mode: str = "errorifexists",
    body_as: str | None = None,
    progress: bool = False,
    *,
    since_manifest: str | None = None,
    snapshot: Snapshot | None = None,
    console: Any = None,
) -> ExportSummary:
    """Read with ``format("clmq")`` and ``options``, write ``fmt`` to ``output``.

    The snapshot (each queue's ``[start, end)``) is resolved first, or given as
    ``snapshot`` (from :func:`resolve_snapshot` with the same ``options``). With
    ``since_manifest`` (a manifest, or an output directory holding one) every queue
    starts where that export ended it. ``progress`` draws a bar on ``console`` (a rich
    Console; default: stdout's).
    """
    started = time.perf_counter()
    snap = snapshot if snapshot is not None else resolve_snapshot(options, since_manifest, spark)
    options = snap.reader_options(options)
    corrupt_dir, user_dir = None, _option(options, "corruptRecordsLog")
    if _option(options, "onCorrupt").strip().lower() == "skip":
        corrupt_dir = user_dir or tempfile.mkdtemp(prefix="clmq-corrupt-")
        options = {k: v for k, v in options.items() if k.lower() != "corruptrecordslog"}
        options["corruptRecordsLog"] = corrupt_dir
    if console is not None and snap.planned_rows:  # which read path, how many tasks, any option clamped
        from ._source import explain

        for line in explain(options).splitlines():
            console.print(f"[dim]plan: {line}", soft_wrap=True, highlight=False)
    df, obs = _frame(spark, snap, options, fmt, body_as)
    writer = df.write.mode(mode).format(fmt)
    if fmt == "csv":
        writer = writer.option("header", "true")
    if progress:
        with _Progress(spark, snap.planned_rows, console) as bar:
            writer.save(output)
            bar.finish(int(obs.get["rows"]))
    else:
        writer.save(output)
    got = obs.get
    rows = int(got["rows"])
    manifest, manifest_path = _record(spark, snap, rows, output, mode)
    seconds = time.perf_counter() - started
    from ._scan import read_corrupt_log

    skipped = read_corrupt_log(corrupt_dir)["records"] if corrupt_dir else 0
    if corrupt_dir and not user_dir:
        shutil.rmtree(corrupt_dir, ignore_errors=True)  # ours: the count is in the summary
    return ExportSummary(rows, int(got["bytes"]), seconds, output, fmt, skipped, manifest, manifest_path)


def _option(options: dict[str, str], name: str) -> str:
    """An option's value whatever the case of its key (Spark's options are case-insensitive)."""
    return next((str(v) for k, v in options.items() if k.lower() == name.lower()), "")


def _frame(spark: Any, snap: Snapshot, options: dict[str, str], fmt: str, body_as: str | None) -> tuple[Any, Any]:
    """The DataFrame to write (observed: rows and body bytes) and its Observation."""
    from pyspark.sql import Observation
    from pyspark.sql import functions as F

    if not snap.planned_rows:  # nothing at the start: no read (a pinned one without topics would read every topic)
        from ._arrow import SCHEMA_DDL

        df = spark.createDataFrame([], SCHEMA_DDL)
    else:
        df = spark.read.format("clmq").options(**options).load()
    obs = Observation("clmq_export")
    df = df.observe(obs, F.count(F.lit(1)).alias("rows"), F.coalesce(F.sum(F.length("body")), F.lit(0)).alias("bytes"))
    body_as = body_as or ("base64" if fmt == "csv" else "raw")
    if body_as == "base64":  # Spark's base64 breaks lines every 76 characters (MIME): one line per row instead
        df = df.withColumn("body", F.translate(F.base64("body"), "\r\n", ""))
    elif body_as == "text":
        df = df.withColumn("body", F.col("body").cast("string"))
    if fmt == "csv":
        df = df.withColumn("properties", F.to_json("properties"))
    return df, obs


def _record(spark: Any, snap: Snapshot, rows: int, output: str, mode: str) -> tuple[dict[str, Any] | None, str | None]:
    """Write the manifest once the data is committed (so a manifest means a whole export)."""
    if snap.pinned:
        doc = snap.manifest(rows)
        return doc, write_manifest(doc, output, spark)
    if mode == "append":  # data added without positions: a manifest left there would mislead the next export
        remove_manifest(output, spark)
    return None, None


# ------------------------------------------------------------------------------ progress
def rows_done(planned: int, tasks_done: int, tasks_total: int, rows_written: int | None) -> int:
    """Rows exported so far, for the progress bar: what the finished tasks wrote when
    Spark reports it (exact, moving as each task ends), else the planned rows times the
    share of tasks done. Never more than ``planned`` (the bar's end until the last update)."""
    if rows_written is not None:
        return max(0, min(rows_written, planned))
    if tasks_total <= 0:
        return 0
    return planned * min(tasks_done, tasks_total) // tasks_total


def rate_text(rows_per_s: float | None, rows: float, elapsed_s: float | None) -> str:
    """The rate column: rich's recent speed, else the average since the bar started (rows
    arrive in steps, as tasks end: one step gives rich no speed), else a dash."""
    if rows_per_s is None and rows > 0 and elapsed_s:
        rows_per_s = rows / elapsed_s
    return "- rows/s" if rows_per_s is None else f"{rows_per_s:,.0f} rows/s"


class _Progress:
    """A rich bar of rows (of ``planned``), rows/s and time remaining, fed by a thread that
    polls Spark's status store: the write stage's output records of finished tasks."""

    def __init__(self, spark: Any, planned: int, console: Any = None) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, ProgressColumn, TextColumn, TimeRemainingColumn
        from rich.text import Text

        class Rate(ProgressColumn):
            def render(self, task: Any) -> Text:
                speed = task.finished_speed or task.speed
                return Text(rate_text(speed, task.completed, task.elapsed), style="progress.data.speed")

        self.sc = spark.sparkContext
        self.planned = planned
        self.bar = Progress(
            TextColumn("exporting"),
            BarColumn(),
            TextColumn("{task.completed:,.0f}/{task.total:,.0f} rows"),
            Rate(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=console or Console(),
            transient=False,
        )
        self.task = self.bar.add_task("export", total=planned)
        self.stages: dict[int, tuple[int, int, int | None]] = {}  # stage -> (tasks done, tasks, rows written)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _Progress:
        self.bar.start()
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(PROGRESS_JOIN_S)
        self.bar.stop()

    def finish(self, rows: int) -> None:
        """The job is done: the bar ends at the exact count."""
        self.stop.set()
        self.thread.join(PROGRESS_JOIN_S)
        self.bar.update(self.task, completed=rows, total=rows)

    def _run(self) -> None:
        tracker, store = self.sc.statusTracker(), self._status_store()
        while not self.stop.wait(PROGRESS_POLL_S):
            for sid in tracker.getActiveStageIds():
                info = tracker.getStageInfo(sid)
                if info is not None:
                    self.stages[sid] = (info.numCompletedTasks, info.numTasks, _written(store, sid))
            done = sum(d for d, _t, _r in self.stages.values())
            total = sum(t for _d, t, _r in self.stages.values())
            written = [r for _d, _t, r in self.stages.values()]
            exact = sum(r for r in written if r is not None) if written and None not in written else None
            self.bar.update(self.task, completed=rows_done(self.planned, done, total, exact))

    def _status_store(self) -> Any:
        try:
            return self.sc._jsc.sc().statusStore()
        except Exception:  # not a classic JVM session: the tasks' share then estimates rows
            return None


def _written(store: Any, stage_id: int) -> int | None:
    """Records written by the stage's finished tasks (None: Spark does not say)."""
    if store is None:
        return None
    from py4j.protocol import Py4JError

    try:
        return int(store.lastStageAttempt(stage_id).outputRecords())
    except Py4JError:  # the stage is gone from the store already
        return None

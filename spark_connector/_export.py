"""``clmq export``: bulk-export queues into Parquet, JSON or CSV with Spark.

A local Spark (``local[*]``) by default, or any ``--master``. The command shows the
tasks' progress while the job runs and ends with a summary: rows, body bytes, time,
and any corrupt records skipped (``--on-corrupt skip``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
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


def add_command(sub: Any) -> None:
    p = sub.add_parser("export", help="export queues to Parquet, JSON or CSV with Spark",
                       description="Export the messages of a store (a data directory, or running brokers) with "
                                   "Spark. Needs the spark extra: pip install 'clmq[spark]'.")  # fmt: skip
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data-dir", help="a store's data directory (may belong to a running broker)")
    src.add_argument("--nameserver", help="name server address(es), host:port[,host:port]: read every broker")
    src.add_argument("--broker", help="broker address(es), host:port[,host:port]")
    p.add_argument("--topics", help="topics, comma separated (default: all)")
    p.add_argument("--topic-pattern", help="topics matching this regular expression")
    p.add_argument("--queues", help="queue ids '0,1' or JSON {\"topic\": [0, 1]} (default: all)")
    p.add_argument("--from-offsets", help="'earliest' (default) or JSON {\"topic\": {\"0\": 42}}")
    p.add_argument("--to-offsets", help="'latest' (default) or JSON; exclusive")
    p.add_argument("--from-time", help="start at messages stored at or after this time (ms since epoch or ISO 8601)")
    p.add_argument("--to-time", help="stop before messages stored at or after this time")
    p.add_argument("--format", choices=FORMATS, default="parquet", help="output format (default parquet)")
    p.add_argument("--output", required=True, help="output directory (a Spark path)")
    p.add_argument("--mode", choices=("errorifexists", "overwrite", "append"), default="errorifexists",
                   help="when the output exists (default: fail)")  # fmt: skip
    p.add_argument("--body-as", choices=("raw", "text", "base64"), default=None,
                   help="body column: raw bytes (default; base64 for csv), UTF-8 text, or base64")  # fmt: skip
    p.add_argument("--master", default="local[*]", help="Spark master (default local[*]: every core here)")
    p.add_argument("--max-split-bytes", type=int, default=None, help="bytes of log per Spark task at most (default 128 MiB; less when the cores need more tasks)")
    p.add_argument("--on-corrupt", choices=("fail", "skip"), default="fail",
                   help="a corrupt record fails the export (default) or is skipped and counted")  # fmt: skip
    p.add_argument("--no-progress", action="store_true", help="no progress display")
    p.set_defaults(func=cmd_export)


def _ms(text: str) -> str:
    if text.strip().isdigit():
        return text.strip()
    try:
        dt = datetime.fromisoformat(text.strip())
    except ValueError:
        raise SystemExit(f"clmq export: {text!r} is neither ms since the epoch nor an ISO 8601 time") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return str(int(dt.timestamp() * 1000))


def reader_options(args: argparse.Namespace) -> dict[str, str]:
    opts: dict[str, str] = {}
    pairs = [("path", args.data_dir), ("nameserver", args.nameserver), ("broker", args.broker),
             ("topics", args.topics), ("topicPattern", args.topic_pattern), ("queues", args.queues),
             ("startingOffsets", args.from_offsets), ("endingOffsets", args.to_offsets),
             ("onCorrupt", args.on_corrupt)]  # fmt: skip
    opts.update({k: str(v) for k, v in pairs if v})
    if args.from_time:
        opts["startingTimestamp"] = _ms(args.from_time)
    if args.to_time:
        opts["endingTimestamp"] = _ms(args.to_time)
    if args.max_split_bytes:
        opts["maxSplitBytes"] = str(args.max_split_bytes)
    return opts


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

    def __enter__(self) -> "_Progress":
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


def cmd_export(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console()
    try:
        import pyspark  # noqa: F401
    except ImportError:
        console.print("[red]clmq export needs Spark: pip install 'clmq[spark]' (and a Java runtime)")
        return 2
    spark = spark_session(args.master)
    try:
        summary = export(spark, reader_options(args), args.format, args.output, args.mode, args.body_as,
                         progress=not args.no_progress)  # fmt: skip
    except Exception as e:  # Spark wraps the reader's errors (raised in its workers): show the reader's words
        message = _root_message(e)
        console.print(f"[red]clmq export: {message}", highlight=False)
        return 2 if message.startswith(("OptionError", "LayoutError")) else 1
    finally:
        spark.stop()
    console.print(f"exported [bold]{summary.rows:,}[/] rows ({summary.body_bytes / 1e6:,.1f} MB of bodies) "
                  f"to {summary.output} as {summary.format} in {summary.seconds:.1f} s "
                  f"({summary.rows_per_s:,.0f} rows/s)")  # fmt: skip
    if summary.corrupt_skipped:
        console.print(f"[yellow]skipped {summary.corrupt_skipped} corrupt record(s) (see the Spark executors' log)")
    return 0


def _root_message(e: BaseException) -> str:
    """The most telling line of a (possibly Java-wrapped) error."""
    from ._layout import LayoutError
    from ._options import OptionError

    if isinstance(e, (OptionError, LayoutError)):
        return f"{type(e).__name__}: {e}"
    text = str(e)
    for marker in ("CorruptRecordError:", "LayoutError:", "OptionError:", "RemoteError:", "AnalysisException:"):
        if marker in text:
            return text[text.index(marker):].splitlines()[0]
    return text.splitlines()[0] if text else type(e).__name__

"""``clmq export``: the command line of the Spark connector's bulk export. Arguments
only until it runs: pyspark is imported then, so ``clmq --help`` stays fast."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable, TypeVar

from clmq.spark_connector import FORMATS, LayoutError, OptionError, spark_available

from ._common import deprecated_alias
from ._errors import EXIT_FAILED, EXIT_USAGE, CliError
from ._output import console, is_json, to_terminal, write_json
from ._timefmt import FORMS, parse_time_ms

T = TypeVar("T")


def add_command(sub: Any) -> None:
    p = sub.add_parser(
        "export",
        help="export queues to Parquet, JSON or CSV with Spark",
        description="Export the messages of a store (a data directory, or running brokers) with "
        "Spark. Needs the spark extra: pip install 'clmq[spark]'.",
    )
    _add_source_args(p)
    _add_output_args(p)
    p.set_defaults(func=cmd_export)


def _add_source_args(p: argparse.ArgumentParser) -> None:
    """What to read: a directory or running brokers, which topics and queues, from where to where."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data-dir", help="a store's data directory (may belong to a running broker)")
    src.add_argument(
        "--namesrv", dest="nameserver", help="name server address(es), host:port[,host:port]: read every broker"
    )
    deprecated_alias(src, "--nameserver", "--namesrv", "nameserver")
    src.add_argument("--broker", help="broker address(es), host:port[,host:port]")
    p.add_argument("--topics", help="topics, comma separated (default: all)")
    p.add_argument("--topic-pattern", help="topics matching this regular expression")
    p.add_argument("--queues", help="queue ids '0,1' or JSON {\"topic\": [0, 1]} (default: all)")
    p.add_argument("--from-offsets", help='\'earliest\' (default) or JSON {"topic": {"0": 42}}')
    p.add_argument("--to-offsets", help="'latest' (default) or JSON; exclusive")
    p.add_argument("--from-time", help=f"start at messages stored at or after this time: {FORMS}")
    p.add_argument("--to-time", help="stop before messages stored at or after this time")
    p.add_argument(
        "--since-manifest",
        metavar="PATH",
        help="continue an earlier export: start every queue where its manifest (_clmq_manifest.json, "
        "or the output directory holding it) ends it; new queues from their earliest offset",
    )


def _add_output_args(p: argparse.ArgumentParser) -> None:
    """Where and how to write, with what Spark, and what to print."""
    p.add_argument("--format", choices=FORMATS, default="parquet", help="output format (default parquet)")
    p.add_argument("--out-dir", dest="out_dir", help="output directory, a Spark path (required)")
    p.add_argument(
        "--mode",
        choices=("errorifexists", "overwrite", "append"),
        default="errorifexists",
        help="when the output exists (default: fail)",
    )
    p.add_argument(
        "--body-as",
        choices=("raw", "text", "base64"),
        default=None,
        help="body column: raw bytes (default; base64 for csv), UTF-8 text, or base64",
    )
    p.add_argument("--master", default="local[*]", help="Spark master (default local[*]: every core here)")
    p.add_argument(
        "--driver-memory",
        default="2g",
        help="the Spark driver's heap, where a local master runs its tasks (default 2g)",
    )
    p.add_argument(
        "--max-split-bytes",
        type=int,
        default=None,
        help="bytes of log per Spark task at most (default 128 MiB; less when the cores need more tasks)",
    )
    p.add_argument(
        "--on-corrupt",
        choices=("fail", "skip"),
        default="fail",
        help="a corrupt record fails the export (default) or is skipped and counted",
    )
    _add_print_args(p)


def _add_print_args(p: argparse.ArgumentParser) -> None:
    """What the command prints while it runs and when it is done."""
    p.add_argument("--no-progress", action="store_true", help="no progress display")
    p.add_argument(
        "-o",
        "--output",
        action=_OutputOrOldOutDir,
        metavar="{table,json}",
        default="table",
        help="table (default: a summary for people) or json (for scripts: stdout is only the summary as JSON)",
    )


class _OutputOrOldOutDir(argparse.Action):
    """``-o/--output`` is the output format in every verb; ``clmq export --output DIR``
    named the output directory before ``--out-dir`` did, and still does (deprecated;
    silently, as scripts parse this command's stderr): a value other than table or
    json is taken for the directory."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        if values in ("table", "json"):
            namespace.output = values
        else:
            namespace.out_dir = values


def _ms(text: str) -> str:
    return str(parse_time_ms(text))


def check_arguments(args: argparse.Namespace) -> None:
    """What can be checked before Spark starts (seconds, and an output directory it
    would leave half made on failure): the source exists, the output is free."""
    if args.data_dir is not None and not Path(args.data_dir).is_dir():
        raise CliError(f"--data-dir {args.data_dir}: no such directory (a broker's data directory, e.g. ./clmq-data)")
    if not args.out_dir:
        raise CliError("give the output directory: --out-dir DIR", EXIT_USAGE)
    output = Path(args.out_dir)
    if "://" not in args.out_dir and output.exists() and args.mode == "errorifexists":
        raise CliError(f"--out-dir {args.out_dir} exists: choose another, or --mode overwrite|append", EXIT_USAGE)
    if args.since_manifest is not None:
        given = [
            flag for flag, value in (("--from-offsets", args.from_offsets), ("--from-time", args.from_time)) if value
        ]
        if given:
            raise CliError(
                f"--since-manifest sets where every queue starts: leave out {' and '.join(given)}", EXIT_USAGE
            )
    for name in ("max_split_bytes",):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise CliError(f"--{name.replace('_', '-')} must be at least 1, got {value}", EXIT_USAGE)


def reader_options(args: argparse.Namespace) -> dict[str, str]:
    opts: dict[str, str] = {}
    pairs = [
        ("path", args.data_dir),
        ("nameserver", args.nameserver),
        ("broker", args.broker),
        ("topics", args.topics),
        ("topicPattern", args.topic_pattern),
        ("queues", args.queues),
        ("startingOffsets", args.from_offsets),
        ("endingOffsets", args.to_offsets),
        ("onCorrupt", args.on_corrupt),
    ]
    opts.update({k: str(v) for k, v in pairs if v})
    if args.from_time:
        opts["startingTimestamp"] = _ms(args.from_time)
    if args.to_time:
        opts["endingTimestamp"] = _ms(args.to_time)
    if args.max_split_bytes:
        opts["maxSplitBytes"] = str(args.max_split_bytes)
    return opts


def cmd_export(args: argparse.Namespace) -> int:
    check_arguments(args)
    options = reader_options(args)
    if not spark_available():
        raise CliError("clmq export needs Spark: pip install 'clmq[spark]' (and a Java runtime)", EXIT_USAGE)
    from clmq.spark_connector import export, spark_session

    snapshot = None
    if not _remote(args.since_manifest):  # resolved before Spark starts: a bad manifest fails in a moment
        snapshot = _failing_clearly(lambda: _resolve(options, args.since_manifest))
    spark = spark_session(args.master, driver_memory=args.driver_memory)
    try:
        summary = _failing_clearly(
            lambda: export(
                spark,
                options,
                args.format,
                args.out_dir,
                args.mode,
                args.body_as,
                progress=not args.no_progress and to_terminal() and not is_json(args),
                since_manifest=args.since_manifest,
                snapshot=snapshot,
                console=console,
            )
        )
    finally:
        spark.stop()
    if is_json(args):
        write_json(_summary_fields(summary))
        return 0
    console.print(
        f"exported [bold]{summary.rows:,}[/] rows ({summary.body_bytes / 1e6:,.1f} MB of bodies) "
        f"to {summary.output} as {summary.format} in {summary.seconds:.1f} s "
        f"({summary.rows_per_s:,.0f} rows/s); manifest {summary.manifest_path or _NO_MANIFEST}",
        soft_wrap=True,
    )
    if summary.corrupt_skipped:
        console.print(f"[yellow]skipped {summary.corrupt_skipped} corrupt record(s) (see the Spark executors' log)")
    return 0


_NO_MANIFEST = "none (several brokers: queue positions are per broker)"


def _summary_fields(summary: Any) -> dict[str, Any]:
    """An export's summary as JSON (``-o json``)."""
    names = ("rows", "body_bytes", "output", "format", "seconds", "rows_per_s", "manifest_path", "corrupt_skipped")
    return {name: getattr(summary, name, None) for name in names}


def _remote(path: str | None) -> bool:
    return path is not None and "://" in path


def _resolve(options: dict[str, str], since_manifest: str | None) -> Any:
    from clmq.spark_connector import resolve_snapshot  # imports no pyspark: planning is plain Python

    return resolve_snapshot(options, since_manifest)


def _failing_clearly(run: Callable[[], T]) -> T:
    """``run()``, its errors made one line: the reader's own words, usage errors exit 2."""
    try:
        return run()
    except Exception as e:  # Spark wraps the reader's errors (raised in its workers): show the reader's words
        message = _root_message(e)
        usage = isinstance(e, (OptionError, LayoutError)) or message.startswith(("OptionError", "LayoutError"))
        raise CliError(message, EXIT_USAGE if usage else EXIT_FAILED) from e


def _root_message(e: BaseException) -> str:
    """The most telling line of a (possibly Java-wrapped) error."""
    if isinstance(e, (OptionError, LayoutError)):
        return f"{type(e).__name__}: {e}"
    text = str(e)
    for marker in ("CorruptRecordError:", "LayoutError:", "OptionError:", "RemoteError:", "AnalysisException:"):
        if marker in text:
            return text[text.index(marker) :].splitlines()[0]
    return text.splitlines()[0] if text else type(e).__name__

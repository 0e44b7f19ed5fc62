"""The ``clmq`` command line: the parser, ``clmq demo`` (the store alone), and the
entry point. The verbs live beside it: services and clients in ``_services.py``,
``_client_verbs.py`` and ``consume_verbs.py``, ``export.py``, and the benchmarks in ``bench/``."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from clmq.bench.commands import add_store_and_compare
from clmq.bench.delay import add_command as add_bench_delay
from clmq.bench.e2e import add_command as add_bench_e2e
from clmq.bench.results import add_out_dir_args, resolve_result_paths
from clmq.bench.spark import add_command as add_bench_spark

from ._errors import report
from ._logging import add_logging_args, configure_logging
from ._progress import bench_progress
from ._services import add_commands
from .dashboard import add_command as add_dashboard
from .dlq_verbs import add_command as add_dlq
from .export import add_command as add_export
from .replication_verbs import add_replication_commands
from .store_tools import add_command as add_store_tools

console = Console()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="clmq", description="clmq: a message broker built on one CommitLog.")
    add_logging_args(parser)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="store demo: append to a local store, restart it, read the queues back")
    # Not ./clmq-data: that is `clmq dev`'s broker directory, which this demo must not write into.
    demo.add_argument(
        "--data-dir", type=Path, default=Path("clmq-demo-data"), help="store directory (default ./clmq-demo-data)"
    )
    demo.add_argument("--messages", type=int, default=100_000, help="messages to append (default 100000)")
    demo.add_argument("--queues", type=int, default=16, help="queues in the demo topic (default 16)")
    demo.set_defaults(func=cmd_demo)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    add_store_and_compare(bench_sub)
    add_bench_e2e(bench_sub)
    add_bench_delay(bench_sub)
    add_commands(sub)
    _add_dev_zookeeper_flag(sub.choices["dev"])
    add_replication_commands(sub)
    # The Spark commands define arguments only; pyspark loads when they run.
    add_bench_spark(bench_sub)
    add_out_dir_args(bench_sub.choices)
    add_export(sub)
    add_store_tools(sub)
    add_dashboard(sub)
    add_dlq(sub)
    return parser


def _add_dev_zookeeper_flag(dev: argparse.ArgumentParser) -> None:
    """``clmq dev --replicas N --zookeeper`` (run by ``dev_replicas.py``)."""
    dev.add_argument(
        "--zookeeper",
        action="store_true",
        help="with --replicas N > 1: also run a local ZooKeeper "
        "server (<data-dir>/zookeeper/, needs Java and Debian's libzookeeper-java) and let it elect the "
        "group's leader and replace it automatically when it dies",
    )


def cmd_demo(args: argparse.Namespace) -> int:
    from clmq.broker.store import Store, StoreConfig
    from clmq.common import Message

    cfg = StoreConfig(args.data_dir)
    with Store.open(cfg).start() as store:
        store.create_topic("demo", args.queues)
        before = sum(store.max_offset("demo", q) for q in range(args.queues))
        t0 = time.perf_counter()
        for start in range(0, args.messages, 1000):
            batch = [
                Message("demo", (start + i) % args.queues, b"hello %d" % (start + i), tags="TagA")
                for i in range(min(1000, args.messages - start))
            ]
            res = store.put_batch(batch)
            if not res.ok:
                console.print(f"[red]append failed: {res.status.value}: {res.error}")
                return 1
        elapsed = time.perf_counter() - t0
        console.print(
            f"appended {args.messages:,} messages over {args.queues} queues in {elapsed:.2f} s "
            f"({args.messages / elapsed:,.0f} msgs/s) to {args.data_dir}/"
        )
    with Store.open(cfg) as store:  # reopen: everything is still there
        table = Table(title=f"topic 'demo' after a restart ({args.data_dir})")
        for col in ("queue", "min offset", "max offset", "last message"):
            table.add_column(col)
        total = 0
        for q in range(args.queues):
            hi = store.max_offset("demo", q)
            total += hi
            last = store.get("demo", q, hi - 1, 1).messages if hi else []
            table.add_row(str(q), str(store.min_offset("demo", q)), str(hi), last[0].body.decode() if last else "-")
        console.print(table)
        console.print(f"{total - before:,} new messages read back; {total:,} in the store")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run one ``clmq`` command; every failure is one line on stderr and an exit code
    (``broker/cli/_errors.py``; ``-v`` adds the stack)."""
    verbose = "-v" in (argv if argv is not None else sys.argv[1:]) or "--verbose" in (argv or sys.argv[1:])
    try:
        args = build_parser().parse_args(argv)
        verbose = args.verbose
        configure_logging(args)
        if args.command == "bench":
            resolve_result_paths(args)
            with bench_progress(args.bench):
                return int(args.func(args) or 0)
        return int(args.func(args) or 0)
    except SystemExit:  # argparse's own usage errors (exit 2) and --help (exit 0)
        raise
    except BaseException as e:  # everything else, KeyboardInterrupt included: one line
        return report(e, verbose)


if __name__ == "__main__":
    sys.exit(main())

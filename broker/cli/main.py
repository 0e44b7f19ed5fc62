"""The ``clmq`` command line: the parser, ``clmq demo`` (the store alone), and the
entry point. The verbs live beside it: services and clients in ``_services.py``,
``_client_verbs.py`` and ``consume_verbs.py``, ``export.py``, and the benchmarks in ``bench/``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import clmq
from clmq.bench.commands import add_store_and_compare
from clmq.bench.delay import add_command as add_bench_delay
from clmq.bench.e2e import add_command as add_bench_e2e
from clmq.bench.pop import add_command as add_bench_pop
from clmq.bench.results import add_out_dir_args, resolve_result_paths
from clmq.bench.spark import add_command as add_bench_spark
from clmq.bench.trace import add_command as add_bench_trace
from clmq.bench.transactions import add_command as add_bench_transactions

from ._common import security_env
from ._errors import report
from ._logging import add_logging_args, configure_logging
from ._output import add_output_arg, console, is_json, json_only_stdout, print_table, write_json
from ._progress import bench_progress
from ._services import add_commands
from ._timefmt import accept_durations
from .dashboard import add_command as add_dashboard
from .dlq_verbs import add_command as add_dlq
from .export import add_command as add_export
from .replication_verbs import add_replication_commands
from .security_verbs import add_command as add_security
from .store_tools import add_command as add_store_tools
from .transaction_verbs import add_command as add_transaction


def build_parser() -> argparse.ArgumentParser:
    """The whole ``clmq`` command line (every verb, its flags and their help)."""
    parser = argparse.ArgumentParser(prog="clmq", description="clmq: a message broker built on one CommitLog.")
    parser.add_argument(
        "--version", action="version", version=f"clmq {clmq.__version__}", help="print clmq's version and exit"
    )
    add_logging_args(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", help="store demo: append to a local store, restart it, read the queues back")
    # Not ./clmq-data: that is `clmq dev`'s broker directory, which this demo must not write into.
    demo.add_argument(
        "--data-dir", type=Path, default=Path("clmq-demo-data"), help="store directory (default ./clmq-demo-data)"
    )
    demo.add_argument("--messages", type=int, default=100_000, help="messages to append (default 100000)")
    demo.add_argument("--queues", type=int, default=16, help="queues in the demo topic (default 16)")
    add_output_arg(demo)
    demo.set_defaults(func=cmd_demo)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    add_store_and_compare(bench_sub)
    add_bench_e2e(bench_sub)
    add_bench_delay(bench_sub)
    add_bench_transactions(bench_sub)
    add_bench_trace(bench_sub)
    add_bench_pop(bench_sub)
    add_commands(sub)
    _add_dev_zookeeper_flag(sub.choices["dev"])
    add_replication_commands(sub)
    # The Spark commands define arguments only; pyspark loads when they run.
    add_bench_spark(bench_sub)
    add_out_dir_args(bench_sub.choices)
    for p in bench_sub.choices.values():  # -o json: the results document on stdout, the steps on stderr
        add_output_arg(p)
    add_export(sub)
    add_store_tools(sub)
    add_dashboard(sub)
    add_dlq(sub)
    add_security(sub)
    add_transaction(sub)
    accept_durations(parser)
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
    """Append to a store, reopen it, read every queue's last message back."""
    from clmq.broker.store import Store, StoreConfig

    cfg = StoreConfig(args.data_dir)
    with Store.open(cfg).start() as store:
        store.create_topic("demo", args.queues)
        before = sum(store.max_offset("demo", q) for q in range(args.queues))
        elapsed = _demo_append(store, args.messages, args.queues)
        console.print(
            f"appended {args.messages:,} messages over {args.queues} queues in {elapsed:.2f} s "
            f"({args.messages / elapsed:,.0f} msgs/s) to {args.data_dir}/"
        )
    with Store.open(cfg) as store:  # reopen: everything is still there
        queues = [_demo_queue(store, q) for q in range(args.queues)]
    total = sum(q["max_offset"] for q in queues)
    if is_json(args):
        write_json({"data_dir": str(args.data_dir), "appended": args.messages, "seconds": elapsed, "queues": queues})
        return 0
    print_table(
        f"topic 'demo' after a restart ({args.data_dir})",
        ["queue", "min offset", "max offset", "last message"],
        [[q["queue_id"], q["min_offset"], q["max_offset"], q["last"] or "-"] for q in queues],
    )
    console.print(f"{total - before:,} new messages read back; {total:,} in the store")
    return 0


def _demo_append(store: Any, messages: int, queues: int) -> float:
    """Append ``messages`` in batches of 1000 over ``queues``; the seconds it took."""
    from clmq.common import Message, StoreError

    t0 = time.perf_counter()
    for start in range(0, messages, 1000):
        batch = [
            Message("demo", (start + i) % queues, b"hello %d" % (start + i), tags="TagA")
            for i in range(min(1000, messages - start))
        ]
        res = store.put_batch(batch)
        if not res.ok:
            raise StoreError(f"append failed: {res.status.value}: {res.error}")
    return time.perf_counter() - t0


def _demo_queue(store: Any, queue_id: int) -> dict[str, Any]:
    hi = store.max_offset("demo", queue_id)
    last = store.get("demo", queue_id, hi - 1, 1).messages if hi else []
    return {
        "queue_id": queue_id,
        "min_offset": store.min_offset("demo", queue_id),
        "max_offset": hi,
        "last": last[0].body.decode("utf-8", errors="backslashreplace") if last else "",
    }


def main(argv: list[str] | None = None) -> int:
    """Run one ``clmq`` command; every failure is one line on stderr and an exit code
    (``broker/cli/_errors.py``; ``-v`` adds the stack)."""
    verbose = "-v" in (argv if argv is not None else sys.argv[1:]) or "--verbose" in (argv or sys.argv[1:])
    try:
        args = build_parser().parse_args(argv)
        verbose = args.verbose
        configure_logging(args)
        with json_only_stdout(args), security_env(args):  # -o json: stdout is only JSON, whatever the verb prints
            if args.command == "bench":
                return _run_bench(args)
            return int(args.func(args) or 0)
    except SystemExit:  # argparse's own usage errors (exit 2) and --help (exit 0)
        raise
    except BaseException as e:  # everything else, KeyboardInterrupt included: one line
        return report(e, verbose)


def _run_bench(args: argparse.Namespace) -> int:
    """A benchmark: its results in ``--out-dir``; with ``-o json`` also on stdout."""
    resolve_result_paths(args)
    with bench_progress(args.bench):
        code = int(args.func(args) or 0)
    if is_json(args) and Path(args.json).exists():
        write_json(json.loads(Path(args.json).read_text()))
    return code


if __name__ == "__main__":
    sys.exit(main())

"""The ``clmq`` command line: the parser, ``clmq demo`` (the store alone), and the
entry point. The verbs live beside it: services and clients in ``_services.py``,
``_client_verbs.py`` and ``consume_verbs.py``, ``export.py``, and the benchmarks in ``bench/``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import clmq

from ._lazy import Verbs, add_verbs, calls
from ._logging import add_logging_args, configure_logging


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The ``clmq`` command line. Without ``argv``: every verb, its flags and their help.
    With ``argv``: the verb it names in full, the others by name and help line only, so
    that a command imports only the modules it runs (``_lazy.py``); its ``--help`` and
    its parsing are the same either way."""
    parser = argparse.ArgumentParser(prog="clmq", description="clmq: a message broker built on one CommitLog.")
    parser.add_argument(
        "--version", action="version", version=f"clmq {clmq.__version__}", help="print clmq's version and exit"
    )
    add_logging_args(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    if add_verbs(sub, COMMANDS, argv):  # only verbs built in full have options to convert
        from ._timefmt import accept_durations

        accept_durations(parser)
    return parser


def _add_demo(sub: Any, words: list[str] | None) -> None:
    from ._output import add_output_arg

    demo = sub.add_parser("demo", help=_DEMO_HELP)
    # Not ./clmq-data: that is `clmq dev`'s broker directory, which this demo must not write into.
    demo.add_argument(
        "--data-dir", type=Path, default=Path("clmq-demo-data"), help="store directory (default ./clmq-demo-data)"
    )
    demo.add_argument("--messages", type=int, default=100_000, help="messages to append (default 100000)")
    demo.add_argument("--queues", type=int, default=16, help="queues in the demo topic (default 16)")
    add_output_arg(demo)
    demo.set_defaults(func=cmd_demo)


def _add_bench(sub: Any, words: list[str] | None) -> None:
    """``clmq bench``: only the benchmark ``words`` name is built in full."""
    from clmq.bench.results import add_out_dir_args

    from ._output import add_output_arg

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    add_verbs(bench_sub, BENCHMARKS, words)
    add_out_dir_args(bench_sub.choices)
    for p in bench_sub.choices.values():  # -o json: the results document on stdout, the steps on stderr
        add_output_arg(p)


def _add_services(sub: Any, words: list[str] | None) -> None:
    """``clmq dev``, ``nameserver`` and ``broker``."""
    from ._services import add_service_commands

    add_service_commands(sub)
    _add_dev_zookeeper_flag(sub.choices["dev"])


def _add_dev_zookeeper_flag(dev: argparse.ArgumentParser) -> None:
    """``clmq dev --replicas N --zookeeper`` (run by ``dev_replicas.py``)."""
    dev.add_argument(
        "--zookeeper",
        action="store_true",
        help="with --replicas N > 1: also run a local ZooKeeper "
        "server (<data-dir>/zookeeper/, needs Java and Debian's libzookeeper-java) and let it elect the "
        "group's leader and replace it automatically when it dies",
    )


_DEMO_HELP = "store demo: append to a local store, restart it, read the queues back"
_CLI = "clmq.broker.cli."

# Every command, in the order `clmq --help` lists them, with its help line (each must be
# the one its registrar gives: tests/test_cli_lazy.py compares the two trees).
COMMANDS: tuple[Verbs, ...] = (
    Verbs(_add_demo, (("demo", _DEMO_HELP),)),
    Verbs(_add_bench, (("bench", "benchmarks"),)),
    Verbs(
        _add_services,
        (
            (
                "dev",
                "name server and broker in one process, on a local data directory; the broker "
                "takes the settings of 'clmq broker' (--config, CLMQ_* variables, flags)",
            ),
            ("nameserver", "run a name server"),
            ("broker", "run a broker ('clmq broker status --addr host:port': one broker's replication state)"),
        ),
    ),
    Verbs(
        calls(_CLI + "_client_verbs:add_client_commands"),
        (
            ("topic", "create, list, describe, update, delete topics"),
            ("produce", "send messages (arguments, or lines of stdin as they arrive)"),
            ("consume", "receive messages: as a member of --group (committing), or just to look (without it)"),
            ("group", "consumer groups: list, describe (per-queue lag), members, delete, reset-offsets"),
            ("message", "read a queue without a group; look a message up by id or key"),
        ),
    ),
    Verbs(
        calls(_CLI + "replication_verbs:add_replication_commands"),
        (
            ("cluster", "the brokers the name servers know, with their replication state"),
            ("admin", "operator actions on one broker: promote"),
        ),
    ),
    Verbs(calls(_CLI + "export:add_command"), (("export", "export queues to Parquet, JSON or CSV with Spark"),)),
    Verbs(
        calls(_CLI + "store_tools:add_command"),
        (("store", "offline tools for a store directory (the broker must be stopped)"),),
    ),
    Verbs(
        calls(_CLI + "dashboard:add_command"),
        (("dashboard", "a web dashboard: brokers, topics, groups and their lag, messages"),),
    ),
    Verbs(
        calls(_CLI + "dlq_verbs:add_command"),
        (("dlq", "dead letters: messages a consumer group gave up on (list, show, resend)"),),
    ),
    Verbs(
        calls(_CLI + "security_verbs:add_command"),
        (
            ("user", "users who log in (SCRAM-SHA-256/512): add, passwd, list, delete"),
            ("acl", "access control lists: who may do what on which topic, group or the cluster"),
        ),
    ),
    Verbs(
        calls(_CLI + "transaction_verbs:add_command"),
        (("transaction", "transactional (half) messages: list the pending ones, show one"),),
    ),
)

# Every benchmark, in the order `clmq bench --help` lists them.
BENCHMARKS: tuple[Verbs, ...] = tuple(
    Verbs(calls(f"clmq.bench.{target}"), ((name, help_line),))
    for name, target, help_line in (
        ("store", "commands:add_store", "storage engine: append, dispatch, rebuild, read-back"),
        ("compare", "commands:add_compare", "commit-log mode against partition-per-file mode, same workload"),
        (
            "replication",
            "replication:add_command",
            "leader/follower replication: throughput, ack latency, lag, catch-up",
        ),
        ("failover", "failover:add_command", "automatic failover through ZooKeeper: time to a new leader's first ack"),
        (
            "request-cost",
            "request_cost:add_command",
            "broker CPU time per small request, many in flight on one connection",
        ),
        ("cold-reader", "cold_reader:add_command", "a lagging consumer reading evicted data against tail consumers"),
        ("kafka", "kafka:add_command", "Kafka clients through the Kafka listener against clmq's client"),
        ("index", "index:add_command", "key index: dispatch with and without it, look-up latency at scale"),
        ("e2e", "e2e:add_command", "produce and consume through a broker over loopback"),
        ("delay", "delay:add_command", "scheduled messages: send rate, delivery lateness, memory per pending message"),
        (
            "transactions",
            "transactions:add_command",
            "transactional messages: send rate against plain, commit-to-visible",
        ),
        ("trace", "trace:add_command", "message traces: produce and consume rates with tracing on and off"),
        ("pop", "pop:add_command", "POP consumption against queue-based: throughput by members, redelivery"),
        ("peers", "peers:add_command", "clmq against Apache RocketMQ 5 and Apache Kafka 4, same workload"),
        ("latency", "latency:add_command", "open-loop latency under load: p50/p99/p99.9/max, over time"),
        ("startup", "startup:add_command", "start-up cost of clmq commands: wall, CPU and import time per process"),
        # The Spark commands define arguments only; pyspark loads when they run.
        ("spark", "spark:add_command", "the clmq Spark source and export against Parquet (needs clmq[spark])"),
    )
)


def cmd_demo(args: argparse.Namespace) -> int:
    """Append to a store, reopen it, read every queue's last message back."""
    from clmq.broker.store import Store, StoreConfig

    from ._output import console, is_json, print_table, write_json

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
    # Before anything imports numpy: its OpenBLAS starts a thread per core at import,
    # which cost every broker and benchmark process about 70 ms of CPU (half of numpy's
    # import) for linear algebra clmq never does. A value the environment gives is kept.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    words = sys.argv[1:] if argv is None else argv
    verbose = "-v" in words or "--verbose" in words
    try:
        args = build_parser(words).parse_args(words)
        verbose = args.verbose
        configure_logging(args)
        from ._common import security_env
        from ._output import json_only_stdout

        with json_only_stdout(args), security_env(args):  # -o json: stdout is only JSON, whatever the verb prints
            if args.command == "bench":
                return _run_bench(args)
            return int(args.func(args) or 0)
    except SystemExit:  # argparse's own usage errors (exit 2) and --help (exit 0)
        raise
    except BaseException as e:  # everything else, KeyboardInterrupt included: one line
        from ._errors import report

        return report(e, verbose)


def _run_bench(args: argparse.Namespace) -> int:
    """A benchmark: its results in ``--out-dir``; with ``-o json`` also on stdout."""
    from clmq.bench.results import resolve_result_paths

    from ._output import is_json, write_json
    from ._progress import bench_progress

    resolve_result_paths(args)
    with bench_progress(args.bench):
        code = int(args.func(args) or 0)
    if is_json(args) and Path(args.json).exists():
        write_json(json.loads(Path(args.json).read_text()))
    return code


if __name__ == "__main__":
    sys.exit(main())

"""``clmq bench peers``: clmq against Apache RocketMQ 5 and Apache Kafka 4 on this machine,
in one run, with one workload, each broker driven by its own official client:

- ``clmq``: clmq's broker with its public Python client (``bench.kafka_load``'s native
  roles: ``submit`` per message with ``linger_ms`` 5, ``open_consumer``);
- ``clmq-kafka``: the same broker through its Kafka listener, with Apache Kafka's Java
  client (``tests/java/peers-kafka/PeersKafka.java``);
- ``kafka``: Apache Kafka 4.4.0 (KRaft, one node) with the same Java client;
- ``rocketmq``: Apache RocketMQ 5 (name server + broker) with its remoting Java client
  (``DefaultMQProducer`` async sends, ``DefaultLitePullConsumer``;
  ``tests/java/peers-rocketmq/PeersRocketMQ.java``).

Per case (flush mode, queue count) and run, the systems one at a time (their order
reversed every other run), each on a fresh broker and data directory: a topic of Q
queues/partitions, ``--messages`` messages of ``--size`` bytes produced (message i to
queue i mod Q), read back by a consumer (at ``--consume-queues``), then ``--latency-rate``
messages a second for ``--latency-seconds`` (at ``--latency-queues``), each timed from its
send to its acknowledgement. The brokers' CPU (user + sys from /proc, name server
included) is read around each load. Medians over the runs, and per case the ratios
clmq / RocketMQ and clmq / Kafka. The brokers are stopped on any failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

from .peers_java import PeersUnavailable, driver_command, require_tools
from .peers_run import PeersBench

SYSTEMS = ("clmq", "clmq-kafka", "rocketmq", "kafka")


def _ints(text: str) -> list[int]:
    return [int(x.replace("_", "")) for x in text.split(",") if x.strip()]


def _systems(text: str) -> list[str]:
    systems = [s.strip() for s in text.split(",") if s.strip()]
    if not systems or any(s not in SYSTEMS for s in systems):
        raise argparse.ArgumentTypeError(f"systems: a list of {', '.join(SYSTEMS)}, got {text!r}")
    return systems


def _flushes(text: str) -> list[str]:
    modes = [s.strip() for s in text.split(",") if s.strip()]
    if not modes or any(m not in ("async", "sync") for m in modes):
        raise argparse.ArgumentTypeError(f"flush: a list of async, sync; got {text!r}")
    return modes


def add_command(bench_sub: Any) -> None:
    p = bench_sub.add_parser("peers", help="clmq against Apache RocketMQ 5 and Apache Kafka 4, same workload")
    a = p.add_argument
    a("--systems", type=_systems, default=list(SYSTEMS), help=f"default {','.join(SYSTEMS)}")
    a("--queues", type=_ints, default=[1, 1000, 10000], help="queue/partition counts (default 1,1000,10000)")
    a("--flush", type=_flushes, default=["async", "sync"], help="flush modes (default async,sync)")
    a("--messages", type=int, default=30_000, help="messages per produce case (default 30,000)")
    a("--large-queues", type=int, default=10_000, help="from this many queues on, --large-messages (default 10,000)")
    a("--large-messages", type=int, default=10_000, help="messages per case at --large-queues (default 10,000)")
    a(
        "--warmup-messages",
        type=int,
        default=2000,
        help="messages each Java producer sends before its measured load, for the JIT (default 2,000)",
    )
    a("--size", type=int, default=1024, help="message size in bytes (default 1024)")
    a("--runs", type=int, default=2, help="runs per case, medians reported (default 2)")
    a("--consume-queues", type=_ints, default=None, help="cases that also consume (default: every --queues)")
    a("--latency-queues", type=_ints, default=[1, 1000], help="cases with the latency load (default 1,1000)")
    a("--latency-rate", type=int, default=10_000, help="msgs/s of the latency load (default 10,000; 0: none)")
    a("--latency-seconds", type=float, default=2.0, help="length of the latency load (default 2)")
    a("--json", type=Path, default=None, help="every sample, the medians and the ratios")
    a("--markdown", type=Path, default=None, help="also write the table as Markdown here")
    p.set_defaults(func=cmd_bench_peers)


def cmd_bench_peers(args: argparse.Namespace) -> int:
    """Run the comparison; 2 with a clear message when Java, Maven or the jars are missing."""
    from rich.console import Console

    from .peers_report import markdown, plot
    from .report import save
    from .results import draw

    console = Console(soft_wrap=True)
    try:
        drivers = _drivers(args.systems)
    except PeersUnavailable as e:
        print(f"clmq bench peers: {e}", file=sys.stderr)
        return 2
    previous = signal.signal(signal.SIGTERM, _interrupted)  # a kill stops the brokers as Ctrl-C does
    try:
        with tempfile.TemporaryDirectory(prefix="clmq-bench-peers-") as root:
            bench = PeersBench(args, drivers, Path(root), lambda line: console.print(line, highlight=False))
            result: dict[str, Any] = bench.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    save(result, markdown(result), args.json, args.markdown, console)
    if args.plot is not None:
        draw(plot, result, args.plot, console)
    short = [s for s in result["samples"] if s["incomplete"]]
    if short:  # a result (e.g. a peer refusing sends under load), said plainly
        console.print(f"[yellow]{len(short)} loads did not complete every message: {json.dumps(short[:3])}")
    if result["failures"]:  # the figures of the other cases are written; the exit status says some are missing
        console.print(f'[red]{len(result["failures"])} cases failed (in the JSON\'s "failures")')
        return 1
    return 0


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _drivers(systems: list[str]) -> dict[str, tuple[list[str], list[str]]]:
    """Per Java system its driver command and the broker's jars (fetched and compiled)."""
    need = {"kafka"} if {"kafka", "clmq-kafka"} & set(systems) else set()
    need |= {"rocketmq"} if "rocketmq" in systems else set()
    if need:
        require_tools()
    return {name: driver_command(name) for name in sorted(need)}

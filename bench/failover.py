"""``clmq bench failover``: how long a group is without a leader that acknowledges
writes, when ZooKeeper coordinates it (issue 16).

It starts its own processes in a temporary directory: a standalone ZooKeeper server
(``tickTime`` 500 ms), a name server and three brokers of one group with the
``zookeeper`` setting (2 s sessions, sync acks held by 2 replicas). A continuous sync
producer runs in this process (the public client, with its retry budget). Then, in
turn for each ``--kinds``, ``--failovers`` times:

- ``sigkill``: the leader is killed; measured from the kill to the first write
  acknowledged by another broker; then it is restarted and rejoins;
- ``graceful``: ``Admin.promote`` of a follower (the leader hands over); measured from
  the request to the first write acknowledged by that follower.

Each failover also reports the write pause (the longest time without any
acknowledgement around it). Reported: median and p99 per kind, produce throughput
during the failovers and afterwards, the errors the client saw (aim: none).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import trio
from rich.console import Console

from clmq.client import Admin, open_admin, open_producer

from .failover_cluster import FailoverCluster
from .failover_load import TOPIC, Acks, send_forever, wait_all_in_sync, wait_first_ack, wait_leader
from .failover_report import plot, print_report, summarize
from .replication_load import _routed
from .results import draw

KINDS = ("sigkill", "graceful")
STEP_TIMEOUT_S = 60.0  # an election, a restart or a catch-up that takes longer is a failure of the run
console = Console(soft_wrap=True)
PAUSE_TAIL_S = 0.5  # the write pause is looked for up to this long after the new leader's first ack


def _kinds(text: str) -> list[str]:
    kinds = [k for k in text.split(",") if k]
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise argparse.ArgumentTypeError(f"kinds are {', '.join(KINDS)}; got {text!r}")
    return kinds


def add_command(bench_sub: Any) -> None:
    """Add ``failover`` to the ``clmq bench`` parser."""
    p = bench_sub.add_parser("failover", help="automatic failover through ZooKeeper: time to a new leader's first ack")
    a = p.add_argument
    a("--failovers", type=int, default=20, help="failovers of each kind (default 20)")
    a("--kinds", type=_kinds, default=list(KINDS), help="sigkill, graceful or both (default sigkill,graceful)")
    a("--session-ms", type=int, default=2000, help="the brokers' zk_session_timeout_ms (default 2000)")
    a("--tick-ms", type=int, default=500, help="ZooKeeper's tickTime (default 500)")
    a("--senders", type=int, default=4, help="sends in flight at once (default 4)")
    a("--queues", type=int, default=8, help="queues of the topic (default 8)")
    a("--size-bytes", type=int, default=1024, help="message size (default 1024)")
    a("--batch-messages", type=int, default=16, help="messages per send (default 16)")
    a("--retry-budget-ms", type=int, default=30_000, help="the producer's retry_budget_ms (default 30000)")
    a("--after-seconds", type=float, default=5.0, help="produce measured after the last failover (default 5)")
    a("--dir", type=Path, default=None, help="where the processes' directories go (default: a temporary directory)")
    a("--json", type=Path, default=None, help="where to write every figure as JSON")
    a("--plot", type=Path, default=None, help="draw each failover's time and pause here (needs matplotlib)")
    p.set_defaults(func=cmd_bench_failover)


def cmd_bench_failover(args: argparse.Namespace) -> int:
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench-failover-", dir=args.dir))
    settings = {"zk_session_timeout_ms": args.session_ms, "ack_mode": "sync", "min_insync_replicas": 2}
    cluster = FailoverCluster(root, settings, tick_time_ms=args.tick_ms)
    try:
        cluster.start()
        result = trio.run(measure_failovers, args, cluster)
    finally:
        problems = cluster.stop()
    result["problems"] = problems
    args.json.write_text(json.dumps(result, indent=2))
    print_report(console, result)
    console.print(f"JSON: {args.json}")
    draw(plot, result, args.plot, console)
    return 0


async def measure_failovers(args: argparse.Namespace, cluster: FailoverCluster) -> dict[str, Any]:
    """Every failover under a running producer; the figures."""
    acks = Acks()
    async with open_admin([cluster.ns_addr], broker_addrs=[n.addr for n in cluster.nodes]) as admin:
        leader = await wait_leader(admin, cluster, STEP_TIMEOUT_S)
        await admin.create_topic(TOPIC, args.queues, on=[leader])
        await wait_all_in_sync(admin, cluster, STEP_TIMEOUT_S)
        producing = open_producer([cluster.ns_addr], retry_budget_ms=args.retry_budget_ms)
        async with producing as producer, trio.open_nursery() as nursery:
            with trio.fail_after(STEP_TIMEOUT_S):  # the name server routes the topic once the leader registers it
                while await _routed(producer, TOPIC) < args.queues:  # noqa: ASYNC110 - another process's state
                    await trio.sleep(0.05)
            for _ in range(args.senders):
                nursery.start_soon(send_forever, producer, acks, args.size_bytes, args.batch_messages, args.queues)
            await wait_first_ack(acks, trio.current_time(), {n.addr for n in cluster.nodes}, STEP_TIMEOUT_S)
            rows, during = await _failovers(args, admin, cluster, acks)
            await wait_all_in_sync(admin, cluster, STEP_TIMEOUT_S)
            start = trio.current_time()
            await trio.sleep(args.after_seconds)
            after = (start, trio.current_time())
            nursery.cancel_scope.cancel()
    return summarize(args, rows, acks, during, after)


async def _failovers(
    args: argparse.Namespace, admin: Admin, cluster: FailoverCluster, acks: Acks
) -> tuple[list[dict[str, Any]], tuple[float, float]]:
    rows: list[dict[str, Any]] = []
    start = trio.current_time()
    for i in range(args.failovers):
        for kind in args.kinds:
            row = await (_sigkill(admin, cluster, acks) if kind == "sigkill" else _graceful(admin, cluster, acks))
            row.update(kind=kind, index=i)
            rows.append(row)
            console.print(
                f"{kind} #{i + 1}: broker {row['from']} -> {row['to']}: first ack after "
                f"{row['failover_s']:.3f} s, write pause {row['pause_s']:.3f} s"
            )
    return rows, (start, trio.current_time())


async def _sigkill(admin: Admin, cluster: FailoverCluster, acks: Acks) -> dict[str, Any]:
    """Kill the leader; time to the first write another broker acknowledges; restart it."""
    old = await wait_all_in_sync(admin, cluster, STEP_TIMEOUT_S)
    node = cluster.node(old)
    errors_before = len(acks.errors)
    killed_at = trio.current_time()
    node.kill()
    took = await wait_first_ack(acks, killed_at, {n.addr for n in cluster.nodes} - {old}, STEP_TIMEOUT_S)
    new = await wait_leader(admin, cluster, STEP_TIMEOUT_S, exclude=old)
    await trio.to_thread.run_sync(node.start)
    await trio.sleep_until(killed_at + took + PAUSE_TAIL_S)  # the pause's window must be over before it is measured
    return _row(acks, old, new, cluster, killed_at, took, errors_before)


async def _graceful(admin: Admin, cluster: FailoverCluster, acks: Acks) -> dict[str, Any]:
    """Promote a follower; time from the request to the first write it acknowledges."""
    old = await wait_all_in_sync(admin, cluster, STEP_TIMEOUT_S)
    target = next(n.addr for n in cluster.nodes if n.addr != old)
    errors_before = len(acks.errors)
    asked_at = trio.current_time()
    await admin.promote(target)
    took = await wait_first_ack(acks, asked_at, {target}, STEP_TIMEOUT_S)
    await trio.sleep_until(asked_at + took + PAUSE_TAIL_S)  # the pause's window must be over before it is measured
    return _row(acks, old, target, cluster, asked_at, took, errors_before)


def _row(
    acks: Acks, old: str, new: str, cluster: FailoverCluster, at: float, took: float, errors_before: int
) -> dict[str, Any]:
    """One failover's figures; the write pause spans from the fault to 0.5 s past the first new ack."""
    pause = acks.longest_gap(at, at + took + PAUSE_TAIL_S)
    return {
        "from": cluster.node(old).broker_id,
        "to": cluster.node(new).broker_id,
        "failover_s": took,
        "pause_s": max(pause, 0.0),
        "errors": len(acks.errors) - errors_before,
    }

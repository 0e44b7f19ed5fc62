"""``clmq bench transactions``: what transactional messages cost, issue 32.

One fresh ``clmq broker`` process (``e2e.BrokerProcess``, async flush, its own data
directory); the clients run in this process through the public trio client.

- Send throughput: ``--senders`` tasks each calling, one message at a time, ``send``
  (plain) or ``send_in_transaction`` whose listener commits at once (a half
  message, then END_TRANSACTION: two requests where a plain send has one), for
  ``--seconds`` each, alternated for ``--runs`` runs (their order swapped every other
  run); the medians and the transactional / plain ratio.
- Commit-to-visible latency: a consumer group long-polls the topic while
  ``--latency-messages`` transactions are sent by ``--latency-senders`` tasks; for each,
  the time from the local transaction's COMMIT (just before END_TRANSACTION goes out)
  to its receipt by the consumer; p50, p99 and max. The same for plain sends (send
  call to receipt) as the reference.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import trio

from clmq.client import ClientError, LocalTransactionState, Message, open_admin, open_consumer, open_producer

from .cpu import cpu_seconds
from .delay import _broker
from .e2e import BrokerProcess
from .replication_load import percentile
from .transactions_report import aims, markdown, plot, throughput_summary

TOPIC = "tx-bench"
LATENCY_TOPIC = "tx-latency"
GROUP = "tx-bench-producers"
WARMUP_S = 0.5  # of each kind of send before the measured runs
CONSUMER_READY_MAX_S = 10.0  # the latency consumer gets its queues (rebalance) before the sends start
RECEIVE_WAIT_S = 15.0  # the latency case waits this long at most for the last message


def add_command(bench_sub: Any) -> None:
    """Add ``clmq bench transactions`` to the parser."""
    p = bench_sub.add_parser("transactions", help="transactional messages: send rate against plain, commit-to-visible")
    a = p.add_argument
    a("--size-bytes", type=int, default=100, help="message body size (default 100)")
    a("--senders", type=int, default=32, help="throughput: sends in flight (default 32)")
    a("--queues", type=int, default=8, help="queues of the topic (default 8)")
    a("--seconds", type=float, default=3.0, help="throughput: seconds per measured run (default 3)")
    a("--runs", type=int, default=5, help="throughput: runs of plain and transactional, alternated (default 5)")
    a("--latency-messages", type=int, default=2000, help="latency: messages of each kind (default 2000)")
    a("--latency-senders", type=int, default=4, help="latency: sends in flight (default 4)")
    a("--settle-seconds", type=float, default=2.0, help="os.sync(), then idle this long before the broker (default 2)")
    a("--json", type=Path, default=None, help="every figure as JSON")
    a("--markdown", type=Path, default=None, help="also write the tables and the aims as Markdown here")
    p.set_defaults(func=cmd_bench_transactions)


class CommitAtOnce:
    """The benchmark's listener: every local transaction commits at once (and so would
    every check, which none is asked: nothing stays pending long enough)."""

    def execute_local_transaction(self, _message: Message, _arg: Any) -> LocalTransactionState:
        return LocalTransactionState.COMMIT

    def check_local_transaction(self, _message: Any) -> LocalTransactionState:
        return LocalTransactionState.COMMIT


async def send_rate(p: Any, kind: str, body: bytes, senders: int, seconds: float, broker_pid: int) -> dict[str, Any]:
    """``senders`` tasks sending one message at a time for ``seconds``: messages
    stored per second, failures, CPU per message of this process and the broker."""
    sent, failed = [0], [0]
    deadline = time.perf_counter() + seconds

    async def sender() -> None:
        while time.perf_counter() < deadline:
            try:
                if kind == "plain":
                    await p.send(TOPIC, body)
                else:
                    r = await p.send_in_transaction(TOPIC, body)
                    if not r.committed:
                        failed[0] += 1
                        continue
            except ClientError:
                failed[0] += 1
            else:
                sent[0] += 1

    t0, client0, broker0 = time.perf_counter(), time.process_time(), cpu_seconds(broker_pid)
    async with trio.open_nursery() as nursery:
        for _ in range(senders):
            nursery.start_soon(sender)
    per = 1e6 / max(1, sent[0])
    return {
        "msgs_per_s": sent[0] / (time.perf_counter() - t0),
        "sent": sent[0],
        "failed": failed[0],
        "client_cpu_us_per_msg": (time.process_time() - client0) * per,
        "broker_cpu_us_per_msg": (cpu_seconds(broker_pid) - broker0) * per,
    }


async def _throughput(broker: BrokerProcess, args: argparse.Namespace, report: Callable[[str], None]) -> list[Any]:
    body = os.urandom(args.size_bytes)
    samples = []
    producer_cm = open_producer(
        broker_addrs=[broker.addr], transaction_group=GROUP, transaction_listener=CommitAtOnce()
    )
    async with producer_cm as p:
        for kind in ("plain", "transactional"):  # connections, routes, the system topics' creation
            await send_rate(p, kind, body, args.senders, WARMUP_S, broker.proc.pid)
        for r in range(args.runs):
            for kind in ("plain", "transactional") if r % 2 == 0 else ("transactional", "plain"):
                s = await send_rate(p, kind, body, args.senders, args.seconds, broker.proc.pid)
                samples.append({"run": r, "kind": kind, **s})
                report(
                    f"run {r + 1}/{args.runs}: {kind}: {s['msgs_per_s']:,.0f} msgs/s, CPU per message: client "
                    f"{s['client_cpu_us_per_msg']:.1f} us, broker {s['broker_cpu_us_per_msg']:.1f} us"
                    + (f", {s['failed']:,} failed" if s["failed"] else "")
                )
    return samples


async def _latency(broker: BrokerProcess, args: argparse.Namespace, kind: str) -> dict[str, Any]:
    """Commit (or send) to receipt, per message, with a consumer long-polling."""
    start: dict[bytes, float] = {}
    seen: dict[bytes, float] = {}
    n = args.latency_messages
    pad = os.urandom(max(0, args.size_bytes - 16))

    def commit(message: Message, _arg: Any) -> LocalTransactionState:
        start[message.body] = time.perf_counter()
        return LocalTransactionState.COMMIT

    async def sender(p: Any, ids: range) -> None:
        for i in ids:
            body = b"%s-%09d" % (kind[:1].encode(), i) + pad
            if kind == "plain":
                start[body] = time.perf_counter()
                await p.send(LATENCY_TOPIC, body)
            else:
                await p.send_in_transaction(LATENCY_TOPIC, body, execute=commit)

    group = f"tx-latency-{kind}"
    subs = {LATENCY_TOPIC: "*"}
    consumer_cm = open_consumer(None, group, subs, broker_addrs=[broker.addr], start_from="latest")
    async with consumer_cm as consumer, trio.open_nursery() as nursery:

        async def receive() -> None:
            with trio.move_on_after(RECEIVE_WAIT_S + n / 100):
                while len(seen) < n:
                    for rec in await consumer.receive():
                        seen.setdefault(rec.body, time.perf_counter())
            nursery.cancel_scope.cancel()

        nursery.start_soon(receive)
        with trio.fail_after(CONSUMER_READY_MAX_S):  # every queue assigned before the sends start
            while len(consumer.assignment()) < args.queues:  # noqa: ASYNC110 - the consumer signals no assignment
                await trio.sleep(0.01)
        producer_cm = open_producer(broker_addrs=[broker.addr], transaction_group=GROUP)
        async with producer_cm as p, trio.open_nursery() as senders:
            for k in range(args.latency_senders):
                senders.start_soon(sender, p, range(k, n, args.latency_senders))
    lat = [(seen[b] - t) * 1000 for b, t in start.items() if b in seen]
    return {
        "kind": kind,
        "messages": n,
        "received": len(lat),
        "p50_ms": percentile(lat, 50),
        "p90_ms": percentile(lat, 90),
        "p99_ms": percentile(lat, 99),
        "max_ms": max(lat, default=float("nan")),
    }


async def _create(addr: str, queues: int) -> None:
    async with open_admin(broker_addrs=[addr]) as admin:
        await admin.create_topic(TOPIC, queues, on=[addr])
        await admin.create_topic(LATENCY_TOPIC, queues, on=[addr])


async def _all(broker: BrokerProcess, args: argparse.Namespace, report: Callable[[str], None]) -> dict[str, Any]:
    await _create(broker.addr, args.queues)
    samples = await _throughput(broker, args, report)
    latency = []
    for kind in ("plain", "transactional"):
        row = await _latency(broker, args, kind)
        latency.append(row)
        report(
            f"latency, {kind}: {row['received']:,} of {row['messages']:,} received; p50 {row['p50_ms']:.1f} ms, "
            f"p99 {row['p99_ms']:.1f} ms, max {row['max_ms']:.1f} ms"
        )
    return {"throughput": throughput_summary(samples), "latency": latency}


def run_all(args: argparse.Namespace, report: Callable[[str], None]) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="clmq-bench-transactions-"))
    try:
        broker = _broker(root, args.settle_seconds)
        try:
            figures = trio.run(_all, broker, args, report)
        finally:
            broker.stop()
    finally:
        subprocess.run(["rm", "-rf", str(root)], check=False)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"}
    result: dict[str, Any] = {
        "settings": settings,
        "machine": {"cpus": os.cpu_count(), "load_after": os.getloadavg()},
        **figures,
    }
    result["aims"] = aims(result)
    return result


def cmd_bench_transactions(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .report import save
    from .results import draw

    console = Console(soft_wrap=True)
    result = run_all(args, lambda line: console.print(line, highlight=False))
    save(result, markdown(result), args.json, args.markdown, console)
    if args.plot is not None:
        draw(plot, result, args.plot, console)
    return 0

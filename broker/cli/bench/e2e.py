"""``clmq bench e2e``: produce and consume through a real broker over loopback.

The broker runs in its own process (its own interpreter and core), started fresh per
case on an empty data directory; the clients run in this process with clmq's own
trio client. Cases: message size x queue count x flush mode, produce throughput
(``--producers`` concurrent batch senders, round robin over the queues), then
consume throughput (a consumer group reading everything back), and produce latency
at a fixed rate with synchronous flush.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import trio

from client import MessageQueue, Producer, Routes, open_admin, open_consumer
from commitlog import Message
from protocol import encode_batch
from protocol.transport import RpcClient


@dataclass
class Throughput:
    size: int
    queues: int
    flush: str
    produce_msgs_per_s: float
    produce_mb_per_s: float
    consume_msgs_per_s: float  # from opening the consumer to closing it: joining, look-ups and commits included
    consume_fetch_msgs_per_s: float  # from the first batch to the last (Kafka's fetch.nMsg.sec)
    consumer_start_s: float  # from opening the consumer to its first batch
    messages: int


@dataclass
class Latency:
    rate_msgs_per_s: int
    batch: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    sends: int


def add_command(bench_sub: Any) -> None:
    p = bench_sub.add_parser("e2e", help="produce and consume through a broker over loopback")
    p.add_argument("--sizes", default="100,1024", help="message sizes in bytes (default 100,1024)")
    p.add_argument("--queues", default="1,1000,10000", help="queue counts (default 1,1000,10000)")
    p.add_argument("--flush", default="async,sync", help="flush modes (default async,sync)")
    p.add_argument("--seconds", type=float, default=3.0, help="seconds of producing per case (default 3)")
    p.add_argument("--runs", type=int, default=3, help="runs; medians are reported (default 3)")
    p.add_argument("--producers", type=int, default=4, help="concurrent batch senders (default 4)")
    p.add_argument("--batch", type=int, default=256, help="messages per batch (default 256)")
    p.add_argument("--latency-rate", type=int, default=10_000, help="msgs/s for the latency case (0: skip)")
    p.add_argument("--settle-seconds", type=float, default=3.0,
                   help="before each case: os.sync(), then this long idle, so that a case does not measure the "
                        "previous one's writeback and file deletions (default 3)")  # fmt: skip
    p.add_argument("--json", type=Path, default=Path("bench-e2e.json"))
    p.add_argument("--markdown", type=Path, default=None)
    p.set_defaults(func=cmd_bench_e2e)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class BrokerProcess:
    """``clmq broker`` in a subprocess, on a fresh data directory."""

    def __init__(self, root: Path, flush: str, storage_mode: str = "commitlog") -> None:
        self.dir = Path(tempfile.mkdtemp(dir=root))
        self.port = _free_port()
        self.addr = f"127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "broker.cli", "broker", "--listen-port", str(self.port), "--data-dir",
               str(self.dir / "data"), "--flush-mode", flush, "--storage-mode", storage_mode]  # fmt: skip
        self.log = self.dir / "broker.log"  # a file, not a pipe: a full pipe would stall the broker
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(self.log, "wb"))  # noqa: SIM115 - the broker process owns it
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"broker exited: {self.log.read_text()[-2000:]}") from None
                time.sleep(0.05)
        raise RuntimeError("broker did not start within 30 s")

    def stop(self) -> None:
        """Stop the broker; its log's warnings and errors, if any, are shown."""
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        problems = [line for line in self.log.read_text(errors="replace").splitlines() if "ERROR" in line or "Traceback" in line]
        if problems:
            print(f"broker log ({self.log}): {len(problems)} errors, first: {problems[0]}", file=sys.stderr)
        subprocess.run(["rm", "-rf", str(self.dir)], check=False)


async def _produce(
    addr: str, topic: str, size: int, queues: int, seconds: float, producers: int, batch: int
) -> tuple[int, float]:
    async with trio.open_nursery() as nursery:
        rpc = RpcClient(nursery)
        producer = Producer(rpc, Routes(rpc, [], broker_addrs=[addr]))
        mqs = await producer.routes.queues(topic)
        body = os.urandom(size)
        sent = [0]
        deadline = time.perf_counter() + seconds

        async def sender(k: int) -> None:
            i = k
            while time.perf_counter() < deadline:
                mq = mqs[i % len(mqs)]
                i += producers
                now = int(time.time() * 1000)  # a real client encodes every batch it sends
                data = encode_batch([Message(topic, mq.queue_id, body, "TagA", born_timestamp_ms=now) for _ in range(batch)])
                await producer.send_to(mq, data, batch)
                sent[0] += batch

        t0 = time.perf_counter()
        async with trio.open_nursery() as senders:
            for k in range(producers):
                senders.start_soon(sender, k)
        elapsed = time.perf_counter() - t0
        await rpc.aclose()
        nursery.cancel_scope.cancel()
    return sent[0], elapsed


async def _consume(addr: str, topic: str, expected: int) -> tuple[float, float, float]:
    """Overall rate (joining and closing included), fetch rate (first batch to last, as
    Kafka's consumer benchmark reports it) and seconds to the first batch."""
    t0 = time.perf_counter()
    got, first, last = 0, 0.0, 0.0
    async with open_consumer(None, "bench", {topic: "*"}, broker_addrs=[addr], pull_batch=1024, buffered_batches=256) as c:
        with trio.fail_after(300):
            got += len(await c.receive())
            first = time.perf_counter()
            while got < expected:
                got += len(await c.receive())
            last = time.perf_counter()
    overall = got / (time.perf_counter() - t0)
    return overall, got / max(last - first, 1e-9), first - t0


async def _latency(addr: str, topic: str, rate: int, seconds: float, batch: int = 10) -> Latency:
    """Send ``batch`` messages every ``batch / rate`` seconds, each send its own task."""
    lat: list[float] = []
    async with trio.open_nursery() as nursery:
        rpc = RpcClient(nursery)
        producer = Producer(rpc, Routes(rpc, [], broker_addrs=[addr]))
        mqs: list[MessageQueue] = await producer.routes.queues(topic)
        body = os.urandom(1024)

        async def one(mq: MessageQueue) -> None:
            t = time.perf_counter()
            data = encode_batch([Message(topic, mq.queue_id, body) for _ in range(batch)])
            await producer.send_to(mq, data, batch)
            lat.append((time.perf_counter() - t) * 1000)

        period, n = batch / rate, int(seconds * rate / batch)
        start = trio.current_time()
        async with trio.open_nursery() as senders:
            for i in range(n):
                await trio.sleep_until(start + i * period)
                senders.start_soon(one, mqs[i % len(mqs)])
        await rpc.aclose()
        nursery.cancel_scope.cancel()
    lat.sort()
    return Latency(rate, batch, statistics.median(lat), lat[int(len(lat) * 0.99) - 1], lat[-1], len(lat))


async def _case(addr: str, size: int, queues: int, flush: str, args: argparse.Namespace) -> Throughput:
    async with open_admin(broker_addrs=[addr]) as admin:
        await admin.create_topic("bench", queues, on=[addr])
    sent, elapsed = await _produce(addr, "bench", size, queues, args.seconds, args.producers, args.batch)
    consume, fetch, start = await _consume(addr, "bench", sent)
    return Throughput(size, queues, flush, sent / elapsed, sent * size / elapsed / 1e6, consume, fetch, start, sent)


def run_all(args: argparse.Namespace, report: Callable[[str], None]) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="clmq-bench-e2e-"))
    sizes = [int(x) for x in args.sizes.split(",")]
    queue_counts = [int(x.replace("_", "")) for x in args.queues.split(",")]
    cases = [(s, q, f) for f in args.flush.split(",") for s in sizes for q in queue_counts]
    samples: dict[tuple[int, int, str], list[Throughput]] = {c: [] for c in cases}
    lat_samples: list[Latency] = []
    for r in range(args.runs):
        for s, q, f in cases:
            _settle(args.settle_seconds)
            broker = BrokerProcess(root, f)
            try:
                t = trio.run(_case, broker.addr, s, q, f, args)
            finally:
                broker.stop()
            samples[(s, q, f)].append(t)
            report(f"run {r + 1}/{args.runs}: {s} B x {q} queues, {f} flush: produce {t.produce_msgs_per_s:,.0f} msgs/s, "
                   f"consume {t.consume_msgs_per_s:,.0f} msgs/s (fetch {t.consume_fetch_msgs_per_s:,.0f}, "
                   f"first batch after {t.consumer_start_s:.2f} s)")  # fmt: skip
        if args.latency_rate:
            lat_samples.append(_latency_case(root, args))
            report(f"run {r + 1}/{args.runs}: sync flush at {args.latency_rate:,} msgs/s: p50 {lat_samples[-1].p50_ms:.2f} ms, "
                   f"p99 {lat_samples[-1].p99_ms:.2f} ms")  # fmt: skip
    rows = [{k: (statistics.median(getattr(x, k) for x in v) if isinstance(getattr(v[0], k), float) else getattr(v[0], k))
             for k in asdict(v[0])} for v in samples.values()]  # fmt: skip
    out: dict[str, Any] = {
        "runs": args.runs,
        "seconds": args.seconds,
        "producers": args.producers,
        "batch": args.batch,
        "rows": rows,
    }
    if lat_samples:
        out["latency"] = {k: statistics.median(getattr(x, k) for x in lat_samples) for k in asdict(lat_samples[0])}
    subprocess.run(["rm", "-rf", str(root)], check=False)
    return out


def _settle(seconds: float) -> None:
    """Let the previous case's I/O finish. Each case leaves hundreds of megabytes of
    dirty pages and, deleted, thousands of queue files: measured with a 10,000-queue
    consumer, the next case ran at 0.65-0.75 of its rate on a quiet disk."""
    os.sync()
    time.sleep(seconds)


def _latency_case(root: Path, args: argparse.Namespace) -> Latency:
    # The throughput cases leave gigabytes of dirty pages; their writeback would share
    # the disk with this case's fsyncs. Measure the broker, not the previous cases.
    _settle(args.settle_seconds)
    broker = BrokerProcess(root, "sync")
    try:

        async def main() -> Latency:
            async with open_admin(broker_addrs=[broker.addr]) as admin:
                await admin.create_topic("lat", 8, on=[broker.addr])
            return await _latency(broker.addr, "lat", args.latency_rate, max(3.0, args.seconds))

        return trio.run(main)
    finally:
        broker.stop()


def markdown(result: dict[str, Any]) -> str:
    lines = ["| size B | queues | flush | produce msgs/s | produce MB/s | consume msgs/s | consume fetch msgs/s | first batch s |",
             "|---:|---:|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in result["rows"]:
        lines.append(f"| {r['size']} | {r['queues']:,} | {r['flush']} | {r['produce_msgs_per_s']:,.0f} | "
                     f"{r['produce_mb_per_s']:.0f} | {r['consume_msgs_per_s']:,.0f} | {r['consume_fetch_msgs_per_s']:,.0f} | "
                     f"{r['consumer_start_s']:.2f} |")  # fmt: skip
    lat = result.get("latency")
    if lat:
        lines += ["", f"Produce latency, sync flush, 1 KiB, {lat['rate_msgs_per_s']:,.0f} msgs/s in sends of {lat['batch']:.0f}: "
                  f"p50 {lat['p50_ms']:.2f} ms, p99 {lat['p99_ms']:.2f} ms, max {lat['max_ms']:.2f} ms."]  # fmt: skip
    return "\n".join(lines) + "\n"


def cmd_bench_e2e(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .report import save

    console = Console()
    result = run_all(args, lambda line: console.print(line, highlight=False))
    save(result, markdown(result), args.json, args.markdown, console)
    return 0

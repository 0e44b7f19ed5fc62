"""``clmq bench cold-reader``: does a consumer far behind (reading data no longer in
the page cache) hold up the consumers at the tail?

One ``clmq broker`` process, one topic. The topic is filled with ``--backlog-mb`` of
messages, then every file of the broker's data directory is dropped from the page cache
(``os.sync()``, then ``posix_fadvise(DONTNEED)``): reading the backlog now means
reading the disk. Then, twice on the same broker, for ``--seconds`` each: a producer
at ``--rate`` messages/s and a tail consumer (group "hot", from the latest offsets)
that measures produce-to-receive latency (each body starts with its send time, ns);
the second time a lagging consumer (group "cold", from the earliest offsets) also reads
the evicted backlog as fast as it can. Raw requests (``SEND_MESSAGE``,
``PULL_MESSAGES``) over clmq's RpcClient: the broker is measured, not a client library.
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing
import os
import struct
import tempfile
import time
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import trio

from clmq.common import Message
from clmq.protocol import RequestCode, decode_records, encode_batch
from clmq.protocol.transport import RpcClient

from .e2e import BrokerProcess
from .e2e_load import ProcessCpu
from .report import _table, save

STAMP = struct.Struct("<Q")  # a body's first 8 bytes: time.time_ns() when the producer encoded it
FILL_SENDERS = 4  # concurrent sends while filling the backlog
FILL_BATCH = 256  # messages per send while filling
TICK_MESSAGES = 10  # the steady producer sends this many messages (one queue) per tick
HOT_WAIT_MS = 200  # the tail consumer's long poll
WINDOW_S = 0.5  # latency is also reported per window of this long (the plot)


def add_command(bench_sub: Any) -> None:
    """Add ``cold-reader`` to the ``clmq bench`` parser."""
    p = bench_sub.add_parser("cold-reader", help="a lagging consumer reading evicted data against tail consumers")
    a = p.add_argument
    a("--backlog-mb", type=int, default=2048, help="backlog written, then evicted from the page cache (default 2048)")
    a(
        "--rate",
        type=int,
        default=5_000,
        help="steady producer, messages/s (default 5,000: on a 2-core machine this client's Python, producing and "
        "decoding at 20,000/s, was the bottleneck even without the cold reader)",
    )
    a("--seconds", type=float, default=10.0, help="measured seconds per run, without and with the cold reader")
    a("--queues", type=int, default=8, help="queues of the topic (default 8)")
    a("--size", type=int, default=1024, help="message size in bytes (default 1024)")
    a("--cold-pulls", type=int, default=4, help="the cold reader's pulls in flight (default 4)")
    a("--cold-max-messages", type=int, default=1024, help="messages per cold pull (default 1024)")
    a("--settle-seconds", type=float, default=2.0, help="after the fill: os.sync(), then idle this long (default 2)")
    a("--dir", type=Path, default=None, help="where the broker's data directory goes (default: a temporary dir)")
    a("--json", type=Path, default=None, help="where to write the JSON")
    a("--markdown", type=Path, default=None, help="also write the table as Markdown here")
    a("--plot", type=Path, default=None, help="draw the tail consumer's latency over time, both runs (matplotlib)")
    p.set_defaults(func=cmd_bench_cold_reader)


@dataclass
class Phase:
    """One measured run: the tail consumer's throughput and latency, the cold reader's rate."""

    cold_reader: bool
    seconds: float
    produced: int = 0
    hot_messages: int = 0
    hot_msgs_per_s: float = 0.0
    hot_p50_ms: float = 0.0
    hot_p99_ms: float = 0.0
    hot_max_ms: float = 0.0
    cold_messages: int = 0
    cold_msgs_per_s: float = 0.0
    cold_mb_per_s: float = 0.0
    broker_cpu_s: float = 0.0
    windows_p99_ms: list[float] = field(default_factory=list)


def cmd_bench_cold_reader(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console(soft_wrap=True)
    root = args.dir or Path(tempfile.mkdtemp(prefix="clmq-bench-data-", dir=args.out_dir))
    broker = BrokerProcess(root, "async")
    try:
        result = trio.run(_run, broker, args, lambda s: console.print(f"[dim]{s}"))
    finally:
        broker.stop()
    save(result, markdown(result), args.json, args.markdown, console)
    if args.plot:
        if importlib.util.find_spec("matplotlib") is not None:
            plot(result, args.plot)
        else:
            console.print("[yellow]no plot: it needs matplotlib (pip install 'clmq[bench]')")
    return 0


async def _run(broker: BrokerProcess, args: argparse.Namespace, say: Any) -> dict[str, Any]:
    topic = "cold-bench"
    async with trio.open_nursery() as nursery:
        rpc = RpcClient(nursery)
        await rpc.request(broker.addr, RequestCode.CREATE_TOPIC, {"topic": topic, "queue_count": args.queues})
        t0 = time.perf_counter()
        filled = await _fill(rpc, broker.addr, topic, args)
        fill_s = time.perf_counter() - t0
        say(f"backlog: {filled:,} messages ({filled * args.size / 2**20:,.0f} MiB) in {fill_s:.1f} s")
        phases = []
        for cold in (False, True):
            os.sync()
            await trio.sleep(args.settle_seconds)
            evicted = evict(broker.dir / "data")
            say(
                f"evicted {evicted / 2**20:,.0f} MiB from the page cache; "
                f"run {'with' if cold else 'without'} the cold reader"
            )
            phases.append(await _phase(rpc, broker, topic, args, cold))
            say(f"  {asdict(phases[-1]) | {'windows_p99_ms': '...'}}")
        await rpc.aclose()
        nursery.cancel_scope.cancel()
    without, with_ = phases
    # Where results go is not a setting of the run (and a Path is not JSON): out_dir too.
    skip = ("func", "json", "markdown", "plot", "dir", "out_dir")
    settings = {k: v for k, v in vars(args).items() if k not in skip}
    return {
        "settings": settings,
        "backlog_messages": filled,
        "fill_s": fill_s,
        "without": asdict(without),
        "with": asdict(with_),
        "hot_throughput_ratio": with_.hot_msgs_per_s / without.hot_msgs_per_s if without.hot_msgs_per_s else 0.0,
        "aim_ratio": 0.9,
    }


def evict(data_dir: Path) -> int:
    """Drop every file under ``data_dir`` from the page cache (after ``os.sync()``:
    dirty pages are not dropped); the bytes it covered."""
    os.sync()
    total = 0
    for path in data_dir.rglob("*"):
        if not path.is_file():
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:  # deleted meanwhile
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total


def _batch(topic: str, queue_id: int, body: bytes, count: int) -> bytes:
    stamp = STAMP.pack(time.time_ns())
    body = stamp + body[len(stamp) :]
    return encode_batch([Message(topic, queue_id, body, "", born_timestamp_ms=time.time_ns() // 1_000_000)] * count)


async def _fill(rpc: RpcClient, addr: str, topic: str, args: argparse.Namespace) -> int:
    target = args.backlog_mb * 2**20 // args.size
    body = os.urandom(args.size)
    sent = [0]

    async def sender(k: int) -> None:
        q = k
        while sent[0] < target:
            sent[0] += FILL_BATCH
            await rpc.request(
                addr,
                RequestCode.SEND_MESSAGE,
                {"topic": topic},
                _batch(topic, q % args.queues, body, FILL_BATCH),
                timeout_ms=30_000,
            )
            q += FILL_SENDERS

    async with trio.open_nursery() as n:
        for k in range(FILL_SENDERS):
            n.start_soon(sender, k)
    return sent[0]


async def _phase(rpc: RpcClient, broker: BrokerProcess, topic: str, args: argparse.Namespace, cold: bool) -> Phase:
    phase = Phase(cold, args.seconds)
    latencies: list[tuple[float, float]] = []  # (receive time, ms)
    starts = [await _max_offset(rpc, broker.addr, topic, q) for q in range(args.queues)]
    if cold:
        ctx = multiprocessing.get_context("spawn")
        conn, child = ctx.Pipe()
        proc = ctx.Process(
            target=_cold_process,
            daemon=True,
            args=(child, broker.addr, topic, args.queues, args.cold_pulls, args.cold_max_messages),
        )
        proc.start()
        await trio.to_thread.run_sync(conn.recv)  # started: its imports are not in the window
        conn.send(args.seconds)
    cpu = ProcessCpu(broker.proc.pid)
    t0 = time.perf_counter()
    deadline = trio.current_time() + args.seconds
    async with trio.open_nursery() as n:
        n.start_soon(_hot, rpc, broker.addr, topic, starts, latencies, deadline)
        phase.produced = await _produce(rpc, broker.addr, topic, args, deadline)
    elapsed = time.perf_counter() - t0
    phase.broker_cpu_s = cpu.used_s()
    if cold:
        phase.cold_messages, nbytes, cold_s = await trio.to_thread.run_sync(conn.recv)
        proc.join()
        phase.cold_msgs_per_s, phase.cold_mb_per_s = phase.cold_messages / cold_s, nbytes / 2**20 / cold_s
    _summarise(phase, latencies, t0, elapsed)
    return phase


def _summarise(phase: Phase, latencies: list[tuple[float, float]], t0: float, elapsed: float) -> None:
    ms = sorted(lat for _t, lat in latencies)
    phase.hot_messages = len(ms)
    phase.hot_msgs_per_s = len(ms) / elapsed
    if ms:
        phase.hot_p50_ms, phase.hot_p99_ms, phase.hot_max_ms = _pct(ms, 0.5), _pct(ms, 0.99), ms[-1]
    windows: dict[int, list[float]] = {}
    for t, lat in latencies:
        windows.setdefault(int((t - t0) / WINDOW_S), []).append(lat)
    phase.windows_p99_ms = [_pct(sorted(windows.get(i, [0.0])), 0.99) for i in range(int(elapsed / WINDOW_S))]


def _pct(sorted_ms: list[float], q: float) -> float:
    return sorted_ms[min(len(sorted_ms) - 1, int(q * len(sorted_ms)))]


async def _max_offset(rpc: RpcClient, addr: str, topic: str, queue_id: int) -> int:
    reply = await rpc.request(addr, RequestCode.QUERY_OFFSETS, {"topic": topic, "queue_id": queue_id})
    offset: int = reply.fields["max_offset"]
    return offset


async def _produce(rpc: RpcClient, addr: str, topic: str, args: argparse.Namespace, deadline: float) -> int:
    """Every ``TICK_MESSAGES / rate`` seconds one send (its own task) to the next queue."""
    body = os.urandom(args.size)
    period = TICK_MESSAGES / args.rate
    start, i = trio.current_time(), 0

    async def one(queue_id: int) -> None:
        await rpc.request(
            addr,
            RequestCode.SEND_MESSAGE,
            {"topic": topic},
            _batch(topic, queue_id, body, TICK_MESSAGES),
            timeout_ms=30_000,
        )

    async with trio.open_nursery() as n:
        while start + i * period < deadline:
            await trio.sleep_until(start + i * period)
            n.start_soon(one, i % args.queues)
            i += 1
    return i * TICK_MESSAGES


async def _hot(
    rpc: RpcClient, addr: str, topic: str, offsets: list[int], latencies: list[tuple[float, float]], deadline: float
) -> None:
    """The tail consumer: one pull of every queue at a time, long polling; each
    message's latency from its send time."""
    with trio.move_on_at(deadline):
        while True:
            asks = [[topic, q, o, None] for q, o in enumerate(offsets)]
            reply = await rpc.request(
                addr,
                RequestCode.PULL_MESSAGES,
                {"queues": asks, "max_messages": 4096, "max_per_queue": 1024, "max_wait_ms": HOT_WAIT_MS},
                timeout_ms=60_000,
            )
            now_ns, now = time.time_ns(), time.perf_counter()
            for q, row in enumerate(reply.fields["results"]):
                offsets[q] = row[1]
            for rec in decode_records(reply.body) if reply.body else []:
                latencies.append((now, (now_ns - STAMP.unpack_from(rec.body)[0]) / 1e6))


def _cold_process(conn: Connection, addr: str, topic: str, queues: int, pulls: int, max_messages: int) -> None:
    """The lagging consumer's own process (its receiving must not slow the tail
    consumer's client down): says "ready", waits for the seconds to run, sends back
    (messages, bytes, seconds)."""
    conn.send("ready")
    seconds = conn.recv()
    conn.send(trio.run(_cold, addr, topic, queues, pulls, max_messages, seconds))


async def _cold(
    addr: str, topic: str, queues: int, pulls: int, max_messages: int, seconds: float
) -> tuple[int, int, float]:
    """From the earliest offsets, ``pulls`` pulls in flight (each over its share of the
    queues), no long poll; counts, does not decode."""
    offsets = [0] * queues
    got = [0, 0]  # messages, bytes

    async def puller(rpc: RpcClient, k: int) -> None:
        mine = [q for q in range(queues) if q % pulls == k]
        while mine:
            asks = [[topic, q, offsets[q], None] for q in mine]
            reply = await rpc.request(
                addr,
                RequestCode.PULL_MESSAGES,
                {"queues": asks, "max_messages": max_messages, "max_per_queue": max_messages, "max_wait_ms": 0},
                timeout_ms=60_000,
            )
            rows = dict(zip(mine, reply.fields["results"]))
            for q, row in rows.items():
                offsets[q] = row[1]
                got[0] += row[2]
            got[1] += len(reply.body)
            # caught up: no longer a cold reader (a SKIPPED row, max_offset -1, was not read this time)
            mine = [q for q in mine if rows[q][4] < 0 or rows[q][1] < rows[q][4]]

    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        rpc = RpcClient(nursery)
        with trio.move_on_after(seconds):
            async with trio.open_nursery() as n:
                for k in range(min(pulls, queues)):
                    n.start_soon(puller, rpc, k)
        elapsed = time.perf_counter() - t0
        await rpc.aclose()
        nursery.cancel_scope.cancel()
    return got[0], got[1], elapsed


def markdown(result: dict[str, Any]) -> str:
    """The two runs side by side, and the ratio against the aim."""
    rows = []
    for name in ("without", "with"):
        p = result[name]
        rows.append(
            [
                name,
                f"{p['produced']:,}",
                f"{p['hot_msgs_per_s']:,.0f}",
                f"{p['hot_p50_ms']:.1f}",
                f"{p['hot_p99_ms']:.1f}",
                f"{p['hot_max_ms']:.0f}",
                f"{p['cold_msgs_per_s']:,.0f}",
                f"{p['cold_mb_per_s']:.1f}",
                f"{p['broker_cpu_s']:.1f}",
            ]
        )
    s = result["settings"]
    head = (
        f"Cold reader: {result['backlog_messages']:,} messages of {s['size']} B evicted from the page cache; "
        f"producer at {s['rate']:,} msgs/s over {s['queues']} queues, {s['seconds']:.0f} s per run. "
        f"Hot throughput with/without: **{result['hot_throughput_ratio']:.2f}** (aim >= {result['aim_ratio']}).\n\n"
    )
    return head + _table(
        [
            "cold reader",
            "produced",
            "hot msgs/s",
            "hot p50 ms",
            "hot p99 ms",
            "hot max ms",
            "cold msgs/s",
            "cold MB/s",
            "broker CPU s",
        ],
        rows,
    )


def plot(result: dict[str, Any], path: Path) -> None:
    """The tail consumer's p99 latency per window, without and with the cold reader."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for name in ("without", "with"):
        w = result[name]["windows_p99_ms"]
        ax.plot([i * WINDOW_S for i in range(len(w))], w, label=f"{name} cold reader")
    ax.set_xlabel("seconds")
    ax.set_ylabel(f"tail consumer p99 latency per {WINDOW_S} s, ms")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title(f"hot throughput with/without: {result['hot_throughput_ratio']:.2f}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)

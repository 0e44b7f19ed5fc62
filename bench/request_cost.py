"""``clmq bench request-cost``: the broker's CPU time per small request.

A real ``clmq broker`` process per flush mode; this process sends one-message
SEND_MESSAGE requests (and, with ``--kind pull``, one-message PULL_MESSAGE requests) on
ONE connection, keeping ``concurrency`` of them in flight, through the raw client path
(``RpcClient`` and ``Producer.send_to``: the client does as little as it can, so that the
broker's cost is what is measured). The broker's CPU time (user + system, every thread,
from its CPU-time clock, :mod:`bench.cpu`) is read before and after each case: CPU microseconds per
request is the figure (less noisy than wall time on a shared machine). The aim is at
most 50 us per small produce request.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable

import trio

from clmq.client import Producer, Routes, open_admin
from clmq.common import Message
from clmq.protocol import RequestCode, encode_batch
from clmq.protocol.transport import RpcClient

from .cpu import cpu_seconds
from .e2e import BrokerProcess

AIM_US = 50.0  # the aim of issue 17: broker CPU per small produce request
TOPIC = "cost"


@dataclass
class Cost:
    kind: str  # "produce" or "pull"
    flush: str
    concurrency: int
    requests: int
    seconds: float
    requests_per_s: float
    broker_cpu_s: float
    broker_us_per_request: float
    client_us_per_request: float


def add_command(bench_sub: Any) -> None:
    p = bench_sub.add_parser("request-cost", help="broker CPU time per small request, many in flight on one connection")
    p.add_argument("--concurrency", default="1,64,200,1000", help="requests in flight (default 1,64,200,1000)")
    p.add_argument("--requests", type=int, default=20_000, help="requests per case (default 20,000)")
    p.add_argument("--runs", type=int, default=3, help="runs; medians are reported (default 3)")
    p.add_argument("--size", type=int, default=1024, help="message body bytes (default 1024)")
    p.add_argument("--flush", default="async,sync", help="flush modes (default async,sync)")
    p.add_argument("--kind", default="produce", help="produce, pull, or both: produce,pull (default produce)")
    p.add_argument("--json", type=Path, default=None, help="where to write the JSON (default: in --out-dir)")
    p.add_argument("--markdown", type=Path, default=None, help="also write the tables as Markdown here")
    p.add_argument("--plot", type=Path, default=None, help="where to draw the plot (default: beside the JSON)")
    p.set_defaults(func=cmd_bench_request_cost)


async def _keep_in_flight(concurrency: int, requests: int, one: Callable[[int], Awaitable[None]]) -> None:
    """Run ``one(i)`` for i in 0..requests-1, ``concurrency`` at a time."""
    counter = iter(range(requests))

    async def worker() -> None:
        for i in counter:
            await one(i)

    async with trio.open_nursery() as nursery:
        for _ in range(min(concurrency, requests)):
            nursery.start_soon(worker)


async def _measure(
    pid: int, kind: str, flush: str, concurrency: int, requests: int, one: Callable[[int], Awaitable[None]]
) -> Cost:
    await _keep_in_flight(concurrency, min(requests, 200), one)  # warm up: connection, code paths
    broker0, client0, t0 = cpu_seconds(pid), time.process_time(), time.perf_counter()
    await _keep_in_flight(concurrency, requests, one)
    elapsed = time.perf_counter() - t0
    broker_s, client_s = cpu_seconds(pid) - broker0, time.process_time() - client0
    return Cost(
        kind,
        flush,
        concurrency,
        requests,
        elapsed,
        requests / elapsed,
        broker_s,
        broker_s / requests * 1e6,
        client_s / requests * 1e6,
    )


async def _cases(
    broker: BrokerProcess, flush: str, args: argparse.Namespace, report: Callable[[str], None]
) -> list[Cost]:
    levels = [int(x) for x in args.concurrency.split(",") if x]
    kinds = args.kind.split(",")
    out: list[Cost] = []
    async with open_admin(broker_addrs=[broker.addr]) as admin:
        await admin.create_topic(TOPIC, 1, on=[broker.addr])
    async with trio.open_nursery() as nursery:
        rpc = RpcClient(nursery)
        producer = Producer(rpc, Routes(rpc, [], broker_addrs=[broker.addr]))
        mq = (await producer.routes.queues(TOPIC))[0]
        body = encode_batch([Message(TOPIC, 0, os.urandom(args.size), "TagA")])

        async def produce(_i: int) -> None:
            await producer.send_to(mq, body, 1)

        async def pull(i: int) -> None:
            fields = {"topic": TOPIC, "queue_id": 0, "offset": i, "max_messages": 1}
            await rpc.request(broker.addr, RequestCode.PULL_MESSAGE, fields, timeout_ms=30_000)

        for kind in kinds:
            for c in levels:
                cost = await _measure(
                    broker.proc.pid, kind, flush, c, args.requests, produce if kind == "produce" else pull
                )
                out.append(cost)
                report(
                    f"{kind}, {flush} flush, {c} in flight: {cost.broker_us_per_request:.0f} us of broker CPU per "
                    f"request, {cost.requests_per_s:,.0f} requests/s, client {cost.client_us_per_request:.0f} us"
                )
        await rpc.aclose()
        nursery.cancel_scope.cancel()
    return out


REGRESSION_CONCURRENCY = 200  # the regression line: one-message produce requests, this many in flight


def run_all(args: argparse.Namespace, report: Callable[[str], None]) -> dict[str, Any]:
    """Every case (flush x kind x concurrency) ``--runs`` times, the flush modes'
    order reversed every other run; a broker process per flush mode and run. With
    ``--kind pull`` alone, ``--requests`` messages are produced first, to be pulled.
    The rows are the medians; ``regression``: the produce case at
    ``REGRESSION_CONCURRENCY`` in flight per flush mode, against the aim."""
    root = Path(tempfile.mkdtemp(prefix="clmq-bench-cost-"))
    samples: list[dict[str, Any]] = []
    flushes = args.flush.split(",")
    for r in range(args.runs):
        for flush in flushes if r % 2 == 0 else flushes[::-1]:
            broker = BrokerProcess(root, flush)
            try:
                if "produce" not in args.kind.split(","):
                    trio.run(_fill, broker.addr, args)
                samples += [{**asdict(c), "run": r} for c in trio.run(_cases, broker, flush, args, report)]
            finally:
                broker.stop()
    shutil.rmtree(root, ignore_errors=True)
    rows = _medians(samples)
    regression = [
        {
            "flush": row["flush"],
            "concurrency": row["concurrency"],
            "broker_us_per_request": row["broker_us_per_request"],
            "aim_us": AIM_US,
            "met": row["broker_us_per_request"] <= AIM_US,
        }
        for row in rows
        if row["kind"] == "produce" and row["concurrency"] == REGRESSION_CONCURRENCY
    ]
    return {
        "requests": args.requests,
        "size": args.size,
        "runs": args.runs,
        "aim_us": AIM_US,
        "rows": rows,
        "regression": regression,
        "samples": samples,
    }


def _medians(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (kind, flush, concurrency), in first-seen order: the runs' medians."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for s in samples:
        groups.setdefault((s["kind"], s["flush"], s["concurrency"]), []).append(s)
    rows = []
    for group in groups.values():
        row = {k: v for k, v in group[0].items() if k != "run"}
        for k, v in row.items():
            if isinstance(v, float):
                row[k] = statistics.median(g[k] for g in group)
        rows.append(row)
    return rows


async def _fill(addr: str, args: argparse.Namespace) -> None:
    """Messages for pulls to read when no produce case runs first."""
    async with open_admin(broker_addrs=[addr]) as admin:
        await admin.create_topic(TOPIC, 1, on=[addr])
    async with trio.open_nursery() as nursery:
        rpc = RpcClient(nursery)
        producer = Producer(rpc, Routes(rpc, [], broker_addrs=[addr]))
        mq = (await producer.routes.queues(TOPIC))[0]
        body = os.urandom(args.size)
        for _start in range(0, args.requests + 200, 256):
            await producer.send_to(mq, encode_batch([Message(TOPIC, 0, body) for _ in range(256)]), 256)
        await rpc.aclose()
        nursery.cancel_scope.cancel()


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "| kind | flush | in flight | broker CPU us / request | requests/s | client CPU us / request |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['kind']} | {r['flush']} | {r['concurrency']:,} | {r['broker_us_per_request']:.0f} | "
            f"{r['requests_per_s']:,.0f} | {r['client_us_per_request']:.0f} |"
        )
    lines += [
        "",
        f"{result['requests']:,} one-message requests of {result['size']} B per case, on one connection; medians "
        f"of {result.get('runs', 1)} runs; aim: at most {result['aim_us']:.0f} us of broker CPU per produce request.",
    ]
    for g in result.get("regression", []):
        verdict = "met" if g["met"] else "**not met**"
        lines.append(
            f"Regression line: produce, {g['flush']} flush, {g['concurrency']} in flight: "
            f"{g['broker_us_per_request']:.0f} us (aim <= {g['aim_us']:.0f} us: {verdict})."
        )
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    """Bars of broker CPU us per request, per concurrency, one bar per kind and flush;
    a line at the aim."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    levels = sorted({r["concurrency"] for r in rows})
    series = sorted({(r["kind"], r["flush"]) for r in rows})
    width = 0.8 / max(1, len(series))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for k, (kind, flush) in enumerate(series):
        values = {
            r["concurrency"]: r["broker_us_per_request"] for r in rows if (r["kind"], r["flush"]) == (kind, flush)
        }
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(levels))]
        ax.bar(xs, [values.get(c, 0.0) for c in levels], width, label=f"{kind}, {flush} flush")
    ax.axhline(result["aim_us"], color="red", linestyle="--", label=f"aim: {result['aim_us']:.0f} us")
    ax.set_xticks(range(len(levels)), [f"{c:,}" for c in levels])
    ax.set_xlabel("requests in flight on one connection")
    ax.set_ylabel("broker CPU us per request")
    ax.set_title(f"broker CPU per one-message request ({result['size']} B)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cmd_bench_request_cost(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .report import save

    console = Console(soft_wrap=True)
    result = run_all(args, lambda line: console.print(line, highlight=False))
    save(result, markdown(result), args.json, args.markdown, console)
    for g in result["regression"]:
        console.print(
            f"regression line: produce, {g['flush']} flush, {g['concurrency']} in flight: "
            f"{g['broker_us_per_request']:.0f} us of broker CPU per request (aim <= {g['aim_us']:.0f}: "
            + ("met)" if g["met"] else "NOT met)"),
            highlight=False,
        )
    if importlib.util.find_spec("matplotlib") is not None:  # the bench extra
        plot(result, args.plot)
        console.print(f"plot written to {args.plot}")
    return 0

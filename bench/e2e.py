"""``clmq bench e2e``: produce and consume through a real broker over loopback.

The broker runs in its own process (its own interpreter and core), started fresh per
case on an empty data directory; the clients run in this process with clmq's own trio
client, through several APIs (``--api``): ``public`` and ``public-many``, exactly what a
user writes (``submit`` per message, or ``submit_many`` per window: ``e2e_public``), and
``raw``, batches encoded by the benchmark and sent as they are (``e2e_raw``). Cases:
the timed case (message size x queue count x flush mode: produce for ``--seconds``,
then a consumer group reads everything back), the sparse case (a
fixed total spread over 1 to 65,536 queues, so that at 65,536 each holds about 3), and
produce latency at a fixed rate with synchronous flush. Figures in ``e2e_report``, the
plot in ``e2e_plot``. With ``--tls`` and ``--auth`` the throughput cases run in each
security mode too, against plaintext in the same run (``e2e_security``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping

import trio

from clmq.client import open_admin
from clmq.protocol.transport import ClientSecurity

from .e2e_load import Consumed, Load, ProcessCpu, Produced
from .e2e_public import consume_public, latency_public, produce_batches, produce_many, produce_public
from .e2e_raw import consume_raw, latency_raw, produce_raw
from .e2e_report import Latency, Throughput, aims, latency_of, markdown, medians
from .e2e_security import PLAIN, Mode, Modes, modes_of, summary

PRODUCE: dict[str, Callable[[str, Load, ClientSecurity | None], Awaitable[Produced]]] = {
    "public": produce_public,
    "public-many": produce_many,
    "public-batches": produce_batches,
    "raw": produce_raw,
}
CONSUME: dict[str, Callable[[str, str, int, ClientSecurity | None], Awaitable[Consumed]]] = {
    "public": consume_public,
    "public-many": consume_public,
    "public-batches": consume_public,
    "raw": consume_raw,
}
LATENCY_QUEUES = 8  # the latency case's topic
RAW_LATENCY_BATCH = 10  # raw: messages per send in the latency case (public: one per send)
DEFAULTS = {"sizes": "1024", "queues": "1,1000,10000", "flush": "async,sync"}
SECURITY_ONLY = {"sizes": "1024", "queues": "1,1000", "flush": "async"}  # --security-only's defaults


def _ints(text: str) -> list[int]:
    return [int(x.replace("_", "")) for x in text.split(",") if x]


def _apis(text: str) -> list[str]:
    apis = [a.strip() for a in text.split(",") if a.strip()]
    unknown = [a for a in apis if a not in PRODUCE]
    if unknown or not apis:
        raise argparse.ArgumentTypeError(f"unknown api {unknown}: choose among {', '.join(PRODUCE)}")
    return apis


def add_command(bench_sub: Any) -> None:
    p = bench_sub.add_parser("e2e", help="produce and consume through a broker over loopback")
    a = p.add_argument
    a(
        "--api",
        type=_apis,
        default=["public", "public-many", "raw"],
        help="client APIs, comma-separated (default public,public-many,raw: one run gives all, cases alternated so "
        "that drift affects all alike). public: what a user writes, with default options: open_producer, per message "
        "submit(topic, body, selector=...) then flush(); open_consumer and receive(). public-many: per window of "
        "1,000 messages one submit_many(topic, bodies) (round robin), then flush(). public-batches: per window of "
        "1,000 messages one send_batch per queue it touches, concurrently (issue 17's first measurement). raw: "
        "batches encoded by the bench and sent with Producer.send_to, --producers in flight, --batch per request "
        "(sparse case: message i to queue i mod Q, so a request spans up to --batch queues), read back with "
        "pull_batch 1024 and buffered_batches 256",
    )
    a("--sizes", default=None, help="message sizes in bytes (default 1024, e.g. 100,1024; --security-only: 1024)")
    a("--queues", default=None, help="queue counts (default 1,1000,10000; --security-only: 1,1000)")
    a("--flush", default=None, help="flush modes (default async,sync; --security-only: async)")
    a("--seconds", type=float, default=3.0, help="seconds of producing per timed case (default 3)")
    a(
        "--sparse-total",
        type=int,
        default=200_000,
        help="sparse case: messages spread over --sparse-queues, produced then consumed (default 200,000; 0: skip)",
    )
    a(
        "--sparse-queues",
        default="1,65536",
        help="sparse case: queue counts (default 1,65536: about 3 messages per queue at the top of the range, "
        "issue 34's case; e.g. 1,1000,10000,65536)",
    )
    a("--sparse-size", type=int, default=1024, help="sparse case: message size in bytes, async flush (default 1024)")
    a("--runs", type=int, default=3, help="runs; medians are reported (default 3)")
    a("--producers", type=int, default=4, help="raw: concurrent batch senders (default 4)")
    a("--batch", type=int, default=256, help="raw: messages per request (default 256)")
    a(
        "--latency-rate",
        type=int,
        default=10_000,
        help="msgs/s for the latency case, sync flush, 1 KiB (default 10,000; 0: skip). public: one send per message, "
        "each awaited in its own task; raw: sends of 10",
    )
    a(
        "--settle-seconds",
        type=float,
        default=3.0,
        help="before each case: os.sync(), then this long idle, so that a case does not measure the "
        "previous one's writeback and file deletions (default 3)",
    )
    a(
        "--tls",
        action="store_true",
        help="also run every throughput case through TLS (a throw-away CA and certificate made for the run; no "
        "sendfile for readers), against plaintext in the same run, the modes alternated (aims: produce >= 0.7, "
        "consume >= 0.5 x plaintext). The latency case stays plaintext",
    )
    a(
        "--auth",
        action="store_true",
        help="also run every throughput case with auth_enabled: producer and consumer log in (SCRAM-SHA-256) as a "
        "user that is not a super user, each request decided by its ACLs (aim: >= 0.95 x plaintext). With --tls: "
        "also TLS and authentication together",
    )
    a(
        "--security-only",
        action="store_true",
        help="with --tls and/or --auth: the timed cases only (no sparse case, no latency case), by default at 1 KiB, "
        "1 and 1,000 queues, async flush",
    )
    a("--json", type=Path, default=None, help="every case of every run, the medians and the aims")
    a("--markdown", type=Path, default=None, help="also write the tables and the aims as Markdown here")
    a(
        "--plot",
        type=Path,
        default=None,
        help="draw produce and consume per queue count against the aims (matplotlib; with --tls or --auth: each "
        "mode against plaintext)",
    )
    p.set_defaults(func=cmd_bench_e2e)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class BrokerProcess:
    """``clmq broker`` in a subprocess, on a fresh data directory."""

    def __init__(self, root: Path, flush: str, storage_mode: str = "commitlog", mode: Mode | None = None) -> None:
        """``mode``: the security settings (as ``CLMQ_*`` variables) and the users and
        ACLs seeded into the data directory; None: plaintext, no logins."""
        self.dir = Path(tempfile.mkdtemp(dir=root))
        self.port = _free_port()
        self.addr = f"127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "clmq",
            "broker",
            "--listen-port",
            str(self.port),
            "--data-dir",
            str(self.dir / "data"),
            "--flush-mode",
            flush,
            "--storage-mode",
            storage_mode,
        ]
        env: Mapping[str, str] | None = None
        if mode is not None:
            mode.seed(self.dir / "data")
            env = {**os.environ, **mode.broker_env}
        self.log = self.dir / "broker.log"  # a file, not a pipe: a full pipe would stall the broker
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(self.log, "wb"), env=env)  # noqa: SIM115 - the broker process owns it
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
        problems = [
            line for line in self.log.read_text(errors="replace").splitlines() if "ERROR" in line or "Traceback" in line
        ]
        if problems:
            print(f"broker log ({self.log}): {len(problems)} errors, first: {problems[0]}", file=sys.stderr)
        subprocess.run(["rm", "-rf", str(self.dir)], check=False)


async def _case(broker: BrokerProcess, api: str, case: str, load: Load, flush: str, mode: Mode) -> Throughput:
    async with open_admin(broker_addrs=[broker.addr], security=mode.admin) as admin:
        await admin.create_topic(load.topic, load.queues, on=[broker.addr])
    client, server = ProcessCpu(), ProcessCpu(broker.proc.pid)
    produced = await PRODUCE[api](broker.addr, load, mode.client)
    produce_cpu = (client.used_s(), server.used_s())
    stored = produced.sent - produced.failed
    if stored <= 0:
        raise RuntimeError(f"{api}: no message stored ({produced.failed:,} failed)")
    client, server = ProcessCpu(), ProcessCpu(broker.proc.pid)
    consumed = await CONSUME[api](broker.addr, load.topic, stored, mode.client)
    consume_cpu = (client.used_s(), server.used_s())
    rate = stored / produced.elapsed_s
    return Throughput(
        api,
        case,
        load.size,
        load.queues,
        flush,
        rate,
        rate * load.size / 1e6,
        consumed.overall_msgs_per_s,
        consumed.fetch_msgs_per_s,
        consumed.first_batch_s,
        stored,
        produced.failed,
        consumed.messages,
        produce_cpu[0] * 1e6 / stored,
        produce_cpu[1] * 1e6 / stored,
        consume_cpu[0] * 1e6 / stored,
        consume_cpu[1] * 1e6 / stored,
        produced.call,
        mode.name,
    )


def _run_case(
    root: Path, api: str, case: str, load: Load, flush: str, args: argparse.Namespace, mode: Mode
) -> Throughput:
    _settle(args.settle_seconds)
    broker = BrokerProcess(root, flush, mode=mode)
    try:
        return trio.run(_case, broker, api, case, load, flush, mode)
    finally:
        broker.stop()


def _line(r: int, args: argparse.Namespace, t: Throughput) -> str:
    return (
        f"run {r + 1}/{args.runs}: {t.api}, {t.case}"
        + ("" if t.mode == PLAIN else f", {t.mode}")
        + f": {t.size} B x {t.queues:,} queues, {t.flush} flush: "
        f"produce {t.produce_msgs_per_s:,.0f} msgs/s ({t.produce_client_cpu_us_per_msg:.1f} / "
        f"{t.produce_broker_cpu_us_per_msg:.1f} µs CPU per message in client / broker), consume "
        f"{t.consume_msgs_per_s:,.0f} msgs/s (fetch {t.consume_fetch_msgs_per_s:,.0f}, first batch after "
        f"{t.consumer_start_s:.2f} s), {t.consumed:,} of {t.messages:,} read back"
        + (f", {t.failed:,} failed" if t.failed else "")
    )


def _resolve(args: argparse.Namespace) -> None:
    """The case options left unset get their defaults (``--security-only``'s with it);
    ``--security-only`` skips the sparse and latency cases."""
    for name, default in (SECURITY_ONLY if args.security_only else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.security_only:
        args.sparse_total, args.latency_rate = 0, 0


def run_all(args: argparse.Namespace, report: Callable[[str], None]) -> dict[str, Any]:
    """Every case ``args.runs`` times (the APIs alternated, and the security modes
    within each API, their order reversed every other run); the samples, their medians
    and the aims."""
    _resolve(args)
    root = Path(tempfile.mkdtemp(prefix="clmq-bench-e2e-"))
    apis: list[str] = args.api
    names = modes_of(args.tls, args.auth)
    timed = [
        Load("bench", s, q, seconds=args.seconds, producers=args.producers, batch=args.batch)
        for s in _ints(args.sizes)
        for q in _ints(args.queues)
    ]
    sparse = (
        [
            Load("bench", args.sparse_size, q, total=args.sparse_total, producers=args.producers, batch=args.batch)
            for q in _ints(args.sparse_queues)
        ]
        if args.sparse_total > 0
        else []
    )
    samples: list[dict[str, Any]] = []
    sparse_samples: list[dict[str, Any]] = []
    lat_samples: dict[str, list[dict[str, Any]]] = {api: [] for api in apis if api in ("public", "raw")}
    try:
        modes = Modes(root, names, ["bench"])
        for r in range(args.runs):
            order = apis if r % 2 == 0 else apis[::-1]
            mode_order = names if r % 2 == 0 else names[::-1]
            for flush in args.flush.split(","):
                for load in timed:
                    for api in order:
                        for m in mode_order:
                            t = _run_case(root, api, "timed", load, flush, args, modes[m])
                            samples.append({**asdict(t), "run": r})
                            report(_line(r, args, t))
            for load in sparse:
                for api in order:
                    for m in mode_order:
                        t = _run_case(root, api, "sparse", load, "async", args, modes[m])
                        sparse_samples.append({**asdict(t), "run": r})
                        report(_line(r, args, t))
            for api in (a for a in order if a in lat_samples and args.latency_rate):
                lat = _latency_case(root, api, args)
                lat_samples[api].append(asdict(lat))
                report(
                    f"run {r + 1}/{args.runs}: {api}, sync flush at {args.latency_rate:,} msgs/s: "
                    f"p50 {lat.p50_ms:.2f} ms, "
                    f"p99 {lat.p99_ms:.2f} ms, max {lat.max_ms:.2f} ms"
                    + (f", {lat.failed:,} sends failed" if lat.failed else "")
                )
    finally:
        subprocess.run(["rm", "-rf", str(root)], check=False)
    return _result(args, samples, sparse_samples, lat_samples, names)


def _result(
    args: argparse.Namespace,
    samples: list[dict[str, Any]],
    sparse_samples: list[dict[str, Any]],
    lat_samples: dict[str, list[dict[str, Any]]],
    modes: list[str],
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "runs": args.runs,
        "apis": args.api,
        "seconds": args.seconds,
        "producers": args.producers,
        "batch": args.batch,
        "sparse_total": args.sparse_total,
        "rows": medians(samples),
        "sparse": medians(sparse_samples),
        "latency": {api: medians(v)[0] for api, v in lat_samples.items() if v},
        "samples": {"rows": samples, "sparse": sparse_samples, "latency": lat_samples},
    }
    out["aims"] = aims(out)
    if len(modes) > 1:
        out["security"] = summary(samples + sparse_samples, modes)
    return out


def _settle(seconds: float) -> None:
    """Let the previous case's I/O finish. Each case leaves hundreds of megabytes of
    dirty pages and, deleted, thousands of queue files: measured with a 10,000-queue
    consumer, the next case ran at 0.65-0.75 of its rate on a quiet disk."""
    os.sync()
    time.sleep(seconds)


def _latency_case(root: Path, api: str, args: argparse.Namespace) -> Latency:
    # The throughput cases leave gigabytes of dirty pages; their writeback would share
    # the disk with this case's fsyncs. Measure the broker, not the previous cases.
    _settle(args.settle_seconds)
    broker = BrokerProcess(root, "sync")
    seconds = max(3.0, args.seconds)
    try:

        async def main() -> tuple[list[float], int]:
            async with open_admin(broker_addrs=[broker.addr]) as admin:
                await admin.create_topic("lat", LATENCY_QUEUES, on=[broker.addr])
            if api == "raw":
                return await latency_raw(broker.addr, "lat", args.latency_rate, seconds, RAW_LATENCY_BATCH)
            return await latency_public(broker.addr, "lat", args.latency_rate, seconds, LATENCY_QUEUES)

        lat, failed = trio.run(main)
    finally:
        broker.stop()
    return latency_of(api, args.latency_rate, RAW_LATENCY_BATCH if api == "raw" else 1, lat, failed)


def cmd_bench_e2e(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .report import save

    if args.security_only and not (args.tls or args.auth):
        print("clmq bench e2e: --security-only needs --tls or --auth (or both)", file=sys.stderr)
        return 2
    console = Console(soft_wrap=True)
    result = run_all(args, lambda line: console.print(line, highlight=False))
    save(result, markdown(result), args.json, args.markdown, console)
    if args.plot is not None:
        if importlib.util.find_spec("matplotlib") is not None:  # the bench extra
            if "security" in result:
                from .e2e_security import plot
            else:
                from .e2e_plot import plot

            plot(result, args.plot)
            console.print(f"plot: {args.plot}")
        else:
            console.print("[yellow]no plot: it needs matplotlib (pip install 'clmq[bench]')")
    return 0

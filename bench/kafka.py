"""``clmq bench kafka``: Kafka's clients through the broker's Kafka listener against
clmq's own client through the native listener, on one broker process.

Per case a fresh ``clmq broker --kafka-port ...`` process on an empty data directory
(the Kafka group coordinator's initial rebalance delay set to 0, so that a lone
consumer does not wait 3 s), a topic created with P queues (P partitions), and the
client in a process of its own (``kafka_load``), so that its CPU does not compete with
the measuring. Cases:

- **produce**: ``--messages`` messages of ``--size`` bytes (or for ``--seconds``),
  message i to partition i mod P, at each ``--partitions`` count and ``--flush`` mode
  (the broker's ``flush_mode``), librdkafka (acks=all) and clmq's client alternated
  (Kafka, native, Kafka, ...; the order reversed every other run);
- **consume**: with async flush and P in ``--consume-partitions``, after the produce
  case the same client type reads everything back in a consumer group;
- **latency**: ``--latency-rate`` messages a second for ``--latency-seconds``, acks=all,
  each timed from its call to its acknowledgement;
- **broker CPU** per message (the process CPU clock, :mod:`bench.cpu`, between the client's
  ``ready`` and its result) in each case, and the ratio Kafka / native;
- with ``--kafka-tools VERSION`` (Maven and java found): Kafka's own
  ``ProducerPerformance`` / ``ConsumerPerformance`` (``org.apache.kafka:kafka-tools``,
  fetched with Maven into ``~/.m2``) as extra rows (``kafka-java``).

``--profile-dir``: every broker runs under ``clmq.bench.profiled`` (cProfile in every
thread); with a consume case the broker is restarted on the same data directory before
consuming, so that the produce and the consume profiles are apart. Profiled runs'
figures are not comparable with unprofiled ones; their summary is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import trio

from clmq.client import open_admin

from .cpu import cpu_seconds
from .kafka_report import (
    CONSUME_KEY,
    LATENCY_KEY,
    PRODUCE_KEY,
    ConsumeSample,
    LatencySample,
    ProduceSample,
    aims,
    cpu_ratios,
    markdown,
    medians,
)

CLIENTS = ("kafka", "native")
START_TIMEOUT_S = 60.0
LOAD_TIMEOUT_S = 600.0
# What a lone consumer would otherwise wait before its group forms (Kafka's default 3 s).
BROKER_ENV = {"CLMQ_KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS": "0"}


def _ints(text: str) -> list[int]:
    return [int(x.replace("_", "")) for x in text.split(",") if x.strip()]


def _clients(text: str) -> list[str]:
    clients = [c.strip() for c in text.split(",") if c.strip()]
    if not clients or any(c not in CLIENTS for c in clients):
        raise argparse.ArgumentTypeError(f"clients: a list of {', '.join(CLIENTS)}, got {text!r}")
    return clients


def add_command(bench_sub: Any) -> None:
    p = bench_sub.add_parser("kafka", help="Kafka clients through the Kafka listener against clmq's client")
    a = p.add_argument
    a("--clients", type=_clients, default=list(CLIENTS), help="kafka (librdkafka) and/or native (default both)")
    a("--partitions", type=_ints, default=[1, 1000, 10000], help="partition counts (default 1,1000,10000)")
    a("--consume-partitions", type=_ints, default=[1, 1000], help="consume cases, async flush (default 1,1000)")
    a("--flush", default="async,sync", help="the broker's flush modes (default async,sync)")
    a("--messages", type=int, default=200_000, help="messages per produce case (default 200,000)")
    a("--seconds", type=float, default=None, help="produce for this long instead of --messages")
    a("--size", type=int, default=1024, help="message size in bytes (default 1024)")
    a("--runs", type=int, default=3, help="runs; medians are reported (default 3)")
    a("--linger-ms", type=int, default=5, help="linger.ms of librdkafka and linger_ms of clmq's client (default 5)")
    a(
        "--native-api",
        choices=["submit", "submit_batch"],
        default="submit",
        help="clmq's producer: one submit per message (default), or per window of 1,000 messages one submit_batch "
        "per queue",
    )
    a("--latency-rate", type=int, default=10_000, help="msgs/s of the latency case (default 10,000; 0: skip)")
    a("--latency-seconds", type=float, default=5.0, help="length of the latency case (default 5)")
    a("--latency-partitions", type=int, default=8, help="partitions of the latency case's topic (default 8)")
    a("--latency-flush", default="async,sync", help="flush modes of the latency case (default async,sync)")
    a("--settle-seconds", type=float, default=1.0, help="os.sync() then this long idle before each case (default 1)")
    a(
        "--kafka-tools",
        default=None,
        metavar="VERSION",
        help="also run Kafka's ProducerPerformance/ConsumerPerformance of org.apache.kafka:kafka-tools:VERSION "
        "(e.g. 3.9.0; fetched with Maven) at async flush (default: skip)",
    )
    a("--profile-dir", type=Path, default=None, help="run every broker under cProfile, profiles here (see docstring)")
    a("--json", type=Path, default=None, help="every sample, the medians, the CPU ratios and the aims")
    a("--markdown", type=Path, default=None, help="also write the tables and the aims as Markdown here")
    a("--plot", type=Path, default=None, help="draw the figures against the aims (matplotlib)")
    p.set_defaults(func=cmd_bench_kafka)


class KafkaBroker:
    """``clmq broker`` with a Kafka listener in a subprocess; ``data``: reuse a data
    directory (a restart), else a fresh one under ``root``; ``env``: more of the broker's
    environment (``CLMQ_<FIELD>`` settings)."""

    def __init__(
        self,
        root: Path,
        flush: str,
        data: Path | None = None,
        profile: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.dir = data.parent if data is not None else Path(tempfile.mkdtemp(dir=root))
        self.data = self.dir / "data"
        module = ["-m", "clmq.bench.profiled", str(profile)] if profile else ["-m", "clmq"]
        cmd = [
            sys.executable,
            *module,
            "broker",
            "--listen-port",
            "0",  # any free port, read back from the log: no race with other processes for a port
            "--kafka-port",
            "0",
            "--namesrv",
            "",
            "--data-dir",
            str(self.data),
            "--flush-mode",
            flush,
        ]
        self.log = self.dir / f"broker-{time.time_ns()}.log"  # a file, not a pipe: a full pipe would stall it
        environ = {**os.environ, **BROKER_ENV, **(env or {})}
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=environ)
        self.addr, self.bootstrap = self._wait()
        self.port = int(self.addr.rsplit(":", 1)[1])

    def _wait(self) -> tuple[str, str]:
        """The native and Kafka addresses, once the broker says it listens on both."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            text = self.log.read_text(errors="replace")
            native = re.search(r"^broker \S+ on (\S+:\d+),", text, re.M)
            kafka = re.search(r"^Kafka listener on (\S+:\d+)", text, re.M)
            if native and kafka:
                return native.group(1), kafka.group(1)
            if self.proc.poll() is not None:
                raise RuntimeError(f"broker exited: {text[-2000:]}")
            time.sleep(0.05)
        raise RuntimeError(f"broker did not start within {START_TIMEOUT_S:.0f} s")

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-2000:]

    def cpu_s(self) -> float:
        return cpu_seconds(self.proc.pid)

    def stop(self, remove: bool = True) -> None:
        """SIGTERM (a clean shutdown: profiles are written); the log's errors are shown."""
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        bad = [ln for ln in self.log.read_text(errors="replace").splitlines() if "ERROR" in ln or "Traceback" in ln]
        if bad:
            print(f"broker log ({self.log}): {len(bad)} error lines, first: {bad[0]}", file=sys.stderr)
        if remove:
            shutil.rmtree(self.dir, ignore_errors=True)


def _create_topic(broker: KafkaBroker, topic: str, queues: int) -> None:
    async def main() -> None:
        async with open_admin(broker_addrs=[broker.addr]) as admin:
            await admin.create_topic(topic, queues, on=[broker.addr])

    trio.run(main)


def run_load(spec: dict[str, Any], broker: KafkaBroker) -> tuple[dict[str, Any], float]:
    """Run ``kafka_load`` with ``spec``: its result and the broker's CPU seconds from its
    ``ready`` to its result."""
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "clmq.bench.kafka_load", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
        assert proc.stdin is not None and proc.stdout is not None
        try:
            ready = proc.stdout.readline()
            if ready.strip() != "ready":
                raise RuntimeError(f"load process: {ready!r}")
            cpu0 = broker.cpu_s()
            proc.stdin.write("go\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
            cpu = broker.cpu_s() - cpu0
            proc.wait(LOAD_TIMEOUT_S)
            if proc.returncode != 0 or not line:
                raise RuntimeError("load process failed")
        except BaseException:
            proc.kill()
            proc.wait()
            err.seek(0)
            print(f"{spec['client']} {spec['role']}: {err.read().decode(errors='replace')[-3000:]}", file=sys.stderr)
            alive = "running" if broker.proc.poll() is None else f"exited {broker.proc.returncode}"
            print(f"broker ({alive}), its log's end:\n{broker.log_tail()}", file=sys.stderr)
            raise
    return json.loads(line), cpu


def _settle(seconds: float) -> None:
    os.sync()
    time.sleep(seconds)


class Bench:
    """The run set: its settings, samples and reports."""

    def __init__(self, args: argparse.Namespace, report: Callable[[str], None]) -> None:
        self.args = args
        self.report = report
        self.root = Path(tempfile.mkdtemp(prefix="clmq-bench-kafka-"))
        self.produce: list[dict[str, Any]] = []
        self.consume: list[dict[str, Any]] = []
        self.latency: list[dict[str, Any]] = []
        self.classpath: str | None = None
        self.notes: list[str] = []

    def _profile(self, name: str) -> Path | None:
        d: Path | None = self.args.profile_dir
        if d is None:
            return None
        d.mkdir(parents=True, exist_ok=True)
        return d / name

    def _spec(self, client: str, role: str, broker: KafkaBroker, topic: str, partitions: int) -> dict[str, Any]:
        a = self.args
        return {
            "client": client,
            "role": role,
            "bootstrap": broker.bootstrap,
            "addr": broker.addr,
            "topic": topic,
            "partitions": partitions,
            "size": a.size,
            "messages": a.messages,
            "seconds": a.seconds,
            "linger_ms": a.linger_ms,
            "api": a.native_api,
        }

    def produce_case(self, r: int, client: str, partitions: int, flush: str) -> None:
        a = self.args
        _settle(a.settle_seconds)
        consume = flush == "async" and partitions in a.consume_partitions
        tag = f"r{r + 1}-{client}-{partitions}p-{flush}"
        broker = KafkaBroker(self.root, flush, profile=self._profile(f"{tag}-produce"))
        try:
            _create_topic(broker, "bench", partitions)
            out, cpu = run_load(self._spec(client, "produce", broker, "bench", partitions), broker)
            stored = out["sent"] - out["failed"]
            if stored <= 0:
                raise RuntimeError(f"{client}: no message stored")
            s = ProduceSample(
                client,
                partitions,
                flush,
                stored,
                out["failed"],
                stored / out["elapsed_s"],
                stored * a.size / out["elapsed_s"] / 1e6,
                cpu * 1e6 / stored,
                out["client_cpu_s"] * 1e6 / stored,
                out["elapsed_s"],
            )
            self.produce.append(asdict(s))
            line = (
                f"run {r + 1}/{a.runs}: {client} produce, {partitions:,} partitions, {flush} flush: "
                f"{s.msgs_per_s:,.0f} msgs/s, broker {s.broker_cpu_us_per_msg:.1f} µs/msg, "
                f"client {s.client_cpu_us_per_msg:.1f} µs/msg" + (f", {s.failed:,} failed" if s.failed else "")
            )
            self.report(line)
            if consume:
                if a.profile_dir is not None:  # the consume profile apart: a restart on the same data
                    broker.stop(remove=False)
                    broker = KafkaBroker(self.root, flush, data=broker.data, profile=self._profile(f"{tag}-consume"))
                self._consume(r, client, partitions, broker, stored + out["warmup"])
        finally:
            broker.stop()

    def _consume(self, r: int, client: str, partitions: int, broker: KafkaBroker, expected: int) -> None:
        spec = {**self._spec(client, "consume", broker, "bench", partitions), "expected": expected, "group": "bench"}
        out, cpu = run_load(spec, broker)
        c = ConsumeSample(
            client,
            partitions,
            out["consumed"],
            out["consumed"] / out["elapsed_s"],
            out["consumed"] / out["fetch_s"],
            out["first_s"],
            cpu * 1e6 / out["consumed"],
            out["client_cpu_s"] * 1e6 / out["consumed"],
        )
        self.consume.append(asdict(c))
        self.report(
            f"run {r + 1}/{self.args.runs}: {client} consume, {partitions:,} partitions: {c.msgs_per_s:,.0f} msgs/s "
            f"(first message to last {c.fetch_msgs_per_s:,.0f}, first after {c.first_s:.2f} s), broker "
            f"{c.broker_cpu_us_per_msg:.1f} µs/msg, {c.messages:,} read"
        )

    def latency_case(self, r: int, client: str, flush: str) -> None:
        a = self.args
        _settle(a.settle_seconds)
        broker = KafkaBroker(self.root, flush)
        try:
            _create_topic(broker, "lat", a.latency_partitions)
            spec = {
                **self._spec(client, "latency", broker, "lat", a.latency_partitions),
                "rate": a.latency_rate,
                "seconds": a.latency_seconds,
            }
            out, cpu = run_load(spec, broker)
        finally:
            broker.stop()
        s = LatencySample(
            client,
            flush,
            a.latency_rate,
            a.latency_partitions,
            out["sent"],
            out["answered"],
            out["failed"],
            out["p50_ms"],
            out["p99_ms"],
            out["max_ms"],
            cpu * 1e6 / max(1, out["answered"]),
        )
        self.latency.append(asdict(s))
        self.report(
            f"run {r + 1}/{a.runs}: {client} latency at {a.latency_rate:,} msgs/s, {flush} flush: p50 {s.p50_ms:.2f} "
            f"ms, p99 {s.p99_ms:.2f} ms, max {s.max_ms:.2f} ms" + (f", {s.failed:,} failed" if s.failed else "")
        )

    # ------------------------------------------------------------ Kafka's own perf tools
    def java_classpath(self) -> str | None:
        """The classpath of kafka-tools (resolved by Maven into ~/.m2), or None (said why)."""
        version = self.args.kafka_tools
        if not (shutil.which("mvn") and shutil.which("java")):
            self.notes.append("kafka-tools: no mvn or java on PATH, skipped")
            return None
        d = Path(tempfile.mkdtemp(dir=self.root))
        (d / "pom.xml").write_text(_POM.format(version=version))
        done = subprocess.run(
            ["mvn", "-q", "-B", "dependency:build-classpath", f"-Dmdep.outputFile={d / 'cp.txt'}"],
            cwd=d,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        if done.returncode != 0 or not (d / "cp.txt").exists():
            self.notes.append(f"kafka-tools {version}: Maven could not resolve it: {done.stdout[-300:]}")
            return None
        return (d / "cp.txt").read_text().strip()

    def java_case(self, r: int, partitions: int, classpath: str) -> None:
        a = self.args
        _settle(a.settle_seconds)
        broker = KafkaBroker(self.root, "async")
        java = ["java", "-Xmx1g", "-cp", classpath]
        try:
            _create_topic(broker, "bench", partitions)
            props = [
                f"bootstrap.servers={broker.bootstrap}",
                "acks=all",
                f"linger.ms={a.linger_ms}",
                "batch.size=1000000",
            ]
            cpu0 = broker.cpu_s()
            done = subprocess.run(
                [
                    *java,
                    "org.apache.kafka.tools.ProducerPerformance",
                    "--topic",
                    "bench",
                    "--num-records",
                    str(a.messages),
                    "--record-size",
                    str(a.size),
                    "--throughput",
                    "-1",
                    "--producer-props",
                    *props,
                ],
                capture_output=True,
                text=True,
                timeout=LOAD_TIMEOUT_S,
                check=False,
            )
            cpu = broker.cpu_s() - cpu0
            m = re.search(r"(\d+) records sent, ([\d.]+) records/sec", done.stdout)
            if done.returncode != 0 or m is None:
                raise RuntimeError(f"ProducerPerformance: {done.stdout[-500:]} {done.stderr[-1500:]}")
            sent, rate = int(m.group(1)), float(m.group(2))
            s = ProduceSample(
                "kafka-java", partitions, "async", sent, 0, rate, rate * a.size / 1e6, cpu * 1e6 / sent, -1, sent / rate
            )
            self.produce.append(asdict(s))
            self.report(
                f"run {r + 1}/{a.runs}: kafka-java produce, {partitions:,} partitions, async flush: {rate:,.0f} "
                f"msgs/s, broker {s.broker_cpu_us_per_msg:.1f} µs/msg (JVM start-up in the broker's window)"
            )
            if partitions in a.consume_partitions:
                self._java_consume(r, partitions, broker, java, sent)
        finally:
            broker.stop()

    def _java_consume(self, r: int, partitions: int, broker: KafkaBroker, java: list[str], sent: int) -> None:
        cpu0 = broker.cpu_s()
        done = subprocess.run(
            [
                *java,
                "org.apache.kafka.tools.ConsumerPerformance",
                "--bootstrap-server",
                broker.bootstrap,
                "--topic",
                "bench",
                "--messages",
                str(sent),
                "--group",
                "bench-java",
                "--timeout",
                "60000",
            ],
            capture_output=True,
            text=True,
            timeout=LOAD_TIMEOUT_S,
            check=False,
        )
        cpu = broker.cpu_s() - cpu0
        lines = [ln for ln in done.stdout.splitlines() if ln.count(",") >= 9 and not ln.startswith("start.time")]
        if done.returncode != 0 or not lines:
            raise RuntimeError(f"ConsumerPerformance: {done.stdout[-500:]} {done.stderr[-1500:]}")
        f = [x.strip() for x in lines[-1].split(",")]
        # start.time, end.time, MB, MB.sec, nMsg, nMsg.sec, rebalance.time.ms, fetch.time.ms, fetch.MB.sec,
        # fetch.nMsg.sec
        msgs, rate, rebalance_ms, fetch_rate = int(f[4]), float(f[5]), float(f[6]), float(f[9])
        c = ConsumeSample("kafka-java", partitions, msgs, rate, fetch_rate, rebalance_ms / 1000, cpu * 1e6 / msgs, -1)
        self.consume.append(asdict(c))
        self.report(
            f"run {r + 1}/{self.args.runs}: kafka-java consume, {partitions:,} partitions: {rate:,.0f} msgs/s "
            f"(fetch {fetch_rate:,.0f}), broker {c.broker_cpu_us_per_msg:.1f} µs/msg (JVM start-up included)"
        )

    # ------------------------------------------------------------ the run set
    def run(self) -> dict[str, Any]:
        a = self.args
        flushes = [f for f in a.flush.split(",") if f]
        try:
            if a.kafka_tools:
                self.classpath = self.java_classpath()
            for r in range(a.runs):
                order = a.clients if r % 2 == 0 else a.clients[::-1]
                for flush in flushes:
                    for partitions in a.partitions:
                        for client in order:
                            self.produce_case(r, client, partitions, flush)
                if self.classpath and "async" in flushes:
                    for partitions in a.partitions:
                        self.java_case(r, partitions, self.classpath)
                if a.latency_rate > 0:
                    for flush in (f for f in a.latency_flush.split(",") if f):
                        for client in order:
                            self.latency_case(r, client, flush)
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
        return self.result(flushes)

    def result(self, flushes: list[str]) -> dict[str, Any]:
        a = self.args
        out: dict[str, Any] = {
            "runs": a.runs,
            "clients": a.clients,
            "partitions": a.partitions,
            "consume_partitions": a.consume_partitions,
            "flushes": flushes,
            "messages": a.messages,
            "seconds": a.seconds,
            "size": a.size,
            "linger_ms": a.linger_ms,
            "native_api": a.native_api,
            "latency_rate": a.latency_rate,
            "latency_seconds": a.latency_seconds,
            "latency_partitions": a.latency_partitions,
            "kafka_tools": a.kafka_tools if self.classpath else None,
            "profiled": a.profile_dir is not None,
            "settings": {
                "kafka producer": f"confluent_kafka {_ck_version()}: acks=all, linger.ms={a.linger_ms}, "
                "batch.size=1000000, compression none, not idempotent, produce(partition=i % P) per message",
                "kafka consumer": "group member, subscribe, auto.offset.reset=earliest, consume(10000, 0.5)",
                "native producer": f"open_producer(broker_addrs=..., linger_ms={a.linger_ms}), "
                + ("submit per message" if a.native_api == "submit" else "submit_batch per queue per 1,000 messages")
                + ", flush()",
                "native consumer": "open_consumer(None, group, {topic: '*'}, broker_addrs=...), receive()",
                "broker": "one clmq broker process per case, fresh data dir, kafka_group_initial_rebalance_delay_ms=0",
            },
            "notes": self.notes,
            "produce": medians(self.produce, PRODUCE_KEY),
            "consume": medians(self.consume, CONSUME_KEY),
            "latency": medians(self.latency, LATENCY_KEY),
            "samples": {"produce": self.produce, "consume": self.consume, "latency": self.latency},
        }
        out["cpu_ratios"] = cpu_ratios(out)
        out["aims"] = aims(out)
        return out


_POM = """<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>clmq.bench</groupId><artifactId>kafka-perf</artifactId><version>1</version>
  <dependencies>
    <dependency><groupId>org.apache.kafka</groupId><artifactId>kafka-tools</artifactId>
      <version>{version}</version></dependency>
    <dependency><groupId>org.slf4j</groupId><artifactId>slf4j-nop</artifactId><version>1.7.36</version></dependency>
  </dependencies>
</project>
"""


def _ck_version() -> str:
    try:
        import confluent_kafka

        return f"{confluent_kafka.version()[0]} (librdkafka {confluent_kafka.libversion()[0]})"
    except ImportError:
        return "(not installed)"


# Where a thread waits (wall time in the profile, no CPU): left out of the shares.
_IDLE = ("'poll' of 'select.epoll", "'acquire' of '_thread.lock", "time.sleep", "'get' of '_queue.SimpleQueue")


def summarize_profiles(profile_dir: Path, top: int = 25) -> str:
    """Per profiled phase (``<tag>-produce``/``<tag>-consume``), every thread's profile
    merged: the functions with the most own time, as shares of the phase's total."""
    import pstats

    phases: dict[str, list[Path]] = {}
    for f in sorted(profile_dir.glob("*.prof")):
        phases.setdefault(f.name.split(".", 1)[0], []).append(f)
    out = []
    for phase, files in phases.items():
        stats = pstats.Stats(*(str(f) for f in files))
        table: Any = stats.stats  # type: ignore[attr-defined]  # {(file, line, name): (cc, nc, tt, ct, callers)}
        table = {k: v for k, v in table.items() if not any(w in k[2] for w in _IDLE)}
        total = sum(v[2] for v in table.values()) or 1.0
        out.append(f"{phase}: {total:.2f} s of own time over {len(files)} threads (waits left out)")
        rows = sorted(table.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
        for (file, line, name), (_cc, nc, tt, ct, _callers) in rows:
            where = "/".join(Path(file).parts[-2:]) if file != "~" else "~"
            out.append(
                f"  {100 * tt / total:5.1f}%  own {tt:7.3f} s  cum {ct:7.3f} s  {nc:>9,} calls  {where}:{line} {name}"
            )
    return "\n".join(out)


def cmd_bench_kafka(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .report import save

    console = Console(soft_wrap=True)
    result = Bench(args, lambda line: console.print(line, highlight=False)).run()
    save(result, markdown(result), args.json, args.markdown, console)
    for note in result["notes"]:
        console.print(f"[yellow]{note}")
    if args.profile_dir is not None:
        console.print(summarize_profiles(args.profile_dir), highlight=False)
    if args.plot is not None:
        from .kafka_report import plot
        from .results import draw

        draw(plot, result, args.plot, console)
    return 0

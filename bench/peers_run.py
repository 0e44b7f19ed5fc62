"""The runs of ``clmq bench peers`` (see ``bench/peers.py``): per case and run, each
system on a fresh broker, its loads in a process of their own (the Java drivers, or
``bench.kafka_load`` for clmq's Python client) behind a ``ready``/``go`` handshake, so
that only the load is inside the broker CPU reading."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from .peers_report import summarize
from .peers_systems import ClmqPeer, KafkaPeer, RocketMQPeer

Peer = ClmqPeer | KafkaPeer | RocketMQPeer
LOAD_TIMEOUT_S = 900.0
TOPIC = "peers"
GROUP = "peers-group"


def run_driver(cmd: list[str], peer: Peer) -> tuple[dict[str, Any], float]:
    """Run one load process: its JSON result and the broker's CPU seconds between its
    ``ready`` and its result. Lines other than those two (a client's log) are skipped."""
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
        assert proc.stdin is not None and proc.stdout is not None
        try:
            for line in proc.stdout:
                if line.strip() == "ready":
                    break
            else:
                raise RuntimeError("the load process ended before it was ready")
            cpu0 = peer.cpu_s()
            proc.stdin.write("go\n")
            proc.stdin.flush()
            result = next((ln for ln in proc.stdout if ln.startswith("{")), "")
            cpu = peer.cpu_s() - cpu0
            proc.wait(LOAD_TIMEOUT_S)
            if proc.returncode != 0 or not result:
                raise RuntimeError(f"the load process exited {proc.returncode}")
        except BaseException:
            proc.kill()
            proc.wait()
            err.seek(0)
            print(f"{' '.join(cmd[-6:])}: {err.read().decode(errors='replace')[-3000:]}", file=sys.stderr)
            raise
    return json.loads(result), cpu


class PeersBench:
    """The run set: its settings, the drivers, and the samples."""

    def __init__(
        self,
        args: argparse.Namespace,
        drivers: dict[str, tuple[list[str], list[str]]],
        root: Path,
        report: Callable[[str], None],
    ) -> None:
        self.args, self.drivers, self.root, self.report = args, drivers, root, report
        self.samples: list[dict[str, Any]] = []
        self.failures: list[dict[str, Any]] = []  # cases that raised: the run goes on without them

    def _case_or_failure(self, system: str, queues: int, flush: str, r: int) -> None:
        """One case; a failure (a peer refusing a topic, a driver crashing) is recorded
        and reported, and the remaining cases still run. Ctrl-C still stops everything."""
        try:
            self.case(system, queues, flush, r)
        except Exception as e:
            error = " ".join(str(e).split())[:2000] or repr(e)
            self.failures.append({"system": system, "queues": queues, "flush": flush, "run": r + 1, "error": error})
            self.report(f"run {r + 1}/{self.args.runs}: {system}, {queues:,} queues, {flush} flush: FAILED: {error}")

    def run(self) -> dict[str, Any]:
        a = self.args
        t0 = time.monotonic()
        for flush in a.flush:
            for queues in a.queues:
                for r in range(a.runs):
                    order = a.systems if r % 2 == 0 else list(reversed(a.systems))
                    for system in order:
                        self._case_or_failure(system, queues, flush, r)
        settings = {k: v for k, v in vars(a).items() if k not in ("func", "json", "markdown", "plot", "out_dir")}
        return {
            "bench": "peers",
            "settings": json.loads(json.dumps(settings, default=str)),
            "elapsed_s": time.monotonic() - t0,
            "samples": self.samples,
            "failures": self.failures,
            **summarize(self.samples),
        }

    def _start(self, system: str, flush: str) -> Peer:
        if system in ("clmq", "clmq-kafka"):
            return ClmqPeer(self.root, flush)
        if system == "kafka":
            return KafkaPeer(self.root, flush, self.drivers["kafka"][1])
        return RocketMQPeer(self.root, flush, self.drivers["rocketmq"][1])

    def _java(self, system: str) -> list[str]:
        return self.drivers["rocketmq" if system == "rocketmq" else "kafka"][0]

    def _create(self, system: str, peer: Peer, queues: int) -> float:
        if isinstance(peer, ClmqPeer):
            return peer.create(TOPIC, queues)
        args = peer.create_args() if isinstance(peer, RocketMQPeer) else peer.driver_args()
        out = subprocess.run(
            [*self._java(system), "create", *args, TOPIC, str(queues)],
            capture_output=True,
            text=True,
            timeout=LOAD_TIMEOUT_S,
            check=False,
        )
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("{")), None)
        if out.returncode != 0 or line is None:
            raise RuntimeError(f"{system}: creating {queues} queues failed: {out.stderr[-2000:]}")
        return float(json.loads(line)["created_s"])

    def _command(self, system: str, peer: Peer, role: str, queues: int, extra: dict[str, Any]) -> list[str]:
        a = self.args
        if system == "clmq":
            assert isinstance(peer, ClmqPeer)
            spec = {
                "client": "native",
                "role": role,
                "addr": peer.addr,
                "topic": TOPIC,
                "partitions": queues,
                "size": a.size,
                "seconds": None,
                "linger_ms": 5,
                "api": "submit",
                "group": GROUP,
                **extra,
            }
            return [sys.executable, "-m", "clmq.bench.kafka_load", json.dumps(spec)]
        base = [*self._java(system), role, *peer.driver_args(), TOPIC]
        if role == "produce":
            return [*base, str(queues), str(extra["messages"]), str(a.size), str(a.warmup_messages)]
        if role == "consume":
            return [*base, str(extra["expected"]), GROUP]
        return [*base, str(queues), str(extra["rate"]), str(extra["seconds"]), str(a.size)]

    def case(self, system: str, queues: int, flush: str, r: int) -> None:
        """One system on a fresh broker: produce, then consume and latency if asked."""
        a = self.args
        messages = a.large_messages if queues >= a.large_queues else a.messages
        key = {"system": system, "queues": queues, "flush": flush, "run": r + 1}
        peer = self._start(system, flush)
        try:
            created_s = self._create(system, peer, queues)
            out, cpu = run_driver(self._command(system, peer, "produce", queues, {"messages": messages}), peer)
            stored = out["sent"] - out["failed"]
            sample = self._sample("produce", key, out, cpu, stored, out["sent"], created_s=created_s)
            self.samples.append(sample)
            if a.consume_queues is None or queues in a.consume_queues:
                expected = stored + out["warmup"]
                extra = {"expected": expected}
                got, cpu = run_driver(self._command(system, peer, "consume", queues, extra), peer)
                self.samples.append(self._sample("consume", key, got, cpu, got["consumed"], expected))
            if a.latency_rate > 0 and queues in a.latency_queues:
                extra = {"rate": a.latency_rate, "seconds": a.latency_seconds}
                lat, cpu = run_driver(self._command(system, peer, "latency", queues, extra), peer)
                self.samples.append(self._sample("latency", key, lat, cpu, lat["answered"], lat["sent"]))
        finally:
            peer.stop()

    def _sample(
        self, kind: str, key: dict[str, Any], out: dict[str, Any], cpu: float, done: int, asked: int, **more: Any
    ) -> dict[str, Any]:
        s: dict[str, Any] = {"kind": kind, **key, **more, "done": done, "asked": asked, "incomplete": done < asked}
        s["broker_cpu_us_per_msg"] = cpu * 1e6 / max(done, 1)
        s["client_cpu_us_per_msg"] = out["client_cpu_s"] * 1e6 / max(done, 1)
        if kind == "latency":
            s.update({k: out.get(k) for k in ("p50_ms", "p99_ms", "p999_ms", "max_ms")})
            line = f"p50 {s['p50_ms']:.2f} ms, p99 {s['p99_ms']:.2f} ms at {self.args.latency_rate:,} msgs/s"
        else:
            s["msgs_per_s"] = done / out["elapsed_s"] if out["elapsed_s"] > 0 else 0.0
            line = f"{s['msgs_per_s']:,.0f} msgs/s"
        self.report(
            f"run {key['run']}/{self.args.runs}: {key['system']} {kind}, {key['queues']:,} queues, {key['flush']} "
            f"flush: {line}, broker {s['broker_cpu_us_per_msg']:.1f} µs/msg, {done:,}/{asked:,} done"
        )
        return s

"""The processes of ``clmq bench replication``: a name server and one broker group
(a leader and its followers), each ``python -m broker.cli ...`` in its own process
with its own data directory and settings file, started fresh for every case.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .cpu import cpu_seconds
from .e2e import _free_port

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


@dataclass
class Service:
    """One service process: its name, address, directory and log file."""

    name: str
    addr: str
    dir: Path
    proc: subprocess.Popen[bytes]
    log: Path

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.proc.pid)


def _wait_listening(svc: Service) -> None:
    port = int(svc.addr.rsplit(":", 1)[1])
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            if svc.proc.poll() is not None:
                raise RuntimeError(f"{svc.name} exited: {svc.log.read_text(errors='replace')[-2000:]}") from None
            time.sleep(0.02)
    raise RuntimeError(f"{svc.name} did not listen within {START_TIMEOUT_S:.0f} s")


def _spawn(name: str, d: Path, args: list[str], cpus: set[int] | None, profile: Path | None) -> Service:
    """Start ``python -m broker.cli <args>`` in ``d`` (every thread profiled if ``profile``),
    pinned to ``cpus``."""
    port = _free_port()
    # every thread profiled (python -m cProfile would see only the main thread)
    module = ["-m", "clmq.bench.profiled", str(profile)] if profile else ["-m", "clmq"]
    cmd = [sys.executable, *module, *args, "--listen-port", str(port)]
    log = d / "service.log"  # a file, not a pipe: a full pipe would stall the service
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=d)
    if cpus:
        os.sched_setaffinity(proc.pid, cpus)
    svc = Service(name, f"127.0.0.1:{port}", d, proc, log)
    _wait_listening(svc)
    return svc


@dataclass
class Group:
    """A name server and one broker group. ``settings``: the leader's BrokerConfig fields
    (followers get the same, with ``role``, ``broker_id`` and ``leader_addr`` set)."""

    root: Path
    settings: dict[str, Any]
    broker_cpus: set[int] | None = None
    profile_dir: Path | None = None
    nameserver: Service | None = None
    leader: Service | None = None
    followers: list[Service] = field(default_factory=list)

    def start(self, followers: int) -> None:
        d = Path(tempfile.mkdtemp(prefix="nameserver-", dir=self.root))
        self.nameserver = _spawn("nameserver", d, ["nameserver"], self.broker_cpus, None)
        self.leader = self._broker(0, {})
        for i in range(1, followers + 1):
            self.add_follower(i)

    def add_follower(self, broker_id: int) -> Service:
        assert self.leader is not None
        svc = self._broker(broker_id, {"role": "follower", "leader_addr": self.leader.addr})
        self.followers.append(svc)
        return svc

    def _broker(self, broker_id: int, extra: dict[str, Any]) -> Service:
        assert self.nameserver is not None
        d = Path(tempfile.mkdtemp(prefix=f"broker{broker_id}-", dir=self.root))
        values = {
            **self.settings,
            **extra,
            "broker_id": broker_id,
            "data_dir": str(d / "data"),
            "namesrv_addrs": [self.nameserver.addr],
        }
        settings = d / "broker.toml"
        settings.write_text("".join(f"{k} = {_toml_value(v)}\n" for k, v in values.items()))
        profile = self.profile_dir / f"broker{broker_id}-{time.time_ns()}" if self.profile_dir else None
        name = "leader" if broker_id == 0 else f"follower {broker_id}"
        return _spawn(name, d, ["broker", "--config", str(settings)], self.broker_cpus, profile)

    def services(self) -> list[Service]:
        return [s for s in (self.nameserver, self.leader, *self.followers) if s is not None]

    def stop(self) -> list[str]:
        """Stop every process (SIGTERM: a clean shutdown; followers first), remove the
        directories; returns the first error line of each service's log that has one."""
        problems = []
        for svc in reversed(self.services()):
            svc.proc.terminate()
            try:
                svc.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                svc.proc.kill()
                svc.proc.wait()
                problems.append(f"{svc.name}: did not stop within {STOP_TIMEOUT_S:.0f} s (killed)")
            bad = [ln for ln in svc.log.read_text(errors="replace").splitlines() if "ERROR" in ln or "Traceback" in ln]
            if bad:
                problems.append(f"{svc.name} ({svc.log}): {len(bad)} error lines, first: {bad[0]}")
        subprocess.run(["rm", "-rf", str(self.root)], check=False)
        return problems

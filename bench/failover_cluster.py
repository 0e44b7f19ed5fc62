"""The processes of ``clmq bench failover``: a standalone ZooKeeper server
(:class:`clmq.devtools.zkserver.LocalZooKeeper`), a name server and the brokers of
one group in ZooKeeper mode (``zookeeper`` set: ZooKeeper elects the leader), each
``python -m broker.cli ...`` in its own process with its own data directory and
settings file. A broker keeps its port across restarts, so that a restarted broker is
the same address to its group and to the clients.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clmq.devtools.zkserver import LocalZooKeeper

from .e2e import _free_port
from .replication_cluster import STOP_TIMEOUT_S, Service, _spawn, _toml_value, _wait_listening

GROUP = "bench"
CHROOT = "/clmq-bench"


@dataclass
class Node:
    """One broker of the group, restartable on its settings file and port."""

    broker_id: int
    port: int
    dir: Path
    settings: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.dir / "broker.log"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        """Start the process and return once it listens (blocking: call it from a thread
        while trio code runs)."""
        # -v: the per-term INFO lines ("leads the group, epoch E") land in the log
        cmd = [sys.executable, "-m", "clmq", "-v", "broker", "--config", str(self.settings)]
        with open(self.log, "ab") as out:  # a file, not a pipe: a full pipe would stall the broker
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=self.dir)
        _wait_listening(Service(f"broker {self.broker_id}", self.addr, self.dir, self.proc, self.log))

    def kill(self) -> None:
        """SIGKILL and reap (a crash: nothing is flushed or said to anyone)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> str:
        """SIGTERM (a clean shutdown); a problem's description, or ""."""
        if self.proc is None or self.proc.poll() is not None:
            return ""
        self.proc.terminate()
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()
            return f"broker {self.broker_id}: did not stop within {STOP_TIMEOUT_S:.0f} s (killed)"
        return ""


@dataclass
class FailoverCluster:
    """ZooKeeper, a name server and ``brokers`` brokers of group :data:`GROUP` under ``root``.
    ``settings``: every broker's extra BrokerConfig fields."""

    root: Path
    settings: dict[str, Any]
    brokers: int = 3
    tick_time_ms: int = 500
    zookeeper: LocalZooKeeper | None = None
    nameserver: Service | None = None
    nodes: list[Node] = field(default_factory=list)

    @property
    def ns_addr(self) -> str:
        assert self.nameserver is not None
        return self.nameserver.addr

    def start(self) -> None:
        """Start everything (blocking); the brokers elect their leader by themselves."""
        self.zookeeper = LocalZooKeeper(self.root / "zookeeper", tick_time_ms=self.tick_time_ms).start()
        d = Path(tempfile.mkdtemp(prefix="nameserver-", dir=self.root))
        self.nameserver = _spawn("nameserver", d, ["nameserver"], None, None)
        self.nodes = [self._node(i) for i in range(self.brokers)]
        for node in self.nodes:
            node.start()

    def _node(self, broker_id: int) -> Node:
        assert self.zookeeper is not None
        d = self.root / f"broker{broker_id}"
        d.mkdir(parents=True, exist_ok=True)
        port = _free_port()
        values = {
            "broker_name": GROUP,
            **self.settings,
            "broker_id": broker_id,
            "listen_port": port,
            "data_dir": str(d / "data"),
            "namesrv_addrs": [self.ns_addr],
            "zookeeper": self.zookeeper.connect_string(CHROOT),
        }
        settings = d / "broker.toml"
        settings.write_text("".join(f"{k} = {_toml_value(v)}\n" for k, v in values.items()))
        return Node(broker_id, port, d, settings)

    def node(self, addr: str) -> Node:
        return next(n for n in self.nodes if n.addr == addr)

    def stop(self) -> list[str]:
        """Stop every process (brokers, the name server, ZooKeeper last) and remove the
        directories; returns the problems seen (a process that would not stop)."""
        problems = [p for p in (n.stop() for n in self.nodes) if p]
        if self.nameserver is not None:
            self.nameserver.proc.terminate()
            try:
                self.nameserver.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.nameserver.proc.kill()
                problems.append("nameserver: did not stop (killed)")
        if self.zookeeper is not None:
            self.zookeeper.stop()
        subprocess.run(["rm", "-rf", str(self.root)], check=False)
        return problems

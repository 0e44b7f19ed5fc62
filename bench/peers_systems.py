"""The brokers of ``clmq bench peers``, each a fresh process (or two) on loopback with a
fresh data directory under the run's temporary directory, stopped by :meth:`stop`:

- :class:`KafkaPeer`: Apache Kafka 4.4.0, KRaft, one node that is broker and controller,
  its storage formatted by ``kafka.tools.StorageTool`` then ``kafka.Kafka server.properties``;
  sync flush is ``log.flush.interval.messages=1`` (the default leaves flushing to the OS);
- :class:`RocketMQPeer`: Apache RocketMQ 5's ``NamesrvStartup`` and ``BrokerStartup`` with a
  ``broker.conf`` (``flushDiskType`` SYNC_FLUSH or ASYNC_FLUSH);
- :class:`ClmqPeer`: ``clmq broker`` with its Kafka listener on (``bench.kafka.KafkaBroker``).

Every JVM has a bounded heap (``JVM_HEAP``)."""

from __future__ import annotations

import base64
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import trio

from clmq.client import open_admin

from .cpu import cpu_seconds
from .kafka import KafkaBroker

START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
JVM_HEAP = ["-Xms256m", "-Xmx1g"]
ROCKETMQ_JVM = [
    "-XX:MaxDirectMemorySize=1g",
    "--add-opens=java.base/java.nio=ALL-UNNAMED",
    "--add-opens=java.base/sun.nio.ch=ALL-UNNAMED",
    "--add-opens=java.base/java.lang=ALL-UNNAMED",
    "--add-exports=java.base/sun.nio.ch=ALL-UNNAMED",
]
PORT_TRIES = 200


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(offsets: tuple[int, ...] = (0,)) -> int:
    """A port P such that P + each offset is free on 127.0.0.1 (RocketMQ's broker also
    listens on P - 2 and P + 1)."""
    for _ in range(PORT_TRIES):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port > 1100 and all(_free(port + o) for o in offsets if o):
            return port
    raise RuntimeError("no free port on 127.0.0.1")


def _wait_for(log: Path, pattern: str, proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace") if log.exists() else ""
        if re.search(pattern, text):
            return
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited {proc.returncode}: {text[-2000:]}")
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not start within {START_TIMEOUT_S:.0f} s (log: {log})")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _spawn(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:  # a file, not a pipe: a full pipe would stall the broker
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})


class KafkaPeer:
    """Apache Kafka, one KRaft node; ``bootstrap`` is its address."""

    system = "kafka"

    def __init__(self, root: Path, flush: str, jars: list[str]) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kafka-", dir=root))
        port, controller = free_port(), free_port()
        self.bootstrap = f"127.0.0.1:{port}"
        props = self.dir / "server.properties"
        lines = [
            "process.roles=broker,controller",
            "node.id=1",
            f"controller.quorum.voters=1@127.0.0.1:{controller}",
            f"listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller}",
            f"advertised.listeners=PLAINTEXT://127.0.0.1:{port}",
            "controller.listener.names=CONTROLLER",
            "listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            f"log.dirs={self.dir / 'data'}",
            "offsets.topic.replication.factor=1",
            "offsets.topic.num.partitions=1",
            "transaction.state.log.replication.factor=1",
            "transaction.state.log.min.isr=1",
            "group.initial.rebalance.delay.ms=0",
        ]
        if flush == "sync":
            lines.append("log.flush.interval.messages=1")
        props.write_text("\n".join(lines) + "\n")
        cp = ["-cp", os.pathsep.join(jars)]
        cluster = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        fmt = ["java", *JVM_HEAP, *cp, "kafka.tools.StorageTool", "format", "-t", cluster, "-c", str(props)]
        done = subprocess.run(fmt, capture_output=True, text=True, timeout=START_TIMEOUT_S, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"kafka storage format failed: {done.stdout[-1000:]}{done.stderr[-1000:]}")
        self.log = self.dir / "kafka.log"
        self.proc = _spawn(["java", *JVM_HEAP, "-XX:+UseG1GC", *cp, "kafka.Kafka", str(props)], self.log)
        self.pids = [self.proc.pid]
        _wait_for(self.log, r"Kafka Server started", self.proc, "kafka")

    def driver_args(self) -> list[str]:
        return [self.bootstrap]

    def cpu_s(self) -> float:
        return sum(cpu_seconds(p) for p in self.pids)

    def stop(self) -> None:
        _stop(self.proc)
        shutil.rmtree(self.dir, ignore_errors=True)


class RocketMQPeer:
    """Apache RocketMQ 5: a name server and one master broker."""

    system = "rocketmq"

    def __init__(self, root: Path, flush: str, jars: list[str]) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="rocketmq-", dir=root))
        ns_port, port = free_port(), free_port((-2, 0, 1))
        self.namesrv, self.broker = f"127.0.0.1:{ns_port}", f"127.0.0.1:{port}"
        (self.dir / "namesrv.conf").write_text(f"listenPort={ns_port}\nbindAddress=127.0.0.1\n")
        store = self.dir / "store"
        conf = {
            "brokerClusterName": "bench-cluster",
            "brokerName": "bench-broker",
            "brokerId": "0",
            "brokerRole": "ASYNC_MASTER",
            "flushDiskType": "SYNC_FLUSH" if flush == "sync" else "ASYNC_FLUSH",
            "namesrvAddr": self.namesrv,
            "brokerIP1": "127.0.0.1",
            "bindAddress": "127.0.0.1",
            "listenPort": str(port),
            "storePathRootDir": str(store),
            "storePathCommitLog": str(store / "commitlog"),
            "autoCreateTopicEnable": "false",
            "mappedFileSizeCommitLog": str(256 << 20),
            "mappedFileSizeConsumeQueue": str(20 * 3000),  # 10,000 queues: no 6 MB file each
        }
        (self.dir / "broker.conf").write_text("".join(f"{k}={v}\n" for k, v in conf.items()))
        java = ["java", *JVM_HEAP, *ROCKETMQ_JVM, f"-Duser.home={self.dir}", f"-Drocketmq.home.dir={self.dir}"]
        cp = ["-cp", os.pathsep.join(jars)]
        env = {"ROCKETMQ_HOME": str(self.dir)}
        self.ns_log, self.log = self.dir / "namesrv.log", self.dir / "broker.log"
        ns = [*java, *cp, "org.apache.rocketmq.namesrv.NamesrvStartup", "-c", str(self.dir / "namesrv.conf")]
        self.ns_proc = _spawn(ns, self.ns_log, env)
        self.proc: subprocess.Popen[bytes] | None = None
        self.pids = [self.ns_proc.pid]
        _wait_for(self.ns_log, r"Name Server boot success", self.ns_proc, "rocketmq name server")
        br = [*java, *cp, "org.apache.rocketmq.broker.BrokerStartup", "-c", str(self.dir / "broker.conf")]
        self.proc = _spawn(br, self.log, env)
        self.pids.append(self.proc.pid)
        _wait_for(self.log, r"boot success", self.proc, "rocketmq broker")

    def driver_args(self) -> list[str]:
        return [self.namesrv]

    def create_args(self) -> list[str]:
        return [self.namesrv, self.broker]

    def cpu_s(self) -> float:
        return sum(cpu_seconds(p) for p in self.pids)

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc)
        _stop(self.ns_proc)
        shutil.rmtree(self.dir, ignore_errors=True)


class ClmqPeer:
    """``clmq broker`` with its Kafka listener; the topic is made by clmq's admin client."""

    system = "clmq"

    def __init__(self, root: Path, flush: str) -> None:
        self.broker = KafkaBroker(root, flush)
        self.bootstrap, self.addr = self.broker.bootstrap, self.broker.addr
        self.pids = [self.broker.proc.pid]

    def create(self, topic: str, queues: int) -> float:
        t0 = time.perf_counter()

        async def main() -> None:
            async with open_admin(broker_addrs=[self.addr]) as admin:
                await admin.create_topic(topic, queues, on=[self.addr])

        trio.run(main)
        return time.perf_counter() - t0

    def driver_args(self) -> list[str]:
        return [self.bootstrap]

    def cpu_s(self) -> float:
        return self.broker.cpu_s()

    def stop(self) -> None:
        self.broker.stop()

"""The plan of ``clmq dev --groups G --replicas N``: which ``clmq broker`` processes to
start, with which settings, ports and data directories (``dev_replicas`` runs them).

One group (the default) is what ``clmq dev --replicas N`` always was: broker name
``broker_name`` (default ``broker-a``), data in ``<data-dir>/replica-<id>``, ports
``--listen-port`` + id. With G > 1 groups the broker names run ``broker-a``,
``broker-b``, ... (the configured name's last letter counts on; a name not ending in
``-<letter>`` gets ``-a``, ``-b``, ... appended), group g's data is in
``<data-dir>/<broker name>/replica-<id>`` and its ports are ``--listen-port`` + g * N +
id (the metrics and Kafka ports likewise; 0 stays "any free port")."""

from __future__ import annotations

import dataclasses
import json
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from clmq.broker.service import BrokerConfig

from ._ready import metrics_url

MAX_GROUPS = 26  # broker names broker-a .. broker-z


@dataclass
class ReplicaProcess:
    """One replica: its settings, where they and its log are, and its process."""

    config: BrokerConfig
    settings_path: Path
    log_path: Path
    process: trio.Process | None = None

    @property
    def name(self) -> str:
        """``replica <id> of <broker name>``, for messages."""
        return f"replica {self.config.broker_id} of {self.config.broker_name}"

    @property
    def addr(self) -> str:
        return f"{self.config.advertised_addr_host}:{self.config.listen_port}"

    @property
    def kafka_addr(self) -> str:
        port = self.config.kafka_listen_port
        return f"{self.config.advertised_addr_host}:{port}" if port >= 0 else ""

    @property
    def metrics_url(self) -> str:
        c = self.config
        return metrics_url(c.metrics_bind_host, c.metrics_port, c.tls_settings() is not None)


def group_names(first: str, count: int) -> list[str]:
    """``count`` broker names counting on from ``first`` (``broker-a`` -> ``broker-a``,
    ``broker-b``, ...); ValueError beyond MAX_GROUPS."""
    if not 1 <= count <= MAX_GROUPS:
        raise ValueError(f"--groups must be 1 to {MAX_GROUPS}, got {count}")
    if count == 1:
        return [first]
    m = re.fullmatch(r"(.*-)([a-z])", first)
    stem, start = (m.group(1), ord(m.group(2)) - ord("a")) if m else (f"{first}-", 0)
    if start + count > MAX_GROUPS:
        raise ValueError(f"broker_name {first!r}: {count} groups would count past '-z'")
    return [f"{stem}{chr(ord('a') + start + g)}" for g in range(count)]


def plan_groups(
    base: BrokerConfig, namesrv: str, groups: int, replicas: int, zookeeper: str = ""
) -> list[list[ReplicaProcess]]:
    """Every group's replicas (see the module's docstring); ValueError for a bad
    combination, naming the setting."""
    names = group_names(base.broker_name, groups)
    if groups == 1:
        return [plan_replicas(base, namesrv, replicas, zookeeper)]
    root = Path(base.data_dir)
    out = []
    for g, name in enumerate(names):
        shift = g * replicas
        cfg = dataclasses.replace(
            base,
            broker_name=name,
            data_dir=str(root / name),
            listen_port=_shifted(base.listen_port, shift),
            metrics_port=_shifted(base.metrics_port, shift),
            kafka_listen_port=_shifted(base.kafka_listen_port, shift),
        )
        out.append(plan_replicas(cfg, namesrv, replicas, zookeeper))
    return out


def _shifted(port: int, by: int) -> int:
    return port + by if port > 0 else port  # 0: any free port; -1: none


def plan_replicas(base: BrokerConfig, namesrv: str, count: int, zookeeper: str = "") -> list[ReplicaProcess]:
    """Replica 0 leads; the others follow it (with ``zookeeper``, a connect string: every
    replica starts as a follower and ZooKeeper elects). Ports (the Kafka listener's and
    the metrics' too): ``listen_port`` + id
    (free ports if 0); data: ``<data_dir>/replica-<id>``. A bad combination (e.g.
    followers with partition-per-file storage) is a ValueError naming the setting."""
    root = Path(base.data_dir)
    ports = _ports(base.listen_port, count)
    metrics_ports = _ports(base.metrics_port, count) if base.metrics_port >= 0 else [-1] * count
    kafka_ports = _ports(base.kafka_listen_port, count) if base.kafka_listen_port >= 0 else [-1] * count
    leader_addr = "" if zookeeper else f"{base.advertised_addr_host}:{ports[0]}"
    out = []
    for i, (port, metrics_port, kafka_port) in enumerate(zip(ports, metrics_ports, kafka_ports)):
        leads = i == 0 and not zookeeper
        cfg = dataclasses.replace(
            base,
            broker_id=i,
            role="leader" if leads else "follower",
            leader_addr="" if leads else leader_addr,
            listen_port=port,
            metrics_port=metrics_port,
            kafka_listen_port=kafka_port,
            zookeeper=zookeeper,
            data_dir=str(root / f"replica-{i}"),
            namesrv_addrs=[namesrv],
        )
        out.append(ReplicaProcess(cfg, root / f"replica-{i}.toml", root / f"replica-{i}.log"))
    return out


def _ports(first: int, count: int) -> list[int]:
    """``first`` + replica id each, or free ports if ``first`` is 0 (known before the
    replicas start: their URLs are printed, and followers need their leader's port)."""
    return _free_ports(count) if first == 0 else [first + i for i in range(count)]


def _free_ports(count: int) -> list[int]:
    """Ports free now (the replicas bind them a moment later: good enough for a dev
    command, and the followers need their leader's port before it starts)."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def settings_toml(config: BrokerConfig) -> str:
    """Every setting of ``config`` as a ``[broker]`` table (what ``clmq broker --config``
    reads back to the same config)."""
    lines = ["# written by clmq dev --replicas: this replica's complete settings", "[broker]"]
    secrets = {"broker_password", "zk_auth"}  # never written to a file: the replica reads them from its environment
    lines += [f"{k} = {_toml_value(v)}" for k, v in dataclasses.asdict(config).items() if k not in secrets]
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(value)  # a JSON string, integer, float or boolean is TOML too

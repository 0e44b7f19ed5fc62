"""``clmq dev --groups G --replicas N [--zookeeper]`` run for real: G broker groups of N
replica processes each, the demo across them, a topic spread over them, and a graceful
stop on Ctrl-C (SIGINT to the command's process group, as a terminal sends it)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from clmq.broker.cli.dev_groups import group_names, plan_groups
from clmq.broker.service import BrokerConfig
from tests.cli_helpers import ENV, clmq
from tests.ports import free_port, free_port_block


def test_group_names_count_on_from_the_configured_name() -> None:
    assert group_names("broker-a", 1) == ["broker-a"]  # one group: exactly as before
    assert group_names("broker-a", 3) == ["broker-a", "broker-b", "broker-c"]
    assert group_names("shop", 2) == ["shop-a", "shop-b"]
    with pytest.raises(ValueError, match="--groups must be 1 to 26"):
        group_names("broker-a", 27)
    with pytest.raises(ValueError, match="past '-z'"):
        group_names("broker-y", 3)


def test_plan_gives_every_group_its_name_directory_and_ports(tmp_path: Path) -> None:
    base = BrokerConfig(data_dir=str(tmp_path), listen_port=20000, metrics_port=0, kafka_listen_port=-1)
    groups = plan_groups(base, "127.0.0.1:9876", 2, 3)
    assert [[r.config.broker_name for r in g] for g in groups] == [["broker-a"] * 3, ["broker-b"] * 3]
    assert [r.config.listen_port for g in groups for r in g] == list(range(20000, 20006))
    assert [r.config.role for r in groups[1]] == ["leader", "follower", "follower"]
    assert {r.config.leader_addr for r in groups[1][1:]} == {groups[1][0].addr}  # each follows its own leader
    assert groups[1][2].config.data_dir == str(tmp_path / "broker-b" / "replica-2")
    metrics = [r.config.metrics_port for g in groups for r in g]  # 0: a free port each, known before the start
    assert len(set(metrics)) == 6 and all(p > 0 for p in metrics)
    assert all(r.config.kafka_listen_port == -1 for g in groups for r in g)  # -1: no Kafka listener
    one = plan_groups(base, "127.0.0.1:9876", 1, 2)  # --groups 1: the layout of clmq dev --replicas N
    assert [r.config.data_dir for r in one[0]] == [str(tmp_path / "replica-0"), str(tmp_path / "replica-1")]


class Dev:
    """``clmq dev --groups ...`` in a session of its own (Ctrl-C goes to its group)."""

    def __init__(self, tmp: Path, *flags: str, servers: int) -> None:
        """``servers``: the replicas it starts (groups x replicas): their broker and
        metrics ports come from this worker's block (tests/ports.py), not bind(0)'s
        ephemeral range, which every connect() on the machine draws from too."""
        self.tmp, self.ns = tmp, f"127.0.0.1:{free_port()}"
        ports = [
            "--listen-port",
            str(free_port_block(servers)),
            "--metrics-port",
            str(free_port_block(servers)),
            "--namesrv-port",
            self.ns.split(":")[1],
        ]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "clmq", "dev", *ports, "--data-dir", str(tmp / "dev"), *flags],
            cwd=tmp,
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.output: list[str] = []

    def read_until(self, text: str) -> str:
        """Output lines up to the first holding ``text`` (each line is an event: no polling)."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)
            if text in line:
                return "".join(self.output)
        raise AssertionError(f"clmq dev ended without printing {text!r}:\n{''.join(self.output)}")

    def rest(self) -> str:
        assert self.proc.stdout is not None
        self.output.append(self.proc.stdout.read())
        return "".join(self.output)

    def pids(self) -> list[int]:
        return [int(p) for p in re.findall(r"pid (\d+)", "".join(self.output))]


@pytest.fixture
def dev_factory() -> Iterator[list[Dev]]:
    """The ``clmq dev`` processes a test starts; whatever the test's end (a failure, a
    timeout), each one still running is killed with every process it started (its
    replicas and ZooKeeper run in sessions of their own: their pids are in its output)."""
    started: list[Dev] = []
    yield started
    for dev in started:
        if dev.proc.poll() is None:
            dev.proc.kill()
            for pid in dev.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        dev.proc.wait(30)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_dev_with_two_groups_serves_a_spread_topic_and_stops_every_process_on_ctrl_c(
    tmp_path: Path, dev_factory: list[Dev]
) -> None:
    dev = Dev(tmp_path, "--groups", "2", "--replicas", "1", "--demo", servers=2)
    dev_factory.append(dev)
    out = dev.read_until("serving;")
    assert "group broker-a of 1 replicas" in out and "group broker-b of 1 replicas" in out, out
    assert "messages flowed: produced 5, consumed 5" in out, out
    pids = dev.pids()
    assert len(set(pids)) == 2 and dev.proc.pid not in pids  # one process per replica
    for name in ("broker-a", "broker-b"):
        assert f"{tmp_path / 'dev' / name / 'replica-0'}/" in out
    made = clmq("topic", "create", "spread", "--queues", "6", "--namesrv", dev.ns, "-o", "json", cwd=tmp_path)
    assert made.returncode == 0, made.stdout + made.stderr
    assert json.loads(made.stdout)["groups"] == {"broker-a": 3, "broker-b": 3}
    first = clmq("topic", "create", "demo", "--queues", "4", "--namesrv", dev.ns, "-o", "json", cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr  # the ready block's first command, after the demo
    assert json.loads(first.stdout)["groups"] == {"broker-a": 2, "broker-b": 2}  # the demo spread it too
    table = clmq("cluster", "list", "--namesrv", dev.ns, cwd=tmp_path).stdout
    assert "broker-a" in table and "broker-b" in table, table
    os.killpg(dev.proc.pid, signal.SIGINT)  # Ctrl-C in the terminal
    assert dev.proc.wait(60) == 0
    rest = dev.rest()
    assert "replica 0 of broker-a stopped (code 0)" in rest and "replica 0 of broker-b stopped (code 0)" in rest, rest
    assert not any(_alive(p) for p in pids)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_dev_with_two_groups_and_zookeeper_elects_a_leader_in_each(tmp_path: Path, dev_factory: list[Dev]) -> None:
    dev = Dev(tmp_path, "--groups", "2", "--replicas", "2", "--zookeeper", "--demo", "--exit-after-demo", servers=4)
    dev_factory.append(dev)  # a hang is ended by the test's timeout, and its processes killed by the fixture
    out = dev.rest()
    assert dev.proc.wait(30) == 0, out
    assert len(re.findall(r"ZooKeeper \S+/clmq-dev elected replica \d the leader", out)) == 2, out
    assert "group broker-a of 2 replicas" in out and "group broker-b of 2 replicas" in out
    assert "messages flowed: produced 5, consumed 5" in out
    assert out.count("stopped (code 0)") == 4 and "ZooKeeper stopped" in out, out

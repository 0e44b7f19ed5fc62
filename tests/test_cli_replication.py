"""The command line of replication, run for real: the replication settings (TOML,
``CLMQ_*`` variables, flags), ``clmq dev --replicas 3`` (separate broker processes),
``clmq cluster list``, ``clmq broker status`` and ``clmq admin promote``."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from clmq.broker.cli.dev_replicas import settings_toml
from clmq.broker.cli.settings import SettingsError, load_settings
from clmq.broker.service import BrokerConfig
from tests.ports import free_port, free_port_block
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[1]
ENV = {"COLUMNS": "200", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
CLI = [sys.executable, "-m", "clmq"]


def clmq(*args: str, cwd: Path, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout_s, env=ENV)


def _free_port() -> int:
    return free_port()


# ------------------------------------------------------------------ settings
def test_list_and_table_settings_load_from_toml_environment_and_flags(tmp_path: Path) -> None:
    conf = tmp_path / "b.toml"
    conf.write_text('[broker]\nreplica_ids = [1, 2]\ntopic_ack_modes = { orders = "sync", logs = "async" }\n')
    from_file = load_settings(BrokerConfig, conf, section="broker", env={})
    assert from_file.replica_ids == [1, 2] and from_file.topic_ack_modes == {"orders": "sync", "logs": "async"}
    env = {"CLMQ_REPLICA_IDS": " 3, 4,", "CLMQ_TOPIC_ACK_MODES": "orders=async, audit = sync"}
    from_env = load_settings(BrokerConfig, conf, section="broker", env=env)  # the environment wins over the file
    assert from_env.replica_ids == [3, 4] and from_env.topic_ack_modes == {"orders": "async", "audit": "sync"}
    flags = {
        "replica_ids": "5",
        "topic_ack_modes": "x=sync",
        "broker_id": "2",
        "role": "follower",
        "leader_addr": "127.0.0.1:1",
        "ack_mode": "sync",
        "min_insync_replicas": "2",
    }
    cfg = load_settings(BrokerConfig, conf, section="broker", env=env, overrides=flags)  # flags win over both
    assert (cfg.replica_ids, cfg.topic_ack_modes, cfg.broker_id, cfg.role) == ([5], {"x": "sync"}, 2, "follower")
    assert (cfg.leader_addr, cfg.ack_mode, cfg.min_insync_replicas) == ("127.0.0.1:1", "sync", 2)
    assert load_settings(BrokerConfig, env={"CLMQ_REPLICA_IDS": "", "CLMQ_TOPIC_ACK_MODES": ""}).replica_ids == []


def test_the_settings_file_of_a_dev_replica_reads_back_to_the_same_settings(tmp_path: Path) -> None:
    cfg = BrokerConfig(
        broker_name='g "1"',
        broker_id=2,
        role="follower",
        leader_addr="127.0.0.1:7",
        topic_ack_modes={"orders": "sync", "a b": "async"},
        replica_ids=[1, 2],
        ack_mode="sync",
        namesrv_addrs=["127.0.0.1:1", "127.0.0.1:2"],
        auto_create_topics=True,
    )
    path = tmp_path / "r.toml"
    path.write_text(settings_toml(cfg))
    assert load_settings(BrokerConfig, path, section="broker", env={}) == cfg


BAD_TOML = {  # a TOML line -> what the error must name
    'replica_ids = [1, "x"]': "replica_ids",
    "replica_ids = [1.5]": "replica_ids",
    "replica_ids = [true]": "replica_ids",
    "replica_ids = 3": "replica_ids",
    'topic_ack_modes = ["orders"]': "topic_ack_modes",
    'topic_ack_modes = { orders = "fast" }': "topic_ack_modes",
    'role = "boss"': "role",
    'ack_mode = "maybe"': "ack_mode",
    "min_insync_replicas = 0": "min_insync_replicas",
    "broker_id = -1": "broker_id",
    'broker_id = "one"': "broker_id",
}
BAD_ENV = {  # a CLMQ_* variable -> what the error must name
    "CLMQ_REPLICA_IDS=1,two": "replica_ids",
    "CLMQ_TOPIC_ACK_MODES=orders": "topic_ack_modes",
    "CLMQ_TOPIC_ACK_MODES==sync": "topic_ack_modes",
    "CLMQ_TOPIC_ACK_MODES=orders=sometimes": "topic_ack_modes",
    "CLMQ_MIN_INSYNC_REPLICAS=many": "min_insync_replicas",
    "CLMQ_ROLE=observer": "role",
}


@pytest.mark.parametrize("line", BAD_TOML)
def test_a_bad_value_in_the_file_is_an_error_naming_the_setting(tmp_path: Path, line: str) -> None:
    conf = tmp_path / "b.toml"
    conf.write_text(f"[broker]\n{line}\n")
    with pytest.raises(SettingsError, match=BAD_TOML[line]):
        load_settings(BrokerConfig, conf, section="broker", env={})


@pytest.mark.parametrize("assignment", BAD_ENV)
def test_a_bad_value_in_the_environment_is_an_error_naming_the_setting(assignment: str) -> None:
    var, _, value = assignment.partition("=")
    with pytest.raises(SettingsError, match=BAD_ENV[assignment]):
        load_settings(BrokerConfig, env={var: value})


def test_clmq_broker_refuses_bad_replication_flags_naming_the_setting(tmp_path: Path) -> None:
    cases = {
        ("--role", "boss"): "role",
        ("--replica-ids", "1,x"): "replica_ids",
        ("--topic-ack-modes", "orders"): "topic_ack_modes",
        ("--min-insync-replicas", "0"): "min_insync_replicas",
        ("--ack-mode", "sometimes"): "ack_mode",
    }
    for flag, setting in cases.items():
        out = clmq("broker", *flag, "--data-dir", str(tmp_path / "d"), "--listen-port", "0", cwd=tmp_path)
        assert out.returncode == 2 and "error:" in out.stderr and setting in out.stderr, (flag, out.stdout, out.stderr)
    assert not (tmp_path / "d").exists()  # refused before anything was opened


# ------------------------------------------------------- a follower on its own
def test_promote_refuses_a_follower_not_in_sync_unless_forced(tmp_path: Path) -> None:
    """A follower whose leader never answered: status says so, promote explains
    --force and its risk, and --force makes it the leader of a new epoch."""
    port, nowhere = _free_port(), _free_port()
    addr = f"127.0.0.1:{port}"
    proc = subprocess.Popen(
        [
            *CLI,
            "broker",
            "--broker-name",
            "solo",
            "--broker-id",
            "1",
            "--role",
            "follower",
            "--leader-addr",
            f"127.0.0.1:{nowhere}",
            "--listen-port",
            str(port),
            "--data-dir",
            str(tmp_path / "d"),
        ],
        cwd=tmp_path,
        env=ENV,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert "broker solo on" in proc.stdout.readline()  # it is listening
        status = json.loads(clmq("broker", "status", "--addr", addr, "-o", "json", cwd=tmp_path).stdout)
        assert (status["role"], status["in_sync"], status["broker_id"]) == ("follower", False, 1)
        refused = clmq("admin", "promote", "--addr", addr, cwd=tmp_path)
        assert refused.returncode == 1 and "not known to be in sync" in refused.stdout, refused.stdout + refused.stderr
        assert "--force" in refused.stdout and "LOST" in refused.stdout
        forced = clmq("admin", "promote", "--addr", addr, "--force", cwd=tmp_path)
        assert forced.returncode == 0 and "is now the leader of group solo, epoch" in forced.stdout, forced.stdout
        after = json.loads(clmq("broker", "status", "--addr", addr, "-o", "json", cwd=tmp_path).stdout)
        assert after["role"] == "leader" and after["epoch"] >= 0
        assert "already leads" in clmq("admin", "promote", "--addr", addr, cwd=tmp_path).stdout
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    missing = clmq("broker", "status", "--addr", f"127.0.0.1:{nowhere}", cwd=tmp_path)
    assert missing.returncode == 3 and missing.stderr.startswith("error:")  # nobody answered


# ------------------------------------------------------------ clmq dev --replicas
class DevGroup:
    """``clmq dev --replicas 3 --demo`` (plus ``extra`` flags) running in its own process."""

    def __init__(self, tmp: Path, *extra: str) -> None:
        self.tmp, self.ns = tmp, f"127.0.0.1:{_free_port()}"
        # A session of its own: the Ctrl-C test signals its whole process group, as a terminal does.
        self.proc = subprocess.Popen(
            [
                *CLI,
                "dev",
                "--replicas",
                "3",
                "--demo",
                "--listen-port",  # the worker's ports, not bind(0)'s ephemeral range (racy under xdist)
                str(free_port_block(3)),
                "--metrics-port",
                str(free_port_block(3)),
                "--namesrv-port",
                self.ns.split(":")[1],
                "--data-dir",
                str(tmp / "dev"),
                *extra,
            ],
            cwd=tmp,
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.output: list[str] = []

    def read_until(self, text: str) -> str:
        """Lines of its output up to the first containing ``text`` (a subprocess's line
        is an event: no polling)."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)
            if text in line:
                return "".join(self.output)
        raise AssertionError(f"clmq dev ended without printing {text!r}:\n{''.join(self.output)}")

    def serving(self) -> str:
        """Its output once it serves (read up to then if no test has yet)."""
        seen = "".join(self.output)
        return seen if "serving;" in seen else self.read_until("serving;")

    def brokers(self) -> list[dict[str, Any]]:
        out = clmq("cluster", "list", "-o", "json", "--namesrv", self.ns, cwd=self.tmp)
        assert out.returncode == 0, out.stdout + out.stderr
        return list(json.loads(out.stdout)["brokers"])


def _running_group(group: DevGroup) -> Iterator[DevGroup]:
    try:
        yield group
    finally:
        if group.proc.poll() is None:
            # a test failed before stopping it; its replicas (and ZooKeeper) are in their own sessions
            group.proc.kill()
            for pid in (int(p) for p in re.findall(r"pid (\d+)", "".join(group.output))):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        group.proc.wait(30)


@pytest.fixture(scope="module")
def dev(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevGroup]:
    yield from _running_group(DevGroup(tmp_path_factory.mktemp("dev")))


@pytest.fixture(scope="module")
def dev_zk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevGroup]:
    yield from _running_group(DevGroup(tmp_path_factory.mktemp("devzk"), "--zookeeper"))


def _settled(brokers: list[dict[str, Any]]) -> bool:
    """One leader, two in-sync followers, every log end the same and confirmed (a
    follower learns the confirmed offset from a fetch answer, after it holds the bytes)."""
    roles = sorted(b["role"] for b in brokers)
    return (
        roles == ["follower", "follower", "leader"]
        and all(b["in_sync"] for b in brokers)
        and len({b["end_offset"] for b in brokers} | {b["confirmed_offset"] for b in brokers}) == 1
    )


@pytest.mark.timeout(120)
def test_dev_replicas_runs_a_group_of_three_processes_and_messages_flow(dev: DevGroup) -> None:
    out = dev.read_until("serving;")
    assert "messages flowed: produced 5, consumed 5" in out, out
    pids = [int(p) for p in re.findall(r"pid (\d+)", out)]
    assert len(set(pids)) == 3 and dev.proc.pid not in pids  # three processes of their own
    for i in range(3):
        assert f"{dev.tmp / 'dev' / f'replica-{i}'}/" in out  # each replica's own data directory is shown
    produced = clmq("produce", "demo", "one", "two", "three", "--namesrv", dev.ns, cwd=dev.tmp)
    assert produced.returncode == 0 and produced.stdout.count("broker-a queue") == 3, produced.stdout + produced.stderr
    brokers = wait_until(
        lambda: (b := dev.brokers()) and _settled(b) and b, 30, "1 leader, 2 in-sync followers, equal log ends"
    )
    assert {b["group"] for b in brokers} == {"broker-a"} and sorted(b["broker_id"] for b in brokers) == [0, 1, 2]
    assert len({b["addr"] for b in brokers}) == 3 and len({b["epoch"] for b in brokers}) == 1
    leader = next(b for b in brokers if b["role"] == "leader")
    assert leader["broker_id"] == 0 and leader["followers_in_sync"] == 2 and leader["end_offset"] > 0
    for f in (b for b in brokers if b["role"] == "follower"):
        assert f["lag_bytes"] == 0 and f["acked_offset"] == leader["end_offset"] and f["leader_addr"] == leader["addr"]
        assert f["confirmed_offset"] == leader["confirmed_offset"] == leader["end_offset"]
    table = clmq("cluster", "list", "--namesrv", dev.ns, cwd=dev.tmp).stdout
    assert table.count("broker-a") == 3 and table.count("follower") == 2 and "yes" in table
    assert "ZK session" not in table  # manual mode: no ZooKeeper columns
    assert all(b["coordination"] == {"mode": "manual"} for b in brokers)


@pytest.mark.timeout(120)
def test_promoting_a_follower_makes_it_the_leader_and_the_old_leader_follows(dev: DevGroup) -> None:
    before = wait_until(lambda: (b := dev.brokers()) and _settled(b) and b, 30, "the group to settle")
    old = next(b for b in before if b["role"] == "leader")
    chosen = next(b for b in before if b["role"] == "follower")
    promoted = clmq("admin", "promote", "--addr", chosen["addr"], cwd=dev.tmp)
    assert promoted.returncode == 0, promoted.stdout + promoted.stderr
    new_epoch = int(re.search(r"epoch (\d+)", promoted.stdout).group(1))  # type: ignore[union-attr]
    assert new_epoch > old["epoch"]

    def switched() -> list[dict[str, Any]] | None:
        by_addr = {b["addr"]: b for b in dev.brokers()}
        new, was = by_addr[chosen["addr"]], by_addr[old["addr"]]
        done = (new["role"], new["epoch"], was["role"], was["registered_role"]) == (
            "leader",
            new_epoch,
            "follower",
            "follower",
        )
        return list(by_addr.values()) if done else None

    wait_until(switched, 30, f"{chosen['addr']} to lead with epoch {new_epoch} and {old['addr']} to follow")
    produced = clmq("produce", "demo", "after", "--namesrv", dev.ns, cwd=dev.tmp)
    assert produced.returncode == 0 and chosen["addr"] in produced.stdout, (
        produced.stdout + produced.stderr
    )  # msg id: the new leader
    after = wait_until(lambda: (b := dev.brokers()) and _settled(b) and b, 30, "the followers to copy the new leader")
    assert {b["epoch"] for b in after} == {new_epoch}
    assert next(b for b in after if b["role"] == "leader")["addr"] == chosen["addr"]


@pytest.mark.timeout(120)
def test_ctrl_c_stops_every_replica_cleanly(dev: DevGroup) -> None:
    dev.serving()  # every replica up (this test may be the first of the module on its xdist worker)
    dev.proc.send_signal(signal.SIGINT)
    assert dev.proc.wait(60) == 0
    assert dev.proc.stdout is not None
    out = "".join(dev.output) + dev.proc.stdout.read()
    assert sorted(re.findall(r"replica (\d) of broker-a stopped \(code 0\)", out)) == ["0", "1", "2"], out
    for pid in (int(p) for p in re.findall(r"pid (\d+)", out)):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # gone (and reaped by clmq dev)
    for i in range(3):
        assert not (dev.tmp / "dev" / f"replica-{i}" / "abort").exists()  # each closed its store cleanly


def _processes_naming(path: Path) -> list[str]:
    """Command lines of the running processes that name ``path`` (its replicas, ZooKeeper)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # gone, or not a process
        if str(path) in cmdline:
            found.append(f"{proc.name}: {cmdline}")
    return found


def _rest_of_output(group: DevGroup) -> str:
    """What the command printed after the lines the test read (for a failure's message)."""
    assert group.proc.stdout is not None
    return group.proc.stdout.read()


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "moment",
    [
        "clmq dev: starting",  # nothing started yet
        "ZooKeeper 127.0.0.1",  # ZooKeeper up, no replica yet
        "clmq dev: name server",  # replicas registered, not yet in sync
        "serving;",  # everything up
    ],
)
def test_ctrl_c_at_any_moment_of_start_up_stops_everything_and_exits_0(tmp_path: Path, moment: str) -> None:
    group = DevGroup(tmp_path, "--zookeeper")
    for _ in _running_group(group):
        group.read_until(moment)
        os.killpg(group.proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C
        code = group.proc.wait(90)
        assert code == 0, "".join(group.output) + _rest_of_output(group)
    assert _processes_naming(tmp_path / "dev") == []
    assert list((tmp_path / "dev").glob("replica-*/abort")) == []  # every started replica closed its store


@pytest.mark.timeout(180)
def test_a_second_ctrl_c_while_stopping_does_not_cut_the_stop_short(tmp_path: Path) -> None:
    group = DevGroup(tmp_path, "--zookeeper")
    for _ in _running_group(group):
        group.read_until("serving;")
        os.killpg(group.proc.pid, signal.SIGINT)
        group.read_until("stopping the replicas")
        os.killpg(group.proc.pid, signal.SIGINT)  # an impatient user
        assert group.proc.wait(90) == 0, "".join(group.output)
    assert _processes_naming(tmp_path / "dev") == []
    assert list((tmp_path / "dev").glob("replica-*/abort")) == []


# ------------------------------------------------- clmq dev --replicas --zookeeper
def _zk_settled(brokers: list[dict[str, Any]]) -> bool:
    """Settled, and ZooKeeper agrees: every session connected, one epoch, all in its in-sync set."""
    if not _settled(brokers) or not all(b["coordination"]["mode"] == "zookeeper" for b in brokers):
        return False
    zk = [b["coordination"] for b in brokers]
    leader = next(b for b in brokers if b["role"] == "leader")
    return (
        all(c["session"] == "CONNECTED" and sorted(c["isr"]) == [0, 1, 2] for c in zk)
        and {c["epoch"] for c in zk} == {leader["epoch"]}
        and {c["leader"] for c in zk} == {leader["broker_id"]}
    )


@pytest.mark.timeout(120)
def test_dev_replicas_with_zookeeper_lets_zookeeper_elect_and_cluster_list_shows_it(dev_zk: DevGroup) -> None:
    out = dev_zk.read_until("serving;")
    zk = re.search(r"ZooKeeper 127\.0\.0\.1:(\d+) \(pid (\d+)\)", out)
    assert zk is not None, out
    connect = f"127.0.0.1:{zk.group(1)}/clmq-dev"
    assert f"ZooKeeper {connect} elected replica" in out and "messages flowed: produced 5, consumed 5" in out, out
    for i in range(3):  # every replica is told the same connect string (and keeps it for `clmq broker --config`)
        settings = load_settings(BrokerConfig, dev_zk.tmp / "dev" / f"replica-{i}.toml", section="broker", env={})
        assert (settings.zookeeper, settings.broker_id, settings.role, settings.leader_addr) == (
            connect,
            i,
            "follower",
            "",
        )
    assert (dev_zk.tmp / "dev" / "zookeeper" / "zoo.cfg").read_text().count("tickTime=500") == 1
    brokers = wait_until(
        lambda: (b := dev_zk.brokers()) and _zk_settled(b) and b, 30, "ZooKeeper to agree on the group"
    )
    leader = next(b for b in brokers if b["role"] == "leader")
    assert f"elected replica {leader['broker_id']} the leader" in out
    assert leader["coordination"]["lease_ms_left"] > 0
    table = clmq("cluster", "list", "--namesrv", dev_zk.ns, cwd=dev_zk.tmp).stdout
    for column in ("ZK session", "ZK epoch", "ZK in-sync set", "lease left"):
        assert column in table, table
    assert table.count("CONNECTED") == 3 and "0,1,2" in table and " ms" in table, table
    status = clmq("broker", "status", "--addr", leader["addr"], cwd=dev_zk.tmp).stdout
    assert "ZooKeeper session" in status and "CONNECTED" in status, status


@pytest.mark.timeout(120)
def test_promote_under_zookeeper_hands_the_group_over(dev_zk: DevGroup) -> None:
    before = wait_until(lambda: (b := dev_zk.brokers()) and _zk_settled(b) and b, 30, "the group to settle")
    old = next(b for b in before if b["role"] == "leader")
    chosen = next(b for b in before if b["role"] == "follower")
    promoted = clmq("admin", "promote", "--addr", chosen["addr"], cwd=dev_zk.tmp)
    assert promoted.returncode == 0 and "handed the group over through ZooKeeper" in promoted.stdout, (
        promoted.stdout + promoted.stderr
    )
    new_epoch = int(re.search(r"epoch (\d+)", promoted.stdout).group(1))  # type: ignore[union-attr]
    assert new_epoch > old["epoch"]

    def handed_over() -> list[dict[str, Any]] | None:
        b = dev_zk.brokers()
        by_addr = {x["addr"]: x for x in b}
        done = by_addr[chosen["addr"]]["role"] == "leader" and by_addr[old["addr"]]["role"] == "follower"
        return b if done and _zk_settled(b) else None

    after = wait_until(handed_over, 30, f"{chosen['addr']} to lead epoch {new_epoch} with everyone in sync")
    assert {b["coordination"]["epoch"] for b in after} == {b["epoch"] for b in after} == {new_epoch}
    produced = clmq("produce", "demo", "after", "--namesrv", dev_zk.ns, cwd=dev_zk.tmp)
    assert produced.returncode == 0 and chosen["addr"] in produced.stdout, produced.stdout + produced.stderr


@pytest.mark.timeout(120)
def test_ctrl_c_stops_the_replicas_then_zookeeper(dev_zk: DevGroup) -> None:
    dev_zk.serving()
    os.killpg(dev_zk.proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: its whole process group
    assert dev_zk.proc.wait(60) == 0
    assert dev_zk.proc.stdout is not None
    out = "".join(dev_zk.output) + dev_zk.proc.stdout.read()
    stops = re.findall(r"replica (\d) of broker-a stopped \(code 0\)", out)
    assert sorted(stops) == ["0", "1", "2"], out
    assert out.index("ZooKeeper stopped") > max(out.index(f"replica {i} of broker-a stopped") for i in stops)  # last
    for pid in (int(p) for p in re.findall(r"pid (\d+)", out)):  # the replicas' and ZooKeeper's
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    for i in range(3):
        assert not (dev_zk.tmp / "dev" / f"replica-{i}" / "abort").exists()


def test_dev_zookeeper_needs_a_group_and_broker_refuses_a_bad_connect_string(tmp_path: Path) -> None:
    out = clmq("dev", "--zookeeper", "--data-dir", str(tmp_path / "d"), cwd=tmp_path)
    assert out.returncode == 2 and "--replicas 2 or more" in out.stdout + out.stderr
    out = clmq(
        "broker", "--zookeeper", "zk/chroot", "--data-dir", str(tmp_path / "b"), "--listen-port", "0", cwd=tmp_path
    )
    assert out.returncode == 2 and "zookeeper must be 'host:port" in out.stdout + out.stderr

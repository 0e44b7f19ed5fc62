"""``clmq dev --replicas N``: a name server (in this process) and one broker group of N
replicas, each a separate ``clmq broker`` process with its own data directory.

Settings resolve once, here (the TOML file, ``CLMQ_*`` variables, flags, as for ``clmq
dev``); each replica gets them complete in ``<data-dir>/replica-<id>.toml`` (reusable
with ``clmq broker --config``) and logs to ``<data-dir>/replica-<id>.log``. The
replicas run in their own sessions, so a Ctrl-C reaches only this process, which
stops them with SIGTERM (each stops gracefully) and waits for them.

With ``--zookeeper`` the command also runs a standalone ZooKeeper server (a ``java``
process, ``<data-dir>/zookeeper/``) and every replica gets ``zookeeper =
"127.0.0.1:PORT/clmq-dev"``: ZooKeeper elects the leader (the command waits until one
replica says it leads, and names none itself), and it is stopped last, after the
replicas. Without the flag replica 0 leads and the others follow it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

import trio

from clmq.broker.service import BrokerConfig
from clmq.client import ConnectionFailed, RpcError, open_admin
from clmq.devtools.zkserver import LocalZooKeeper, ZooKeeperError
from clmq.nameserver import serve as serve_nameserver

from ._dev_tls import dev_nameserver_config
from ._output import console
from ._ready import metrics_url, print_ready
from .replication_verbs import cluster_rows, print_cluster_table

START_TIMEOUT_S = 30.0  # every replica registered with the name server
IN_SYNC_TIMEOUT_S = 20.0  # every follower joined and in sync (a warning after this, not an error)
CATCH_UP_TIMEOUT_S = 10.0  # after the demo: the followers' log ends reach the leader's
STOP_TIMEOUT_S = 20.0  # a replica still running this long after SIGTERM is killed
ELECTION_TIMEOUT_S = 30.0  # --zookeeper: one replica leads (ZooKeeper elected it)
ZK_TICK_TIME_MS = 500  # a 2000 ms session is 4 ticks: failover in about 2 s, not Debian's 4 s
ZK_CHROOT = "/clmq-dev"
POLL_S = 0.1  # the name server and the brokers send no notifications: their state is asked for


@dataclass
class ReplicaProcess:
    """One replica: its settings, where they and its log are, and its process."""

    config: BrokerConfig
    settings_path: Path
    log_path: Path
    process: trio.Process | None = None

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


async def run_replica_group(args: Any, base: BrokerConfig, demo: Callable[[str], Awaitable[None]]) -> int:
    """The whole of ``clmq dev --replicas N``; returns the exit code."""
    exited: list[ReplicaProcess] = []  # replicas that exited on their own: the command fails
    try:
        async with _zookeeper(Path(base.data_dir), getattr(args, "zookeeper", False)) as zk:
            return await _run_group(args, base, demo, zk, exited)
    except ZooKeeperError as e:
        console.print(f"[red]error:[/red] {e}")
        return 1


@contextlib.asynccontextmanager
async def _zookeeper(data_dir: Path, wanted: bool) -> AsyncIterator[LocalZooKeeper | None]:
    """A ZooKeeper server under ``<data_dir>/zookeeper/`` while the block runs (None
    without ``--zookeeper``); stopped after the block, i.e. after the replicas."""
    if not wanted:
        yield None
        return
    zk = LocalZooKeeper(data_dir / "zookeeper", tick_time_ms=ZK_TICK_TIME_MS)
    await trio.to_thread.run_sync(zk.start)
    console.print(f"clmq dev: ZooKeeper {zk.connect_string()} (pid {zk.pid}), data and log in {zk.directory}/")
    try:
        yield zk
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(zk.stop)
        console.print("ZooKeeper stopped")


async def _run_group(
    args: Any,
    base: BrokerConfig,
    demo: Callable[[str], Awaitable[None]],
    zk: LocalZooKeeper | None,
    exited: list[ReplicaProcess],
) -> int:
    async with trio.open_nursery() as nursery:
        ns = await nursery.start(serve_nameserver, dev_nameserver_config(args.namesrv_port, base))
        try:
            replicas = plan_replicas(base, ns.addr, args.replicas, zk.connect_string(ZK_CHROOT) if zk else "")
        except ValueError as e:
            console.print(f"[red]error:[/red] {e}")
            ns.shutdown()
            return 1
        try:
            with trio.CancelScope() as scope:
                nursery.start_soon(_cancel_on_signal, scope)
                await _start_and_serve(replicas, ns.addr, args, demo, scope, exited)
        finally:
            with trio.CancelScope(shield=True):
                await _stop_all(replicas)
            ns.shutdown()
            nursery.cancel_scope.cancel()  # the signal watcher
    return 1 if exited else 0


async def _cancel_on_signal(scope: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            console.print("stopping the replicas and the name server (graceful)")
            scope.cancel()
            return


async def _start_and_serve(
    replicas: list[ReplicaProcess],
    namesrv: str,
    args: Any,
    demo: Callable[[str], Awaitable[None]],
    scope: trio.CancelScope,
    exited: list[ReplicaProcess],
) -> None:
    """Start the replicas, show them, run the demo, serve until ``scope`` is cancelled
    (a signal, or a replica exiting: listed in ``exited``)."""
    elected = bool(replicas[0].config.zookeeper)
    async with trio.open_nursery() as nursery:
        # Manual mode: the leader listens before its followers call it. ZooKeeper mode:
        # all at once, and ZooKeeper elects.
        for group in [replicas] if elected else [replicas[:1], replicas[1:]]:
            for r in group:
                await _spawn(r)
                nursery.start_soon(_watch_exit, r, exited, scope)
            await _wait_registered(namesrv, {r.addr for r in group}, group)
        leader = await _wait_elected(replicas) if elected else replicas[0]
        _print_plan(replicas, namesrv, leader)
        await _wait_in_sync(leader.addr, len(replicas) - 1)
        if args.demo:
            await demo(namesrv)
            await _wait_caught_up(replicas)
            await print_cluster(namesrv)
        if args.exit_after_demo:
            nursery.cancel_scope.cancel()
            return
        brokers = [
            {"addr": r.addr, "broker_id": r.config.broker_id, "metrics_url": r.metrics_url, "kafka_addr": r.kafka_addr}
            for r in replicas
        ]
        print_ready(args, namesrv, brokers, str(Path(replicas[0].config.data_dir).parent))
        console.print(
            f"serving; watch the state: clmq cluster list --namesrv {namesrv}\n"
            f"         promote:         clmq admin promote --addr {_a_follower(replicas, leader).addr}   "
            "(Ctrl-C stops all)",
            highlight=False,
        )
        await trio.sleep_forever()


async def _spawn(r: ReplicaProcess) -> None:
    r.settings_path.parent.mkdir(parents=True, exist_ok=True)
    r.settings_path.write_text(settings_toml(r.config))
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLMQ_")}  # resolved into the settings file
    for name in ("broker_password", "zk_auth"):  # ... except the secrets, kept out of it
        if getattr(r.config, name):
            env[f"CLMQ_{name.upper()}"] = getattr(r.config, name)
    with r.log_path.open("ab") as log_file:  # the child has its own descriptor; this one closes
        r.process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "clmq", "broker", "--config", str(r.settings_path)],
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=log_file,
            env=env,
            start_new_session=True,
        )


async def _watch_exit(r: ReplicaProcess, exited: list[ReplicaProcess], scope: trio.CancelScope) -> None:
    """A replica that exits on its own stops the whole command, showing why."""
    assert r.process is not None
    code = await r.process.wait()
    exited.append(r)
    console.print(f"[red]replica {r.config.broker_id} at {r.addr} exited (code {code}); its log, {r.log_path}:")
    console.print(_tail(r.log_path), markup=False, highlight=False)
    scope.cancel()


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"(unreadable: {e})"


def _a_follower(replicas: list[ReplicaProcess], leader: ReplicaProcess) -> ReplicaProcess:
    return next(r for r in reversed(replicas) if r is not leader)


def _print_plan(replicas: list[ReplicaProcess], namesrv: str, leader: ReplicaProcess) -> None:
    c = replicas[0].config
    console.print(
        f"clmq dev: name server {namesrv}; group {c.broker_name} of {len(replicas)} replicas, "
        f"{c.ack_mode} acks, min_insync_replicas {c.min_insync_replicas}, {c.flush_mode} flush"
    )
    if c.zookeeper:
        console.print(
            f"  ZooKeeper {c.zookeeper} elected replica {leader.config.broker_id} the leader "
            f"(zk_session_timeout_ms {c.zk_session_timeout_ms}: a dead leader is replaced about that fast)"
        )
    for r in replicas:
        role = ("leader" if r is leader else "follower") + (", elected" if c.zookeeper else " at first start")
        pid = r.process.pid if r.process else "-"
        console.print(
            f"  replica {r.config.broker_id} ({role}) on {r.addr}, pid {pid}\n    data {r.config.data_dir}/\n"
            f"    settings {r.settings_path}, log {r.log_path}",
            highlight=False,
        )
    console.print(
        f"the state: clmq cluster list --namesrv {namesrv}   one replica: clmq broker status --addr {replicas[0].addr}"
    )


async def _wait_registered(namesrv: str, addrs: set[str], group: list[ReplicaProcess]) -> None:
    try:
        with trio.fail_after(START_TIMEOUT_S):
            async with open_admin([namesrv]) as admin:
                while not addrs <= {b["addr"] for b in await admin.brokers()}:  # noqa: ASYNC110 - no watch to wait on
                    await trio.sleep(POLL_S)
    except trio.TooSlowError:
        logs = ", ".join(str(r.log_path) for r in group)
        raise RuntimeError(
            f"replicas not registered with the name server within {START_TIMEOUT_S:.0f} s; their logs: {logs}"
        ) from None


async def _wait_elected(replicas: list[ReplicaProcess]) -> ReplicaProcess:
    """Until one replica says it leads (ZooKeeper elected it); a RuntimeError naming the
    logs after ELECTION_TIMEOUT_S."""
    with trio.move_on_after(ELECTION_TIMEOUT_S):
        async with open_admin(broker_addrs=[r.addr for r in replicas]) as admin:
            while True:
                for r in replicas:
                    try:
                        if (await admin.replica_status(r.addr))["role"] == "leader":
                            return r
                    except (ConnectionFailed, RpcError):
                        pass  # a replica that died is reported by its watcher
                await trio.sleep(POLL_S)
    logs = ", ".join(str(r.log_path) for r in replicas)
    raise RuntimeError(
        f"no replica was elected leader through ZooKeeper within {ELECTION_TIMEOUT_S:.0f} s; their logs: {logs}"
    )


async def _wait_in_sync(leader: str, followers: int) -> None:
    """Until the leader counts every follower in sync; a warning (not a failure) after
    IN_SYNC_TIMEOUT_S: the group still serves, and the table shows who is behind."""
    with trio.move_on_after(IN_SYNC_TIMEOUT_S):
        async with open_admin(broker_addrs=[leader]) as admin:
            while True:
                try:
                    s = await admin.replica_status(leader)
                    if sum(1 for r in s["replicas"] if r["in_sync"]) >= followers:
                        return
                except (ConnectionFailed, RpcError):
                    pass  # not up yet
                await trio.sleep(POLL_S)
    console.print(f"[yellow]not every follower is in sync after {IN_SYNC_TIMEOUT_S:.0f} s; see clmq cluster list")


async def _wait_caught_up(replicas: list[ReplicaProcess]) -> None:
    """Until every follower's log end is the leader's (after the demo's messages)."""
    with trio.move_on_after(CATCH_UP_TIMEOUT_S):
        async with open_admin(broker_addrs=[r.addr for r in replicas]) as admin:
            while True:
                try:
                    if len({(await admin.replica_status(r.addr))["end_offset"] for r in replicas}) == 1:
                        return
                except (ConnectionFailed, RpcError):
                    pass  # a replica that died is reported by its watcher
                await trio.sleep(POLL_S)


async def print_cluster(namesrv: str) -> None:
    """``clmq cluster list``'s table, from inside a command."""
    async with open_admin([namesrv]) as admin:
        rows = await cluster_rows(admin)
    print_cluster_table(rows, "replication state (clmq cluster list)")


async def _stop_all(replicas: list[ReplicaProcess]) -> None:
    """SIGTERM to every replica still running, then wait; a replica still running after
    STOP_TIMEOUT_S is killed (and said so)."""
    running = [r for r in replicas if r.process is not None and r.process.returncode is None]
    for r in running:
        assert r.process is not None
        r.process.send_signal(signal.SIGTERM)
    async with trio.open_nursery() as nursery:
        for r in running:
            nursery.start_soon(_await_stop, r)


async def _await_stop(r: ReplicaProcess) -> None:
    assert r.process is not None
    with trio.move_on_after(STOP_TIMEOUT_S):
        await r.process.wait()
        console.print(f"replica {r.config.broker_id} stopped (code {r.process.returncode})")
        return
    console.print(f"[red]replica {r.config.broker_id} did not stop within {STOP_TIMEOUT_S:.0f} s: killed")
    r.process.kill()
    await r.process.wait()

"""``clmq dev --replicas N [--groups G]``: a name server (in this process) and G broker
groups (default 1) of N replicas, each a separate ``clmq broker`` process with its own
data directory (``dev_groups`` plans their names, ports and directories).

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
Every group is its own election (ZooKeeper keys it by broker name).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

import trio

from clmq.broker.service import BrokerConfig
from clmq.client import ConnectionFailed, RpcError, open_admin
from clmq.devtools.zkserver import LocalZooKeeper, ZooKeeperError
from clmq.nameserver import serve as serve_nameserver

from ._dev_tls import dev_nameserver_config
from ._output import console
from ._ready import print_ready
from .dev_groups import ReplicaProcess, plan_groups, plan_replicas, settings_toml
from .replication_verbs import cluster_rows, print_cluster_table

__all__ = ["ReplicaProcess", "plan_groups", "plan_replicas", "run_replica_group", "settings_toml"]

START_TIMEOUT_S = 30.0  # every replica registered with the name server
IN_SYNC_TIMEOUT_S = 20.0  # every follower joined and in sync (a warning after this, not an error)
CATCH_UP_TIMEOUT_S = 10.0  # after the demo: the followers' log ends reach the leader's
STOP_TIMEOUT_S = 20.0  # a replica still running this long after SIGTERM is killed
ELECTION_TIMEOUT_S = 30.0  # --zookeeper: one replica leads (ZooKeeper elected it)
ZK_TICK_TIME_MS = 500  # a 2000 ms session is 4 ticks: failover in about 2 s, not Debian's 4 s
ZK_CHROOT = "/clmq-dev"
POLL_S = 0.1  # the name server and the brokers send no notifications: their state is asked for


async def run_replica_group(args: Any, base: BrokerConfig, demo: Callable[[str], Awaitable[None]]) -> int:
    """The whole of ``clmq dev --replicas N``; returns the exit code. Ctrl-C (or SIGTERM)
    is caught from this function's first line to its last: at any moment of start-up,
    serving or stopping, it stops whatever started, gracefully, and the command exits 0."""
    exited: list[ReplicaProcess] = []  # replicas that exited on their own: the command fails
    stop = trio.CancelScope()  # cancelled by a signal or by a replica exiting
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as watcher:
            watcher.start_soon(_stop_on_signal, signals, stop)
            try:
                return await _run_stoppable(args, base, demo, stop, exited)
            finally:
                watcher.cancel_scope.cancel()
    raise AssertionError("unreachable")  # pragma: no cover - the nursery returns or raises


async def _run_stoppable(
    args: Any,
    base: BrokerConfig,
    demo: Callable[[str], Awaitable[None]],
    stop: trio.CancelScope,
    exited: list[ReplicaProcess],
) -> int:
    groups, replicas = getattr(args, "groups", 1), args.replicas
    console.print(f"clmq dev: starting {groups} group(s) of {replicas} replicas under {base.data_dir}/ (Ctrl-C stops)")
    with stop:
        try:
            async with _zookeeper(Path(base.data_dir), getattr(args, "zookeeper", False)) as zk:
                return await _run_group(args, base, demo, zk, stop, exited)
        except ZooKeeperError as e:
            if stop.cancel_called:  # asked to stop while ZooKeeper started: its failure is moot
                console.print(f"ZooKeeper did not start before the stop: {str(e).splitlines()[0]}")
                return 0
            console.print(f"[red]error:[/red] {e}")
            return 1
    return 1 if exited else 0


async def _stop_on_signal(signals: AsyncIterator[int], stop: trio.CancelScope) -> None:
    """Every SIGINT/SIGTERM is taken here: the first stops the command, later ones are said
    to be in hand (the stop in progress is not cut short)."""
    async for _ in signals:
        if stop.cancel_called:
            console.print("already stopping (gracefully); waiting for the processes to exit")
            continue
        console.print("stopping the replicas and the name server (graceful)")
        stop.cancel()


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
    scope: trio.CancelScope,
    exited: list[ReplicaProcess],
) -> int:
    async with trio.open_nursery() as nursery:
        ns = await nursery.start(serve_nameserver, dev_nameserver_config(args.namesrv_port, base))
        try:
            zk_connect = zk.connect_string(ZK_CHROOT) if zk else ""
            groups = plan_groups(base, ns.addr, getattr(args, "groups", 1), args.replicas, zk_connect)
        except ValueError as e:
            console.print(f"[red]error:[/red] {e}")
            ns.shutdown()
            return 1
        try:
            await _start_and_serve(groups, ns.addr, args, demo, scope, exited)
        finally:
            with trio.CancelScope(shield=True):
                await _stop_all([r for g in groups for r in g])
            ns.shutdown()
            nursery.cancel_scope.cancel()  # the name server
    return 1 if exited else 0


async def _start_and_serve(
    groups: list[list[ReplicaProcess]],
    namesrv: str,
    args: Any,
    demo: Callable[[str], Awaitable[None]],
    scope: trio.CancelScope,
    exited: list[ReplicaProcess],
) -> None:
    """Start every group's replicas, show them, run the demo, serve until ``scope`` is
    cancelled (a signal, or a replica exiting: listed in ``exited``)."""
    async with trio.open_nursery() as nursery:
        leaders = await _start_groups(groups, namesrv, nursery, scope, exited)
        for i, (group, leader) in enumerate(zip(groups, leaders)):
            _print_plan(group, namesrv, leader, last=i == len(groups) - 1)
        for group, leader in zip(groups, leaders):
            await _wait_in_sync(leader.addr, len(group) - 1)
        if args.demo:
            await demo(namesrv)
            for group in groups:
                await _wait_caught_up(group)
            await print_cluster(namesrv)
        if args.exit_after_demo:
            nursery.cancel_scope.cancel()
            return
        _print_serving(args, namesrv, groups, leaders)
        await trio.sleep_forever()


async def _start_groups(
    groups: list[list[ReplicaProcess]],
    namesrv: str,
    nursery: trio.Nursery,
    scope: trio.CancelScope,
    exited: list[ReplicaProcess],
) -> list[ReplicaProcess]:
    """Start the replicas; each group's leader. Manual mode: the leaders listen before
    their followers call them. ZooKeeper mode: all at once, and ZooKeeper elects one
    leader per group (each group is its own election, by broker name)."""
    elected = bool(groups[0][0].config.zookeeper)
    everyone = [r for g in groups for r in g]
    waves = [everyone] if elected else [[g[0] for g in groups], [r for g in groups for r in g[1:]]]
    for wave in (w for w in waves if w):
        for r in wave:
            await _spawn(r)
            nursery.start_soon(_watch_exit, r, exited, scope)
        await _wait_registered(namesrv, {r.addr for r in wave}, wave)
    return [await _wait_elected(g) if elected else g[0] for g in groups]


def _print_serving(args: Any, namesrv: str, groups: list[list[ReplicaProcess]], leaders: list[ReplicaProcess]) -> None:
    everyone = [r for g in groups for r in g]
    brokers = [
        {
            "addr": r.addr,
            "broker_name": r.config.broker_name,
            "broker_id": r.config.broker_id,
            "metrics_url": r.metrics_url,
            "kafka_addr": r.kafka_addr,
        }
        for r in everyone
    ]
    root = Path(everyone[0].config.data_dir).parent
    print_ready(args, namesrv, brokers, str(root if len(groups) == 1 else root.parent))
    promote = next(((g, lead) for g, lead in zip(groups, leaders) if len(g) > 1), None)
    hint = f"\n         promote:         clmq admin promote --addr {_a_follower(*promote).addr}" if promote else ""
    console.print(
        f"serving; watch the state: clmq cluster list --namesrv {namesrv}{hint}   (Ctrl-C stops all)",
        highlight=False,
    )


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
    console.print(f"[red]{r.name} at {r.addr} exited (code {code}); its log, {r.log_path}:")
    console.print(_tail(r.log_path), markup=False, highlight=False)
    scope.cancel()


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"(unreadable: {e})"


def _a_follower(replicas: list[ReplicaProcess], leader: ReplicaProcess) -> ReplicaProcess:
    return next(r for r in reversed(replicas) if r is not leader)


def _print_plan(replicas: list[ReplicaProcess], namesrv: str, leader: ReplicaProcess, last: bool = True) -> None:
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
    if last:
        console.print(
            f"the state: clmq cluster list --namesrv {namesrv}   "
            f"one replica: clmq broker status --addr {replicas[0].addr}"
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
        console.print(f"{r.name} stopped (code {r.process.returncode})")
        return
    console.print(f"[red]{r.name} did not stop within {STOP_TIMEOUT_S:.0f} s: killed")
    r.process.kill()
    await r.process.wait()

"""Real name servers and brokers on 127.0.0.1 for the service tests, run in the test's
nursery (pytest-trio); every broker has its own data directory under tmp_path."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import trio

from clmq.broker.service import Broker, BrokerConfig
from clmq.broker.service import serve as serve_broker
from clmq.client import NoRouteError, Routes, open_admin
from clmq.common import MiB
from clmq.nameserver import NameServer, NameServerConfig
from clmq.nameserver import serve as serve_nameserver
from tests.waiting import await_until

FAST_CONSUMER = {"heartbeat_interval_ms": 100, "rebalance_interval_ms": 200, "commit_interval_ms": 100}


@dataclass
class Cluster:
    nursery: trio.Nursery
    root: Path
    nameserver: NameServer | None = None
    brokers: dict[str, Broker] = field(default_factory=dict)
    scopes: dict[str, trio.CancelScope] = field(default_factory=dict)
    stopped: dict[str, trio.Event] = field(default_factory=dict)  # set once serve() returned (store closed)

    @property
    def ns(self) -> list[str]:
        assert self.nameserver is not None
        return [self.nameserver.addr]

    async def start_nameserver(self) -> NameServer:
        self.nameserver = await self.nursery.start(
            serve_nameserver, NameServerConfig(listen_port=0, broker_expiry_ms=1500, scan_interval_ms=100)
        )
        return self.nameserver

    async def start_broker(
        self,
        name: str = "broker-a",
        port: int = 0,
        namesrv_addrs: list[str] | None = None,
        key: str | None = None,
        **settings: Any,
    ) -> Broker:
        """Start a broker named ``name``, known in this cluster as ``key`` (default: its
        name; replicas of one group need distinct keys), with its own data directory."""
        name, key = name, key or name
        defaults: dict[str, Any] = {
            "register_interval_ms": 200,
            "client_expiry_ms": 1000,
            "segment_bytes": 4 * MiB,
            "max_message_bytes": 256 * 1024,
        }
        cfg = BrokerConfig(
            broker_name=name,
            listen_port=port,
            data_dir=str(self.root / key),
            namesrv_addrs=namesrv_addrs or self.ns,
            **{**defaults, **settings},
        )
        scope, stopped = trio.CancelScope(), trio.Event()

        async def run(task_status: trio.TaskStatus[Broker] = trio.TASK_STATUS_IGNORED) -> None:
            try:
                with scope:
                    await serve_broker(cfg, task_status=task_status)
            finally:
                stopped.set()

        broker = await self.nursery.start(run)
        self.brokers[key], self.scopes[key], self.stopped[key] = broker, scope, stopped
        return broker

    async def stop_broker(self, name: str) -> None:
        """Graceful stop; returns once the store is closed."""
        self.brokers.pop(name).shutdown()
        with trio.fail_after(15):
            await self.stopped[name].wait()  # serve() closes the store before it returns

    async def create_topic(self, topic: str, queues: int) -> None:
        """Create on every broker and wait until the name server routes it."""
        async with open_admin(self.ns) as admin:

            async def all_registered() -> bool:
                return len(await admin.brokers()) >= len(self.brokers)

            await await_until(all_registered, 10, f"all {len(self.brokers)} brokers registered with the name server")
            await admin.create_topic(topic, queues)
        await self.wait_routed(topic, {b.config.broker_name for b in self.brokers.values()})

    async def wait_routed(
        self, topic: str, brokers: set[str], ns: list[str] | None = None, timeout_s: float = 10
    ) -> None:
        """Wait until the name servers ``ns`` (default: the cluster's) route ``topic`` to
        exactly ``brokers`` (names): brokers register new topics at once, but the name
        server tells nobody when it has them."""
        await wait_routed(ns or self.ns, topic, brokers, timeout_s)


async def wait_routed(ns: list[str], topic: str, brokers: set[str] | None = None, timeout_s: float = 10) -> None:
    """Wait until the name servers ``ns`` route ``topic`` (to exactly ``brokers``, the
    brokers' names, if given)."""
    async with open_admin(ns) as admin:
        routes = Routes(admin.rpc, ns)

        async def routed() -> bool:
            try:
                names = {mq.broker_name for mq in await routes.queues(topic, refresh=True)}
            except NoRouteError:
                return False
            return brokers is None or names == brokers

        await await_until(routed, timeout_s, f"the name server to route topic {topic!r} to {sorted(brokers or [])}")


@contextlib.contextmanager
def cluster_in_thread(root: Path, **settings: Any) -> Iterator[Cluster]:
    """A name server and a broker (``settings``: its own) with topic "sync" (2 queues),
    run by trio in a thread."""
    stop, started, ready = threading.Event(), threading.Event(), []

    async def serve() -> None:
        try:
            async with trio.open_nursery() as n:
                c = Cluster(n, root)
                await c.start_nameserver()
                await c.start_broker(**settings)
                await c.create_topic("sync", 2)
                ready.append(c)
                started.set()
                await trio.to_thread.run_sync(stop.wait, 120)
                n.cancel_scope.cancel()
        finally:
            started.set()  # failed to start, too: no need to wait out the timeout

    server = threading.Thread(target=trio.run, args=(serve,))
    server.start()
    try:
        started.wait(20)
        assert ready, "the cluster did not start"
        yield ready[0]
    finally:
        stop.set()
        server.join(30)


async def follower_routed(c: Cluster, topic: str, addr: str, group: str = "g") -> None:
    """Until the name server lists the follower at ``addr`` in ``topic``'s route (a
    follower registers a topic once it copied it from its leader)."""
    async with open_admin(c.ns) as admin:
        routes = Routes(admin.rpc, c.ns)

        async def listed() -> bool:
            await routes.queues(topic, refresh=True)
            return addr in routes.followers(group)

        await await_until(listed, 10, f"the follower {addr} in the route of {topic!r}")


async def one_broker(nursery: trio.Nursery, tmp_path: Path) -> Cluster:
    """A name server and one broker ("broker-a") in this process: the usual ``cluster`` fixture."""
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    await c.start_broker("broker-a")
    return c

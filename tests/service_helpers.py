"""Real name servers and brokers on 127.0.0.1 for the service tests, run in the test's
nursery (pytest-trio); every broker has its own data directory under tmp_path."""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import trio

from broker.service import Broker, BrokerConfig
from broker.service import serve as serve_broker
from client import NoRouteError, open_admin
from commitlog import MiB
from nameserver import NameServer, NameServerConfig
from nameserver import serve as serve_nameserver

FAST_CONSUMER = {"heartbeat_interval_ms": 100, "rebalance_interval_ms": 200, "commit_interval_ms": 100}


@dataclass
class Cluster:
    nursery: trio.Nursery
    root: Path
    nameserver: NameServer | None = None
    brokers: dict[str, Broker] = field(default_factory=dict)
    scopes: dict[str, trio.CancelScope] = field(default_factory=dict)

    @property
    def ns(self) -> list[str]:
        assert self.nameserver is not None
        return [self.nameserver.addr]

    async def start_nameserver(self) -> NameServer:
        self.nameserver = await self.nursery.start(
            serve_nameserver, NameServerConfig(listen_port=0, broker_expiry_ms=1500, scan_interval_ms=100)
        )
        return self.nameserver

    async def start_broker(self, name: str = "broker-a", port: int = 0, namesrv_addrs: list[str] | None = None,
                           **settings: Any) -> Broker:  # fmt: skip
        cfg = BrokerConfig(broker_name=name, listen_port=port, data_dir=str(self.root / name),
                           namesrv_addrs=namesrv_addrs or self.ns,
                           register_interval_ms=200, client_expiry_ms=1000, segment_bytes=4 * MiB,
                           max_message_bytes=256 * 1024, **settings)  # fmt: skip
        scope = trio.CancelScope()

        async def run(task_status: trio.TaskStatus[Broker] = trio.TASK_STATUS_IGNORED) -> None:
            with scope:
                await serve_broker(cfg, task_status=task_status)

        broker = await self.nursery.start(run)
        self.brokers[name], self.scopes[name] = broker, scope
        return broker

    async def stop_broker(self, name: str) -> None:
        """Graceful stop; returns once the store is closed."""
        broker = self.brokers.pop(name)
        broker.shutdown()
        with trio.fail_after(15):
            while not broker.store._closed:
                await trio.sleep(0.02)

    async def create_topic(self, topic: str, queues: int) -> None:
        """Create on every broker and wait until the name server routes it."""
        async with open_admin(self.ns) as admin:
            with trio.fail_after(10):
                while len(await admin.brokers()) < len(self.brokers):
                    await trio.sleep(0.05)
                await admin.create_topic(topic, queues)
                while True:
                    try:
                        from client import Routes

                        routes = Routes(admin.rpc, self.ns)
                        if len({mq.broker_name for mq in await routes.queues(topic)}) == len(self.brokers):
                            return
                    except NoRouteError:
                        pass
                    await trio.sleep(0.05)


@contextlib.contextmanager
def cluster_in_thread(root: Path) -> Iterator[Cluster]:
    """A name server and a broker with topic "sync" (2 queues), run by trio in a thread."""
    stop, ready = threading.Event(), []

    async def serve() -> None:
        async with trio.open_nursery() as n:
            c = Cluster(n, root)
            await c.start_nameserver()
            await c.start_broker()
            await c.create_topic("sync", 2)
            ready.append(c)
            await trio.to_thread.run_sync(stop.wait, 120)
            n.cancel_scope.cancel()

    server = threading.Thread(target=trio.run, args=(serve,))
    server.start()
    try:
        for _ in range(400):
            if ready or not server.is_alive():
                break
            time.sleep(0.05)
        assert ready, "the cluster did not start"
        yield ready[0]
    finally:
        stop.set()
        server.join(30)

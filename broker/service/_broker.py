"""The broker as a network service: the store behind the wire protocol, registered
with every name server, stopped gracefully within a deadline."""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import ssl
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator

import trio
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from clmq.broker.coordination import CoordinationConfig, GroupCoordinator
from clmq.broker.replication import Replica
from clmq.broker.store import StorageEngine, Store
from clmq.protocol import RequestCode
from clmq.protocol.transport import (
    ClientSecurity,
    ConnectionFailed,
    RpcClient,
    RpcError,
    RpcServer,
    TlsHandshakes,
    metrics_login,
    metrics_page,
    rendered_in_thread,
    serve_http,
    warn_if_anonymous,
)

from ._append import AppendLane
from ._config import BrokerConfig
from ._context import BrokerContext, now_ms
from ._groups import ConsumerGroups
from ._handlers import Handlers, registration
from ._longpoll import PullWaiters
from ._metrics import BrokerCollector
from ._offsets import ConsumerOffsets
from ._replicated import ReplicatedMetadata
from ._security import BrokerSecurity
from ._stalls import StallDetector
from ._trace_buffer import TraceRecorder
from ._trace_writer import trace_loop
from .pop import PopCollector
from .transaction import TransactionCollector

if TYPE_CHECKING:
    from .kafka import KafkaService

log = logging.getLogger("clmq.broker")

# Python's cyclic collector, at its defaults, ran a young pass every 700 allocations and
# full passes over every long-lived object of the broker (topic and queue tables,
# modules): under small requests (each allocates trio tasks, events, frames) that was a
# fifth of the event loop's time. The broker's garbage is almost all freed by reference
# counting, so: young passes every this many allocations (at least), and what exists
# once the store is open is frozen (``gc.freeze``: never scanned again).
GC_YOUNG_THRESHOLD_OBJECTS = 50_000


class Broker:
    """A running broker (what :func:`serve` reports as started)."""

    def __init__(self, config: BrokerConfig, store: StorageEngine, token: trio.lowlevel.TrioToken) -> None:
        self.config = config
        self.store = store
        self.offsets = ConsumerOffsets(store.directory / "consumer_offsets.json")
        self.offsets.clamp(
            lambda topic, queue_id: store.max_offset(topic, queue_id) if store.queue_exists(topic, queue_id) else None
        )
        self.groups = ConsumerGroups(config.client_expiry_ms)
        self.waiters = PullWaiters(token)
        store.add_arrival_listener(self.waiters.on_arrivals)
        self.lane = AppendLane(
            store, config.max_inflight_produce_bytes, inline_max_bytes=config.inline_append_max_bytes
        )
        self.metadata = ReplicatedMetadata(store, self.offsets, self.groups)
        self.security = BrokerSecurity(config, store.directory, self.metadata.bump)
        self.metadata.security = self.security
        self.replica = Replica(
            config.replication_config(),
            store,
            self.metadata,
            token,
            self.register_now,
            writes_idle=self.lane.wait_idle,
            addr=lambda: self.addr,
        )
        self.ctx = BrokerContext(
            config,
            store,
            self.offsets,
            self.groups,
            self.waiters,
            self.lane,
            register_now=self.register_now,
            addr=lambda: self.addr,
            connections=lambda: self.rpc.connections,
            replica=self.replica,
            metadata=self.metadata,
            security=self.security,
            kafka_addr=lambda: self.kafka.kafka_addr() if self.kafka is not None else "",
            kafka_members=lambda group: self.kafka.members(group) if self.kafka is not None else {},
            kafka_groups=lambda: self.kafka.group_ids() if self.kafka is not None else [],
            tracer=TraceRecorder(config.trace_enabled),
            pop_describe=lambda group: self.handlers.pop.describe(group),
            pop_groups=lambda: self.handlers.pop.groups(),
            pop_drop_topic=lambda topic: self.handlers.pop.drop_topic(topic),
            stalls=StallDetector(config.stall_threshold_ms, f"broker {config.broker_name}"),
        )
        self.handlers = Handlers(self.ctx)
        self.kafka: KafkaService | None = None
        if config.kafka_listen_port >= 0:
            # Imported only here: the Kafka listener's modules (its message schemas, built at
            # import) were a fifth of every broker process's start-up, listener or not.
            from .kafka import KafkaService

            self.kafka = KafkaService(self.ctx, self.handlers.readers, lambda: self.client, self.handlers.pop)
        self.metadata.timer = self.handlers.timer
        self.metadata.transactions = self.handlers.transactions
        self.metadata.pop = self.handlers.pop
        table = self.handlers.table(self.replica.handlers())
        tls = config.tls_settings()
        self.tls_context: ssl.SSLContext | None = None
        if tls is not None:
            self.tls_context = tls.server_context()
            if self.kafka is not None:  # the Kafka SSL listener
                self.kafka.listener.tls = TlsHandshakes(
                    f"broker {config.broker_name} kafka listener", self.tls_context, tls.handshake_timeout_ms
                )
        # The broker's own connections (name servers, its leader): the same certificate
        # (mutual TLS) and CA, and its user's login.
        self.client_security = ClientSecurity(tls, config.broker_user, config.broker_password)
        self.rpc = RpcServer(
            f"broker {config.broker_name}",
            table,
            max_frame_bytes=config.max_frame_bytes,
            idle_timeout_ms=config.idle_timeout_ms,
            max_inflight_per_connection=config.max_inflight_per_connection,
            serial_codes=frozenset({RequestCode.SEND_MESSAGE}),
            limits=config.server_limits(),
            tls=self.tls_context,
        )
        self.started = time.monotonic()
        self.metrics = CollectorRegistry(auto_describe=False)  # this broker's own: several may share a process
        self.metrics.register(
            BrokerCollector(
                self.ctx,
                self.rpc.request_stats,
                lambda: self.rpc.connections,
                self.handlers.timer_fields,
                self.tls_handshake_failures,
            )
        )
        self.metrics.register(TransactionCollector(self.handlers.transactions))
        self.metrics.register(PopCollector(self.handlers.pop))
        if self.kafka is not None:
            from .kafka import KafkaCollector  # (imported with the listener, above)

            self.metrics.register(KafkaCollector(self.kafka))
        self.metrics_port = -1  # the port /metrics is served on, once started (-1: none)
        self._stop = trio.Event()
        self._register_wakeup = trio.Event()
        self._registered: dict[str, bool] = {}
        self.client: RpcClient | None = None
        self.coordinator: GroupCoordinator | None = None
        if config.zookeeper:  # automatic failover: ZooKeeper decides the replica's role
            zk = CoordinationConfig(
                config.zookeeper, config.zk_session_timeout_ms, config.unclean_leader_election, config.zk_auth
            )
            self.coordinator = GroupCoordinator(zk, self.replica, lambda: self.addr, token)
        # A store that fails (an fsync error) says so to the name servers at once, not at
        # the next registration interval: producers must stop being routed here.
        store.add_failure_listener(lambda _failure: _call_soon(token, self.register_now))

    @property
    def addr(self) -> str:
        return f"{self.config.advertised_addr_host}:{self.rpc.port}"

    def tls_handshake_failures(self) -> dict[str, int]:
        """Failed TLS handshakes per listener (none: a plaintext broker)."""
        if self.tls_context is None:
            return {}
        kafka = self.kafka.listener.tls if self.kafka is not None else None
        return {"native": self.rpc.tls_handshake_failures} | ({"kafka": kafka.failures} if kafka else {})

    def shutdown(self) -> None:
        """Begin a graceful stop: stop accepting, drain, flush, close the store."""
        self._stop.set()

    def register_now(self) -> None:
        self._register_wakeup.set()

    # ------------------------------------------------------------ name servers
    async def _register_loop(self) -> None:
        while True:
            await self._register_all()
            with trio.move_on_after(self.config.register_interval_ms / 1000):
                await self._register_wakeup.wait()
            self._register_wakeup = trio.Event()

    async def _register_all(self) -> None:
        fields = registration(self.ctx)
        async with trio.open_nursery() as nursery:
            for ns in self.config.namesrv_addrs:
                nursery.start_soon(self._register_with, ns, fields)

    async def _register_with(self, ns: str, fields: dict[str, Any]) -> None:
        assert self.client is not None
        try:
            reply = await self.client.request(ns, RequestCode.REGISTER_BROKER, fields, timeout_ms=3000)
            ok = True
            leader = reply.fields.get("leader_addr")
            if isinstance(leader, str) and isinstance(reply.fields.get("leader_epoch"), int):
                self.replica.group_leader(leader, reply.fields["leader_epoch"], self.addr)
        except (ConnectionFailed, RpcError, trio.TooSlowError) as e:
            ok = False
            if self._registered.get(ns, True):  # say it once per outage, not every few seconds
                log.warning("broker %s: cannot register with name server %s: %s", self.config.broker_name, ns, e)
        if ok and not self._registered.get(ns, False):
            log.info("broker %s registered with name server %s", self.config.broker_name, ns)
        self._registered[ns] = ok

    async def _unregister_all(self) -> None:
        assert self.client is not None
        with trio.move_on_after(1.0):
            for ns in self.config.namesrv_addrs:
                try:
                    await self.client.request(ns, RequestCode.UNREGISTER_BROKER, {"addr": self.addr}, timeout_ms=500)
                except (ConnectionFailed, RpcError, trio.TooSlowError):
                    pass

    # ------------------------------------------------------------ housekeeping
    async def _housekeeping_loop(self) -> None:
        while True:
            await trio.sleep(self.config.offset_flush_interval_ms / 1000)
            for group, client_id in self.groups.expire(now_ms()):
                log.info(
                    "consumer %s left group %s (no heartbeat for %d ms)", client_id, group, self.config.client_expiry_ms
                )
            try:
                await trio.to_thread.run_sync(self.offsets.flush)
            except OSError as e:
                log.warning("cannot persist consumer offsets yet: %s", e)

    async def _sample_rates(self) -> None:
        """A sample of the traffic counters every second: BROKER_INFO's rates."""
        while True:
            self.ctx.traffic.rates()
            await trio.sleep(1)

    async def _stop_gracefully(self) -> None:
        self.replica.stopping()
        self.rpc.stop_accepting()
        if self.kafka is not None:
            await self.kafka.listener.stop_accepting()
        if self.coordinator is not None:  # the group elects now, not after the session timeout
            with trio.move_on_after(self.config.shutdown_timeout_ms / 1000):
                await self.coordinator.resign()
        drained = await self.rpc.drain(self.config.shutdown_timeout_ms / 1000)
        if not drained:
            log.warning(
                "broker %s: %d requests still in flight after shutdown_timeout_ms=%d; cutting them off",
                self.config.broker_name,
                self.rpc.inflight,
                self.config.shutdown_timeout_ms,
            )
        await self._unregister_all()

    def close_storage(self) -> None:
        """Persist offsets, then close the store (writing the clean-shutdown marker)."""
        try:
            self.offsets.flush()
        finally:
            self.security.close()
            self.store.close()


def _call_soon(token: trio.lowlevel.TrioToken, fn: Callable[[], None]) -> None:
    """Run ``fn`` on the event loop from another thread; nothing if the loop has ended."""
    try:
        token.run_sync_soon(fn)
    except trio.RunFinishedError:
        pass


_gc_users = [0, 0]  # brokers running in this process; the young threshold before the first


@contextlib.contextmanager
def _tuned_gc() -> Iterator[None]:
    """Fewer and cheaper cyclic collections while brokers run (see
    ``GC_YOUNG_THRESHOLD_OBJECTS``); a threshold set higher by the embedding program is
    left as it is. The collector is shared by the whole process, so the last broker to
    stop puts it back as it was (tests, and programs that embed a broker, run other
    code in the same process)."""
    if not _gc_users[0]:
        young, *older = gc.get_threshold()
        _gc_users[1] = young
        if 0 < young < GC_YOUNG_THRESHOLD_OBJECTS:
            gc.set_threshold(GC_YOUNG_THRESHOLD_OBJECTS, *older)
        gc.freeze()
    _gc_users[0] += 1
    try:
        yield
    finally:
        _gc_users[0] -= 1
        if not _gc_users[0]:
            gc.unfreeze()
            _young, *older = gc.get_threshold()
            gc.set_threshold(_gc_users[1], *older)


_switch_asked: list[float] = []  # the GIL switch intervals (s) of the brokers running in this process
_switch_before = [0.0]  # the interval before the first of them


@contextlib.contextmanager
def _tuned_switch_interval(seconds: float) -> Iterator[None]:
    """The GIL's switch interval at most ``seconds`` while the broker runs (see
    ``BrokerConfig.gil_switch_interval_us``): the lowest any running broker asks for,
    never above what the embedding program set; the last broker to stop puts it back."""
    if not _switch_asked:
        _switch_before[0] = sys.getswitchinterval()
    _switch_asked.append(seconds)
    _set_switch_interval(min([_switch_before[0], *_switch_asked]))
    try:
        yield
    finally:
        _switch_asked.remove(seconds)
        _set_switch_interval(min([_switch_before[0], *_switch_asked]))


def _set_switch_interval(seconds: float) -> None:
    if seconds != sys.getswitchinterval():  # it is kept in whole µs: setting what it reads may lower it by one
        sys.setswitchinterval(seconds)


def open_store(config: BrokerConfig) -> StorageEngine:
    """Open (recovering if need be) and start the store a broker of ``config`` serves."""
    return Store.open(config.store_config()).start()


async def serve(config: BrokerConfig, *, task_status: trio.TaskStatus[Broker] = trio.TASK_STATUS_IGNORED) -> None:
    """Run a broker until cancelled or :meth:`Broker.shutdown`; the store is closed
    cleanly either way."""
    store = await trio.to_thread.run_sync(open_store, config)
    with _tuned_gc(), _tuned_switch_interval(config.gil_switch_interval_us / 1e6):
        await _serve_store(config, store, task_status)


async def _serve_store(config: BrokerConfig, store: StorageEngine, task_status: trio.TaskStatus[Broker]) -> None:
    try:
        broker = Broker(config, store, trio.lowlevel.current_trio_token())
    except BaseException:  # e.g. MetadataError from the consumer offsets: close what was opened
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(store.close)
        raise
    broker.ctx.stalls.install()  # every task step of this run is timed from here on
    try:
        async with trio.open_nursery() as nursery:
            broker.client = RpcClient(nursery, security=broker.client_security)
            warn_if_anonymous(f"broker {config.broker_name}", config.listen_host, config.auth_enabled)
            await nursery.start(broker.rpc.serve, config.listen_host, config.listen_port, nursery)
            if broker.kafka is not None:
                await nursery.start(broker.kafka.serve, config.listen_host, config.kafka_listen_port)
            nursery.start_soon(broker.lane.append_loop)
            nursery.start_soon(broker.lane.durable.timeout_loop)  # timeouts of sync-flush answers without a task
            nursery.start_soon(broker._register_loop)
            nursery.start_soon(broker._housekeeping_loop)
            nursery.start_soon(broker._sample_rates)
            if config.metrics_port >= 0:
                # Off loopback with logins on: a Basic login of a user who may DESCRIBE the cluster.
                login = metrics_login(broker.security.access, config.metrics_bind_host)
                broker.metrics_port = await nursery.start(
                    functools.partial(serve_http, tls=broker.tls_context, login=login),
                    config.metrics_bind_host,
                    config.metrics_port,
                    metrics_page(rendered_in_thread(broker.metrics.collect, generate_latest), CONTENT_TYPE_LATEST),
                    "broker metrics",
                )
            nursery.start_soon(broker.replica.role_loop, broker.client)
            nursery.start_soon(broker.handlers.timer.tick_loop)
            nursery.start_soon(broker.handlers.transactions.check_loop)
            nursery.start_soon(broker.handlers.pop.revive_loop)
            nursery.start_soon(trace_loop, broker.ctx)  # trace_enabled: %TRACE% and the broker's own events
            if broker.coordinator is not None:
                await nursery.start(broker.coordinator.coordinate)
            log.info(
                "broker %s/%d listening on %s%s (%s, %s flush, %s, epoch %d)",
                config.broker_name,
                config.broker_id,
                broker.addr,
                " (TLS)" if broker.tls_context is not None else "",
                config.storage_mode,
                config.flush_mode,
                broker.replica.role,
                broker.replica.epoch,
            )
            task_status.started(broker)
            await broker._stop.wait()
            await broker._stop_gracefully()
            nursery.cancel_scope.cancel()
    finally:
        broker.ctx.stalls.uninstall()
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(broker.close_storage)
        log.info("broker %s stopped", config.broker_name)

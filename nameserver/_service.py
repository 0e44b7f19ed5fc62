"""The name server: brokers register their topics with it every few seconds; clients
ask it where a topic lives. Several run independently; brokers register with all."""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field

import trio

from clmq.protocol import ErrorCode, Frame, RequestCode
from clmq.protocol.auth import check_principal
from clmq.protocol.transport import (
    Handler,
    Peer,
    Reply,
    RequestError,
    RpcServer,
    ServerLimits,
    TlsSettings,
    checked,
    exposure_problem,
    metrics_login,
    serve_http,
    tls_settings_of,
    warn_if_anonymous,
)

from ._access import NAMESERVER_RULES, nameserver_access
from ._metrics import metrics_registry, metrics_route
from ._routes import RouteTable

log = logging.getLogger("clmq.nameserver")


@dataclass
class NameServerConfig:
    listen_host: str = "127.0.0.1"
    listen_port: int = 9876
    broker_expiry_ms: int = 10_000  # a broker silent this long is dropped from routes
    scan_interval_ms: int = 1000  # how often expiry is checked
    max_frame_bytes: int = 16 << 20
    idle_timeout_ms: int = 120_000
    shutdown_timeout_ms: int = 2000
    # Limits at the door, as the broker's (see its settings of the same names).
    max_connections: int = 10_000
    reserved_file_descriptors: int = 128
    max_connection_buffer_bytes: int = 64 << 20
    max_buffered_request_bytes: int = 256 << 20
    frame_timeout_ms: int = 60_000
    metrics_port: int = -1  # Prometheus metrics over HTTP (GET /metrics): -1 none, 0 any free port
    metrics_host: str = ""  # "": 127.0.0.1 (loopback); elsewhere needs auth_enabled (a login) or allow_anonymous
    # Security (docs/security.md), as the broker's settings of the same names.
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_ca_file: str = ""
    tls_require_client_cert: bool = False
    tls_min_version: str = "1.2"
    auth_enabled: bool = False  # every connection logs in; the ACLs of security_file decide
    security_file: str = (
        ""  # users and ACLs (written by `clmq user add --file`, `clmq acl add --file`); re-read when changed
    )
    super_users: list[str] = field(default_factory=list)
    allow_anonymous: bool = False
    auth_failure_delay_ms: int = 1000
    audit_log: str = ""  # JSON lines of denied requests, failed logins and admin actions; "": none

    def __post_init__(self) -> None:
        if not 0 <= self.listen_port <= 65535:  # 0: any free port
            raise ValueError(f"listen_port must be in 0..65535 (0: any free port), got {self.listen_port}")
        if not -1 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in -1..65535 (-1: none, 0: any free port), got {self.metrics_port}")
        problem = exposure_problem("the name server", self.listen_host, self.auth_enabled, self.allow_anonymous)
        if self.metrics_port >= 0:
            problem = problem or exposure_problem(
                "the name server's metrics", self.metrics_bind_host, self.auth_enabled, self.allow_anonymous
            )
        if problem:
            raise ValueError(problem)
        for principal in self.super_users:
            check_principal(principal)
        if (tls := self.tls_settings()) is not None:  # a ValueError naming the file or setting
            tls.server_context()  # the certificate and key load, and match

    @property
    def metrics_bind_host(self) -> str:
        """Where /metrics listens: ``metrics_host``, or loopback."""
        return self.metrics_host or "127.0.0.1"

    def tls_settings(self) -> TlsSettings | None:
        """TLS of the name server's listeners (native and metrics); None: plaintext."""
        return tls_settings_of(self)

    def server_limits(self) -> ServerLimits:
        return ServerLimits(
            self.max_connections,
            self.reserved_file_descriptors,
            self.max_connection_buffer_bytes,
            self.max_buffered_request_bytes,
            self.frame_timeout_ms,
        )


def _now_ms() -> float:
    return time.monotonic() * 1000


class NameServer:
    """A running name server (what :func:`serve` reports as started)."""

    def __init__(self, config: NameServerConfig) -> None:
        self.config = config
        self.routes = RouteTable(config.broker_expiry_ms)
        tls = config.tls_settings()
        self.tls_context = tls.server_context() if tls is not None else None
        self.access, self.audit_handler = nameserver_access(
            config.auth_enabled,
            config.security_file,
            config.super_users,
            config.auth_failure_delay_ms,
            config.audit_log,
        )
        handlers: dict[int, Handler] = {
            RequestCode.REGISTER_BROKER: self._register,
            RequestCode.UNREGISTER_BROKER: self._unregister,
            RequestCode.GET_ROUTE: self._route,
            RequestCode.GET_CLUSTER: self._cluster,
        }
        table = self.access.guard_all(handlers, NAMESERVER_RULES, lambda code: RequestCode(code).name)
        self.rpc = RpcServer(
            "nameserver",
            {**table, RequestCode.AUTHENTICATE: checked(self.access.authenticate)},
            max_frame_bytes=config.max_frame_bytes,
            idle_timeout_ms=config.idle_timeout_ms,
            limits=config.server_limits(),
            tls=self.tls_context,
        )
        self._stop = trio.Event()
        self.metrics = metrics_registry(
            self.routes, self.rpc.request_stats, lambda: self.rpc.tls_handshake_failures, self.access.stats
        )
        self.metrics_port = -1  # where /metrics is served, once started (-1: none)

    @property
    def addr(self) -> str:
        return f"{self.config.listen_host}:{self.rpc.port}"

    def shutdown(self) -> None:
        """Begin a graceful stop (:func:`serve` returns once it is done)."""
        self._stop.set()

    async def _register(self, frame: Frame, peer: Peer) -> Reply:
        f = frame.fields  # checked: protocol.REQUEST_FIELDS
        addr, topics, healthy, failure = f["addr"], f["topics"], f.get("healthy", True), f.get("failure") or ""
        was = self.routes.health(addr)
        claimed = f.get("role") or "leader"
        if self.routes.register(
            f.get("cluster") or "",
            f["broker_name"],
            addr,
            topics,
            _now_ms(),
            healthy,
            failure,
            broker_id=f.get("broker_id") or 0,
            role=claimed,
            epoch=f["epoch"] if f.get("epoch") is not None else -1,
            kafka_addr=f.get("kafka_addr") or "",
        ):
            log.info("broker %s at %s registered %d topics (%s)", f["broker_name"], addr, len(topics), claimed)
        if was != healthy and not healthy:
            log.warning(
                "broker %s at %s is unhealthy: %s; producers skip it until it is healthy",
                f["broker_name"],
                addr,
                failure,
            )
        elif was is False and healthy:
            log.info("broker %s at %s is healthy again", f["broker_name"], addr)
        leader_addr, leader_epoch = self.routes.leader_of(f["broker_name"])
        if claimed == "leader" and leader_addr != addr:
            log.warning(
                "broker %s at %s claims leadership with epoch %s, but %s leads with epoch %d: told to follow",
                f["broker_name"],
                addr,
                f.get("epoch"),
                leader_addr,
                leader_epoch,
            )
        return Reply({"leader_addr": leader_addr, "leader_epoch": leader_epoch})

    async def _unregister(self, frame: Frame, peer: Peer) -> Reply:
        if self.routes.unregister(frame.fields["addr"]):
            log.info("broker at %s unregistered", frame.fields["addr"])
        return Reply()

    async def _route(self, frame: Frame, peer: Peer) -> Reply:
        topic = frame.fields["topic"]
        brokers = self.routes.route(topic)
        if not brokers:
            raise RequestError(ErrorCode.NOT_FOUND, f"no broker serves topic {topic!r}")
        return Reply({"brokers": brokers})

    async def _cluster(self, frame: Frame, peer: Peer) -> Reply:
        return Reply({"brokers": self.routes.cluster(_now_ms())})

    async def _expire_loop(self) -> None:
        while True:
            await trio.sleep(self.config.scan_interval_ms / 1000)
            for addr in self.routes.expire(_now_ms()):
                log.warning(
                    "broker at %s missed its registrations for %d ms: dropped", addr, self.config.broker_expiry_ms
                )


async def serve(
    config: NameServerConfig, *, task_status: trio.TaskStatus[NameServer] = trio.TASK_STATUS_IGNORED
) -> None:
    """Run a name server until cancelled or :meth:`NameServer.shutdown`."""
    ns = NameServer(config)
    try:
        await _serve(ns, config, task_status)
    finally:
        if ns.audit_handler is not None:
            logging.getLogger("clmq.audit").removeHandler(ns.audit_handler)
            ns.audit_handler.close()


async def _serve(ns: NameServer, config: NameServerConfig, task_status: trio.TaskStatus[NameServer]) -> None:
    async with trio.open_nursery() as nursery:
        warn_if_anonymous("the name server", config.listen_host, config.auth_enabled)
        await nursery.start(ns.rpc.serve, config.listen_host, config.listen_port, nursery)
        nursery.start_soon(ns._expire_loop)
        if config.metrics_port >= 0:
            # Off loopback with logins on: a Basic login of a user who may DESCRIBE the cluster.
            login = metrics_login(ns.access, config.metrics_bind_host)
            ns.metrics_port = await nursery.start(
                functools.partial(serve_http, tls=ns.tls_context, login=login),
                config.metrics_bind_host,
                config.metrics_port,
                metrics_route(ns.metrics),
                "name server metrics",
            )
        log.info("name server listening on %s%s", ns.addr, " (TLS)" if ns.tls_context is not None else "")
        task_status.started(ns)
        await ns._stop.wait()
        ns.rpc.stop_accepting()
        await ns.rpc.drain(config.shutdown_timeout_ms / 1000)
        nursery.cancel_scope.cancel()

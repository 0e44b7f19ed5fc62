"""The Kafka listener of one broker: every handler over the broker's context, the table
of which API each serves, and the listener's task (``serve``)."""

from __future__ import annotations

import logging
from typing import Any, Callable

import trio

from clmq.common import PROP_KAFKA_PRODUCER
from clmq.protocol.kafka import ApiKey, ErrorCode, KafkaRequest, api_name
from clmq.protocol.transport import RpcClient

from .._context import BrokerContext
from .._read_threads import ReadThreads
from .._topic_requests import TopicRequests
from ._access import Denials, guard_all
from ._acls import KafkaAcls
from ._cluster import ClusterViews
from ._coordinator import GroupSettings, KafkaGroups
from ._fetch import KafkaFetch
from ._listener import Handler, KafkaListener, ListenerSettings, Peer, Refused
from ._metadata import ADVERTISED, NO_TRANSACTIONS, MetadataRequests, coordinator_for, topic_id
from ._offsets import KafkaOffsets
from ._produce import KafkaProduce
from ._sasl import KafkaSasl
from ._sequences import Sequences, parse_producer_property
from ._share_fetch import KafkaShare
from ._share_sessions import PopLike
from ._topics import TopicAdmin

log = logging.getLogger("clmq.broker.kafka")

RECOVER_CHUNK_MESSAGES = 1024
# Answered before a login (with auth_enabled any other API closes the connection).
BEFORE_LOGIN = frozenset({ApiKey.API_VERSIONS, ApiKey.SASL_HANDSHAKE, ApiKey.SASL_AUTHENTICATE})
SASL_APIS = frozenset({ApiKey.SASL_HANDSHAKE, ApiKey.SASL_AUTHENTICATE})


class KafkaService:
    """Kafka's protocol over one broker's store, groups and offsets."""

    def __init__(
        self,
        ctx: BrokerContext,
        readers: ReadThreads,
        client: Callable[[], RpcClient | None],
        pop: PopLike | None = None,  # the broker's POP service (share groups); None: share APIs unavailable
    ) -> None:
        cfg = ctx.config
        self.ctx = ctx
        self._readers = readers
        self.views = ClusterViews(ctx, self.kafka_addr, client)
        self.listener = KafkaListener(
            ListenerSettings(
                cfg.kafka_max_frame_bytes,
                cfg.kafka_max_connections,
                cfg.kafka_max_inflight_requests,
                cfg.kafka_idle_timeout_ms,
                cfg.kafka_request_timeout_ms,
            ),
            self.dispatch,
            ADVERTISED,
            serial=SASL_APIS,  # the requests after a login step are judged by its outcome
        )
        self.access = ctx.security.access
        self.sasl = KafkaSasl(self.access, lambda: ctx.security.state, cfg.kafka_sasl_mechanisms)
        self._ids: tuple[int, dict[Any, str]] = (0, {})  # (id of the view, topic id -> name)
        self.sequences = Sequences(cfg.kafka_max_producer_ids, self._recover)
        self._epoch = ctx.replica.epoch
        self.groups = KafkaGroups(
            GroupSettings(
                cfg.kafka_group_min_session_timeout_ms,
                cfg.kafka_group_max_session_timeout_ms,
                cfg.kafka_group_initial_rebalance_delay_ms,
                cfg.kafka_group_max_size_members,
            ),
            native_members=lambda group: len(ctx.groups.members(group)),
            drop_offsets=lambda group: _drop(ctx, group),
        )
        self.produce = KafkaProduce(ctx, self.views, self.sequences)
        admin = TopicAdmin(TopicRequests(ctx, readers), self.views, self.produce.acked.forget_topic)
        self.metadata = MetadataRequests(self.views, cfg.cluster, admin)
        self.fetch = KafkaFetch(ctx, self.views, readers, self.produce.acked)
        self.offsets = KafkaOffsets(ctx, self.views, self.groups)
        self.share = KafkaShare(ctx, self.fetch, readers, self.topic_name, lambda: pop)
        self.denials = Denials()
        self._table = guard_all(
            self._handlers(admin), self.access, self.topic_name, self.denials, prepare=self.views.current
        )

    def kafka_addr(self) -> str:
        """host:port Kafka clients are told ("" until the listener has its port)."""
        port = self.listener.port
        return f"{self.ctx.config.advertised_addr_host}:{port}" if port >= 0 else ""

    def topic_name(self, tid: Any) -> str | None:
        """The name of the topic with id ``tid`` in the last cluster view (None: unknown)."""
        view = self.views.last
        if tid is None or view is None:
            return None
        if self._ids[0] != id(view):
            cluster = self.ctx.config.cluster
            self._ids = (id(view), {topic_id(cluster, t): t for t in view.topics})
        return self._ids[1].get(tid)

    def _handlers(self, admin: TopicAdmin) -> dict[int, Callable[[KafkaRequest, Peer], Any]]:
        """Every API this listener serves (each gets an ACL rule: ``_access.KAFKA_RULES``)."""
        m, g = self.metadata, self.groups
        acls = KafkaAcls(self.ctx)
        return {
            ApiKey.API_VERSIONS: m.api_versions,
            ApiKey.SASL_HANDSHAKE: self.sasl.handshake,
            ApiKey.SASL_AUTHENTICATE: self.sasl.authenticate,
            ApiKey.METADATA: m.metadata,
            ApiKey.DESCRIBE_CLUSTER: m.describe_cluster,
            ApiKey.FIND_COORDINATOR: m.find_coordinator,
            ApiKey.PRODUCE: self._produce,
            ApiKey.FETCH: self.fetch.fetch,
            ApiKey.LIST_OFFSETS: self.fetch.list_offsets,
            ApiKey.OFFSET_FOR_LEADER_EPOCH: self.fetch.offset_for_leader_epoch,
            ApiKey.OFFSET_COMMIT: self.offsets.offset_commit,
            ApiKey.OFFSET_FETCH: self.offsets.offset_fetch,
            ApiKey.JOIN_GROUP: self._coordinated(lambda r, p: g.join_group(r.body, r.api_version, p.client_id, p.host)),
            ApiKey.SYNC_GROUP: self._coordinated(lambda r, p: g.sync_group(r.body, r.api_version)),
            ApiKey.HEARTBEAT: self._coordinated(lambda r, p: g.heartbeat(r.body, r.api_version)),
            ApiKey.LEAVE_GROUP: self._coordinated(lambda r, p: g.leave_group(r.body, r.api_version)),
            ApiKey.DESCRIBE_GROUPS: _now(lambda r: g.describe_groups(r.body, r.api_version)),
            ApiKey.LIST_GROUPS: _now(lambda r: g.list_groups(r.body, r.api_version)),
            ApiKey.DELETE_GROUPS: _now(lambda r: g.delete_groups(r.body, r.api_version)),
            ApiKey.CREATE_TOPICS: admin.create_topics,
            ApiKey.DELETE_TOPICS: admin.delete_topics,
            ApiKey.CREATE_PARTITIONS: admin.create_partitions,
            ApiKey.DESCRIBE_CONFIGS: admin.describe_configs,
            ApiKey.INIT_PRODUCER_ID: self._init_producer_id,
            ApiKey.DESCRIBE_ACLS: acls.describe_acls,
            ApiKey.CREATE_ACLS: acls.create_acls,
            ApiKey.DELETE_ACLS: acls.delete_acls,
            ApiKey.SHARE_GROUP_HEARTBEAT: self._coordinated(self.share.heartbeat),
            ApiKey.SHARE_FETCH: self.share.share_fetch,
            ApiKey.SHARE_ACKNOWLEDGE: self.share.share_acknowledge,
        }

    def _coordinated(self, handler: Callable[[KafkaRequest, Peer], Any]) -> Callable[[KafkaRequest, Peer], Any]:
        """``handler`` of a group request, answered NOT_COORDINATOR when this broker is not
        the group's coordinator (any more: after a failover the coordinator moves, and a
        member still talking to the old one must look it up again, not keep a second
        copy of the group here)."""

        async def checked(req: KafkaRequest, peer: Peer) -> Any:
            view = await self.views.current()
            node = coordinator_for(view, str(req.body.get("group_id", "")))
            if node is None or node.node_id != self.views.me.node_id or self.ctx.replica.role != "leader":
                code = ErrorCode.COORDINATOR_NOT_AVAILABLE if node is None else ErrorCode.NOT_COORDINATOR
                return {"throttle_time_ms": 0, "error_code": code, "member_id": req.body.get("member_id", "")}
            return await handler(req, peer)

        return checked

    def members(self, group: str) -> dict[str, str]:
        """The Kafka members of ``group``: member id -> client id (empty: none)."""
        if not self.groups.has_members(group):
            return {}
        for g in self.groups.groups():
            if g["group_id"] == group:
                return {m["member_id"]: m.get("client_id", "") for m in g["members"]} or {"(joining)": ""}
        return {}

    def group_ids(self) -> list[str]:
        return [g["group_id"] for g in self.groups.groups()]

    def dispatch(self, req: KafkaRequest, peer: Peer) -> Handler | None:
        """The request's handler; :class:`Refused` (the connection is closed) for any API but
        ApiVersions and the SASL ones before a login, with authentication on (Kafka's rule)."""
        if req.api_key not in BEFORE_LOGIN and not self.sasl.logged_in(peer):
            raise Refused(f"API {api_name(req.api_key)} before a SASL login (this broker has auth_enabled)")
        return self._table.get(req.api_key)

    @property
    def denied(self) -> int:
        """Kafka requests (or parts of them) the ACLs refused since start."""
        return self.denials.count

    @property
    def handler_table(self) -> dict[int, Callable[[KafkaRequest, Peer], Any]]:
        """Every API served and its (guarded) handler."""
        return dict(self._table)

    async def serve(
        self, host: str, port: int, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """The listener and the group coordinator's timers, until cancelled."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self.groups.run)
            bound = await nursery.start(self.listener.serve, host, port)
            nursery.start_soon(self.views.refresh_loop)  # once the port is known: the view names this node
            log.info(
                "broker %s: Kafka listener on %s (node id %d)",
                self.ctx.config.broker_name,
                self.kafka_addr(),
                self.views.me.node_id,
            )
            task_status.started(bound)

    async def _produce(self, req: KafkaRequest, peer: Peer) -> dict[str, Any] | None:
        if self.ctx.replica.epoch != self._epoch:  # leadership changed: producer state is read again
            self._epoch = self.ctx.replica.epoch
            self.sequences.forget_minted()
        return await self.produce.produce(req, peer)

    async def _init_producer_id(self, req: KafkaRequest, peer: Peer) -> dict[str, Any]:
        body = req.body
        if body.get("transactional_id") is not None:
            log.info("kafka: %s asked for a transactional producer: %s", peer.client_id, NO_TRANSACTIONS)
            return {
                "throttle_time_ms": 0,
                "error_code": ErrorCode.UNSUPPORTED_VERSION,
                "producer_id": -1,
                "producer_epoch": -1,
            }
        pid, epoch = body.get("producer_id", -1), body.get("producer_epoch", -1)
        if pid >= 0 and 0 <= epoch < 32767:  # KIP-360: the same producer, its epoch bumped
            return {"throttle_time_ms": 0, "error_code": 0, "producer_id": pid, "producer_epoch": epoch + 1}
        return {"throttle_time_ms": 0, "error_code": 0, "producer_id": self.sequences.mint(), "producer_epoch": 0}

    async def _recover(self, pid: int, topic: str, queue_id: int) -> tuple[int, list[tuple[int, int, int]]] | None:
        """A producer's last batches in a queue, read back from its tail."""
        return await self._readers.in_thread(self._scan_tail, pid, topic, queue_id)

    def _scan_tail(self, pid: int, topic: str, queue_id: int) -> tuple[int, list[tuple[int, int, int]]] | None:
        store = self.ctx.store
        if not store.queue_exists(topic, queue_id):
            return None
        lo, hi = store.bounds(topic, queue_id)
        offset = max(lo, hi - self.ctx.config.dedup_max_messages)
        rows: list[tuple[int, int, int]] = []
        epoch = -1
        while offset < hi:
            got = store.get(topic, queue_id, offset, RECOVER_CHUNK_MESSAGES)
            if not got.messages:
                break
            for r in got.messages:
                raw = r.properties.get(PROP_KAFKA_PRODUCER) if r.properties else None
                parsed = parse_producer_property(raw) if raw else None
                if parsed is not None and parsed[0] == pid:
                    epoch = parsed[1]
                    rows.append((parsed[2], parsed[3], r.queue_offset))
            offset = got.next_offset
        return (epoch, rows) if rows else None


def _now(fn: Callable[[KafkaRequest], dict[str, Any]]) -> Callable[[KafkaRequest, Peer], Any]:
    """A handler that answers at once, as the async handler the table holds."""

    async def handler(req: KafkaRequest, peer: Peer) -> dict[str, Any]:
        return fn(req)

    return handler


def _drop(ctx: BrokerContext, group: str) -> None:
    """A deleted Kafka group's committed offsets go with it (followers copy that)."""
    ctx.offsets.drop_group(group)
    ctx.metadata.bump()

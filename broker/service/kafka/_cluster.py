"""The cluster as Kafka clients see it: nodes (every broker with a Kafka listener),
and for each topic its partitions, each one clmq queue of one broker group.

Partition numbering: a topic's broker groups in the order of their names (the order
of the name servers' routes), each group's queues in order; partition p is the p-th
queue of that list. It is stable while the set of groups holding the topic stays the
same (docs/kafka.md says what adding a group to a topic does).

Where it comes from: the name servers' GET_CLUSTER (cached for ``VIEW_TTL_S``), with
this broker's own group taken from its own store (fresher); with no name servers,
this broker alone.
"""

from __future__ import annotations

import logging
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

import trio

from clmq.common import is_system_topic
from clmq.protocol import RequestCode
from clmq.protocol.transport import ConnectionFailed, RpcClient, RpcError

from .._context import BrokerContext

log = logging.getLogger("clmq.broker.kafka")

VIEW_TTL_S = 1.0  # the view is asked for again this often (a failover shows in metadata within this)
NAMESRV_TIMEOUT_MS = 2000


@dataclass(frozen=True, slots=True)
class Node:
    node_id: int
    host: str
    port: int


@dataclass(frozen=True, slots=True)
class Home:
    """Where one partition lives: a queue of a broker group, led by ``leader``."""

    group: str
    queue_id: int
    leader: Node | None
    replicas: tuple[Node, ...]
    leader_addr: str = ""  # the leader's native address (commits of another group's queues go there)
    isr: tuple[Node, ...] | None = None  # the in-sync replicas when known (this broker leads), else all


@dataclass(frozen=True)
class ClusterView:
    nodes: tuple[Node, ...]
    topics: dict[str, tuple[Home, ...]]
    controller: Node | None
    made_at: float = field(default_factory=time.monotonic)
    leaders: tuple[Node, ...] = ()  # each broker group's leader, by group name (groups' coordinators)
    built_as: tuple[str, int] = ("", -1)  # this broker's role and epoch when it was made


def node_id_of(kafka_addr: str, configured: int = -1) -> int:
    """A broker's Kafka node id: the configured one, else a stable number derived from
    its Kafka address (unique in practice; a clash would show as two brokers with one id)."""
    return configured if configured >= 0 else zlib.crc32(kafka_addr.encode()) & 0x7FFFFFFF


def _node(kafka_addr: str, configured: int = -1) -> Node | None:
    host, _, port = kafka_addr.rpartition(":")
    if not host or not port.isdigit():
        return None
    return Node(node_id_of(kafka_addr, configured), host, int(port))


class ClusterViews:
    """This broker's view of the cluster, refreshed on demand."""

    def __init__(self, ctx: BrokerContext, kafka_addr: Callable[[], str], client: Callable[[], RpcClient | None]):
        self.ctx = ctx
        self._kafka_addr = kafka_addr
        self._client = client
        self._view: ClusterView | None = None
        self._lock = trio.Lock()
        self._brokers: list[dict[str, Any]] | None = None  # the name servers' last answer
        self._must_ask = True  # invalidated: the next current() asks before answering

    def client(self) -> RpcClient | None:
        """The broker's client of the native protocol (None before it runs)."""
        return self._client()

    @property
    def me(self) -> Node:
        node = _node(self._kafka_addr(), self.ctx.config.kafka_node_id)
        assert node is not None, self._kafka_addr()
        return node

    async def current(self, fresh: bool = False) -> ClusterView:
        """The view :meth:`refresh_loop` keeps (a produce never waits for the name
        servers); invalidated, ``fresh`` or none yet: asked for first."""
        view = self._view
        if view is not None and not fresh and not self._must_ask and view.built_as == self._role():
            return view
        return await self._refresh(view)

    def _role(self) -> tuple[str, int]:
        """This broker's role and epoch: a view made before they changed is made again
        at once (a new leader must name itself at its first Metadata, not a second later)."""
        return self.ctx.replica.role, self.ctx.replica.epoch

    async def refresh_loop(self) -> None:
        """Ask the name servers every ``VIEW_TTL_S``: every broker holds their last answer,
        also one that no client asked yet when they stop answering."""
        while True:
            try:
                await self._refresh(self._view)
            except Exception:  # reported, and asked again: the listener must not stop for it
                log.exception("kafka: refreshing the cluster view failed")
            await trio.sleep(VIEW_TTL_S)

    async def _refresh(self, seen: ClusterView | None) -> ClusterView:
        async with self._lock:
            current = self._view
            if current is not seen and current is not None and not self._must_ask and current.built_as == self._role():
                return current  # another request refreshed it meanwhile
            self._must_ask = False
            brokers = await self._ask_namesrv()
            if brokers is not None:
                self._brokers = brokers
            elif self.ctx.config.namesrv_addrs:  # none answered: the last answer, not a view of this broker alone
                brokers = self._brokers
            self._view = self._build(brokers)
            return self._view

    @property
    def last(self) -> ClusterView | None:
        """The view last made, however old (None: none yet)."""
        return self._view

    def invalidate(self) -> None:
        """The next :meth:`current` asks again before answering (topics changed here, or a
        client was told it reached the wrong broker)."""
        self._must_ask = True

    async def _ask_namesrv(self) -> list[dict[str, Any]] | None:
        client = self._client()
        if client is None or not self.ctx.config.namesrv_addrs:
            return None
        for ns in self.ctx.config.namesrv_addrs:
            try:
                reply = await client.request(ns, RequestCode.GET_CLUSTER, {}, timeout_ms=NAMESRV_TIMEOUT_MS)
            except (ConnectionFailed, RpcError, trio.TooSlowError) as e:
                log.debug("kafka metadata: name server %s: %s", ns, e)
                continue
            brokers = reply.fields.get("brokers")
            if isinstance(brokers, list):
                return brokers
        return None

    def _build(self, brokers: list[dict[str, Any]] | None) -> ClusterView:
        """The view from the name servers' broker list (None: this broker alone)."""
        cfg = self.ctx.config
        groups: dict[str, list[dict[str, Any]]] = {}
        for b in brokers or []:
            if b.get("broker_name") != cfg.broker_name and isinstance(b.get("topics"), dict):
                groups.setdefault(str(b["broker_name"]), []).append(b)
        nodes: dict[int, Node] = {}
        members: dict[str, _Members] = {}
        for name, entries in groups.items():
            members[name] = _group(entries, nodes)
        members[cfg.broker_name] = self._own_group(brokers or [], nodes)
        topics = _partitions(members)
        by_name = tuple(leader for n in sorted(members) if (leader := members[n].leader) is not None)
        leaders = sorted((m.leader for m in members.values() if m.leader is not None), key=lambda n: n.node_id)
        return ClusterView(
            tuple(sorted(nodes.values(), key=lambda n: n.node_id)),
            topics,
            leaders[0] if leaders else None,
            leaders=by_name,
            built_as=self._role(),
        )

    def _own_group(self, brokers: list[dict[str, Any]], nodes: dict[int, Node]) -> _Members:
        """This broker's group: its topics from the own store, its leader as the
        replica knows it (this broker, or the leader the name servers name)."""
        cfg = self.ctx.config
        me = self.me
        nodes[me.node_id] = me
        replicas = [me]
        leader: Node | None = me if self.ctx.replica.role == "leader" else None
        leader_addr = self.ctx.addr() if leader is not None else ""
        in_sync = self._in_sync_ids()
        isr = [me]
        for b in brokers:
            if b.get("broker_name") != cfg.broker_name or b.get("addr") == self.ctx.addr():
                continue
            node = _node(str(b.get("kafka_addr") or ""))
            if node is None:
                continue
            nodes[node.node_id] = node
            replicas.append(node)
            if b.get("broker_id") in in_sync:
                isr.append(node)
            if leader is None and b.get("role") == "leader":
                leader, leader_addr = node, str(b.get("addr") or "")
        topics = {t: n for t, n in self.ctx.store.topics.all().items() if not is_system_topic(t)}
        return _Members(leader, _by_id(replicas), topics, leader_addr, _by_id(isr) if leader is me else None)

    def _in_sync_ids(self) -> set[int]:
        """Broker ids of the followers in sync with this broker (when it leads)."""
        leader = self.ctx.replica.leader
        if leader is None:
            return set()
        return {row["broker_id"] for row in leader.replicas() if row["in_sync"]}


def _by_id(nodes: list[Node]) -> tuple[Node, ...]:
    return tuple(sorted(nodes, key=lambda n: n.node_id))


@dataclass(frozen=True, slots=True)
class _Members:
    """One broker group as the view needs it."""

    leader: Node | None
    replicas: tuple[Node, ...]
    topics: dict[str, int]  # topic -> queue count, as its leader (or a member) registered it
    leader_addr: str  # the leader's native address ("": none)
    isr: tuple[Node, ...] | None = None


def _group(entries: list[dict[str, Any]], nodes: dict[int, Node]) -> _Members:
    """Another group: its leader's node, every member's node, the leader's topics."""
    leader: Node | None = None
    leader_addr = ""
    replicas: list[Node] = []
    topics: dict[str, int] = {}
    for b in sorted(entries, key=lambda e: str(e.get("addr"))):
        node = _node(str(b.get("kafka_addr") or ""))
        if node is not None:
            nodes[node.node_id] = node
            replicas.append(node)
        if b.get("role") == "leader" or not topics:
            topics = {str(t): int(n) for t, n in b["topics"].items() if not is_system_topic(str(t))}
            if b.get("role") == "leader":
                leader, leader_addr = node, str(b.get("addr") or "")
    return _Members(leader, tuple(sorted(replicas, key=lambda n: n.node_id)), topics, leader_addr)


def _partitions(members: dict[str, _Members]) -> dict[str, tuple[Home, ...]]:
    """Every topic's partitions: its groups by name, each group's queues in order."""
    topics: dict[str, list[Home]] = {}
    for name in sorted(members):
        m = members[name]
        for topic, count in m.topics.items():
            homes = topics.setdefault(topic, [])
            homes.extend(Home(name, q, m.leader, m.replicas, m.leader_addr, m.isr) for q in range(count))
    return {t: tuple(h) for t, h in sorted(topics.items())}

"""ApiVersions, Metadata, DescribeCluster and FindCoordinator: what a Kafka client asks
before anything else (which versions, which nodes, who leads what)."""

from __future__ import annotations

import uuid
import zlib
from typing import Any

from clmq.protocol.kafka import SUPPORTED_VERSIONS, ApiKey, ErrorCode, KafkaRequest, api_versions_keys

from ._cluster import ClusterView, ClusterViews, Home, Node
from ._listener import Peer
from ._topics import create_missing, valid_topic_name

# APIs listed in the codec but not offered to clients: Kafka transactions (clients
# then report that the broker does not support them, before any transactional write).
# The SASL APIs are always listed, as Kafka lists them (a broker without authentication
# answers them ILLEGAL_SASL_STATE).
NOT_ADVERTISED = frozenset(
    {
        ApiKey.ADD_PARTITIONS_TO_TXN,
        ApiKey.ADD_OFFSETS_TO_TXN,
        ApiKey.END_TXN,
        ApiKey.TXN_OFFSET_COMMIT,
        ApiKey.DESCRIBE_PRODUCERS,
    }
)
NO_TRANSACTIONS = "clmq's Kafka listener does not support transactions (docs/kafka.md); use an idempotent producer"
_TOPIC_ID_NAMESPACE = uuid.UUID("6f0d8a54-3c1e-4b8a-9a53-6c6d710a1d29")


# The APIs and versions this broker serves and lists in ApiVersions.
ADVERTISED: dict[ApiKey, tuple[int, int]] = {
    key: span for key, span in sorted(SUPPORTED_VERSIONS.items()) if key not in NOT_ADVERTISED
}


def topic_id(cluster: str, topic: str) -> uuid.UUID:
    """A topic's id for clients of Metadata v10+ and Fetch v13+: the same on every
    broker, derived from the cluster and topic names (a topic deleted and created again
    keeps its id)."""
    return uuid.uuid5(_TOPIC_ID_NAMESPACE, f"{cluster}\0{topic}")


def coordinator_for(view: ClusterView, key: str) -> Node | None:
    """The node coordinating group ``key``: a stable hash over the broker groups' leaders
    (in group-name order), so every broker names the same one; after a failover the new
    leader takes its group's place."""
    leaders = view.leaders
    if not leaders:
        return None
    return leaders[zlib.crc32(key.encode()) % len(leaders)]


class MetadataRequests:
    """The first requests of every Kafka client."""

    def __init__(self, views: ClusterViews, cluster_name: str, topics_owner: Any) -> None:
        self.views = views
        self.cluster = cluster_name
        self.topics_owner = topics_owner  # creates topics on auto-creation (the admin handlers)

    async def api_versions(self, req: KafkaRequest, peer: Peer) -> dict[str, Any]:
        return {"error_code": 0, "api_keys": api_versions_keys(ADVERTISED), "throttle_time_ms": 0}

    async def metadata(self, req: KafkaRequest, peer: Peer) -> dict[str, Any]:
        body = req.body
        asked = body.get("topics")
        names: list[str] | None = None
        if asked is not None and not (req.api_version == 0 and not asked):  # v0: an empty list meant every topic
            names = [t.get("name") or self._name_of(t.get("topic_id")) or "" for t in asked]
        view = await self.views.current()
        missing = [n for n in names or [] if n not in view.topics]
        if missing and body.get("allow_auto_topic_creation", True) and await create_missing(self.topics_owner, missing):
            view = await self.views.current(fresh=True)
        topics = [self._topic(view, n) for n in (sorted(view.topics) if names is None else names)]
        return {
            "throttle_time_ms": 0,
            "brokers": [{"node_id": n.node_id, "host": n.host, "port": n.port, "rack": None} for n in view.nodes],
            "cluster_id": self.cluster,
            "controller_id": view.controller.node_id if view.controller else -1,
            "topics": topics,
        }

    def _name_of(self, tid: uuid.UUID | None) -> str | None:
        view = self.views.last
        if tid is None or view is None:
            return None
        return next((t for t in view.topics if topic_id(self.cluster, t) == tid), None)

    def _topic(self, view: ClusterView, name: str) -> dict[str, Any]:
        homes = view.topics.get(name)
        if homes is None:
            code = ErrorCode.UNKNOWN_TOPIC_OR_PARTITION if valid_topic_name(name) else ErrorCode.INVALID_TOPIC_EXCEPTION
            return {"error_code": code, "name": name, "topic_id": topic_id(self.cluster, name), "partitions": []}
        return {
            "error_code": 0,
            "name": name,
            "topic_id": topic_id(self.cluster, name),
            "is_internal": False,
            "partitions": [_partition(i, h) for i, h in enumerate(homes)],
        }

    async def describe_cluster(self, req: KafkaRequest, peer: Peer) -> dict[str, Any]:
        view = await self.views.current()
        return {
            "error_code": 0,
            "cluster_id": self.cluster,
            "controller_id": view.controller.node_id if view.controller else -1,
            "brokers": [{"broker_id": n.node_id, "host": n.host, "port": n.port, "rack": None} for n in view.nodes],
        }

    async def find_coordinator(self, req: KafkaRequest, peer: Peer) -> dict[str, Any]:
        body = req.body
        keys = body.get("coordinator_keys")
        if keys is None:  # v0-3: one key
            keys = [body.get("key", "")]
        view = await self.views.current()
        found = [self._coordinator(view, k, body.get("key_type", 0)) for k in keys]
        first = found[0] if found else {}
        return {"throttle_time_ms": 0, "coordinators": found, **{k: v for k, v in first.items() if k != "key"}}

    def _coordinator(self, view: ClusterView, key: str, key_type: int) -> dict[str, Any]:
        if key_type != 0:
            return _no_coordinator(key, ErrorCode.UNSUPPORTED_VERSION, NO_TRANSACTIONS)
        node = coordinator_for(view, key)
        if node is None:
            return _no_coordinator(key, ErrorCode.COORDINATOR_NOT_AVAILABLE, "no broker group has a leader")
        return {
            "key": key,
            "node_id": node.node_id,
            "host": node.host,
            "port": node.port,
            "error_code": 0,
            "error_message": None,
        }


def _no_coordinator(key: str, code: int, text: str) -> dict[str, Any]:
    return {"key": key, "node_id": -1, "host": "", "port": -1, "error_code": code, "error_message": text}


def _partition(index: int, home: Home) -> dict[str, Any]:
    replicas = [n.node_id for n in home.replicas]
    isr = replicas if home.isr is None else [n.node_id for n in home.isr]
    leader = home.leader
    return {
        "error_code": 0 if leader is not None else ErrorCode.LEADER_NOT_AVAILABLE,
        "partition_index": index,
        "leader_id": leader.node_id if leader is not None else -1,
        "leader_epoch": -1,
        "replica_nodes": replicas,
        "isr_nodes": isr,
        "offline_replicas": [],
    }

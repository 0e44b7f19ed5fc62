"""CreateTopics, DeleteTopics, CreatePartitions and DescribeConfigs: topic
administration from Kafka's admin clients, done through the same path as clmq's own
CREATE_TOPIC and DELETE_TOPIC (so followers copy it and the name servers learn it).

A topic is created in this broker's group (the one the client reached: the
controller Metadata names, which is a group leader). clmq replicates by broker group,
not by topic: a topic's replication factor is its group's replica count, and the one
asked for is accepted if it is at least 1. Kafka's topic configs describe what the
broker does; ``cleanup.policy=compact`` is refused (clmq does not compact)."""

from __future__ import annotations

import re
from typing import Any, Callable

from clmq.protocol import ErrorCode as ClmqError
from clmq.protocol.kafka import ErrorCode, KafkaRequest
from clmq.protocol.transport import RequestError

from .._topic_requests import TopicRequests
from ._cluster import ClusterViews
from ._listener import Peer

_NAME = re.compile(r"^[a-zA-Z0-9._-]{1,249}$")
RESOURCE_TOPIC = 2
RESOURCE_BROKER = 4
CONFIG_SOURCE_DEFAULT = 5  # Kafka's DEFAULT_CONFIG


def valid_topic_name(name: str) -> bool:
    """Kafka's rule for topic names (clmq's own is wider)."""
    return bool(_NAME.match(name)) and name not in {".", ".."}


def _error(e: RequestError) -> tuple[int, str]:
    if e.code == ClmqError.NOT_LEADER:
        return ErrorCode.NOT_CONTROLLER, e.text
    if e.code == ClmqError.TOPIC_NOT_FOUND:
        return ErrorCode.UNKNOWN_TOPIC_OR_PARTITION, e.text
    if e.code == ClmqError.REPLICATION_TIMEOUT:  # made here, not yet held by the in-sync followers
        return ErrorCode.REQUEST_TIMED_OUT, e.text
    if e.code == ClmqError.INVALID_TOPIC:
        return ErrorCode.INVALID_PARTITIONS if "queue" in e.text else ErrorCode.INVALID_TOPIC_EXCEPTION, e.text
    return ErrorCode.UNKNOWN_SERVER_ERROR, e.text


async def create_missing(admin: TopicAdmin, names: list[str]) -> bool:
    """Metadata's auto-creation (when ``auto_create_topics`` is on): True if any was made."""
    if not admin.topics.config.auto_create_topics:
        return False
    made = False
    for name in names:
        if valid_topic_name(name):
            try:
                await admin.topics.create(name, admin.topics.config.default_queue_count)
                made = True
            except RequestError:
                pass  # answered UNKNOWN_TOPIC_OR_PARTITION: a follower, or a bad name
    return made


class TopicAdmin:
    """Kafka's topic administration on this broker."""

    def __init__(self, topics: TopicRequests, views: ClusterViews, deleted: Callable[[str], None]) -> None:
        self.topics = topics
        self.views = views
        self.deleted = deleted  # told of each topic deleted here (what produce remembered of it goes)

    async def create_topics(self, req: KafkaRequest, peer: Peer) -> dict[str, Any]:
        body = req.body
        results = []
        for t in body.get("topics", []):
            results.append(await self._create_one(t, bool(body.get("validate_only", False))))
        self.views.invalidate()
        return {"throttle_time_ms": 0, "topics": results}

    async def _create_one(self, t: dict[str, Any], validate_only: bool) -> dict[str, Any]:
        name, count = t["name"], t["num_partitions"]
        count = self.topics.config.default_queue_count if count == -1 else count
        result: dict[str, Any] = {
            "name": name,
            "error_code": 0,
            "error_message": None,
            "num_partitions": count,
            "replication_factor": t["replication_factor"],
            "configs": [],
        }
        problem = self._create_problem(t, name, count)
        if problem is None and not validate_only:
            try:
                await self.topics.create(name, count)
            except RequestError as e:
                problem = _error(e)
        if problem is not None:
            result.update(error_code=problem[0], error_message=problem[1], num_partitions=-1, replication_factor=-1)
        return result

    def _create_problem(self, t: dict[str, Any], name: str, count: int) -> tuple[int, str] | None:
        if not valid_topic_name(name):
            return ErrorCode.INVALID_TOPIC_EXCEPTION, f"{name!r}: Kafka topic names are 1-249 of [a-zA-Z0-9._-]"
        if self.topics.store.topics.queue_count(name) is not None:
            return ErrorCode.TOPIC_ALREADY_EXISTS, f"topic {name!r} already exists"
        if count < 1:
            return ErrorCode.INVALID_PARTITIONS, f"num_partitions must be at least 1, got {count}"
        if t["replication_factor"] == 0 or t["replication_factor"] < -1:
            return ErrorCode.INVALID_REPLICATION_FACTOR, "replication_factor must be -1 or at least 1"
        if t.get("assignments"):
            return ErrorCode.INVALID_REPLICA_ASSIGNMENT, "clmq places replicas by broker group: no manual assignment"
        for c in t.get("configs", []):
            if c["name"] == "cleanup.policy" and "compact" in (c["value"] or ""):
                return ErrorCode.INVALID_CONFIG, "clmq does not compact topics (cleanup.policy=delete only)"
        return None

    async def delete_topics(self, req: KafkaRequest, peer: Peer) -> dict[str, Any]:
        body = req.body
        names = body.get("topic_names")
        if names is None:
            names = [t.get("name") or "" for t in body.get("topics", [])]
        results = []
        for name in names:
            row: dict[str, Any] = {"name": name, "error_code": 0, "error_message": None}
            try:
                await self.topics.delete(name)
            except RequestError as e:
                row["error_code"], row["error_message"] = _error(e)
            if self.topics.store.topics.queue_count(name) is None:  # gone here, even if not yet copied
                self.deleted(name)
            results.append(row)
        self.views.invalidate()
        return {"throttle_time_ms": 0, "responses": results}

    async def create_partitions(self, req: KafkaRequest, peer: Peer) -> dict[str, Any]:
        body = req.body
        results = []
        for t in body.get("topics", []):
            row: dict[str, Any] = {"name": t["name"], "error_code": 0, "error_message": None}
            have = self.topics.store.topics.queue_count(t["name"])
            if have is None:
                row.update(error_code=ErrorCode.UNKNOWN_TOPIC_OR_PARTITION, error_message="no such topic here")
            elif t["count"] <= have:
                row.update(
                    error_code=ErrorCode.INVALID_PARTITIONS,
                    error_message=f"topic has {have} partitions; the count can only grow (asked {t['count']})",
                )
            elif not body.get("validate_only", False):
                try:
                    await self.topics.create(t["name"], t["count"])
                except RequestError as e:
                    row["error_code"], row["error_message"] = _error(e)
            results.append(row)
        self.views.invalidate()
        return {"throttle_time_ms": 0, "results": results}

    async def describe_configs(self, req: KafkaRequest, peer: Peer) -> dict[str, Any]:
        return {"throttle_time_ms": 0, "results": [self._describe(r) for r in req.body.get("resources", [])]}

    def _describe(self, r: dict[str, Any]) -> dict[str, Any]:
        row: dict[str, Any] = {
            "error_code": 0,
            "error_message": None,
            "resource_type": r["resource_type"],
            "resource_name": r["resource_name"],
            "configs": [],
        }
        if r["resource_type"] == RESOURCE_TOPIC and self.topics.store.topics.queue_count(r["resource_name"]) is None:
            row.update(error_code=ErrorCode.UNKNOWN_TOPIC_OR_PARTITION, error_message="no such topic here")
            return row
        if r["resource_type"] not in (RESOURCE_TOPIC, RESOURCE_BROKER):
            row.update(
                error_code=ErrorCode.INVALID_REQUEST, error_message="only topic and broker configs are described"
            )
            return row
        keys = r.get("configuration_keys")
        row["configs"] = [
            {
                "name": k,
                "value": v,
                "read_only": True,
                "is_default": True,
                "config_source": CONFIG_SOURCE_DEFAULT,
                "is_sensitive": False,
                "synonyms": [],
                "config_type": 0,
                "documentation": None,
            }
            for k, v in self._configs().items()
            if keys is None or k in keys
        ]
        return row

    def _configs(self) -> dict[str, str]:
        """Kafka's names for what this broker does to every topic."""
        c = self.topics.config
        return {
            "cleanup.policy": "delete",
            "retention.ms": str(c.retention_ms),
            "retention.bytes": "-1",
            "max.message.bytes": str(c.max_message_bytes),
            "segment.bytes": str(c.segment_bytes),
            "message.timestamp.type": "CreateTime",
            "min.insync.replicas": str(c.min_insync_replicas),
            "compression.type": "producer",
            "unclean.leader.election.enable": str(c.unclean_leader_election).lower(),
        }

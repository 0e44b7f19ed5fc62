"""What replication needs of the broker around it, as small protocols (the broker's
service implements them; replication imports nothing of the service)."""

from __future__ import annotations

from typing import Any, Protocol


class MetadataPort(Protocol):
    """The broker's replicated metadata: topics, consumer-group offsets and subscriptions."""

    def version(self) -> int:
        """A number that changes whenever the metadata does (followers copy it then)."""
        ...

    def topics_version(self) -> int:
        """A number that changes whenever a topic is created, resized or deleted (followers
        copy at once then: a message of a topic its replicas do not know cannot be read there)."""
        ...

    def snapshot(self) -> dict[str, Any]:
        """``topics`` {name: queue_count}, ``offset_lists`` [[group, topic, [queue ids], [offsets]]]
        (before: ``offsets`` [[group, topic, queue_id, offset]], still accepted),
        ``subscriptions`` [[group, mode, [topics]]] (a leader's answer to REPLICA_METADATA)."""
        ...

    def apply(self, snapshot: dict[str, Any]) -> None:
        """Make this broker's metadata the leader's (a follower; runs in a worker thread)."""
        ...

    def after_truncation(self) -> None:
        """The log was cut: consumer offsets past the queues' new ends come back to them."""
        ...


class CoordinatorPort(Protocol):
    """What a replica asks of the coordinator (ZooKeeper mode: ``clmq.broker.coordination``
    implements it). The coordinator in turn calls :meth:`Replica.become_leader` and
    :meth:`Replica.become_follower`."""

    def may_ack(self) -> str | None:
        """None while this broker may acknowledge writes as its group's leader (its
        ZooKeeper lease holds); else why not."""
        ...

    def min_leader_epoch(self) -> int:
        """The group's epoch as ZooKeeper last said: a leader with an older one is stale."""
        ...

    async def shrink(self, broker_ids: list[int]) -> bool:
        """Remove followers from the group's in-sync set in ZooKeeper; True once written."""
        ...

    async def expand(self, broker_ids: list[int]) -> bool:
        """Add followers to the group's in-sync set in ZooKeeper; True once written."""
        ...

    async def hand_over(self, broker_id: int) -> int:
        """Make follower ``broker_id`` the group's leader in ZooKeeper (a new epoch,
        returned); this broker then follows it."""
        ...

    def status(self) -> dict[str, Any]:
        """``mode``, ``session``, ``leader``, ``epoch``, ``isr``, ``lease_ms_left``."""
        ...

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
        """``topics`` {name: queue_count}, ``offsets`` [[group, topic, queue_id, offset]],
        ``subscriptions`` [[group, mode, [topics]]] (a leader's answer to REPLICA_METADATA)."""
        ...

    def apply(self, snapshot: dict[str, Any]) -> None:
        """Make this broker's metadata the leader's (a follower; runs in a worker thread)."""
        ...

    def after_truncation(self) -> None:
        """The log was cut: consumer offsets past the queues' new ends come back to them."""
        ...

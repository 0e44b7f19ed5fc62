"""The broker's metadata as replication copies it (:class:`clmq.broker.replication.MetadataPort`):
topics, consumer-group offsets and subscriptions. A leader counts changes (a version
its followers watch); a follower makes its own metadata the leader's."""

from __future__ import annotations

import logging
from typing import Any, Iterator, Protocol

from clmq.broker.store import StorageEngine

from ._groups import ConsumerGroups
from ._offsets import ConsumerOffsets

log = logging.getLogger("clmq.broker")


class TimerCheckpoints(Protocol):
    """The timer's side (``_timer.Timer``): its last checkpoint, and a leader's, adopted."""

    def checkpoint_json(self) -> dict[str, Any] | None: ...
    def adopt_checkpoint(self, value: dict[str, Any]) -> None: ...
    def after_truncation(self) -> None: ...


class SecurityCopies(Protocol):
    """The users and ACLs (``_security.BrokerSecurity``): a leader's snapshot, a follower's copy."""

    def snapshot(self) -> dict[str, Any]: ...
    def adopt(self, value: dict[str, Any]) -> None: ...


def offset_rows(snapshot: dict[str, Any]) -> Iterator[tuple[str, str, int, int]]:
    """A leader's committed offsets, (group, topic, queue id, offset): from its
    ``offset_lists`` ([group, topic, [queue ids], [offsets]]) and, from a leader of an
    older version, its ``offsets`` ([group, topic, queue id, offset])."""
    for g, t, qs, os in snapshot.get("offset_lists") or []:
        for q, o in zip(qs, os, strict=True):
            yield g, t, q, o
    for g, t, q, o in snapshot.get("offsets") or []:
        yield g, t, q, o


class ReplicatedMetadata:
    def __init__(self, store: StorageEngine, offsets: ConsumerOffsets, groups: ConsumerGroups) -> None:
        self.store = store
        self.offsets = offsets
        self.groups = groups
        self._version = 0
        self._topics_version = 0
        # Subscriptions copied from the leader: group -> (mode, topics). A promoted
        # follower lists these groups before their consumers' first heartbeat.
        self.subscriptions: dict[str, tuple[str, list[str]]] = {}
        self.timer: TimerCheckpoints | None = None  # set by the broker
        self.transactions: TimerCheckpoints | None = None  # transactions' checkpoint: the same three calls
        self.pop: TimerCheckpoints | None = None  # POP's checkpoint (pop.PopService): the same three calls
        self.security: SecurityCopies | None = None  # set by the broker

    def bump(self) -> None:
        """Something replicated changed (a topic, a committed offset, a subscription)."""
        self._version += 1

    def bump_topics(self) -> None:
        """A topic was created, resized or deleted."""
        self._topics_version += 1
        self._version += 1

    def version(self) -> int:
        return self._version

    def topics_version(self) -> int:
        return self._topics_version

    def snapshot(self) -> dict[str, Any]:
        subs = dict(self.subscriptions)
        for g in self.groups.groups():
            members = self.groups.members(g)
            subs[g] = (members[0].mode, sorted({t for m in members for t in m.topics}))
        timer = self.timer.checkpoint_json() if self.timer is not None else None
        return {
            "topics": self.store.topics.all(),
            "offset_lists": self.offsets.lists(),  # a row per (group, topic), not per queue
            "timer": timer,
            "transactions": self.transactions.checkpoint_json() if self.transactions is not None else None,
            "pop": self.pop.checkpoint_json() if self.pop is not None else None,
            "security": self.security.snapshot() if self.security is not None else None,
            "subscriptions": [[g, mode, topics] for g, (mode, topics) in sorted(subs.items())],
        }

    def apply(self, snapshot: dict[str, Any]) -> None:
        """Make this (follower's) metadata the leader's; runs in a worker thread."""
        topics: dict[str, int] = snapshot.get("topics") or {}
        mine = self.store.topics.all()
        for name, count in topics.items():
            if mine.get(name) != count:
                self.store.create_topic(name, count)
        for name in mine.keys() - topics.keys():
            self.store.delete_topic(name)
            self.offsets.drop_topic(name)
        for g, t, q, o in offset_rows(snapshot):
            if self.offsets.query(g, t, q) != o:
                self.offsets.commit(g, t, q, o)
        self.subscriptions = {g: (mode, list(ts)) for g, mode, ts in snapshot.get("subscriptions") or []}
        timer = snapshot.get("timer")
        if isinstance(timer, dict) and self.timer is not None:
            self.timer.adopt_checkpoint(timer)
        transactions = snapshot.get("transactions")
        if isinstance(transactions, dict) and self.transactions is not None:
            self.transactions.adopt_checkpoint(transactions)
        pop = snapshot.get("pop")
        if isinstance(pop, dict) and self.pop is not None:
            self.pop.adopt_checkpoint(pop)
        security = snapshot.get("security")
        if isinstance(security, dict) and self.security is not None:
            self.security.adopt(security)
        self.bump()

    def after_truncation(self) -> None:
        store = self.store
        self.offsets.clamp(lambda t, q: store.max_offset(t, q) if store.queue_exists(t, q) else None)
        if self.timer is not None:
            self.timer.after_truncation()
        if self.transactions is not None:
            self.transactions.after_truncation()
        if self.pop is not None:
            self.pop.after_truncation()

"""What every request handler of a broker works with, in one object, so that handler
modules depend on this small module and not on the broker that assembles them (which
imports them: the other way would be a cycle)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from clmq.broker.replication import Replica
from clmq.broker.store import StorageEngine
from clmq.protocol.transport import RequestError

from ._append import AppendLane
from ._config import BrokerConfig
from ._groups import ConsumerGroups
from ._longpoll import PullWaiters
from ._offsets import ConsumerOffsets
from ._replicated import ReplicatedMetadata
from ._security import BrokerSecurity
from ._stalls import StallDetector
from ._trace_buffer import TraceRecorder
from ._traffic import TopicTraffic


def now_ms() -> float:
    """A monotonic clock in milliseconds, for expiry (never a wall-clock time)."""
    return time.monotonic() * 1000


@dataclass(frozen=True)
class BrokerContext:
    """The broker's state and the few things a handler may ask of the running broker."""

    config: BrokerConfig
    store: StorageEngine
    offsets: ConsumerOffsets
    groups: ConsumerGroups
    waiters: PullWaiters
    lane: AppendLane
    register_now: Callable[[], None]  # re-register with the name servers now (topics changed)
    addr: Callable[[], str]  # the address clients are told to use
    connections: Callable[[], int]  # connections open now
    replica: Replica  # leader or follower: asked before every write
    metadata: ReplicatedMetadata  # what followers copy (bump() on every change)
    security: BrokerSecurity  # users, ACLs and the decisions both listeners take by them
    traffic: TopicTraffic = field(default_factory=TopicTraffic)  # messages and bytes in and out per topic
    kafka_addr: Callable[[], str] = lambda: ""  # host:port of the Kafka listener ("": none)
    # The Kafka groups' members by group (one group namespace: a group has members of
    # one protocol at a time): member id -> client id; empty when none, or no listener.
    kafka_members: Callable[[str], dict[str, str]] = lambda group: {}
    kafka_groups: Callable[[], list[str]] = lambda: []
    tracer: TraceRecorder = field(default_factory=TraceRecorder)  # the broker's trace events (trace_enabled)
    # DESCRIBE_GROUP's "pop" part of a group (None: no POP state for it here; pop.PopService.describe)
    pop_describe: Callable[[str], dict[str, Any] | None] = lambda group: None
    pop_groups: Callable[[], list[str]] = lambda: []  # the groups with POP state here (LIST_GROUPS lists them)
    pop_drop_topic: Callable[[str], None] = lambda topic: None  # a deleted topic's POP state goes
    stalls: StallDetector = field(default_factory=lambda: StallDetector(0))  # event-loop stalls (stall_threshold_ms)

    async def topic_changed(self, topic: str) -> None:
        """After ``topic`` was created, grown or deleted here: followers hear of it now,
        and the change is answered only once every in-sync follower holds it
        (RequestError otherwise: made here, not acknowledged; a retry answers once it
        is copied); then the name servers. Topics are copied beside the log: without
        this wait, a follower elected right after the change would lead without it,
        and its followers would drop the topic too."""
        self.metadata.bump_topics()
        try:
            await self.topics_held(topic)
        finally:
            self.register_now()

    async def topics_held(self, topic: str) -> None:
        """Wait until every in-sync follower holds this broker's topics (at once when no
        change is being copied); RequestError if not within ``replication_timeout_ms``."""
        problem = await self.replica.wait_topics(topic)
        if problem is not None:
            raise RequestError(*problem)

"""Share sessions (KIP-932) of one broker, and the POP service's API as the share
group handlers use it.

A session is keyed by (group, member id): ShareFetch with epoch 0 opens it (a session
already open for that member is closed first), each later request carries the next
epoch, -1 closes it. The session holds the partitions the member fetches (added by
naming them, removed by ForgottenTopicsData) and the receipt handles of the records it
was given and has not settled. Closing a session releases those records at once
(Kafka releases a closed session's acquired records); a member that dies without
closing loses its records when their lock runs out.

Epochs are checked leniently: a session's request may carry any epoch from the one
expected on (a retried request the client counted twice is not refused); an older one
is INVALID_SHARE_SESSION_EPOCH, an epoch > 0 without a session SHARE_SESSION_NOT_FOUND.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from clmq.protocol.kafka import ErrorCode

MAX_EPOCH = 2**31 - 1
SHARE_SESSION_LIMIT_REACHED = 133  # Kafka 4.1's code, newer than the ErrorCode table's Kafka tree

# ShareFetch: held records looked at per fetch for ones no longer this session's (settled,
# or their lock ran out and they went to another member): bounded work, oldest first.
HELD_PRUNE_PER_FETCH = 256
PartitionKey = tuple[str, int]  # (topic, partition index)
HeldKey = tuple[str, int, int]  # (topic, queue id, queue offset)


class DeliveryLike(Protocol):
    """What the share handlers read of a POP delivery (``clmq.broker.service.pop.Delivery``)."""

    @property
    def topic(self) -> str: ...
    @property
    def queue_id(self) -> int: ...
    @property
    def queue_offset(self) -> int: ...
    @property
    def attempt(self) -> int: ...
    @property
    def handle(self) -> str: ...


class PopLike(Protocol):
    """The part of the broker's PopService (``clmq.broker.service.pop``) share groups use."""

    async def pop(
        self,
        group: str,
        client_id: str,
        topic: str,
        *,
        max_messages: int,
        invisible_time_ms: int,
        queue_ids: Sequence[int] | None = None,
        max_wait_ms: int = 0,
        max_bytes: int | None = None,
    ) -> Sequence[DeliveryLike]: ...
    async def ack(self, group: str, handles: Sequence[str]) -> list[str]: ...
    async def change_invisible_time(
        self, group: str, handles: Sequence[str], invisible_time_ms: int
    ) -> list[tuple[str, str]]: ...
    async def reject(self, group: str, handles: Sequence[str]) -> list[str]: ...
    def delivery_of(self, group: str, topic: str, queue_id: int, queue_offset: int) -> DeliveryLike | None: ...
    def owner_of(self, group: str, handle: str) -> str | None: ...
    @property
    def running(self) -> bool: ...
    def running_state(self) -> object: ...  # RequestError when not running here (NOT_LEADER, SYSTEM_BUSY)


@dataclass
class ShareSession:
    """One member's share session on this broker."""

    group: str
    member: str
    epoch: int = 1  # the next epoch expected
    partitions: set[PartitionKey] = field(default_factory=set)
    held: dict[HeldKey, str] = field(default_factory=dict)  # records given and not settled: handle
    used: float = field(default_factory=time.monotonic)  # the last request of the session


class ShareSessions:
    """The open share sessions of this broker."""

    def __init__(self, max_sessions: int, idle_ms: int) -> None:
        self.max_sessions = max_sessions
        self.idle_ms = idle_ms  # a session unused this long is dropped when the table is full
        self.sessions: dict[tuple[str, str], ShareSession] = {}

    def _make_room(self) -> bool:
        """Whether a new session fits, after dropping the sessions idle past ``idle_ms``
        (a member that died on another broker than its coordinator never closes its
        session here; the records it held come back when their locks run out)."""
        if len(self.sessions) < self.max_sessions:
            return True
        limit = time.monotonic() - self.idle_ms / 1000
        for key in [k for k, s in self.sessions.items() if s.used < limit]:
            del self.sessions[key]
        return len(self.sessions) < self.max_sessions

    def enter(self, group: str, member: str, epoch: int, *, opening: bool) -> ShareSession | int:
        """The session a request with ``epoch`` belongs to, or its error code. Epoch 0
        opens a fresh session when ``opening`` (ShareFetch), else is invalid."""
        key = (group, member)
        if epoch == 0:
            if not opening:
                return ErrorCode.INVALID_SHARE_SESSION_EPOCH
            if key not in self.sessions and not self._make_room():
                return SHARE_SESSION_LIMIT_REACHED
            self.sessions[key] = ShareSession(group, member)
            return self.sessions[key]
        session = self.sessions.get(key)
        if session is None:
            return ErrorCode.SHARE_SESSION_NOT_FOUND
        session.used = time.monotonic()
        if epoch == -1:
            return session
        if epoch < session.epoch:
            return ErrorCode.INVALID_SHARE_SESSION_EPOCH
        session.epoch = 1 if epoch >= MAX_EPOCH else epoch + 1
        return session

    def close(self, group: str, member: str) -> ShareSession | None:
        """The member's session, removed (None: it had none)."""
        return self.sessions.pop((group, member), None)


def prune_held(pop: PopLike, session: ShareSession, most: int = HELD_PRUNE_PER_FETCH) -> int:
    """Forget up to ``most`` of the session's oldest held records, those whose current
    delivery is no longer the one given to it (settled, or given again since); the ones
    still held move to the back (the next fetch looks at others). How many were forgotten."""
    held, dropped = session.held, 0
    for key in list(itertools.islice(held, most)):
        handle = held.pop(key)
        now = pop.delivery_of(session.group, *key)
        if now is not None and now.handle == handle:
            held[key] = handle
        else:
            dropped += 1
    return dropped


async def release_held(pop: PopLike, session: ShareSession) -> int:
    """Every record the session still holds visible again at once (its delivery count
    rises when it is given again); how many were released."""
    handles = []
    for (topic, queue_id, offset), handle in session.held.items():
        now = pop.delivery_of(session.group, topic, queue_id, offset)
        if now is not None and now.handle == handle:
            handles.append(handle)
    session.held.clear()
    if not handles:
        return 0
    results = await pop.change_invisible_time(session.group, handles, 0)
    return sum(1 for status, _ in results if status == "ok")

"""Kafka classic consumer groups as plain data: a group, its members, and the deadline table.

The rules follow Kafka's ``ClassicGroup``/``ClassicGroupMember``; the transitions that
move a group between states live in :mod:`._rebalance`, the waiting in
:mod:`._coordinator`. Nothing here touches trio: a waiting request is a :class:`Reply`
that someone completes, and time is a number handed in.
"""

from __future__ import annotations

import heapq
import itertools
import uuid
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable

from clmq.protocol.kafka import ErrorCode

# Kafka error codes this coordinator answers, by the names its modules use.
NONE = int(ErrorCode.NONE)
COORDINATOR_NOT_AVAILABLE = int(ErrorCode.COORDINATOR_NOT_AVAILABLE)
ILLEGAL_GENERATION = int(ErrorCode.ILLEGAL_GENERATION)
INCONSISTENT_GROUP_PROTOCOL = int(ErrorCode.INCONSISTENT_GROUP_PROTOCOL)
INVALID_GROUP_ID = int(ErrorCode.INVALID_GROUP_ID)
UNKNOWN_MEMBER_ID = int(ErrorCode.UNKNOWN_MEMBER_ID)
INVALID_SESSION_TIMEOUT = int(ErrorCode.INVALID_SESSION_TIMEOUT)
REBALANCE_IN_PROGRESS = int(ErrorCode.REBALANCE_IN_PROGRESS)
NON_EMPTY_GROUP = int(ErrorCode.NON_EMPTY_GROUP)
GROUP_ID_NOT_FOUND = int(ErrorCode.GROUP_ID_NOT_FOUND)
MEMBER_ID_REQUIRED = int(ErrorCode.MEMBER_ID_REQUIRED)
GROUP_MAX_SIZE_REACHED = int(ErrorCode.GROUP_MAX_SIZE_REACHED)
FENCED_INSTANCE_ID = int(ErrorCode.FENCED_INSTANCE_ID)

NO_GENERATION = -1
GROUP_TYPE = "classic"


@dataclass(frozen=True)
class GroupSettings:
    """The coordinator's bounds (Kafka's ``group.*`` broker settings, same defaults but the size)."""

    min_session_timeout_ms: int = 6000
    max_session_timeout_ms: int = 1_800_000
    initial_rebalance_delay_ms: int = 3000
    max_group_size: int = 1000
    # A new member's JoinGroup is parked at most this long (Kafka's fixed 5 minutes): it has
    # no member id to heartbeat with, and a client that gave up would otherwise stay forever.
    new_member_join_timeout_ms: int = 300_000


class State(str, Enum):
    """A classic group's states, spelled as Kafka reports them (DescribeGroups, ListGroups)."""

    EMPTY = "Empty"
    PREPARING_REBALANCE = "PreparingRebalance"
    COMPLETING_REBALANCE = "CompletingRebalance"
    STABLE = "Stable"
    DEAD = "Dead"


class Reply:
    """A response someone is (or was) waiting for: completed once, by whoever finishes the step.

    ``notify`` is set by the waiter (a trio event's ``set``); completing a reply whose waiter
    went away (connection closed) is harmless, as with Kafka's response futures.
    """

    __slots__ = ("notify", "response")

    def __init__(self) -> None:
        self.response: dict[str, Any] | None = None
        self.notify: Callable[[], None] = _nothing

    def complete(self, response: dict[str, Any]) -> bool:
        """Answer the waiter; False if it was answered already."""
        if self.response is not None:
            return False
        self.response = response
        self.notify()
        return True


def _nothing() -> None:
    pass


Protocols = list[tuple[str, bytes]]


@dataclass(eq=False)
class Member:
    """One member of a classic group, with its outstanding JoinGroup/SyncGroup replies."""

    member_id: str
    group_instance_id: str | None
    client_id: str
    client_host: str
    rebalance_timeout_ms: int
    session_timeout_ms: int
    protocol_type: str
    protocols: Protocols
    assignment: bytes = b""
    join: Reply | None = None
    sync: Reply | None = None
    # New members have no id the client knows yet, so they cannot heartbeat: their join is
    # bounded by its own timeout instead (Kafka's isNew).
    is_new: bool = False

    @property
    def awaiting_join(self) -> bool:
        return self.join is not None

    def has_satisfied_heartbeat(self) -> bool:
        """Whether a session expiry should spare this member (it is parked in a rebalance step)."""
        if self.is_new:
            return False
        return self.join is not None or self.sync is not None

    def vote(self, candidates: set[str]) -> str:
        """The member's most preferred protocol among those every member supports."""
        return next(name for name, _ in self.protocols if name in candidates)

    def metadata(self, protocol_name: str | None) -> bytes:
        return next((meta for name, meta in self.protocols if name == protocol_name), b"")

    def matches(self, protocols: Protocols) -> bool:
        return protocols == self.protocols


def new_member_id(client_id: str, group_instance_id: str | None) -> str:
    """Kafka's member ids: the instance id (static) or client id (dynamic), a dash, a UUID."""
    return f"{group_instance_id if group_instance_id is not None else client_id}-{uuid.uuid4()}"


def error_join(error: int, member_id: str = "") -> dict[str, Any]:
    """A JoinGroup response that only carries an error."""
    return {
        "throttle_time_ms": 0,
        "error_code": error,
        "generation_id": NO_GENERATION,
        "protocol_type": None,
        "protocol_name": None,
        "leader": "",
        "skip_assignment": False,
        "member_id": member_id,
        "members": [],
    }


def error_sync(error: int) -> dict[str, Any]:
    """A SyncGroup response that only carries an error."""
    return {"throttle_time_ms": 0, "error_code": error, "protocol_type": None, "protocol_name": None, "assignment": b""}


@dataclass(eq=False)
class Group:
    """One classic group: members by id (in join order), static members, pending joins and syncs."""

    group_id: str
    state: State = State.EMPTY
    previous_state: State = State.EMPTY
    generation_id: int = 0
    protocol_type: str | None = None
    protocol_name: str | None = None
    leader_id: str | None = None
    members: dict[str, Member] = field(default_factory=dict)
    static: dict[str, str] = field(default_factory=dict)  # group instance id -> member id
    pending_join: set[str] = field(default_factory=set)  # ids handed out by MEMBER_ID_REQUIRED
    pending_sync: set[str] = field(default_factory=set)
    # The initial rebalance is extended while members keep arriving.
    new_member_added: bool = False

    # -- membership -------------------------------------------------------------------

    def add(self, member: Member, reply: Reply | None) -> None:
        """Add a member (its protocols were checked by :meth:`supports_protocols`)."""
        if member.group_instance_id is not None:
            self.static[member.group_instance_id] = member.member_id
        if not self.members:
            self.protocol_type = member.protocol_type
        if self.leader_id is None:
            self.leader_id = member.member_id
        self.members[member.member_id] = member
        member.join = reply
        self.pending_join.discard(member.member_id)

    def remove(self, member_id: str) -> None:
        """Drop a member or pending member; its parked requests learn it is gone."""
        member = self.members.pop(member_id, None)
        if member is not None:
            if member.group_instance_id is not None and self.static.get(member.group_instance_id) == member_id:
                del self.static[member.group_instance_id]
            # Kafka answers a parked join this way so the client retries as a new member;
            # a parked sync gets the same rather than hanging until the client's timeout.
            self.complete_join(member, error_join(UNKNOWN_MEMBER_ID))
            self.complete_sync(member, error_sync(UNKNOWN_MEMBER_ID))
        if self.leader_id == member_id:
            self.leader_id = next(iter(self.members), None)
        self.pending_join.discard(member_id)
        self.pending_sync.discard(member_id)

    def replace_static(self, instance_id: str, old_id: str, new_id: str) -> Member:
        """Give a static member a new member id; the old id's parked requests are fenced."""
        old = self.members.pop(old_id)
        self.complete_join(old, error_join(FENCED_INSTANCE_ID, old_id))
        self.complete_sync(old, error_sync(FENCED_INSTANCE_ID))
        new = Member(
            new_id,
            old.group_instance_id,
            old.client_id,
            old.client_host,
            old.rebalance_timeout_ms,
            old.session_timeout_ms,
            old.protocol_type,
            old.protocols,
            old.assignment,
        )
        self.members[new_id] = new
        if self.leader_id == old_id:
            self.leader_id = new_id
        self.static[instance_id] = new_id
        return new

    def update_member(
        self, member: Member, protocols: Protocols, rebalance_ms: int, session_ms: int, reply: Reply
    ) -> None:
        """A known member rejoins: new protocols and timeouts, and a new parked join."""
        member.protocols = protocols
        member.rebalance_timeout_ms = rebalance_ms
        member.session_timeout_ms = session_ms
        # A join parked earlier by the same member is stale (its connection is likely gone):
        # answer it so that no caller waits on a reply nobody will complete.
        self.complete_join(member, error_join(REBALANCE_IN_PROGRESS, member.member_id))
        member.join = reply

    def complete_join(self, member: Member, response: dict[str, Any]) -> bool:
        """Answer the member's parked JoinGroup, if any."""
        reply, member.join = member.join, None
        return reply is not None and reply.complete(response)

    def complete_sync(self, member: Member, response: dict[str, Any]) -> bool:
        """Answer the member's parked SyncGroup, if any."""
        reply, member.sync = member.sync, None
        return reply is not None and reply.complete(response)

    # -- queries ----------------------------------------------------------------------

    def validate_member(self, member_id: str, instance_id: str | None) -> int:
        """Kafka's validateMember: FENCED_INSTANCE_ID or UNKNOWN_MEMBER_ID, else NONE."""
        if instance_id is not None:
            known = self.static.get(instance_id)
            if known is None:
                return UNKNOWN_MEMBER_ID
            if known != member_id:
                return FENCED_INSTANCE_ID
        return NONE if member_id in self.members else UNKNOWN_MEMBER_ID

    def num_awaiting_join(self) -> int:
        return sum(1 for m in self.members.values() if m.awaiting_join)

    def has_all_joined(self) -> bool:
        return all(m.awaiting_join for m in self.members.values()) and not self.pending_join

    def rebalance_timeout_ms(self) -> int:
        return max((m.rebalance_timeout_ms for m in self.members.values()), default=0)

    def can_rebalance(self) -> bool:
        return self.state in (State.STABLE, State.COMPLETING_REBALANCE, State.EMPTY)

    def transition(self, state: State) -> None:
        self.previous_state, self.state = self.state, state

    def candidate_protocols(self) -> set[str]:
        """Protocol names every member supports."""
        names = [{name for name, _ in m.protocols} for m in self.members.values()]
        return set.intersection(*names) if names else set()

    def supports_protocols(self, protocol_type: str, protocols: Protocols) -> bool:
        """Whether a member with these protocols may join (Kafka's supportsProtocols)."""
        names = {name for name, _ in protocols}
        if self.state == State.EMPTY:
            return bool(protocol_type) and bool(names)
        return self.protocol_type == protocol_type and bool(names & self.candidate_protocols())

    def select_protocol(self) -> str:
        """Kafka's vote: each member names its favourite common protocol; the most named wins."""
        candidates = self.candidate_protocols()
        votes: dict[str, int] = {}
        for member in self.members.values():
            choice = member.vote(candidates)
            votes[choice] = votes.get(choice, 0) + 1
        return max(votes, key=lambda name: votes[name])

    def elect_joined_leader(self) -> bool:
        """Keep a leader that rejoined, else pick a member that did; False if none rejoined."""
        if self.leader_id is None:
            return False
        if self.members[self.leader_id].awaiting_join:
            return True
        joined = next((m.member_id for m in self.members.values() if m.awaiting_join), None)
        if joined is None:
            return False
        self.leader_id = joined
        return True

    def init_next_generation(self) -> None:
        self.generation_id += 1
        if self.members:
            self.protocol_name = self.select_protocol()
            self.transition(State.COMPLETING_REBALANCE)
        else:
            self.protocol_name = None
            self.transition(State.EMPTY)
        self.pending_sync.clear()

    def leader_members(self) -> list[dict[str, Any]]:
        """Every member's metadata for the chosen protocol: what the leader's JoinGroup carries."""
        return [
            {
                "member_id": m.member_id,
                "group_instance_id": m.group_instance_id,
                "metadata": m.metadata(self.protocol_name),
            }
            for m in self.members.values()
        ]

    def join_response(self, member_id: str, members: list[dict[str, Any]], leader: str | None) -> dict[str, Any]:
        """A successful JoinGroup response for the current generation."""
        return {
            "throttle_time_ms": 0,
            "error_code": NONE,
            "generation_id": self.generation_id,
            "protocol_type": self.protocol_type,
            "protocol_name": self.protocol_name,
            "leader": leader or "",
            "skip_assignment": False,
            "member_id": member_id,
            "members": members,
        }


TimerKey = tuple[str, ...]


class Timers:
    """Deadlines by key (a later schedule of a key replaces the earlier one); times in seconds.

    ``on_sooner`` is called when a schedule moves the earliest deadline forward, so that the
    task sleeping until the earliest deadline can wake and sleep again for less.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, TimerKey]] = []
        self._live: dict[TimerKey, tuple[int, Callable[[], None]]] = {}
        self._seq = itertools.count()
        self.on_sooner: Callable[[], None] = _nothing

    def schedule(self, key: TimerKey, deadline: float, action: Callable[[], None]) -> None:
        seq = next(self._seq)
        self._live[key] = (seq, action)
        heapq.heappush(self._heap, (deadline, seq, key))
        if self._heap[0][1] == seq:
            self.on_sooner()

    def cancel(self, key: TimerKey) -> None:
        self._live.pop(key, None)

    def next_deadline(self) -> float | None:
        # Replaced and cancelled entries stay in the heap until they surface: drop them here.
        while self._heap and self._live.get(self._heap[0][2], (None,))[0] != self._heap[0][1]:
            heapq.heappop(self._heap)
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now: float) -> Callable[[], None] | None:
        """The next action whose deadline has passed (removed from the table), else None."""
        deadline = self.next_deadline()
        if deadline is None or deadline > now:
            return None
        _, _, key = heapq.heappop(self._heap)
        return self._live.pop(key)[1]

    def __len__(self) -> int:
        return len(self._live)

"""The in-flight state of POP consumption, pure data (no I/O): per group, per queue,
the next offset never popped and the deliveries not yet settled (Kafka share groups'
model, RocketMQ 5's CK/ACK records). Applying the ``%POP%`` records in log order from
any point at or before the one a state reflects gives the same state (a replay from a
checkpoint may start early)."""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any, Callable

from ._records import Acks, Checkpoint

QueueKey = tuple[str, int]
LOW_SCAN_MAX = 64  # offsets looked at above a settled lowest one before a min() over the in-flight set


@dataclass(slots=True)
class Flight:
    """One popped, unsettled queue offset: its current delivery."""

    ck: int  # the CK record's queue offset in %POP% (-1: being written)
    deadline_ms: int  # epoch ms: visible again from then
    attempt: int  # deliveries made (0: reserved by a pop that stored nothing)
    owner: str  # the client id it was delivered to
    max_reconsume_times: int
    settling: bool = False  # its ACK is being written: neither visible nor acknowledgeable meanwhile


@dataclass
class QueueFlights:
    """One queue's state for one group."""

    next_offset: int
    flights: dict[int, Flight] = field(default_factory=dict)
    heap: list[tuple[int, int]] = field(default_factory=list)  # (deadline, offset), stale ones skipped
    low: int | None = None  # min(flights) when known (None, or an offset no longer in flight: look again)

    def settled_offset(self) -> int:
        """The lowest offset not settled."""
        if not self.flights:
            return self.next_offset
        low = self.low
        if low is not None and low not in self.flights:  # settled: acks come mostly in order, look just above
            low = next(
                (o for o in range(low + 1, min(low + LOW_SCAN_MAX, self.next_offset)) if o in self.flights), None
            )
        if low is None:
            low = min(self.flights)
        self.low = low
        return low

    def put(self, offset: int, flight: Flight) -> None:
        """Make ``flight`` the offset's current delivery."""
        self.flights[offset] = flight
        if self.low is not None and offset < self.low:
            self.low = offset
        heapq.heappush(self.heap, (flight.deadline_ms, offset))
        if len(self.heap) > 2 * len(self.flights) + 64:
            self.heap = [(f.deadline_ms, o) for o, f in self.flights.items()]
            heapq.heapify(self.heap)

    def settle(self, offset: int, ck: int) -> bool:
        """Settle the delivery ``ck`` of ``offset``; False if it is not the current one."""
        f = self.flights.get(offset)
        if f is None or f.ck != ck:
            return False
        del self.flights[offset]
        return True

    def visible(self, now_ms: int) -> bool:
        """Whether a delivery's deadline has passed."""
        while self.heap:
            deadline, offset = self.heap[0]
            f = self.flights.get(offset)
            if f is not None and f.deadline_ms == deadline and not f.settling:
                return deadline <= now_ms
            heapq.heappop(self.heap)  # (a settling one is put back if its ACK is not written)
        return False

    def busy(self, now_ms: int) -> bool:
        """Whether a delivery is in flight and not yet visible again (orderly POP waits)."""
        return any(f.settling or f.deadline_ms > now_ms for f in self.flights.values())

    def due(self, now_ms: int, limit: int, orderly: bool = False) -> tuple[list[int], list[int]]:
        """Offsets visible again: up to ``limit`` to deliver, and every one past its
        dead-letter limit (all taken off the heap; the others stay). ``orderly``: the
        lowest offsets, none past one not visible yet."""
        if orderly:
            return self._due_in_order(now_ms, limit)
        take: list[int] = []
        dead: list[int] = []
        keep: list[tuple[int, int]] = []
        seen: set[int] = set()
        while self.heap and self.heap[0][0] <= now_ms:
            deadline, offset = heapq.heappop(self.heap)
            f = self.flights.get(offset)
            if f is None or f.deadline_ms != deadline or offset in seen or f.settling:
                continue
            seen.add(offset)
            if f.attempt > f.max_reconsume_times:
                dead.append(offset)
            elif len(take) < limit:
                take.append(offset)
            else:
                keep.append((deadline, offset))
        for item in keep:
            heapq.heappush(self.heap, item)
        return sorted(take), dead

    def _due_in_order(self, now_ms: int, limit: int) -> tuple[list[int], list[int]]:
        """:meth:`due` for an orderly pop: in offset order, up to the first not visible."""
        take: list[int] = []
        dead: list[int] = []
        for offset in sorted(self.flights):
            f = self.flights[offset]
            if f.settling or f.deadline_ms > now_ms or len(take) >= limit:
                break
            (dead if f.attempt > f.max_reconsume_times else take).append(offset)
        gone = set(take) | set(dead)
        if gone:  # their heap entries: stale from now (each is put again with its new delivery)
            self.heap = [(d, o) for d, o in self.heap if o not in gone]
            heapq.heapify(self.heap)
        return take, dead


@dataclass
class GroupStats:
    """Counts since this leader started."""

    popped: int = 0
    acked: int = 0
    ack_expired: int = 0
    redelivered: int = 0
    dead_lettered: int = 0


@dataclass
class GroupFlights:
    """One group's POP state."""

    queues: dict[QueueKey, QueueFlights] = field(default_factory=dict)
    members: dict[str, int] = field(default_factory=dict)  # client id -> its last pop (epoch ms)
    turn: int = 0  # which queue goes first at the next pop
    stats: GroupStats = field(default_factory=GroupStats)
    invisible_time_ms_last: int = 0
    last_pop_ms: int = 0  # epoch ms of its last pop (a start counts as one): an idle group is forgotten

    def inflight(self) -> int:
        """Deliveries not settled, over every queue."""
        return sum(len(q.flights) for q in self.queues.values())


class PopState:
    """Every group's state; :meth:`apply` replays ``%POP%`` records."""

    def __init__(self) -> None:
        self.groups: dict[str, GroupFlights] = {}

    def group(self, name: str) -> GroupFlights:
        """The group's state (made empty the first time)."""
        g = self.groups.get(name)
        if g is None:
            g = self.groups[name] = GroupFlights()
        return g

    def drop_topics(self, gone: Callable[[str], bool]) -> None:
        """Forget the queues of the topics ``gone`` says were deleted."""
        for g in self.groups.values():
            for key in [k for k in g.queues if gone(k[0])]:
                del g.queues[key]

    def apply(self, record: Checkpoint | Acks, ck: int) -> None:
        """Apply the record stored at ``%POP%`` queue offset ``ck``."""
        g = self.group(record.group)
        if isinstance(record, Checkpoint):
            key = (record.topic, record.queue_id)
            q = g.queues.get(key)
            if q is None:
                q = g.queues[key] = QueueFlights(record.next_offset)
            for offset, attempt in zip(record.offsets, record.attempts):
                q.put(offset, Flight(ck, record.deadline_ms, attempt, record.client_id, record.max_reconsume_times))
            q.next_offset = max(q.next_offset, record.next_offset)
            return
        for topic, qid, offset, ack_ck in record.rows:
            q = g.queues.get((topic, qid))
            if q is not None:
                q.settle(offset, ack_ck)

    def to_json(self) -> dict[str, Any]:
        """The state as a checkpoint saves it."""
        out: dict[str, Any] = {}
        for name, g in self.groups.items():
            out[name] = [
                [
                    t,
                    qid,
                    q.next_offset,
                    [[o, f.ck, f.deadline_ms, f.attempt, f.owner, f.max_reconsume_times] for o, f in q.flights.items()],
                ]
                for (t, qid), q in g.queues.items()
            ]
        return out

    @staticmethod
    def from_json(value: dict[str, Any]) -> PopState:
        """A saved state (ValueError, KeyError, TypeError if it is not one)."""
        state = PopState()
        for name, queues in value.items():
            g = state.group(str(name))
            for t, qid, next_offset, flights in queues:
                q = g.queues[(str(t), int(qid))] = QueueFlights(int(next_offset))
                for o, ck, deadline, attempt, owner, maxr in flights:
                    q.put(int(o), Flight(int(ck), int(deadline), int(attempt), str(owner), int(maxr)))
        return state

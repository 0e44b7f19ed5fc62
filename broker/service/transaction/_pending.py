"""The pending half messages of a leader and the recently ended ones, as plain data
(no trio, no store): what END_TRANSACTION, CHECK_TRANSACTIONS, LIST_TRANSACTIONS, the
checker and retention's floor read and change. One event loop changes it; retention's
thread only reads the keys (``floor``), which CPython does atomically."""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass

COMMITTED = "committed"
ROLLED_BACK = "rolled_back"
ENDED_KEPT = 100_000  # recently ended half messages remembered (a second END answers already_*)


class Half:
    """One pending half message (a few dozen bytes: strings are shared per group/topic)."""

    __slots__ = (
        "checks",
        "given_up",
        "group",
        "last_check_ms",
        "offset",
        "queue_id",
        "queue_offset",
        "ready_ms",
        "size",
        "stored_ms",
        "topic",
    )

    def __init__(
        self, offset: int, size: int, queue_offset: int, group: str, topic: str, queue_id: int, stored_ms: int
    ) -> None:
        self.offset, self.size, self.queue_offset = offset, size, queue_offset
        self.group, self.topic, self.queue_id = group, topic, queue_id
        self.stored_ms = stored_ms
        self.checks = 0  # checks asked (check op records written)
        self.last_check_ms = 0  # wall ms of the last check asked (0: never)
        self.given_up = False  # transaction_unresolved "keep": checked the most, asked no more
        self.ready_ms = 0  # wall ms it was handed to its group's polls (in ``ready``)


@dataclass
class Ended:
    """How a half message ended, and where its committed copy went (for ``already_*``)."""

    state: str  # COMMITTED or ROLLED_BACK
    queue_id: int = -1  # where the committed message went (-1: not known, e.g. after a restart)
    queue_offset: int = -1
    commitlog_offset: int = -1
    group: str = ""  # the half's producer group and real topic ("": not known, read from its record)
    topic: str = ""


@dataclass
class TransactionStats:
    """Ends and checks counted since this leader's pending set was built."""

    committed: int = 0
    rolled_back: int = 0
    checks: int = 0


class PendingSet:
    """``pending``: commit-log offset -> :class:`Half`; ``ended``: the latest ended ones
    (at most ``ENDED_KEPT``), offset -> :class:`Ended`; ``read_to``: every half message
    below this commit-log offset has been read from ``%TRANS_HALF%`` (a newer one lies
    at or past it).

    Checks cost O(log n) per half, not a scan of every pending one: ``schedule`` is a
    heap of (time it was stored or last asked about, offset), stale entries dropped as
    they come up; what is due moves to ``ready``, per group, where CHECK_TRANSACTIONS
    polls take it from."""

    def __init__(self, ended_kept: int = ENDED_KEPT) -> None:
        self.pending: dict[int, Half] = {}
        self.ended: OrderedDict[int, Ended] = OrderedDict()
        self.ended_kept = ended_kept
        self.read_to = 0
        self.queue_read = 0  # %TRANS_HALF% queue 0's next offset to read
        self.stats = TransactionStats()
        self.schedule: list[tuple[int, int]] = []  # heap: (stored or last asked ms, offset)
        self.order: list[tuple[int, int]] = []  # heap: (offset, queue offset) of every pending half (and some ended)
        self.ready: dict[str, dict[int, Half]] = {}  # group -> its halves due for a check, oldest first
        self._names: dict[str, str] = {}

    def intern(self, name: str) -> str:
        """One string object per group and topic name, however many halves share it."""
        return self._names.setdefault(name, name)

    def add(self, half: Half) -> bool:
        """A half message read from the queue (or found by its END): pending unless
        already known; False if it was."""
        if half.offset in self.pending or half.offset in self.ended:
            return False
        half.group, half.topic = self.intern(half.group), self.intern(half.topic)
        self.pending[half.offset] = half
        heapq.heappush(self.schedule, (half.stored_ms, half.offset))
        heapq.heappush(self.order, (half.offset, half.queue_offset))
        return True

    def end(self, offset: int, ended: Ended) -> Half | None:
        """Mark ``offset`` ended; the half it was (None if it was not pending)."""
        half = self.pending.pop(offset, None)
        if half is not None:  # an END of another group must not learn of it (NOT_FOUND)
            ended.group, ended.topic = half.group, half.topic
        while self.order and self.order[0][0] not in self.pending:  # the floor moves up at once
            heapq.heappop(self.order)
        self.ended[offset] = ended
        self.ended.move_to_end(offset)
        # The oldest go, but never one the half queue has not been read past: reading it
        # later must find it ended, not pending again.
        while len(self.ended) > self.ended_kept and next(iter(self.ended)) < self.read_to:
            self.ended.popitem(last=False)
        if ended.state == COMMITTED:
            self.stats.committed += 1
        else:
            self.stats.rolled_back += 1
        return half

    def remember(self, offset: int, state: str) -> None:
        """An end found by a rebuild (not counted: it happened before this start)."""
        self.ended[offset] = Ended(state)
        while len(self.ended) > self.ended_kept:
            self.ended.popitem(last=False)

    def floor(self) -> int:
        """The lowest commit-log offset a pending half (or one not yet read) may have:
        O(1), and safe from retention's thread (the heap's top is at or below every
        pending half, ended ones not yet dropped only make it lower)."""
        read_to = self.read_to
        try:  # the head taken once: the event loop may pop the last one between a check and a read
            lowest = self.order[0][0]
        except IndexError:
            lowest = read_to
        return min(lowest, read_to)

    def lowest_queue_offset(self) -> int:
        """The ``%TRANS_HALF%`` queue offset below which nothing is pending (on the
        event loop: drops the ended halves from the top of ``order``)."""
        order = self.order
        if len(order) > 2 * len(self.pending) + 1024:  # ended ones above an old pending one: compact
            order = [(h.offset, h.queue_offset) for h in self.pending.values()]
            heapq.heapify(order)
            self.order = order  # one assignment: retention's thread sees the old heap or the new
        while order and order[0][0] not in self.pending:
            heapq.heappop(order)
        return min(order[0][1], self.queue_read) if order else self.queue_read

    def take_due(self, now_ms: int, timeout_ms: int) -> list[Half]:
        """The pending halves whose stored or last-asked time is ``timeout_ms`` old
        (each once: they leave the schedule until asked again, :meth:`asked`)."""
        out, cut = [], now_ms - timeout_ms
        while self.schedule and self.schedule[0][0] <= cut:
            at, offset = heapq.heappop(self.schedule)
            half = self.pending.get(offset)
            if half is not None and not half.given_up and at == max(half.stored_ms, half.last_check_ms):
                out.append(half)
        return out

    def again(self, half: Half) -> None:
        """Back in the schedule as it was: due at the next look (a decision that failed)."""
        heapq.heappush(self.schedule, (max(half.stored_ms, half.last_check_ms), half.offset))

    def make_ready(self, half: Half, now_ms: int = 0) -> None:
        """``half`` is due: handed to its group's polls (``ready``) from ``now_ms``."""
        mine = self.ready.setdefault(half.group, {})
        if half.offset not in mine:
            half.ready_ms = now_ms
            mine[half.offset] = half

    def ready_of(self, group: str) -> list[Half]:
        """The group's halves due for a check and still pending (ended ones dropped)."""
        mine = self.ready.get(group)
        if not mine:
            return []
        for offset in [o for o in mine if o not in self.pending]:
            del mine[offset]
        return list(mine.values())

    def asked(self, halves: list[Half], now_ms: int) -> None:
        """``halves`` were handed to a producer: out of ``ready``, asked again once due."""
        for half in halves:
            half.last_check_ms = now_ms
            self.ready.get(half.group, {}).pop(half.offset, None)
            heapq.heappush(self.schedule, (now_ms, half.offset))

    def of_group(self, group: str | None) -> list[Half]:
        """The pending halves of ``group`` (None: of every group), in no set order."""
        return [h for h in self.pending.values() if group is None or h.group == group]

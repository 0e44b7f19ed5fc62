"""Idempotent Kafka producers: per (producer id, topic, queue) the sequence numbers of
the last batches, so that a retried batch is answered with the offsets it was first
stored at (never stored twice) and a batch out of order is refused, Kafka's rules
(``ProducerStateManager``):

- a batch of an older epoch: INVALID_PRODUCER_EPOCH;
- a newer epoch must start at sequence 0 (else OUT_OF_ORDER_SEQUENCE_NUMBER);
- a batch equal (first and last sequence) to one of the last ``BATCHES_KEPT``: a
  duplicate, answered with that batch's base offset;
- otherwise its first sequence must follow the last one (int32 wraps to 0).

Survives restarts and failovers without a file of its own: the first message of every
idempotent batch carries ``__kafka.producer = "pid epoch first last"``, replicated with
the log; the first time a (producer, queue) is seen here its state is read back from
the queue's tail (``recover``). A producer id minted by this broker while it leads
cannot have written anywhere before, so it is not looked for.
"""

from __future__ import annotations

import collections
import secrets
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import trio

from clmq.protocol.kafka import ErrorCode

BATCHES_KEPT = 5  # Kafka keeps the last five batches per producer and partition (max.in.flight <= 5)
MAX_SEQUENCE = 2**31 - 1


@dataclass(slots=True)
class BatchMeta:
    first_seq: int
    last_seq: int
    base_offset: int = -1  # -1: still being stored
    done: trio.Event = field(default_factory=trio.Event)
    ok: bool = False


@dataclass(slots=True)
class _Entry:
    epoch: int
    batches: collections.deque[BatchMeta] = field(default_factory=lambda: collections.deque(maxlen=BATCHES_KEPT))


@dataclass(frozen=True, slots=True)
class Accepted:
    meta: BatchMeta


@dataclass(frozen=True, slots=True)
class Duplicate:
    meta: BatchMeta


@dataclass(frozen=True, slots=True)
class Refused:
    error_code: int
    text: str


Check = Accepted | Duplicate | Refused
Key = tuple[int, str, int]  # producer id, topic, queue id
Recover = Callable[[int, str, int], Awaitable["tuple[int, list[tuple[int, int, int]]] | None"]]


def next_seq(seq: int) -> int:
    return 0 if seq == MAX_SEQUENCE else seq + 1


def producer_property(pid: int, epoch: int, first_seq: int, last_seq: int) -> str:
    return f"{pid} {epoch} {first_seq} {last_seq}"


def parse_producer_property(text: str) -> tuple[int, int, int, int] | None:
    parts = text.split()
    if len(parts) != 4 or not all(p.lstrip("-").isdigit() for p in parts):
        return None
    pid, epoch, first, last = (int(p) for p in parts)
    return pid, epoch, first, last


class Sequences:
    """The idempotent producers' state of this broker's queues."""

    def __init__(self, max_producers: int, recover: Recover) -> None:
        self.max_producers = max_producers
        self._recover = recover
        self._entries: collections.OrderedDict[Key, _Entry] = collections.OrderedDict()
        self._minted: set[int] = set()

    def mint(self) -> int:
        """A new producer id: random 63 bits, so ids never repeat across brokers,
        restarts and failovers without a counter to keep."""
        pid = secrets.randbits(62) + 1
        self._minted.add(pid)
        if len(self._minted) > self.max_producers:
            self._minted.pop()
        return pid

    def forget_minted(self) -> None:
        """Leadership lost or gained: ids minted before may have written elsewhere."""
        self._minted.clear()
        self._entries.clear()

    async def check(self, pid: int, epoch: int, topic: str, queue_id: int, first: int, count: int) -> Check:
        """Whether a batch may be appended (then it is recorded as in flight)."""
        key = (pid, topic, queue_id)
        entry = self._entries.get(key)
        if entry is None:
            entry = await self._load(key)
            entry = self._entries.setdefault(key, entry)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_producers:
            self._entries.popitem(last=False)
        last = (first + count - 1) % (MAX_SEQUENCE + 1)
        return _check(entry, epoch, first, last)

    async def _load(self, key: Key) -> _Entry:
        pid, topic, queue_id = key
        if pid in self._minted:
            return _Entry(epoch=-1)
        found = await self._recover(pid, topic, queue_id)
        if found is None:
            return _Entry(epoch=-1)
        epoch, rows = found
        entry = _Entry(epoch)
        for first, last, offset in rows[-BATCHES_KEPT:]:
            meta = BatchMeta(first, last, offset, ok=True)
            meta.done.set()
            entry.batches.append(meta)
        return entry

    def failed(self, pid: int, topic: str, queue_id: int, meta: BatchMeta) -> None:
        """A batch accepted but not stored: it and every later one are forgotten, so that
        the producer's retries (in order) are accepted again."""
        entry = self._entries.get((pid, topic, queue_id))
        meta.done.set()
        if entry is None or meta not in entry.batches:
            return
        while entry.batches and entry.batches[-1] is not meta:
            entry.batches.pop().done.set()
        entry.batches.pop()


def _check(entry: _Entry, epoch: int, first: int, last: int) -> Check:
    if entry.epoch >= 0 and epoch < entry.epoch:
        return Refused(ErrorCode.INVALID_PRODUCER_EPOCH, f"producer epoch {epoch} is older than {entry.epoch}")
    if epoch > entry.epoch and entry.epoch >= 0:
        if first != 0:
            return Refused(ErrorCode.OUT_OF_ORDER_SEQUENCE_NUMBER, f"a new epoch {epoch} must start at sequence 0")
        entry.batches.clear()
    entry.epoch = epoch
    for meta in entry.batches:
        if meta.first_seq == first and meta.last_seq == last:
            return Duplicate(meta)
    if entry.batches:
        expected = next_seq(entry.batches[-1].last_seq)
        if first != expected:
            return Refused(
                ErrorCode.OUT_OF_ORDER_SEQUENCE_NUMBER, f"sequence {first} out of order: expected {expected}"
            )
    meta = BatchMeta(first, last)
    entry.batches.append(meta)
    return Accepted(meta)

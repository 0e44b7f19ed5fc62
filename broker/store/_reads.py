"""The read API of both storage modes over a mode's :class:`QueueSource`: what a read's
arguments must be, what it answers when there is nothing to read, and a read of many
queues as one queue after another."""

from __future__ import annotations

from typing import Callable, Iterable, Protocol

from clmq.common import CorruptRecordError, InvalidInputError, MiB, Record

from ._results import GetResult, GetStatus, RawRead, Span
from ._state import StoreState

ReadAsk = tuple[str, int, int, Iterable[str] | None]  # topic, queue id, offset, tags (None: all)
ManyRead = RawRead | CorruptRecordError | None  # a queue's read, its damage, or not read (bounds reached)
Limits = tuple[int, int, int]  # a many-queue read's max messages, max per queue, max bytes
# read_raw(topic, queue id, offset, max messages, tags, max bytes)
RawReadFn = Callable[[str, int, int, int, Iterable[str] | None, int], RawRead]
Early = tuple[tuple[GetStatus, int] | None, int, int]  # (status, next offset) or None; min; max


class QueueSource(Protocol):
    """A mode's queues as the read API reads them (arguments already checked, the
    offset inside the queue's bounds)."""

    def min_offset(self, topic: str, queue_id: int) -> int: ...
    def max_offset(self, topic: str, queue_id: int) -> int: ...
    def bounds(self, topic: str, queue_id: int) -> tuple[int, int]: ...
    def offset_for_timestamp(self, topic: str, queue_id: int, timestamp_ms: int) -> int: ...

    def records(
        self, topic: str, queue_id: int, offset: int, max_messages: int, tags: set[str] | None
    ) -> tuple[list[Record], int]:
        """Records from ``offset`` on (tag-filtered) and the queue offset after the last one looked at."""
        ...

    def spans(
        self, topic: str, queue_id: int, offset: int, max_messages: int, tags: set[str] | None, max_bytes: int
    ) -> tuple[list[Span], int, int]:
        """``(spans, record count, next queue offset)`` from ``offset`` on, within ``max_bytes``."""
        ...


class Reads:
    """The read API of a store (see :class:`StoreBase`) over its mode's queues."""

    def __init__(self, state: StoreState, source: QueueSource) -> None:
        self._state = state
        self.source = source

    def check_get(self, topic: str, queue_id: int, offset: int) -> Early:
        """``(None or (status, next offset) when there is nothing to read, min, max)``."""
        if not self._state.topics.has_queue(topic, queue_id):
            return (GetStatus.NO_QUEUE, 0), 0, 0
        lo, hi = self.source.bounds(topic, queue_id)
        return nothing_to_read(offset, lo, hi), lo, hi

    def get(self, topic: str, queue_id: int, offset: int, max_messages: int, tags: Iterable[str] | None) -> GetResult:
        """Up to ``max_messages`` records from ``offset``; arguments checked first."""
        tag_set = check_get_args(topic, queue_id, offset, max_messages, tags, 1)
        early, lo, hi = self.check_get(topic, queue_id, offset)
        if early is not None:
            return GetResult(early[0], next_offset=early[1], min_offset=lo, max_offset=hi)
        messages, next_offset = self.source.records(topic, queue_id, offset, max_messages, tag_set)
        status = GetStatus.FOUND if messages else GetStatus.NO_MATCHED_MESSAGE
        return GetResult(status, messages, next_offset, lo, hi)

    def read_raw(
        self,
        topic: str,
        queue_id: int,
        offset: int,
        max_messages: int = 32,
        tags: Iterable[str] | None = None,
        max_bytes: int = 4 * MiB,
    ) -> RawRead:
        """Like :meth:`get`, the records as stored, within ``max_bytes`` (but one)."""
        tag_set = check_get_args(topic, queue_id, offset, max_messages, tags, max_bytes)
        early, lo, hi = self.check_get(topic, queue_id, offset)
        if early is not None:
            return RawRead(early[0], next_offset=early[1], min_offset=lo, max_offset=hi)
        spans, count, next_offset = self.source.spans(topic, queue_id, offset, max_messages, tag_set, max_bytes)
        return RawRead(GetStatus.FOUND if count else GetStatus.NO_MATCHED_MESSAGE, spans, count, next_offset, lo, hi)

    def read_raw_many(self, asks: Iterable[ReadAsk], limits: Limits) -> list[ManyRead]:
        """:meth:`read_raw` of each ask in turn, within the request's ``limits``."""
        out: list[ManyRead] = []
        found = nbytes = 0
        for ask in asks:
            res, found, nbytes = read_one_of_many(self.read_raw, ask, found, nbytes, limits)
            out.append(res)
        return out


def nothing_to_read(offset: int, lo: int, hi: int) -> tuple[GetStatus, int] | None:
    """``(status, next offset)`` when a queue of bounds ``lo``..``hi`` has nothing to read
    at ``offset`` (below its start, at or past its end), else None."""
    if offset < lo:
        return GetStatus.OFFSET_TOO_SMALL, lo
    if offset >= hi:
        return GetStatus.NO_MESSAGE if offset == hi else GetStatus.OFFSET_OVERFLOW, min(offset, hi)
    return None


def read_raw_to_damage(
    read_raw: RawReadFn, topic: str, queue_id: int, offset: int, limit: int, tags: Iterable[str] | None, max_bytes: int
) -> RawRead | CorruptRecordError:
    """``read_raw``'s answer, or the error of a damaged record at ``offset``. A read that
    meets a damaged record further on is retried with half the limit until it stops
    before it, so that the records before the damage are still served."""
    while True:
        try:
            return read_raw(topic, queue_id, offset, limit, tags, max_bytes)
        except CorruptRecordError as e:
            if limit <= 1:
                return e
            limit //= 2


def read_one_of_many(
    read_raw: RawReadFn, ask: ReadAsk, found: int, nbytes: int, limits: Limits
) -> tuple[ManyRead, int, int]:
    """One step of a many-queue read: the ask's read after ``found`` records of
    ``nbytes``, and the counts after it."""
    max_messages, max_per_queue, max_bytes = limits
    topic, queue_id, offset, tags = ask
    if found >= max_messages or nbytes >= max_bytes:
        return None, found, nbytes
    limit = min(max_per_queue, max_messages - found)
    res = read_raw_to_damage(read_raw, topic, queue_id, offset, limit, tags, max_bytes - nbytes)
    if not isinstance(res, RawRead):
        return res, found, nbytes
    if nbytes and nbytes + res.nbytes > max_bytes:  # its first record alone is past the bound: next time
        return None, found, max_bytes
    return res, found + res.count, nbytes + res.nbytes


def check_get_args(
    topic: object, queue_id: object, offset: object, max_messages: object, tags: object, max_bytes: object
) -> set[str] | None:
    """The tag set of a read, once every argument has its type and range; else
    :class:`InvalidInputError` naming the argument (a caller's bug, not an answer)."""
    if type(topic) is not str:
        raise InvalidInputError(f"read: 'topic' must be a str, got {type(topic).__name__}")
    for name, value, least in (
        ("queue_id", queue_id, None),
        ("offset", offset, None),
        ("max_messages", max_messages, 1),
        ("max_bytes", max_bytes, 1),
    ):
        if type(value) is not int or (least is not None and value < least):
            want = "an int" if least is None else f"an int >= {least}"
            raise InvalidInputError(f"read: {name!r} must be {want}, got {value!r:.40}")
    if tags is None:
        return None
    if isinstance(tags, (str, bytes)) or not isinstance(tags, Iterable):  # a string would be its letters
        raise InvalidInputError(f"read: 'tags' must be None or an iterable of str, got {tags!r:.40}")
    tag_set = set(tags)
    if not all(type(t) is str for t in tag_set):
        raise InvalidInputError(f"read: 'tags' must hold only str, got {sorted(map(repr, tag_set))[:3]}")
    return tag_set

"""Typed rows of the requests and answers that carry many queues at once
(PULL_MESSAGES), and the statuses a queue's read can have.

On the wire a row is a msgpack list (compact: a fetch of 10,000 queues carries 10,000
of them); in code it is a named tuple with typed fields. ``from_wire`` checks every
field's type and raises :class:`RowError` (a MALFORMED_REQUEST for a server) naming
the row and the field; ``to_wire`` gives the list back.
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple

from clmq.common import InvalidInputError

from ._codes import MAX_I64, MAX_QUEUE_ID


class RowError(InvalidInputError):
    """A row of a request or an answer that does not have the documented shape."""


class PullStatus(str, enum.Enum):
    """What reading one queue found (``PULL_MESSAGE``'s ``status``, a fetch row's first field)."""

    FOUND = "FOUND"
    NO_MATCHED_MESSAGE = "NO_MATCHED_MESSAGE"  # entries scanned, all filtered out by tag
    NO_MESSAGE = "NO_MESSAGE"  # offset == max: nothing new yet
    OFFSET_OVERFLOW = "OFFSET_OVERFLOW"  # offset > max
    OFFSET_TOO_SMALL = "OFFSET_TOO_SMALL"  # below min: those messages fell out of retention
    NO_QUEUE = "NO_QUEUE"  # no such topic or queue id on this broker
    SKIPPED = "SKIPPED"  # fetch only: not read this time (the request's limits were reached)
    # Fetch only: the record at ``next_offset`` is damaged (it does not match its queue
    # entry, or its CRC); the row's ``error`` names the file, offset and check. The
    # queue does not move past it; other queues of the request are served as usual.
    CORRUPT = "CORRUPT"


class FetchAsk(NamedTuple):
    """One queue of a PULL_MESSAGES request: read from ``offset``, only ``tags`` if given."""

    topic: str
    queue_id: int
    offset: int
    tags: list[str] | None

    @classmethod
    def from_wire(cls, row: Any) -> FetchAsk:
        # The usual case in one test (a broker parses an ask per queue per fetch: 1,024
        # of them in a sparse consumer's); the checks below find the words for the rest.
        if type(row) is list and len(row) == 4:
            topic, queue_id, offset, tags = row
            if (
                type(topic) is str
                and type(queue_id) is int
                and type(offset) is int
                and tags is None
                and 0 <= queue_id <= MAX_QUEUE_ID
                and 0 <= offset <= MAX_I64
            ):
                return tuple.__new__(cls, (topic, queue_id, offset, None))
        if not (isinstance(row, list) and len(row) == 4):
            raise RowError(f"a fetch ask must be [topic, queue_id, offset, tags or nil], got {row!r:.80}")
        topic, queue_id, offset, tags = row
        _check(isinstance(topic, str), "topic", "a string", topic)
        _check(
            _is_int(queue_id) and 0 <= queue_id <= MAX_QUEUE_ID,
            "queue_id",
            f"an integer in 0..{MAX_QUEUE_ID}",
            queue_id,
        )
        _check(_is_int(offset) and 0 <= offset <= MAX_I64, "offset", f"an integer in 0..{MAX_I64}", offset)
        _check(
            tags is None or (isinstance(tags, list) and all(isinstance(t, str) for t in tags)),
            "tags",
            "nil or a list of strings",
            tags,
        )
        return cls(topic, queue_id, offset, tags)

    @staticmethod
    def row(topic: str, queue_id: int, offset: int, tags: list[str] | None) -> list[Any]:
        """The wire row of an ask, built without the tuple (a fetch asks for up to thousands)."""
        return [topic, queue_id, offset, tags]

    def to_wire(self) -> list[Any]:
        return self.row(*self)


class FetchResult(NamedTuple):
    """One queue's part of a PULL_MESSAGES answer, in the order asked. ``nbytes`` of the
    answer's body are this queue's records; ``max_offset`` is the queue's high
    watermark (-1 when SKIPPED: not looked at). ``message_count`` is the wire's
    ``count``: a field named ``count`` would shadow ``tuple.count``. ``error`` is the
    broker's description of the damage of a CORRUPT row ("" otherwise); on the wire it
    is a sixth cell, present only when not empty."""

    status: PullStatus
    next_offset: int
    message_count: int
    nbytes: int
    max_offset: int
    error: str = ""

    @classmethod
    def skipped(cls, offset: int) -> FetchResult:
        return cls(PullStatus.SKIPPED, offset, 0, 0, -1)

    @staticmethod
    def row(
        status: PullStatus, next_offset: int, message_count: int, nbytes: int, max_offset: int, error: str = ""
    ) -> list[Any]:
        """The wire row of a result, built without the tuple: a broker answers for up to
        thousands of queues per fetch, and the tuple would triple the cost of each."""
        if error:
            return [status.value, next_offset, message_count, nbytes, max_offset, error]
        return [status.value, next_offset, message_count, nbytes, max_offset]

    @classmethod
    def from_wire(cls, row: Any) -> FetchResult:
        """The typed result of a wire row; :class:`RowError` naming the field if malformed."""
        # The usual case in one test (a client decodes a row per queue per fetch); the
        # slow path below only finds the words for what is wrong.
        if type(row) is list and len(row) == 5:
            status, nxt, count, nbytes, hwm = row
            parsed = _STATUS_BY_WIRE.get(status) if type(status) is str else None
            ints = type(nxt) is int and type(count) is int and type(nbytes) is int and type(hwm) is int
            if parsed is not None and ints and count >= 0 and nbytes >= 0:
                return tuple.__new__(cls, (parsed, nxt, count, nbytes, hwm, ""))
        return cls._refuse(row)

    @classmethod
    def _refuse(cls, row: Any) -> FetchResult:
        if not (isinstance(row, list) and len(row) in (5, 6)):
            raise RowError(
                f"a fetch result must be [status, next_offset, count, bytes, max_offset, error if any], got {row!r:.80}"
            )
        status, next_offset, count, nbytes, max_offset = row[:5]
        error = row[5] if len(row) == 6 else ""
        _check(isinstance(error, str), "error", "a string", error)
        try:
            parsed = PullStatus(status)
        except ValueError:
            raise RowError(f"fetch result: unknown status {status!r}") from None
        for name, value in (
            ("next_offset", next_offset),
            ("count", count),
            ("bytes", nbytes),
            ("max_offset", max_offset),
        ):
            _check(_is_int(value), name, "an integer", value)
        _check(count >= 0 and nbytes >= 0, "count and bytes", "not negative", (count, nbytes))
        return cls(parsed, next_offset, count, nbytes, max_offset, error)

    def to_wire(self) -> list[Any]:
        return self.row(*self)


_STATUS_BY_WIRE = {s.value: s for s in PullStatus}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(ok: bool, field: str, want: str, got: object) -> None:
    if not ok:
        raise RowError(f"field {field!r} must be {want}, got {got!r:.80}")

"""What the store's put and get return: results with a status, not exceptions."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from clmq.commitlog import AppendResult, AppendStatus
from clmq.common import Record


class PutStatus(enum.Enum):
    OK = "ok"
    FLUSH_DISK_TIMEOUT = "flush disk timeout"  # written, not yet known durable
    MESSAGE_TOO_LARGE = "message too large"
    INVALID_MESSAGE = "invalid message"
    INVALID_TOPIC = "invalid topic"
    UNKNOWN_TOPIC = "unknown topic"
    INVALID_QUEUE_ID = "invalid queue id"
    MALFORMED_BATCH = "malformed batch"  # packed messages that do not decode
    DISK_FULL = "disk full"
    IO_ERROR = "i/o error"
    STORE_CLOSED = "store closed"
    STORE_FAILED = "store failed"  # a background thread failed; reopen the store (restart)


_FROM_APPEND = {
    AppendStatus.OK: PutStatus.OK,
    AppendStatus.MESSAGE_TOO_LARGE: PutStatus.MESSAGE_TOO_LARGE,
    AppendStatus.INVALID_MESSAGE: PutStatus.INVALID_MESSAGE,
    AppendStatus.DISK_FULL: PutStatus.DISK_FULL,
    AppendStatus.IO_ERROR: PutStatus.IO_ERROR,
    AppendStatus.OFFSET_MISMATCH: PutStatus.IO_ERROR,
    AppendStatus.INVALID_QUEUE_ID: PutStatus.INVALID_QUEUE_ID,
    AppendStatus.MALFORMED_BATCH: PutStatus.MALFORMED_BATCH,
    AppendStatus.STORE_FAILED: PutStatus.STORE_FAILED,
}


@dataclass(slots=True)
class PutResult:
    """Outcome of a put. Unless ``status`` is OK or FLUSH_DISK_TIMEOUT nothing was written."""

    status: PutStatus
    error: str = ""
    queue_offsets: list[int] = field(default_factory=list)
    commitlog_offsets: list[int] = field(default_factory=list)
    end_offset: int = 0
    store_timestamp_ms: int = 0
    batch_sizes: list[int] = field(default_factory=list)  # put_packed: messages per batch

    @property
    def ok(self) -> bool:
        return self.status is PutStatus.OK

    @classmethod
    def from_append(cls, r: AppendResult) -> PutResult:
        return cls(
            _FROM_APPEND[r.status],
            r.error,
            r.queue_offsets,
            r.commitlog_offsets,
            r.end_offset,
            r.store_timestamp_ms,
            r.batch_sizes,
        )

    def split(self) -> list[PutResult]:
        """One result per batch of a successful ``put_packed``, in order."""
        out, at = [], 0
        for n in self.batch_sizes:
            out.append(
                PutResult(
                    self.status,
                    self.error,
                    self.queue_offsets[at : at + n],
                    self.commitlog_offsets[at : at + n],
                    self.end_offset,
                    self.store_timestamp_ms,
                    [n],
                )
            )
            at += n
        return out


class GetStatus(enum.Enum):
    FOUND = "found"
    NO_MATCHED_MESSAGE = "no matched message"  # entries scanned, all filtered out by tag
    NO_MESSAGE = "no message"  # offset == max: nothing new yet
    OFFSET_OVERFLOW = "offset overflow"  # offset > max
    OFFSET_TOO_SMALL = "offset too small"  # below min: the messages fell out
    NO_QUEUE = "no such queue"


@dataclass(slots=True)
class GetResult:
    status: GetStatus
    messages: list[Record] = field(default_factory=list)
    next_offset: int = 0  # where the next get should start
    min_offset: int = 0
    max_offset: int = 0


@dataclass(slots=True)
class Span:
    """Bytes of stored records: ``length`` bytes at ``position`` of file ``path`` (so a
    server can send them with ``sendfile``), or, when ``data`` is set, those bytes."""

    path: str | None
    position: int
    length: int
    data: bytes | None = None


@dataclass(slots=True)
class RawRead:
    """What :meth:`StoreBase.read_raw` returns: records as stored, not decoded."""

    status: GetStatus
    spans: list[Span] = field(default_factory=list)
    count: int = 0
    next_offset: int = 0
    min_offset: int = 0
    max_offset: int = 0

    @property
    def nbytes(self) -> int:
        return sum(s.length for s in self.spans)

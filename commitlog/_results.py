"""What an append answers, and the clock it stamps records with."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field


class AppendStatus(enum.Enum):
    """Why an append did (OK) or did not write anything."""

    OK = "ok"
    MESSAGE_TOO_LARGE = "message too large"
    INVALID_MESSAGE = "invalid message"
    DISK_FULL = "disk full"
    IO_ERROR = "i/o error"
    OFFSET_MISMATCH = "offset mismatch"  # raw appends that do not continue the log
    INVALID_QUEUE_ID = "invalid queue id"  # packed appends: a queue id the topic lacks
    MALFORMED_BATCH = "malformed batch"  # packed appends: bytes that do not decode
    STORE_FAILED = "store failed"  # durability was lost (fsync error): no more writes


# EncodeError.kind -> the status reported for it.
ENCODE_STATUS = {
    "too_large": AppendStatus.MESSAGE_TOO_LARGE,
    "invalid": AppendStatus.INVALID_MESSAGE,
    "queue": AppendStatus.INVALID_QUEUE_ID,
    "malformed": AppendStatus.MALFORMED_BATCH,
}


@dataclass(slots=True)
class AppendResult:
    """The outcome of one append. ``status`` other than OK means nothing was written."""

    status: AppendStatus
    error: str = ""
    start_offset: int = 0
    end_offset: int = 0
    store_timestamp_ms: int = 0
    queue_offsets: list[int] = field(default_factory=list)
    commitlog_offsets: list[int] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)  # messages per input batch

    @property
    def ok(self) -> bool:
        """True when the append was written."""
        return self.status is AppendStatus.OK


def now_ms() -> int:
    """Wall-clock time in milliseconds (the store timestamp of records)."""
    return time.time_ns() // 1_000_000

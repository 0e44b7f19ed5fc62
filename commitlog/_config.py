"""Settings of the CommitLog. Every limit carries its unit in its name."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from clmq.common import BLANK_SIZE, HEADER_SIZE, NO_HOST, ConfigError, GiB, Host, MiB


class FlushMode(str, enum.Enum):
    """When appended bytes are fsynced."""

    ASYNC = "async"  # by interval and by dirty bytes; an ack means "written"
    SYNC = "sync"  # group commit; an ack means "fsynced"


@dataclass(frozen=True)
class CommitLogConfig:
    segment_bytes: int = GiB
    max_message_bytes: int = 4 * MiB
    flush_mode: FlushMode = FlushMode.ASYNC
    flush_interval_ms: int = 500
    flush_dirty_bytes: int = 16 * MiB
    sync_flush_timeout_ms: int = 5000
    boundary_interval_bytes: int = 4 * MiB
    retention_ms: int | None = 72 * 3600 * 1000
    retention_bytes: int | None = None
    store_host: Host = NO_HOST

    def __post_init__(self) -> None:
        object.__setattr__(self, "flush_mode", FlushMode(self.flush_mode))
        if self.segment_bytes > 0xFFFF_FFFF:
            raise ConfigError(f"segment_bytes={self.segment_bytes} exceeds 4 GiB (positions are u32)")
        if self.max_message_bytes < HEADER_SIZE:
            raise ConfigError(f"max_message_bytes={self.max_message_bytes} is below the {HEADER_SIZE}-byte header")
        if self.max_message_bytes + BLANK_SIZE > self.segment_bytes:
            raise ConfigError(
                f"max_message_bytes={self.max_message_bytes} does not fit a segment of "
                f"segment_bytes={self.segment_bytes} (a record never crosses segments)"
            )
        if self.boundary_interval_bytes <= 0 or self.flush_interval_ms <= 0:
            raise ConfigError("boundary_interval_bytes and flush_interval_ms must be positive")

    @property
    def acks_wait_for_fsync(self) -> bool:
        """Does a put wait for fsync before it is acknowledged? Decided here only.

        The rule: yes exactly when ``flush_mode`` is SYNC. Then a put is answered once
        everything up to its end is fsynced (group commit: one fsync for every put
        waiting), or FLUSH_DISK_TIMEOUT after ``sync_flush_timeout_ms``, or
        STORE_FAILED. In ASYNC mode it is answered once written (page cache), and the
        answer says whether it happened to be durable already; the flush loop fsyncs
        every ``flush_interval_ms`` and after ``flush_dirty_bytes``.

        Everyone who acts on it asks here: the store's put (its ``wait_durable``
        default), the log's flush trigger (a put that will be waited for starts the
        group commit at once), the partition store's append (dirty bytes trigger a
        flush only when nobody waits), the broker's produce and its own appends."""
        return self.flush_mode is FlushMode.SYNC

"""The store's settings (both storage modes), and the small things every part of a store
uses while opening: the directory lock's error and the timing of open's phases."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from clmq.commitlog import CommitLogConfig
from clmq.common import ConfigError, MiB, StoreError

STORAGE_MODES = ("commitlog", "partition-per-file")


class StoreLockedError(StoreError):
    """Another process has the data directory open."""


@dataclass(frozen=True)
class StoreConfig:
    data_dir: Path
    commitlog: CommitLogConfig = field(default_factory=CommitLogConfig)
    storage_mode: str = "commitlog"  # or "partition-per-file" (Kafka's layout, for comparison)
    cq_entries_per_file: int = 300_000
    max_open_files: int = 1024
    cq_flush_interval_ms: int = 1000  # also: how often the checkpoint is written
    cq_flush_min_bytes: int = 4096  # a queue's new entries wait in memory until this many ...
    cq_full_flush_interval_ms: int = 10_000  # ... or until this long has passed (bounds memory: rate x 20 B x this)
    dispatch_chunk_bytes: int = 4 * MiB
    retention_check_interval_ms: int = 10_000
    max_scan_entries: int = 16_000  # per get, when a tag filter skips entries
    index_interval_bytes: int = 4096  # partition-per-file: one offset index entry per this many bytes
    auto_create_topics: bool = False
    default_queue_count: int = 8
    # The key index (commitlog mode; docs/operations.md "The key index").
    index_enabled: bool = True  # the dispatcher also indexes every record's keys and UNIQ_KEY
    index_hash_slots: int = 1_000_000  # hash slots per index file (4 B each; the active file's in memory)
    index_max_entries_per_file: int = 4_000_000  # entries per index file (20 B each; 4 a slot); then a new file
    # The index is fed in batches: dispatched records wait at most this long (0: every round) ...
    index_batch_interval_ms: int = 20
    index_batch_bytes: int = 1 * MiB  # ... or until this many bytes of log wait (a query never waits for it)
    # A look-up indexes what waits first; of a backlog that failed index writes left, at most this much
    # (it holds the dispatcher's rounds meanwhile): further behind, it answers at once and says how far.
    index_query_catch_up_bytes: int = 8 * MiB

    def __post_init__(self) -> None:
        object.__setattr__(self, "data_dir", Path(self.data_dir))
        if self.index_batch_interval_ms < 0 or self.index_batch_bytes < 1:
            raise ConfigError(
                f"index_batch_interval_ms must be at least 0 (got {self.index_batch_interval_ms}) and "
                f"index_batch_bytes at least 1 (got {self.index_batch_bytes})"
            )
        if self.index_query_catch_up_bytes < 1:
            raise ConfigError(f"index_query_catch_up_bytes must be at least 1 (got {self.index_query_catch_up_bytes})")
        if self.storage_mode not in STORAGE_MODES:
            raise ConfigError(f"storage_mode={self.storage_mode!r}: use one of {', '.join(STORAGE_MODES)}")


class Stopwatch:
    """Times the phases of opening a store, for the log and for benchmarks."""

    def __init__(self) -> None:
        self.stats: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.stats[name] = round(now - self._last, 4)
        self._last = now

"""The partition-per-file mode's shared state: every part of the mode (its writer,
flusher and reads, and the store) holds the same :class:`PartitionState`.

Who writes what (``lock`` is a plain ``threading.Lock``):

- ``partitions``: a partition is added under ``lock`` (or at open, before any other
  thread exists); readers look one up without it (one dict read).
- ``written`` (the *virtual offset*: bytes appended across every partition, so that
  "durable up to X" means what it means in the CommitLog mode), ``dirty`` (files
  written since the last flush) and ``new_dirs`` (directories with new files since
  then): under ``lock``; a flush swaps ``dirty`` and ``new_dirs`` out under it.
- ``flush_lock``: one flush at a time owns the durable offset (``state.durable``): it
  publishes only after every fsync of what it took has returned (a second flush waits,
  then takes the rest).
"""

from __future__ import annotations

import errno
import threading
from pathlib import Path

from clmq.commitlog import QueueKey
from clmq.consumequeue import FileCache

from ._partition_log import PartitionLoader, PartitionLog
from ._state import StoreState

DISK_FULL = (errno.ENOSPC, errno.EDQUOT)  # a full disk: the one error housekeeping retries (an append: DISK_FULL)


class PartitionState:
    """The partitions, their files and what is written but not yet fsynced."""

    __slots__ = ("dirty", "files", "flush_lock", "lock", "new_dirs", "partitions", "root", "state", "written")

    def __init__(self, state: StoreState) -> None:
        self.state = state
        self.root = state.directory / "partitions"
        self.files = FileCache(state.config.max_open_files)
        self.partitions: dict[QueueKey, PartitionLog] = {}
        self.lock = threading.Lock()
        self.written = 0  # virtual offset: bytes appended, all partitions together
        self.dirty: set[Path] = set()
        self.new_dirs: set[Path] = set()  # directories with new files since the last flush
        self.flush_lock = threading.Lock()

    def new_partition(self, key: QueueKey) -> PartitionLog:
        """The log of partition ``key`` (not loaded, not registered)."""
        config = self.state.config
        cl = config.commitlog
        return PartitionLog(
            self.root / f"{key[0]}-{key[1]}",
            key[0],
            key[1],
            cl.segment_bytes,
            config.index_interval_bytes,
            cl.max_message_bytes,
        )

    def partition(self, key: QueueKey) -> PartitionLog:
        """The partition of ``key``, created (directory and first segment) on first use;
        the caller holds ``lock``."""
        part = self.partitions.get(key)
        if part is None:
            part = self.new_partition(key)
            PartitionLoader(part, self.files, 0, unclean=False).load()
            self.new_dirs.update((part.directory, self.root))  # made durable by the next flush
            self.partitions[key] = part
        return part

"""The CommitLog mode's parts, and the one object they share.

:func:`~._log_open.open_log_parts` builds a :class:`LogParts` in recovery order (the
log, then the queues checked against it, then the dispatcher that brings them up to
the log's end); the store's reads (:class:`~._queue_reads.QueueReads`), its
housekeeping (:mod:`._housekeeping`) and the store itself then all hold the same one.

Who writes what:

- ``log``, ``queues``, ``dispatcher``, ``entries``, ``rebuild``, ``index``: set once, at open.
- ``manifest`` (the checkpointed extents of queues not loaded, carried forward until
  they are) and ``saved`` (the last checkpoint written): by a checkpoint, under the
  store's ``checkpoint_lock``.
"""

from __future__ import annotations

import logging
from typing import Sequence

from clmq.commitlog import CommitLog, QueueKey
from clmq.common import CorruptRecordError, Message, PackedMessages
from clmq.consumequeue import ConsumeQueueSet, Dispatcher, EntryReader, KeyIndex

from ._checkpoint import Checkpoint
from ._recovery import RebuildList
from ._results import PutResult
from ._state import StoreState

log = logging.getLogger("clmq.store")

REBUILD_FILE = "rebuild-queues"  # queues marked for rebuild at the next open
_NOT_MARKED = frozenset({"crc32c", "read"})  # the record or the log's read failed: rebuilding the queue would not help


class LogParts:
    """The log, its queues, the dispatcher, the checked entry reader and the rebuild
    list, with the store's :class:`StoreState` (see the module docstring for the rules)."""

    __slots__ = ("dispatcher", "entries", "index", "log", "manifest", "queues", "rebuild", "saved", "state")

    def __init__(
        self,
        state: StoreState,
        log: CommitLog,
        queues: ConsumeQueueSet,
        dispatcher: Dispatcher,
        entries: EntryReader,
        rebuild: RebuildList,
    ) -> None:
        self.state = state
        self.log = log
        self.queues = queues
        self.dispatcher = dispatcher
        self.entries = entries  # reads records through entries, checking their identity
        self.rebuild = rebuild  # queues marked for rebuild at the next open
        self.manifest: dict[QueueKey, tuple[int, int]] = {}
        self.saved: Checkpoint | None = None
        self.index: KeyIndex | None = dispatcher.index  # the key index (None: index_enabled off)

    def mark_for_rebuild(self, topic: str, queue_id: int, error: CorruptRecordError) -> None:
        """Record durably that the queue must be rebuilt from the log (at the next open)."""
        if error.check in _NOT_MARKED:
            return
        try:
            if self.rebuild.add((topic, queue_id), f"{error.check} at {error.file}:{error.offset}"):
                log.error("consume queue %s/%d marked for rebuild at the next open: %s", topic, queue_id, error)
        except OSError as e:  # the read's own error says what is wrong; this only delays the rebuild
            log.error("could not mark consume queue %s/%d for rebuild: %s", topic, queue_id, e)

    def release(self) -> None:
        """Close every file without flushing or checkpointing (as a crash would)."""
        self.entries.close()
        self.queues.files.close()
        if self.index is not None:
            self.index.close()
        self.log.abandon()


class LogAppender:
    """The CommitLog mode's :class:`~._puts.Appender`: the log's own append, packed
    batches as they are. Its encoder checks every message before it takes a queue
    offset, so a put need not check the fields first."""

    checks_fields = True

    def __init__(self, commitlog: CommitLog) -> None:
        self._log = commitlog

    def append(self, messages: Sequence[Message]) -> PutResult:
        return PutResult.from_append(self._log.append(messages))

    def append_packed(self, batches: Sequence[PackedMessages], queue_counts: Sequence[int]) -> PutResult:
        return PutResult.from_append(self._log.append_packed(batches, queue_counts))

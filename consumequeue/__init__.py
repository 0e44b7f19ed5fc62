"""clmq's ConsumeQueues: per-queue files of 20-byte entries pointing into the CommitLog.

Derived data: built asynchronously by the :class:`Dispatcher` from the log and rebuilt
from it after a crash. Plain, synchronous, typed storage code (no trio).
"""

from ._damage import AffectedQueue, affected_queues
from ._dispatch import Dispatcher, tag_hash
from ._entries import ENTRY, ENTRY_DTYPE, ENTRY_SIZE, HOLE_ENTRY, HOLE_TAG, START_TAG, Entry
from ._files import FileCache
from ._queue import ConsumeQueue
from ._set import Arrivals, ConsumeQueueSet
from ._verify import PREAD_MAX_BYTES, EntryReader, FileSpan, check_headers, check_record_identity, contiguous_runs

__all__ = [
    "ENTRY",
    "ENTRY_DTYPE",
    "ENTRY_SIZE",
    "HOLE_ENTRY",
    "HOLE_TAG",
    "PREAD_MAX_BYTES",
    "START_TAG",
    "AffectedQueue",
    "Arrivals",
    "ConsumeQueue",
    "ConsumeQueueSet",
    "Dispatcher",
    "Entry",
    "EntryReader",
    "FileCache",
    "FileSpan",
    "affected_queues",
    "check_headers",
    "check_record_identity",
    "contiguous_runs",
    "tag_hash",
]

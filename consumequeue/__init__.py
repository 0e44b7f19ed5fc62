"""clmq's ConsumeQueues: per-queue files of 20-byte entries pointing into the CommitLog.

Derived data: built asynchronously by the :class:`Dispatcher` from the log and rebuilt
from it after a crash. Plain, synchronous, typed storage code (no trio).
"""

from ._dispatch import Dispatcher, tag_hash
from ._files import FileCache
from ._queue import ENTRY, ENTRY_DTYPE, ENTRY_SIZE, ConsumeQueue, Entry
from ._set import Arrivals, ConsumeQueueSet

__all__ = [
    "ENTRY",
    "ENTRY_DTYPE",
    "ENTRY_SIZE",
    "Arrivals",
    "ConsumeQueue",
    "ConsumeQueueSet",
    "Dispatcher",
    "Entry",
    "FileCache",
    "tag_hash",
]  # fmt: skip

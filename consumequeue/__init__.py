"""clmq's ConsumeQueues: per-queue files of 20-byte entries pointing into the CommitLog.

Derived data: built asynchronously by the :class:`Dispatcher` from the log and rebuilt
from it after a crash. Plain, synchronous, typed storage code (no trio).
"""

from ._damage import AffectedQueue, affected_queues
from ._dispatch import Dispatcher, tag_hash
from ._entries import ENTRY, ENTRY_DTYPE, ENTRY_SIZE, HOLE_ENTRY, HOLE_TAG, START_TAG, Entry
from ._files import FileCache
from ._index_check import IndexProblem, check_index_dir
from ._index_file import ENTRY_SIZE as INDEX_ENTRY_SIZE
from ._index_file import HEADER_SIZE as INDEX_HEADER_SIZE
from ._index_file import INDEX_ENTRY_DTYPE, IndexFile, IndexHeader, index_file_name
from ._keyindex import INDEX_RETRY_INTERVAL_MS, Candidate, IndexSettings, KeyIndex, WalkBudget
from ._keyindex_keys import UNIQ_KEY, chunk_keys, hash_rows, key_hash, topic_seed
from ._queue import ConsumeQueue
from ._set import Arrivals, ConsumeQueueSet
from ._verify import PREAD_MAX_BYTES, EntryReader, FileSpan, check_headers, check_record_identity, contiguous_runs

__all__ = [
    "ENTRY",
    "ENTRY_DTYPE",
    "ENTRY_SIZE",
    "HOLE_ENTRY",
    "HOLE_TAG",
    "INDEX_ENTRY_DTYPE",
    "INDEX_ENTRY_SIZE",
    "INDEX_HEADER_SIZE",
    "INDEX_RETRY_INTERVAL_MS",
    "PREAD_MAX_BYTES",
    "START_TAG",
    "UNIQ_KEY",
    "AffectedQueue",
    "Arrivals",
    "Candidate",
    "ConsumeQueue",
    "ConsumeQueueSet",
    "Dispatcher",
    "Entry",
    "EntryReader",
    "FileCache",
    "FileSpan",
    "IndexFile",
    "IndexHeader",
    "IndexProblem",
    "IndexSettings",
    "KeyIndex",
    "WalkBudget",
    "affected_queues",
    "check_headers",
    "check_index_dir",
    "check_record_identity",
    "chunk_keys",
    "contiguous_runs",
    "hash_rows",
    "index_file_name",
    "key_hash",
    "tag_hash",
    "topic_seed",
]

"""clmq's ConsumeQueues: per-queue files of 20-byte entries pointing into the CommitLog.

Derived data: built asynchronously by the :class:`Dispatcher` from the log and rebuilt
from it after a crash. Plain, synchronous, typed storage code (no trio).
"""

from ._damage import AffectedQueue, affected_queues
from ._dispatch import Dispatcher, tag_hash
from ._files import FileCache
from ._queue import ENTRY, ENTRY_DTYPE, ENTRY_SIZE, HOLE_ENTRY, HOLE_TAG, START_TAG, ConsumeQueue, Entry
from ._set import Arrivals, ConsumeQueueSet
from ._system import (
    DLQ_PREFIX,
    PROP_CANCEL_OF,
    PROP_DELIVER_AT,
    PROP_DLQ_BODY_OF,
    PROP_DLQ_GROUP,
    PROP_ORIGIN_ADDR,
    PROP_ORIGIN_MSG_ID,
    PROP_ORIGIN_OFFSET,
    PROP_ORIGIN_QID,
    PROP_ORIGIN_TOPIC,
    PROP_REAL_QID,
    PROP_REAL_TAGS,
    PROP_REAL_TOPIC,
    PROP_TIMER_SRC,
    RETRY_PREFIX,
    SYSTEM_PREFIX,
    TIMER_TOPIC,
    dlq_topic,
    is_system_topic,
    retry_topic,
    timer_tag,
    timer_tag_code,
)
from ._verify import PREAD_MAX_BYTES, EntryReader, FileSpan, check_headers, check_record_identity, contiguous_runs

__all__ = [
    "DLQ_PREFIX",
    "ENTRY",
    "ENTRY_DTYPE",
    "ENTRY_SIZE",
    "HOLE_ENTRY",
    "HOLE_TAG",
    "PREAD_MAX_BYTES",
    "PROP_CANCEL_OF",
    "PROP_DELIVER_AT",
    "PROP_DLQ_BODY_OF",
    "PROP_DLQ_GROUP",
    "PROP_ORIGIN_ADDR",
    "PROP_ORIGIN_MSG_ID",
    "PROP_ORIGIN_OFFSET",
    "PROP_ORIGIN_QID",
    "PROP_ORIGIN_TOPIC",
    "PROP_REAL_QID",
    "PROP_REAL_TAGS",
    "PROP_REAL_TOPIC",
    "PROP_TIMER_SRC",
    "RETRY_PREFIX",
    "START_TAG",
    "SYSTEM_PREFIX",
    "TIMER_TOPIC",
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
    "dlq_topic",
    "is_system_topic",
    "retry_topic",
    "tag_hash",
    "timer_tag",
    "timer_tag_code",
]  # fmt: skip

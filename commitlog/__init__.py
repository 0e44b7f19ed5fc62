"""clmq's CommitLog: one sequential, segmented log holding every message of every queue.

Plain, synchronous, typed storage code (no trio, msgpack, kazoo or pyspark). The
public surface is re-exported here; the modules behind it are private.
"""

from typing import TYPE_CHECKING

from clmq.common import lazy_exports

from ._config import CommitLogConfig, FlushMode
from ._durability import DurableOffset
from ._durable_file import (
    LoadedJson,
    MetadataSource,
    delete_json,
    load_json,
    previous_path,
    read_json,
    write_atomic,
    write_json,
    write_json_body,
)
from ._encoder import BatchEncoder, EncodeError, encode_message
from ._pagecache import pages_missing, read_exactly
from ._progress import ProgressSink, report_progress, set_progress_sink
from ._segment import fsync_dir, read_boundary_index
from ._timings import FSYNC_BUCKETS_S, Timings

if TYPE_CHECKING:
    from ._check import LogLayout, LogProblem, LogReport, QueueRange, check_log, merge_ranges, queue_extents, repair_log
    from ._log import AppendResult, AppendStatus, CommitLog, QueueKey, ScanResult, now_ms
    from ._raw import whole_prefix

# The log itself, its check and its raw appends walk records in columns (numpy, about 70
# ms to import): imported when first used, so that the wire protocol and the clients,
# which take only the metadata files and page-cache reads from here, start without it.
_LAZY = dict.fromkeys(
    ("LogLayout", "LogProblem", "LogReport", "QueueRange", "check_log", "merge_ranges", "queue_extents", "repair_log"),
    "_check",
)
_LAZY |= dict.fromkeys(("AppendResult", "AppendStatus", "CommitLog", "QueueKey", "ScanResult", "now_ms"), "_log")
_LAZY["whole_prefix"] = "_raw"

__getattr__ = lazy_exports(__name__, _LAZY, globals())


__all__ = [
    "FSYNC_BUCKETS_S",
    "AppendResult",
    "AppendStatus",
    "BatchEncoder",
    "CommitLog",
    "CommitLogConfig",
    "DurableOffset",
    "EncodeError",
    "FlushMode",
    "LoadedJson",
    "LogLayout",
    "LogProblem",
    "LogReport",
    "MetadataSource",
    "ProgressSink",
    "QueueKey",
    "QueueRange",
    "ScanResult",
    "Timings",
    "check_log",
    "delete_json",
    "encode_message",
    "fsync_dir",
    "load_json",
    "merge_ranges",
    "now_ms",
    "pages_missing",
    "previous_path",
    "queue_extents",
    "read_boundary_index",
    "read_exactly",
    "read_json",
    "repair_log",
    "report_progress",
    "set_progress_sink",
    "whole_prefix",
    "write_atomic",
    "write_json",
    "write_json_body",
]

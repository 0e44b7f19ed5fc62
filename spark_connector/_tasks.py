"""What planning and the tasks of both readers (batch and streaming) share: the user
schema's check, the sources of a plan, and reading one split on an executor."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Iterator

import pyarrow as pa
from pyspark.sql.datasource import InputPartition
from pyspark.sql.types import StructType

from ._arrow import ALL_COLUMNS, arrow_schema
from ._layout import LogLayout, SegmentInfo, local_layout
from ._local import LocalStore, SegmentGoneError
from ._options import OptionError, ReadOptions
from ._plan import DataLossError, QueueSource, ScanSplit, Split
from ._scan import ByteSource, Damage, Emitter, Filter, ReadSpec, read_index_split, read_scan_split, report_damage

log = logging.getLogger("clmq.spark")

CHUNK_BYTES = 4 << 20  # bytes read (and walked) at once by a scan task

_SIMPLE = {
    "STRING": "string",
    "INT": "int",
    "BIGINT": "bigint",
    "BINARY": "binary",
    "TIMESTAMP": "timestamp",
    "MAP<STRING, STRING>": "map<string,string>",
}


def check_schema(schema: StructType) -> list[str]:
    """The columns a (possibly narrower) user schema asks for, checked against clmq's."""
    names = []
    for f in schema.fields:
        if f.name not in ALL_COLUMNS:
            raise OptionError(f"schema column {f.name!r} is not a clmq column; columns: {', '.join(ALL_COLUMNS)}")
        want = _SIMPLE[ALL_COLUMNS[f.name][0]]
        if f.dataType.simpleString() != want:
            raise OptionError(f"schema column {f.name!r} must be {want}, not {f.dataType.simpleString()}")
        names.append(f.name)
    return names


def open_sources(opts: ReadOptions) -> list[QueueSource]:
    """One source per store: the data directory, or every broker found."""
    if not opts.network:
        assert opts.path is not None
        return [LocalStore(opts.path)]
    from ._wire import RemoteStore, find_brokers

    return [RemoteStore(addr, opts.timeout_ms, security=opts.security) for addr in find_brokers(opts)]


def task_source(split: Split, timeout_ms: int, security: tuple[tuple[str, str], ...] = ()) -> ByteSource:
    """The byte source a task reads its split from (opened on the executor; ``security``:
    :attr:`ReadOptions.security`)."""
    if split.network:
        from ._wire import RemoteStore

        return RemoteStore(split.source, timeout_ms, fetch_layout=False, security=security)
    if isinstance(split, ScanSplit):
        seg = SegmentInfo(split.seg_base, split.data_end, ())
        return LocalStore(split.source, LogLayout(split.source, split.seg_base, split.data_end, (seg,)))
    return LocalStore(split.source, replace(local_layout(split.source), end_offset=split.end_offset))


def read_split(
    split: Split | None,
    spec: ReadSpec,
    columns: list[str],
    timeout_ms: int,
    security: tuple[tuple[str, str], ...] = (),
) -> Iterator[pa.RecordBatch]:
    """The Arrow batches of one split."""
    if split is None:  # a plan of no splits: Spark runs one task with an empty partition
        return
    src = task_source(split, timeout_ms, security)
    damage = Damage()
    emitter = Emitter(spec, Filter(spec.selection, split.source), arrow_schema(columns), damage)
    try:
        if isinstance(split, ScanSplit):
            yield from read_scan_split(split, src, emitter, CHUNK_BYTES)
        else:
            yield from read_index_split(split, src, emitter)
    except SegmentGoneError as e:
        if spec.fail_on_data_loss:
            raise DataLossError(f"{e} (option failOnDataLoss=false reads what is left)") from None
        log.warning("%s; this task's records there are left out (failOnDataLoss=false)", e)
    finally:
        src.close()
    report_damage(spec, damage, split)


class ClmqPartition(InputPartition):
    def __init__(self, split: Split) -> None:
        super().__init__(split)


def read_spec(opts: ReadOptions, selection: Any) -> ReadSpec:
    return ReadSpec(
        selection,
        opts.on_corrupt,
        opts.max_batch_rows,
        opts.max_batch_bytes,
        opts.corrupt_records_log,
        opts.fail_on_data_loss,
        opts.check_crc,
    )

"""The PySpark data source ``clmq``: batch and streaming readers over CommitLog ranges.

Planning (``reader()``/``streamReader()``, in a Python worker) resolves the snapshot
and cuts it into splits; ``read()`` runs on executors, one split per task, and yields
Arrow record batches. Everything a task needs travels inside its partition.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Iterator, Sequence

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.types import StructType

from ._arrow import COLUMNS, SCHEMA_DDL, arrow_schema
from ._layout import LogLayout, SegmentInfo, local_layout
from ._local import LocalStore
from ._options import OptionError, ReadOptions, parse_options
from ._plan import QueueSource, ScanSplit, Split, plan
from ._scan import ByteSource, Damage, Emitter, Filter, ReadSpec, read_index_split, read_scan_split, report_damage

CHUNK_BYTES = 4 << 20  # bytes read (and walked) at once by a scan task

_SIMPLE = {"STRING": "string", "INT": "int", "BIGINT": "bigint", "BINARY": "binary", "TIMESTAMP": "timestamp",
           "MAP<STRING, STRING>": "map<string,string>"}  # fmt: skip


def check_schema(schema: StructType) -> list[str]:
    """The columns a (possibly narrower) user schema asks for, checked against clmq's."""
    names = []
    for f in schema.fields:
        if f.name not in COLUMNS:
            raise OptionError(f"schema column {f.name!r} is not a clmq column; columns: {', '.join(COLUMNS)}")
        want = _SIMPLE[COLUMNS[f.name][0]]
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

    return [RemoteStore(addr, opts.timeout_ms) for addr in find_brokers(opts)]


def task_source(split: Split, timeout_ms: int) -> ByteSource:
    """The byte source a task reads its split from (opened on the executor)."""
    if split.network:
        from ._wire import RemoteStore

        return RemoteStore(split.source, timeout_ms, fetch_layout=False)
    if isinstance(split, ScanSplit):
        seg = SegmentInfo(split.seg_base, split.data_end, ())
        return LocalStore(split.source, LogLayout(split.source, split.seg_base, split.data_end, (seg,)))
    return LocalStore(split.source, replace(local_layout(split.source), end_offset=split.end_offset))


def read_split(split: Split, spec: ReadSpec, columns: list[str], timeout_ms: int) -> Iterator[pa.RecordBatch]:
    src = task_source(split, timeout_ms)
    damage = Damage()
    emitter = Emitter(spec, Filter(spec.selection, split.source), arrow_schema(columns), damage)
    try:
        if isinstance(split, ScanSplit):
            yield from read_scan_split(split, src, emitter, CHUNK_BYTES)
        else:
            yield from read_index_split(split, src, emitter)
    finally:
        src.close()
    report_damage(spec, damage, split)


class ClmqPartition(InputPartition):
    def __init__(self, split: Split) -> None:
        super().__init__(split)


class ClmqReader(DataSourceReader):
    """Batch reads: the snapshot is resolved here, once, when the query is planned."""

    def __init__(self, options: dict[str, str], schema: StructType) -> None:
        self.opts = parse_options(options)
        self.columns = check_schema(schema)
        sources = open_sources(self.opts)
        try:
            selection, self.splits = plan(self.opts, sources, self.opts.network)
        finally:
            for s in sources:
                s.close()
        self.spec = _spec(self.opts, selection)

    def partitions(self) -> Sequence[InputPartition]:
        return [ClmqPartition(s) for s in self.splits]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        yield from read_split(partition.value, self.spec, self.columns, self.opts.timeout_ms)


def _spec(opts: ReadOptions, selection: Any) -> ReadSpec:
    return ReadSpec(selection, opts.on_corrupt, opts.max_batch_rows, opts.max_batch_bytes, opts.corrupt_records_log)


class ClmqDataSource(DataSource):
    """``spark.read.format("clmq")``: see docs/spark.md for the options."""

    @classmethod
    def name(cls) -> str:
        return "clmq"

    def schema(self) -> str:
        return SCHEMA_DDL

    def reader(self, schema: StructType) -> DataSourceReader:
        return ClmqReader(dict(self.options), schema)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        from ._stream import ClmqStreamReader

        return ClmqStreamReader(dict(self.options), schema)


def register(spark: Any) -> None:
    """Make ``format("clmq")`` available in ``spark`` (a SparkSession)."""
    spark.dataSource.register(ClmqDataSource)


__all__ = ["ClmqDataSource", "ClmqReader", "register", "read_split", "open_sources"]

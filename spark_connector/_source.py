"""The PySpark data source ``clmq``: batch and streaming readers over CommitLog ranges.

Planning (``reader()``/``streamReader()``, in a Python worker) resolves the snapshot
and cuts it into splits; ``read()`` runs on executors, one split per task, and yields
Arrow record batches. Everything a task needs travels inside its partition.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    DataSourceWriter,
    InputPartition,
)
from pyspark.sql.types import StructType

from ._arrow import SCHEMA_DDL
from ._options import parse_options
from ._plan import plan
from ._stream import ClmqStreamReader
from ._tasks import ClmqPartition, check_schema, open_sources, read_spec, read_split


class ClmqReader(DataSourceReader):
    """Batch reads: the snapshot is resolved here, once, when the query is planned."""

    def __init__(self, options: dict[str, str], schema: StructType) -> None:
        self.opts = parse_options(options)
        self.columns = check_schema(schema)
        sources = open_sources(self.opts)
        try:
            self.plan = plan(self.opts, sources, self.opts.network)
        finally:
            for s in sources:
                s.close()
        self.splits = self.plan.splits
        self.spec = read_spec(self.opts, self.plan.selection)

    def partitions(self) -> Sequence[InputPartition]:
        return [ClmqPartition(s) for s in self.splits]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        yield from read_split(partition.value, self.spec, self.columns, self.opts.timeout_ms, self.opts.security)


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
        return ClmqStreamReader(dict(self.options), schema)

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        from ._sink import ClmqWriter  # the sink: df.write.format("clmq")

        return ClmqWriter(dict(self.options), schema, overwrite)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        from ._sink import ClmqStreamWriter  # the sink: df.writeStream.format("clmq")

        return ClmqStreamWriter(dict(self.options), schema, overwrite)


def explain(options: dict[str, str]) -> str:
    """What a read with these options would do, without Spark: per store, the read path
    chosen and why, the number of tasks and their size, and any option clamped."""
    opts = parse_options(options)
    sources = open_sources(opts)
    try:
        return plan(opts, sources, opts.network).describe()
    finally:
        for s in sources:
            s.close()


def register(spark: Any) -> None:
    """Make ``format("clmq")`` available in ``spark`` (a SparkSession)."""
    spark.dataSource.register(ClmqDataSource)


__all__ = ["ClmqDataSource", "ClmqReader", "explain", "register"]

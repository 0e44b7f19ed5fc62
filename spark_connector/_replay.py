"""A measuring instrument for ``clmq bench spark``: the same rows as the clmq source,
already parsed into Arrow files, replayed by a Python data source that does nothing but
hand them to Spark. Its speed is the ceiling of any Python data source on this machine
(the Python worker's Arrow transfer and Spark's ingestion of it), against which the
clmq source's own parsing cost can be told apart."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator, Sequence

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.types import StructType

from ._arrow import SCHEMA_DDL, arrow_schema
from ._source import ClmqReader

FORMAT = "clmq_arrow_replay"


def write_replay_files(store: str, directory: str) -> int:
    """Parse the store with the clmq reader's own code (in this process) into one Arrow
    IPC file per split of its default plan; returns the rows written."""
    schema = StructType.fromDDL(SCHEMA_DDL)
    assert isinstance(schema, StructType)  # fromDDL is typed DataType; a column list parses to a StructType
    reader = ClmqReader({"path": store}, schema)
    Path(directory).mkdir(parents=True, exist_ok=True)
    rows = 0
    for i, part in enumerate(reader.partitions()):
        path = os.path.join(directory, f"split-{i:05d}.arrow")
        with pa.OSFile(path, "wb") as f, pa.ipc.new_stream(f, arrow_schema(reader.columns)) as out:
            for batch in reader.read(part):
                out.write_batch(batch)
                rows += batch.num_rows
    return rows


class _ReplayReader(DataSourceReader):
    def __init__(self, path: str) -> None:
        self.files = sorted(str(p) for p in Path(path).glob("*.arrow"))

    def partitions(self) -> Sequence[InputPartition]:
        return [InputPartition(f) for f in self.files]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        with pa.memory_map(partition.value) as source:
            yield from pa.ipc.open_stream(source)


class ArrowReplaySource(DataSource):
    """``spark.read.format("clmq_arrow_replay").load(dir)``: replays ``write_replay_files``."""

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> str:
        return SCHEMA_DDL

    def reader(self, schema: StructType) -> DataSourceReader:
        return _ReplayReader(str(self.options["path"]))


def register_replay(spark: Any) -> None:
    spark.dataSource.register(ArrowReplaySource)

"""Structured Streaming: follow a store (or live brokers) by commit-log position.

An offset is ``{source: position}``, one commit-log position per store (the data
directory, or each broker's address). A micro-batch ``(start, end]`` reads, per source,
the records that *start* in ``[start, end)``: the same ownership rule as batch splits,
so a position may fall mid-record and no record is read twice or skipped. Per-trigger
limits (``maxBytesPerTrigger``, ``maxRowsPerTrigger``, or Spark's read limits) move the
end forward by at most that much; with ``Trigger.AvailableNow`` the end stops at the
snapshot taken when the query started.
"""

from __future__ import annotations

import logging
from typing import Iterator, Sequence

import pyarrow as pa
from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxBytes, ReadMaxRows

try:  # pyspark >= 4.2
    from pyspark.sql.streaming.datasource import SupportsTriggerAvailableNow
except ImportError:  # pragma: no cover - older pyspark
    SupportsTriggerAvailableNow = object  # type: ignore[assignment,misc]

from pyspark.sql.types import StructType

from clmq.common import walk_records

from ._options import OptionError, ReadOptions, parse_options
from ._plan import DataLossError, QueueSource, scan_splits, select, split_bytes
from ._tasks import CHUNK_BYTES, ClmqPartition, check_schema, open_sources, read_spec, read_split

Offsets = dict[str, int]
log = logging.getLogger("clmq.spark")


class ClmqStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, options: dict[str, str], schema: StructType) -> None:
        self.opts = parse_options(options)
        o = self.opts
        if any(
            v is not None
            for v in (
                o.ending,
                o.ending_timestamp_ms,
                o.starting_timestamp_ms,
                o.starting_by_timestamp,
                o.ending_by_timestamp,
            )
        ):
            raise OptionError(
                "a stream has no end and starts at 'earliest' or 'latest' (startingOffsets); "
                "endingOffsets and timestamps are for batch reads"
            )
        if (
            self.opts.starting is not None
            and self.opts.starting != {"*": {-1: -1}}
            and self.opts.starting != {"*": {-1: -2}}
        ):
            raise OptionError("startingOffsets of a stream is 'earliest' or 'latest'")
        self.columns = check_schema(schema)
        sources = self._sources()
        try:
            self.spec = read_spec(self.opts, select(self.opts, sources))
            latest = self.opts.starting == {"*": {-1: -1}}
            self.initial = {s.layout.source: s.layout.end_offset if latest else s.layout.min_offset for s in sources}
        finally:
            _close(sources)
        self.target: Offsets | None = None

    def _sources(self) -> list[QueueSource]:
        sources = open_sources(self.opts)
        for s in sources:
            if s.layout.storage_mode != "commitlog":
                _close(sources)
                raise OptionError(
                    f"{s.layout.source} stores in {s.layout.storage_mode} mode: streams follow "
                    "CommitLog positions; read it with batch queries"
                )
        return sources

    def initialOffset(self) -> Offsets:
        return dict(self.initial)

    def prepareForTriggerAvailableNow(self) -> None:
        sources = self._sources()
        try:
            self.target = {s.layout.source: s.layout.end_offset for s in sources}
        finally:
            _close(sources)

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.opts.max_rows_per_trigger:
            return ReadMaxRows(self.opts.max_rows_per_trigger)
        if self.opts.max_bytes_per_trigger:
            return ReadMaxBytes(self.opts.max_bytes_per_trigger)
        return ReadAllAvailable()

    def latestOffset(self, start: Offsets, limit: ReadLimit) -> Offsets:
        sources = self._sources()
        try:
            out = {}
            for s in sources:
                name = s.layout.source
                end = s.layout.end_offset if self.target is None else min(self.target.get(name, 0), s.layout.end_offset)
                at = start.get(name, s.layout.min_offset)
                if at < s.layout.min_offset:
                    _lost(self.opts, name, at, s.layout.min_offset)
                out[name] = _advance(s, at, end, limit)
            return out
        finally:
            _close(sources)

    def reportLatestOffset(self) -> Offsets:
        """Where each store's log ends now: Spark reports it beside the batch's end, so
        the progress (and the UI) shows how far the query lags."""
        sources = self._sources()
        try:
            return {s.layout.source: s.layout.end_offset for s in sources}
        finally:
            _close(sources)

    def partitions(self, start: Offsets, end: Offsets) -> Sequence[InputPartition]:
        sources = self._sources()
        try:
            parts = []
            for s in sources:
                name = s.layout.source
                a, b = start.get(name, s.layout.min_offset), end.get(name, s.layout.min_offset)
                size = split_bytes(self.opts, [s])
                parts += [ClmqPartition(x) for x in scan_splits(s.layout, self.opts.network, size, a, b)]
            return parts
        finally:
            _close(sources)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        yield from read_split(partition.value, self.spec, self.columns, self.opts.timeout_ms, self.opts.security)

    def commit(self, end: Offsets) -> None:
        """Nothing to do: the store keeps its data by retention, not by acknowledgement."""


def _lost(opts: ReadOptions, source: str, at: int, min_offset: int) -> None:
    """Retention deleted records the stream had not read yet: fail (failOnDataLoss) or warn."""
    text = (
        f"{source}: the stream is at log position {at}, but the log now starts at {min_offset}: "
        f"records in [{at}, {min_offset}) were deleted by retention before the query read them"
    )
    if opts.fail_on_data_loss:
        raise DataLossError(text + " (option failOnDataLoss=false goes on from what is there)")
    log.warning("%s; going on from %d (failOnDataLoss=false)", text, min_offset)


def _advance(src: QueueSource, start: int, end: int, limit: ReadLimit) -> int:
    """How far one micro-batch may go from ``start`` towards ``end`` under ``limit``."""
    start = max(start, src.layout.min_offset)
    if end <= start or isinstance(limit, ReadAllAvailable):
        return max(start, end)
    if isinstance(limit, ReadMaxBytes):
        return min(end, start + max(1, limit.max_bytes))
    if isinstance(limit, ReadMaxRows):
        return _after_rows(src, start, end, max(1, limit.max_rows))
    return end


def _after_rows(src: QueueSource, start: int, end: int, rows: int) -> int:
    """The position after ``rows`` records from ``start`` (records of every queue count,
    so a batch never holds more than ``rows`` rows)."""
    splits = scan_splits(src.layout, False, 1 << 62, start, end)
    pos, left = start, rows
    for split in splits:
        at = split.resync
        while at < split.end and left > 0:
            data = src.read(split.seg_base, at, min(CHUNK_BYTES, split.data_end - at))
            walk = walk_records(data)
            starts = walk.starts + at
            owned = starts[starts >= max(pos, split.start)]
            if len(owned) >= left:
                return int(owned[left - 1]) + 1  # just past the start of the last record allowed
            left -= len(owned)
            if walk.stop == 0 or walk.reason != "end":
                break
            at += walk.stop
        pos = split.end
    return end


def _close(sources: list[QueueSource]) -> None:
    for s in sources:
        s.close()

"""Reading one split: walk the records, check them, keep the selected ones, yield Arrow.

Both read paths (CommitLog ranges, consume-queue ranges) and both locations (a data
directory, a broker over the wire) end here, in :func:`parse_chunk`: a buffer of whole
records back to back is walked (vectorised over same-size runs), every record is
CRC-checked, the selection is applied with numpy masks, and the survivors become Arrow
record batches of bounded size.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol, cast

import crc32c as _crc32c
import numpy as np
import pyarrow as pa

from clmq.common import (
    CRC_START,
    HEADER_DTYPE,
    HEADER_SIZE,
    OFF_COMMITLOG_OFFSET,
    CorruptRecordError,
    Walk,
    check_record,
    walk_records,
)

from ._arrow import build_batch
from ._local import LocalStore
from ._plan import IndexSplit, ScanSplit, Selection

log = logging.getLogger("clmq.spark")

_SIZE = struct.Struct("<I")


class ByteSource(Protocol):
    """Reads stored bytes of one store: the CommitLog by offset, and queues by entry."""

    def read(self, seg_base: int, offset: int, n: int) -> bytes: ...  # fewer bytes only at the data's end
    def where(self, seg_base: int) -> str: ...
    def close(self) -> None: ...


class PullSource(ByteSource, Protocol):
    """A broker: the index path pulls its queues (a data directory reads them in log order)."""

    def queue_records(self, topic: str, qid: int, lo: int, hi: int, end_offset: int) -> Iterator[bytes]: ...


@dataclass
class Damage:
    """Corrupt records met in skip mode: counted, reported, and left out of the rows."""

    records: int = 0
    regions: list[dict[str, Any]] = field(default_factory=list)  # file, offset, error

    def add(self, where: str, offset: int, why: str) -> None:
        self.records += 1
        if len(self.regions) < 100:
            self.regions.append({"file": where, "offset": offset, "error": why})
        log.warning("skipped a corrupt record in %s at offset %d: %s", where, offset, why)


@dataclass(frozen=True)
class ReadSpec:
    """Everything a task needs besides its split (pickled into every partition)."""

    selection: Selection
    on_corrupt: str = "fail"
    max_batch_rows: int = 65_536
    max_batch_bytes: int = 8 << 20
    corrupt_records_log: str | None = None
    fail_on_data_loss: bool = True
    check_crc: bool = True


class Filter:
    """The selection as numpy masks over parsed headers, for one source."""

    def __init__(self, sel: Selection, source: str) -> None:
        self.topics = {t.encode(): t for t in sel.topics}
        self.queues = {t: np.asarray(q, dtype=np.uint32) for t, q in sel.queues.items()}
        prefix = f"{source}|"
        self.ranges: dict[tuple[str, int], tuple[int, int]] = {}
        for key, r in sel.ranges.items():
            if key.startswith(prefix):
                t, q = key[len(prefix) :].rsplit("/", 1)
                self.ranges[(t, int(q))] = r

    def mask(self, buf: np.ndarray, starts: np.ndarray, h: np.ndarray) -> np.ndarray:
        keep = np.zeros(len(starts), dtype=bool)
        tl = h["topic_len"]
        for raw, name in self.topics.items():
            cand = np.flatnonzero(tl == len(raw))
            if not len(cand):
                continue
            names = windows(buf, HEADER_SIZE + len(raw))[starts[cand], HEADER_SIZE:]
            hit = cand[(names == np.frombuffer(raw, np.uint8)).all(axis=1)]
            keep[hit] = np.isin(h["queue_id"][hit], self.queues[name])
            for (t, q), (lo, hi) in self.ranges.items():
                if t == name:
                    at = hit[h["queue_id"][hit] == q]
                    qo = h["queue_offset"][at].astype(np.int64)
                    keep[at] &= (qo >= lo) & ((qo < hi) if hi >= 0 else True)
        return keep


def check_crcs(data: bytes, starts: np.ndarray, h: np.ndarray, base: int, crc: bool = True) -> np.ndarray:
    """Indexes of records whose CRC32C (unless ``crc`` is false), field lengths or stored
    offset are wrong."""
    sizes = h["total_size"].astype(np.int64)
    lengths = HEADER_SIZE + sum(
        h[f].astype(np.int64) for f in ("topic_len", "tags_len", "keys_len", "props_len", "body_len")
    )
    bad = lengths != sizes
    if crc:  # one C call per record: about a third of the reader's Python time
        mv, crc32c = memoryview(data), _crc32c.crc32c
        actual = np.fromiter(
            (crc32c(mv[s + CRC_START : s + z]) for s, z in zip(starts.tolist(), sizes.tolist())), np.uint32, len(starts)
        )
        bad |= actual != h["crc"]
    if base >= 0:  # CommitLog reads know each record's offset; it must match what it says
        bad |= h["commitlog_offset"].astype(np.int64) != starts + base
    return np.flatnonzero(bad)


class Emitter:
    """Turns parsed chunks into Arrow batches of bounded rows and bytes."""

    def __init__(self, spec: ReadSpec, filt: Filter, schema: pa.Schema, damage: Damage) -> None:
        self.spec, self.filt, self.schema, self.damage = spec, filt, schema, damage

    def parse(self, data: bytes, starts: np.ndarray, base: int, where: str) -> Iterator[pa.RecordBatch]:
        """``data`` holds whole records at ``starts``; ``base`` is data[0]'s log offset (-1: unknown)."""
        if not len(starts):
            return
        buf = np.frombuffer(data, dtype=np.uint8)
        h = headers_at(buf, starts)
        bad = check_crcs(data, starts, h, base, self.spec.check_crc)
        keep = np.ones(len(starts), dtype=bool)
        for i in bad.tolist():
            pos = int(starts[i])
            offset = base + pos if base >= 0 else int(h["commitlog_offset"][i])
            error = _describe(data, pos, where, offset)
            if self.spec.on_corrupt != "skip":
                raise error
            self.damage.add(where, offset, str(error))
            keep[i] = False
        if len(bad):  # fields of a damaged record are not to be trusted, even for the filter
            starts, h = starts[keep], h[keep]
        keep = self.filt.mask(buf, starts, h)
        starts, h = starts[keep], h[keep]
        if not len(starts):
            return
        mean_size = max(1, int(h["total_size"].mean()))
        step = max(1, min(self.spec.max_batch_rows, self.spec.max_batch_bytes // mean_size))
        for i in range(0, len(starts), step):
            yield build_batch(data, buf, starts[i : i + step], h[i : i + step], self.schema)


def headers_at(buf: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """The record headers at ``starts`` as a structured array (a strided copy when the
    records are evenly spaced, as same-size records are; a gather of rows otherwise)."""
    n = len(starts)
    stride = int(starts[1] - starts[0]) if n > 1 else HEADER_SIZE
    if (
        n > 1
        and stride >= HEADER_SIZE
        and starts[-1] - starts[0] == stride * (n - 1)
        and (np.diff(starts) == stride).all()
    ):
        rows = np.lib.stride_tricks.as_strided(buf[int(starts[0]) :], shape=(n, HEADER_SIZE), strides=(stride, 1))
    else:
        rows = windows(buf, HEADER_SIZE)[starts]
    return np.ascontiguousarray(rows).view(HEADER_DTYPE).reshape(n)


def windows(buf: np.ndarray, width: int) -> np.ndarray:
    """Every ``width``-byte window of ``buf`` as rows of a view (no copy): indexing it with
    record starts copies just those rows, where an index array of starts + arange(width)
    would first build ``width`` indexes per record."""
    if len(buf) < width:
        buf = np.concatenate((buf, np.zeros(width - len(buf), np.uint8)))
    return np.lib.stride_tricks.sliding_window_view(buf, width)


def _describe(data: bytes, pos: int, where: str, offset: int) -> CorruptRecordError:
    """The error for a record that failed a check (the first check that fails)."""
    try:
        check_record(data, pos, where, offset)
    except CorruptRecordError as e:
        return e
    stored = int.from_bytes(data[pos + OFF_COMMITLOG_OFFSET : pos + OFF_COMMITLOG_OFFSET + 8], "little")
    return CorruptRecordError(where, offset, "commitlog offset", str(offset), str(stored))


# -------------------------------------------------------------------- scan path
def read_scan_split(split: ScanSplit, src: ByteSource, emitter: Emitter, chunk_bytes: int) -> Iterator[pa.RecordBatch]:
    """Records starting in ``[split.start, split.end)``, walking from ``split.resync``."""
    pos = split.resync
    resyncs = list(split.boundaries)
    while pos < split.end and pos < split.data_end:
        data = src.read(split.seg_base, pos, min(chunk_bytes, split.data_end - pos))
        walk = _walk_chunk(data, pos, src, split)
        starts = walk.starts
        owned = starts[(starts + pos >= split.start) & (starts + pos < split.end)]
        yield from emitter.parse(walk.data, owned, pos, src.where(split.seg_base))
        if walk.reason == "blank":
            return  # the segment's end marker: the next segment is another split
        if walk.reason == "corrupt":
            pos = _past_damage(walk.data, walk.stop, pos, src, emitter, resyncs, split)
            if pos < 0:
                return
            continue
        pos += walk.stop


class _Chunk:
    def __init__(self, data: bytes, walk: Walk) -> None:
        self.data, self.starts, self.stop, self.reason = data, walk.starts, walk.stop, walk.reason


def _walk_chunk(data: bytes, pos: int, src: ByteSource, split: ScanSplit) -> _Chunk:
    """Walk a chunk; if it holds no whole record, read the one record that is bigger than
    the chunk; if that is impossible too, the bytes are damaged (reason "corrupt")."""
    walk = walk_records(data)
    if walk.stop == 0 and walk.reason == "end":
        need = _SIZE.unpack_from(data, 0)[0] if len(data) >= 4 else 0
        if HEADER_SIZE <= need <= split.data_end - pos and need > len(data):
            data = src.read(split.seg_base, pos, need)
            walk = walk_records(data)
        if walk.stop == 0 and walk.reason == "end":
            walk = Walk([], 0, "corrupt")
    return _Chunk(data, walk)


def _past_damage(
    data: bytes, stop: int, pos: int, src: ByteSource, emitter: Emitter, resyncs: list[int], split: ScanSplit
) -> int:
    """Fail with the damage described, or (skip mode) resume at the next boundary."""
    offset = pos + stop
    if offset >= split.end:
        return -1  # the damage is the next task's to report
    if offset >= split.start:  # before the start: the previous task's to report
        where = src.where(split.seg_base)
        error = _describe(data, stop, where, offset)
        if emitter.spec.on_corrupt != "skip":
            raise error
        emitter.damage.add(where, offset, str(error))
    later = [b for b in resyncs if b > offset]
    return later[0] if later else -1


# ------------------------------------------------------------------- index path
def read_index_split(split: IndexSplit, src: ByteSource, emitter: Emitter) -> Iterator[pa.RecordBatch]:
    if isinstance(src, LocalStore):  # a data directory: every queue of the task merged in log order
        strict = emitter.spec.fail_on_data_loss
        for data, starts, base, where in src.index_windows(split.pieces, split.end_offset, strict):
            yield from emitter.parse(data, starts, base, where)
        return
    pulls = cast(PullSource, src)  # a broker: pulls, queue by queue
    for topic, qid, lo, hi in split.pieces:
        for data in pulls.queue_records(topic, qid, lo, hi, split.end_offset):
            walk = walk_records(data)
            if walk.reason != "end" or walk.stop != len(data):
                where = f"{src.where(-1)} queue {topic}/{qid}"
                error = _describe(data, walk.stop, where, -1)
                if emitter.spec.on_corrupt != "skip":
                    raise error
                emitter.damage.add(where, -1, str(error))
            yield from emitter.parse(data, walk.starts, -1, f"{src.where(-1)} queue {topic}/{qid}")


def report_damage(spec: ReadSpec, damage: Damage, split: object) -> None:
    """Write this task's count of skipped records where the query asked for it."""
    if not damage.records or not spec.corrupt_records_log:
        return
    os.makedirs(spec.corrupt_records_log, exist_ok=True)
    name = f"task-{os.getpid()}-{time.monotonic_ns()}.json"
    with open(os.path.join(spec.corrupt_records_log, name), "w") as f:
        json.dump({"split": repr(split), "records": damage.records, "regions": damage.regions}, f)


def read_corrupt_log(directory: str) -> dict[str, Any]:
    """Sum up what the tasks of a query skipped (``corruptRecordsLog``)."""
    total, regions = 0, []
    if os.path.isdir(directory):
        for name in sorted(os.listdir(directory)):
            with open(os.path.join(directory, name)) as f:
                doc = json.load(f)
            total += doc["records"]
            regions += doc["regions"]
    return {"records": total, "regions": regions}

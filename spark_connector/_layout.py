"""What a scan reads: a consistent snapshot of a store's CommitLog and consume queues.

The snapshot is resolved once, when a query is planned, and travels to every task, so
all tasks of a query agree on it even while a broker keeps appending:

- ``end_offset`` bounds every read. For a data directory it is
  ``min(log_durable, dispatched)`` of the store's last checkpoint: bytes below it are
  fsynced and their consume-queue entries are in the queue files, so the scan path and
  the index path see exactly the same records. (A broker checkpoints every
  ``cq_flush_interval_ms``; a closed store's checkpoint covers everything.)
- ``segments`` are the CommitLog segments below ``end_offset`` with their boundary
  index (record starts at least every ``boundary_interval_bytes``), which lets a task
  start anywhere in a segment without scanning it from the beginning.

No pyspark here: the layout is plain data, built by the driver-side planner and by
tests alike.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from clmq.commitlog import load_json, read_boundary_index, read_json
from clmq.common import OFF_STORE_TS, ConnectorError

ENTRY_DTYPE = np.dtype([("offset", "<u8"), ("size", "<u4"), ("tag", "<u8")])  # as consumequeue writes them


class LayoutError(ConnectorError):
    """The location cannot be read as a clmq store (the message says why and what to do)."""


@dataclass(frozen=True)
class SegmentInfo:
    """One CommitLog segment as far as the snapshot reaches into it."""

    base: int  # log offset of the segment's first byte
    data_end: int  # log offset where the snapshot's bytes in this segment end
    boundaries: tuple[int, ...]  # log offsets of record starts, increasing, base first


@dataclass(frozen=True)
class LogLayout:
    """A consistent snapshot of one store (one broker)."""

    source: str  # the data directory, or the broker's address
    min_offset: int
    end_offset: int
    segments: tuple[SegmentInfo, ...]
    topics: dict[str, int] = field(default_factory=dict)
    storage_mode: str = "commitlog"

    def segment_at(self, offset: int) -> SegmentInfo:
        for seg in reversed(self.segments):
            if seg.base <= offset:
                return seg
        raise LayoutError(f"{self.source}: offset {offset} is before the first segment (retention removed it)")


def _segment_files(log_dir: Path) -> list[tuple[int, Path]]:
    out = []
    for name in os.listdir(log_dir):
        stem, _, suffix = name.partition(".")
        if suffix == "log" and len(stem) == 20 and stem.isdigit():
            out.append((int(stem), log_dir / name))
    return sorted(out)


def _boundaries(seg_path: Path, base: int, data_end: int) -> tuple[int, ...]:
    """The segment's boundary index as log offsets (just ``base`` if the file is missing)."""
    positions = read_boundary_index(seg_path.with_suffix(".bidx"), base)
    starts = [base] + [base + p for p in positions if 0 < base + p < data_end]
    return tuple(sorted(set(starts)))


def local_layout(data_dir: str | Path) -> LogLayout:
    """The snapshot of the store in ``data_dir`` (it may be open in a running broker)."""
    root = Path(data_dir)
    if not root.is_dir():
        raise LayoutError(f"{root}: no such directory (give the data directory of a clmq store)")
    if (root / "partitions").is_dir() and not (root / "commitlog").is_dir():
        raise LayoutError(
            f"{root} is a partition-per-file store: it has no CommitLog to scan; read it through "
            "its broker instead (option 'broker' or 'nameserver')"
        )
    if not (root / "commitlog").is_dir():
        raise LayoutError(f"{root}: no commitlog/ directory (is this a clmq data directory?)")
    # Checked, falling back to the previous generation: a store replacing its checkpoint
    # renames the current one to .prev before it moves the new one in.
    loaded = load_json(root / "checkpoint")
    cp = loaded.value if isinstance(loaded.value, dict) else None
    if cp is None or "log_durable" not in cp:
        why = "; ".join(loaded.problems) or "open the store once so that it records what is durable"
        raise LayoutError(f"{root}: no usable checkpoint ({why})")
    end = min(int(cp["log_durable"]), int(cp["dispatched"]))
    topics_doc = read_json(root / "topics.json") or {}  # checked, or its previous generation
    topics = {str(k): int(v) for k, v in dict(topics_doc.get("topics", {})).items()}
    segments = []
    for base, path in _segment_files(root / "commitlog"):
        if base >= end:
            break
        data_end = min(base + os.stat(path).st_size, end)
        segments.append(SegmentInfo(base, data_end, _boundaries(path, base, data_end)))
    min_offset = segments[0].base if segments else end
    return LogLayout(str(root), min_offset, end, tuple(segments), topics)


# ----------------------------------------------------------------- consume queues
class LocalQueueIndex:
    """Read-only access to a store's consume-queue files and record timestamps.

    Never writes and never takes the store's lock, so it works beside a running broker;
    entries at or past the snapshot's end are ignored.
    """

    def __init__(self, data_dir: str | Path, layout: LogLayout) -> None:
        self.root = Path(data_dir)
        self.layout = layout

    def _files(self, topic: str, qid: int) -> list[tuple[int, Path]]:
        d = self.root / "consumequeue" / topic / str(qid)
        try:
            names = os.listdir(d)
        except FileNotFoundError:
            return []
        return sorted((int(n), d / n) for n in names if len(n) == 20 and n.isdigit())

    def entries(self, topic: str, qid: int, lo: int = 0, hi: int | None = None) -> tuple[int, np.ndarray]:
        """``(first queue offset, entries)`` for queue offsets ``[lo, hi)`` inside the snapshot
        (holes, all-zero entries, included; the caller skips them)."""
        parts: list[np.ndarray] = []
        first = None
        for start, path in self._files(topic, qid):
            raw = np.fromfile(path, dtype=ENTRY_DTYPE)
            f_lo, f_hi = start, start + len(raw)
            a, b = max(lo, f_lo), f_hi if hi is None else min(hi, f_hi)
            if a >= b:
                continue
            if first is None:
                first = a
            elif first + sum(len(p) for p in parts) != a:
                break  # a gap between files: stop at the contiguous part
            parts.append(raw[a - start : b - start])
        if first is None:
            return lo, np.empty(0, ENTRY_DTYPE)
        entries = np.concatenate(parts)
        inside = np.flatnonzero((entries["offset"] >= self.layout.end_offset) & (entries["size"] > 0))
        if len(inside):
            entries = entries[: inside[0]]  # the snapshot ends before this entry
        # a trailing run of holes is an unwritten tail, not data
        nz = np.flatnonzero(entries["size"] > 0)
        return first, entries[: nz[-1] + 1] if len(nz) else entries[:0]

    def bounds(self, topic: str, qid: int) -> tuple[int, int]:
        """``(min, max)`` queue offsets present in the snapshot (max exclusive)."""
        first, e = self.entries(topic, qid)
        live = np.flatnonzero((e["size"] > 0) & (e["offset"] >= self.layout.min_offset))
        if not len(live):
            return first + len(e), first + len(e)
        return first + int(live[0]), first + len(e)

    def offset_for_timestamp(self, topic: str, qid: int, timestamp_ms: int) -> int:
        """The first queue offset stored at or after ``timestamp_ms`` (the max offset if none)."""
        first, e = self.entries(topic, qid)
        live = np.flatnonzero((e["size"] > 0) & (e["offset"] >= self.layout.min_offset))
        lo, hi = 0, len(live)
        while lo < hi:  # store timestamps grow with queue offsets; holes and deleted records have none
            mid = (lo + hi) // 2
            if self._stored_at(e[live[mid]]) >= timestamp_ms:
                hi = mid
            else:
                lo = mid + 1
        return first + (int(live[lo]) if lo < len(live) else len(e))

    def _stored_at(self, entry: np.void) -> int:
        offset = int(entry["offset"])
        if entry["size"] == 0 or offset < self.layout.min_offset:
            return -1  # a hole or a record gone to retention: older than anything asked
        seg = self.layout.segment_at(offset)
        path = Path(self.layout.source) / "commitlog" / f"{seg.base:020d}.log"
        with open(path, "rb") as f:
            f.seek(offset - seg.base + OFF_STORE_TS)
            return int(struct.unpack("<Q", f.read(8))[0])  # struct gives Any


def segment_path(layout: LogLayout, base: int) -> str:
    return os.path.join(layout.source, "commitlog", f"{base:020d}.log")

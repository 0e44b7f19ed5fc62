"""Reading a data directory in place: segments by ``pread``, queues through their files.

Read-only: it neither takes the store's lock nor writes anything, so it may run beside
the broker that owns the directory (the snapshot says how far to read).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from ._layout import LayoutError, LocalQueueIndex, LogLayout, local_layout, segment_path

log = logging.getLogger("clmq.spark")

READ_RUN_BYTES = 8 << 20  # the index path reads contiguous records in runs up to this size
# Records of other queues closer together than this are read through rather than seeked
# over: one larger sequential read beats many small ones on every disk here.
MAX_GAP_BYTES = 256 << 10


class SegmentGoneError(LayoutError):
    """Records a query planned to read were deleted (by retention) before its task read them."""


class LocalStore:
    """A :class:`~clmq.spark_connector._plan.QueueSource` and ``ByteSource`` over a data directory."""

    def __init__(self, data_dir: str | Path, layout: LogLayout | None = None) -> None:
        self.root = Path(data_dir)
        self.layout = layout if layout is not None else local_layout(data_dir)
        self.index = LocalQueueIndex(data_dir, self.layout)
        self._fds: dict[int, int] = {}
        self._count: int | None = None

    # ------------------------------------------------------------- planning
    def bounds(self, topic: str, qid: int) -> tuple[int, int]:
        return self.index.bounds(topic, qid)

    def offset_for_timestamp(self, topic: str, qid: int, timestamp_ms: int) -> int:
        return self.index.offset_for_timestamp(topic, qid, timestamp_ms)

    def message_count(self) -> int:
        """Messages in the store, from the checkpoint's queue extents (no queue file read)."""
        if self._count is None:
            import json

            try:
                doc = json.loads((self.root / "checkpoint").read_bytes())
                self._count = sum(int(n) - int(f) for _t, _q, f, n in doc.get("queues", []))
            except (OSError, ValueError):
                self._count = 0
        return self._count

    # -------------------------------------------------------------- reading
    def where(self, seg_base: int) -> str:
        return str(self.root) if seg_base < 0 else segment_path(self.layout, seg_base)

    def _fd(self, base: int) -> int:
        fd = self._fds.get(base)
        if fd is None:
            try:
                fd = self._fds[base] = os.open(segment_path(self.layout, base), os.O_RDONLY)
            except FileNotFoundError:
                raise SegmentGoneError(
                    f"{segment_path(self.layout, base)} is gone: retention deleted it after the query was planned"
                ) from None
        return fd

    def read(self, seg_base: int, offset: int, n: int) -> bytes:
        return os.pread(self._fd(seg_base), n, offset - seg_base)

    def index_windows(
        self, pieces: Sequence[tuple[str, int, int, int]], end_offset: int, fail_on_lost: bool = True
    ) -> Iterator[tuple[bytes, np.ndarray, int, str]]:
        """The records of many queues' ranges merged in log order: ``(bytes, record starts
        in them, log offset of the bytes, file)`` per window of nearby records, so a task
        over a thousand queues reads the log forwards instead of queue by queue."""
        offs, sizes = self._entries_of(pieces, end_offset, fail_on_lost)
        if not len(offs):
            return
        bases = np.asarray([seg.base for seg in self.layout.segments], dtype=np.int64)
        seg = np.searchsorted(bases, offs, side="right") - 1
        ends = offs + sizes
        for i, j in _windows(offs, ends, seg):
            a, b, base = int(offs[i]), int(ends[j - 1]), int(bases[seg[i]])
            try:
                data = self.read(base, a, b - a)
            except SegmentGoneError as e:
                if fail_on_lost:
                    raise
                log.warning("%s; its %d record(s) here are left out (failOnDataLoss=false)", e, j - i)
                continue  # the windows of segments still there are read
            yield data, offs[i:j] - a, a, segment_path(self.layout, base)

    def _entries_of(
        self, pieces: Sequence[tuple[str, int, int, int]], end_offset: int, fail_on_lost: bool
    ) -> tuple[np.ndarray, np.ndarray]:
        """Offsets and sizes of the records of every piece, sorted by log offset. Planning
        started each piece inside the log, so a record below its start now was deleted
        since: SegmentGoneError, or (``fail_on_lost`` false) a warning and left out."""
        parts = []
        for topic, qid, lo, hi in pieces:
            first, e = self.index.entries(topic, qid, lo, hi)
            e = e[(e["size"] > 0) & (e["offset"] + e["size"] <= end_offset)]
            # retention also deletes whole queue files: then the entries start past ``lo``
            lost = max(0, first - lo) + int(np.count_nonzero(e["offset"] < self.layout.min_offset))
            if lost:
                text = (
                    f"{self.root}: {lost} record(s) of queue {topic}/{qid} in [{lo}, {hi}) were deleted by "
                    "retention after the query was planned"
                )
                if fail_on_lost:
                    raise SegmentGoneError(text)
                log.warning("%s; left out (failOnDataLoss=false)", text)
            parts.append(e[e["offset"] >= self.layout.min_offset])
        if not parts:
            return np.empty(0, np.int64), np.empty(0, np.int64)
        live = np.concatenate(parts)
        live = live[np.argsort(live["offset"], kind="stable")]
        return live["offset"].astype(np.int64), live["size"].astype(np.int64)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _windows(offs: np.ndarray, ends: np.ndarray, seg: np.ndarray) -> Iterator[tuple[int, int]]:
    """``[i, j)`` index ranges of records read together: split where the gap to the
    previous record exceeds MAX_GAP_BYTES, where a segment ends, and every READ_RUN_BYTES."""
    breaks = np.flatnonzero((offs[1:] - ends[:-1] > MAX_GAP_BYTES) | (seg[1:] != seg[:-1])) + 1
    firsts = np.concatenate(([0], breaks)).tolist()
    lasts = np.concatenate((breaks, [len(offs)])).tolist()
    for i, j in zip(firsts, lasts):
        piece = (offs[i:j] - offs[i]) // READ_RUN_BYTES
        cuts = (np.flatnonzero(np.diff(piece)) + 1 + i).tolist()
        yield from zip([i] + cuts, cuts + [j])

"""Planning a scan: which records a query selects, and how the work splits into tasks.

Two read paths, both ending in the same vectorised parser:

- **scan**: CommitLog byte ranges. A segment is cut every ``maxSplitBytes``, at a
  boundary-index entry when one is near (so a task starts on a record), otherwise at
  the exact byte (mid-record): the task then walks record headers from the boundary
  before its start and owns the records that *start* inside its range.
- **index**: for a few queues out of many, their consume-queue entries point at just
  their records; each task reads whole queue-offset ranges.

``auto`` takes the index path when the selection names specific queues or topics and
their records are under ``indexPathFraction`` (default 25%) of the bytes a scan would
read; otherwise it scans.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Protocol

from ._layout import LogLayout, SegmentInfo
from ._options import EARLIEST, LATEST, OptionError, Positions, ReadOptions

INDEX_PATH_MAX_QUEUES = 256  # beyond this many queues a scan is cheaper to plan and to run
MIN_SPLIT_BYTES = 1 << 20  # below this, Spark's cost per task outweighs the parallelism


class QueueSource(Protocol):
    """What planning needs of one store (a data directory or one broker)."""

    layout: LogLayout

    def bounds(self, topic: str, qid: int) -> tuple[int, int]: ...  # (min, max) queue offsets
    def offset_for_timestamp(self, topic: str, qid: int, timestamp_ms: int) -> int: ...
    def message_count(self) -> int: ...
    def read(self, seg_base: int, offset: int, n: int) -> bytes: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class Selection:
    """What a query selects, shared by every task (filters applied to parsed records)."""

    topics: tuple[str, ...]
    queues: dict[str, tuple[int, ...]]  # topic -> selected queue ids
    ranges: dict[str, tuple[int, int]] = field(default_factory=dict)  # "topic/qid" -> [lo, hi)
    all_queues: bool = True  # every queue of every selected topic, no offset bounds

    def queue_count(self) -> int:
        return sum(len(q) for q in self.queues.values())


@dataclass(frozen=True)
class ScanSplit:
    source: str  # data directory or broker address
    network: bool
    seg_base: int
    data_end: int  # where the segment's bytes in the snapshot end
    start: int  # the task owns records starting in [start, end)
    end: int
    resync: int  # a record start at or before ``start`` (walk from here)
    boundaries: tuple[int, ...]  # record starts after ``start``, to resync past damage


@dataclass(frozen=True)
class IndexSplit:
    source: str
    network: bool
    pieces: tuple[tuple[str, int, int, int], ...]  # (topic, queue id, lo, hi) queue-offset ranges
    end_offset: int  # the snapshot's end: records at or past it are not read
    storage_mode: str = "commitlog"


Split = ScanSplit | IndexSplit


def resolve_topics(opts: ReadOptions, available: dict[str, int], where: str) -> tuple[str, ...]:
    names: list[str] = []
    if opts.topics:
        missing = [t for t in opts.topics if t not in available]
        if missing:
            raise OptionError(f"topic(s) {', '.join(missing)} not found in {where}; "
                              f"topics there: {', '.join(sorted(available)) or 'none'}")  # fmt: skip
        names += opts.topics
    if opts.topic_pattern:
        rx = re.compile(opts.topic_pattern)
        names += [t for t in sorted(available) if rx.fullmatch(t) and t not in names]
    if not opts.topics and not opts.topic_pattern:
        names = sorted(available)
    return tuple(names)


def _queue_ids(opts: ReadOptions, topic: str, count: int) -> tuple[int, ...]:
    wanted = opts.queues
    if isinstance(wanted, dict):
        ids = wanted.get(topic, tuple(range(count)))
    else:
        ids = wanted if wanted is not None else tuple(range(count))
    bad = [q for q in ids if not 0 <= q < count]
    if bad:
        raise OptionError(f"queue id(s) {bad} not in 0..{count - 1} of topic {topic!r}")
    return tuple(sorted(set(ids)))


def _position(positions: Positions | None, topic: str, qid: int) -> int | None:
    if positions is None:
        return None
    per = positions.get(topic) or positions.get("*") or {}
    return per.get(qid, per.get(-1))


def _range(src: QueueSource, opts: ReadOptions, topic: str, qid: int) -> tuple[int, int] | None:
    """``[lo, hi)`` queue offsets for one queue, or None for the whole snapshot."""
    lo, hi = 0, -1  # -1: to the snapshot's end
    if opts.starting_timestamp_ms is not None:
        lo = src.offset_for_timestamp(topic, qid, opts.starting_timestamp_ms)
    else:
        start = _position(opts.starting, topic, qid)
        if start == LATEST:
            lo = src.bounds(topic, qid)[1]
        elif start is not None and start != EARLIEST:
            lo = start
    if opts.ending_timestamp_ms is not None:
        hi = src.offset_for_timestamp(topic, qid, opts.ending_timestamp_ms)
    else:
        end = _position(opts.ending, topic, qid)
        if end is not None and end not in (LATEST, EARLIEST):
            hi = end
        elif end == EARLIEST:
            hi = src.bounds(topic, qid)[0]
    if lo == 0 and hi == -1:
        return None
    return lo, hi


def select(opts: ReadOptions, sources: list[QueueSource]) -> Selection:
    """Resolve topics, queues and per-queue offset ranges (once, at planning)."""
    available: dict[str, int] = {}
    for src in sources:
        for t, n in src.layout.topics.items():
            available[t] = max(n, available.get(t, 0))
    where = ", ".join(s.layout.source for s in sources)
    topics = resolve_topics(opts, available, where)
    queues = {t: _queue_ids(opts, t, available[t]) for t in topics}
    ranges: dict[str, tuple[int, int]] = {}
    for src in sources:
        for t in topics:
            for q in queues[t]:
                if src.layout.topics.get(t, 0) > q:
                    r = _range(src, opts, t, q)
                    if r is not None:
                        ranges[f"{src.layout.source}|{t}/{q}"] = r
    all_queues = not ranges and all(len(queues[t]) == available[t] for t in topics)
    return Selection(topics, queues, ranges, all_queues)


# ---------------------------------------------------------------- scan splits
def scan_splits(layout: LogLayout, network: bool, max_split_bytes: int, start: int | None = None,
                end: int | None = None) -> list[ScanSplit]:  # fmt: skip
    """Cut ``[start, end)`` of the log (default: the whole snapshot) into splits."""
    lo = layout.min_offset if start is None else max(start, layout.min_offset)
    hi = layout.end_offset if end is None else min(end, layout.end_offset)
    out: list[ScanSplit] = []
    for seg in layout.segments:
        a, b = max(lo, seg.base), min(hi, seg.data_end)
        if a < b:
            out += _cut_segment(layout.source, network, seg, a, b, max_split_bytes)
    return out


def _cut_segment(source: str, network: bool, seg: SegmentInfo, a: int, b: int, max_bytes: int) -> list[ScanSplit]:
    bounds = seg.boundaries
    out = []
    pos = a
    while pos < b:
        limit = min(b, pos + max_bytes)
        # prefer a cut at a record start (no resync walk for the next task) if one is near
        near = [x for x in bounds if pos < x <= limit and x >= pos + max_bytes // 2]
        cut = near[-1] if near and limit < b else limit
        resync = max(x for x in bounds if x <= pos) if bounds and bounds[0] <= pos else seg.base
        after = tuple(x for x in bounds if pos < x < cut)
        out.append(ScanSplit(source, network, seg.base, seg.data_end, pos, cut, resync, after))
        pos = cut
    return out


# --------------------------------------------------------------- index splits
def index_pieces(src: QueueSource, sel: Selection) -> list[tuple[str, int, int, int]]:
    """Each selected queue's ``(topic, qid, lo, hi)`` inside this source's snapshot."""
    pieces = []
    for t in sel.topics:
        for q in sel.queues[t]:
            if src.layout.topics.get(t, 0) <= q:
                continue
            qmin, qmax = src.bounds(t, q)
            lo, hi = sel.ranges.get(f"{src.layout.source}|{t}/{q}", (0, -1))
            lo, hi = max(lo, qmin), qmax if hi < 0 else min(hi, qmax)
            if lo < hi:
                pieces.append((t, q, lo, hi))
    return pieces


def index_splits(src: QueueSource, network: bool, pieces: list[tuple[str, int, int, int]],
                 messages_per_split: int) -> list[IndexSplit]:  # fmt: skip
    out = []
    for t, q, lo, hi in pieces:
        for a in range(lo, hi, messages_per_split):
            piece = (t, q, a, min(hi, a + messages_per_split))
            out.append(IndexSplit(src.layout.source, network, (piece,), src.layout.end_offset, src.layout.storage_mode))
    return out


def choose_index_path(opts: ReadOptions, src: QueueSource, sel: Selection,
                      pieces: list[tuple[str, int, int, int]] | None) -> bool:  # fmt: skip
    """Whether reading through consume queues beats scanning (see the module doc)."""
    if opts.read_path != "auto":
        return opts.read_path == "index"
    if src.layout.storage_mode != "commitlog":
        return True
    if (sel.all_queues and not sel.ranges) or pieces is None:
        return False
    messages = sum(hi - lo for _t, _q, lo, hi in pieces)
    total = max(1, src.message_count())
    scan_bytes = src.layout.end_offset - src.layout.min_offset
    return messages * scan_bytes / total < opts.index_path_fraction * scan_bytes


def split_bytes(opts: ReadOptions, sources: list[QueueSource]) -> int:
    """Bytes per scan split: as large as ``maxSplitBytes`` allows (each Spark task costs
    tens of milliseconds), but small enough for ``minPartitions`` tasks, so that every
    core has work (default: twice the cores of the machine that plans)."""
    total = sum(s.layout.end_offset - s.layout.min_offset for s in sources if s.layout.storage_mode == "commitlog")
    parts = opts.min_partitions or 2 * (os.cpu_count() or 1)
    return min(opts.max_split_bytes, max(MIN_SPLIT_BYTES, -(-total // parts)))


def plan(opts: ReadOptions, sources: list[QueueSource], network: bool) -> tuple[Selection, list[Split]]:
    """The selection and every task's split, over all sources (brokers)."""
    sel = select(opts, sources)
    size = split_bytes(opts, sources)
    splits: list[Split] = []
    for src in sources:
        narrow = sel.queue_count() <= INDEX_PATH_MAX_QUEUES and not sel.all_queues
        pieces = index_pieces(src, sel) if (narrow or opts.read_path == "index"
                                            or src.layout.storage_mode != "commitlog") else None  # fmt: skip
        if choose_index_path(opts, src, sel, pieces):
            avg = max(1, (src.layout.end_offset - src.layout.min_offset) // max(1, src.message_count()))
            per_split = max(1024, size // avg)
            splits += index_splits(src, network, pieces if pieces is not None else index_pieces(src, sel), per_split)
        else:
            splits += scan_splits(src.layout, network, size)
    return sel, splits

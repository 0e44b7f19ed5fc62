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

import logging
import os
from dataclasses import dataclass, field
from typing import Callable

from ._layout import LogLayout, SegmentInfo
from ._options import ReadOptions
from ._select import DataLossError, QueueSource, Selection, resolve_topics, select

log = logging.getLogger("clmq.spark")


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


# ---------------------------------------------------------------- scan splits
def scan_splits(
    layout: LogLayout, network: bool, max_split_bytes: int, start: int | None = None, end: int | None = None
) -> list[ScanSplit]:
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
Piece = tuple[str, int, int, int]  # (topic, queue id, lo, hi): queue offsets [lo, hi)


def selected_ranges(src: QueueSource, sel: Selection) -> list[Piece]:
    """Each selected queue's ``(topic, qid, lo, hi)`` inside this source's snapshot, empty
    ranges included (an export's manifest records those too)."""
    out = []
    for t in sel.topics:
        for q in sel.queues[t]:
            if src.layout.topics.get(t, 0) <= q:
                continue
            qmin, qmax = src.bounds(t, q)
            lo, hi = sel.ranges.get(f"{src.layout.source}|{t}/{q}", (0, -1))
            hi = qmax if hi < 0 else min(hi, qmax)
            out.append((t, q, min(max(lo, qmin), hi), hi))
    return out


def index_pieces(src: QueueSource, sel: Selection) -> list[Piece]:
    """The non-empty ones of :func:`selected_ranges`: what the index path reads."""
    return [p for p in selected_ranges(src, sel) if p[2] < p[3]]


def index_splits(src: QueueSource, network: bool, pieces: list[Piece], messages_per_split: int) -> list[IndexSplit]:
    """Pieces packed into tasks of about ``messages_per_split`` messages each: one task
    reads many queues (a data directory reads them merged in log order, see _local)."""
    out: list[IndexSplit] = []
    batch: list[Piece] = []
    room = messages_per_split
    for t, q, lo, hi in pieces:
        while lo < hi:
            take = min(hi - lo, room)
            batch.append((t, q, lo, lo + take))
            lo, room = lo + take, room - take
            if room == 0:
                out.append(
                    IndexSplit(src.layout.source, network, tuple(batch), src.layout.end_offset, src.layout.storage_mode)
                )
                batch, room = [], messages_per_split
    if batch:
        out.append(IndexSplit(src.layout.source, network, tuple(batch), src.layout.end_offset, src.layout.storage_mode))
    return out


def choose_index_path(opts: ReadOptions, src: QueueSource, sel: Selection, pieces: list[Piece] | None) -> bool:
    """Whether reading through consume queues beats scanning (see the module doc)."""
    return _path_choice(opts, src, sel, pieces)[0]


def _path_choice(opts: ReadOptions, src: QueueSource, sel: Selection, pieces: list[Piece] | None) -> tuple[bool, str]:
    """``(index?, why)``: the read path of one source and the reason, for the plan's description."""
    if opts.read_path != "auto":
        return opts.read_path == "index", f"readPath={opts.read_path}"
    if src.layout.storage_mode != "commitlog":
        return True, f"a {src.layout.storage_mode} store has no CommitLog to scan"
    if pieces is None:
        return False, "every queue of every topic is selected"
    messages = sum(hi - lo for _t, _q, lo, hi in pieces)
    total = max(1, src.message_count())
    share = messages / total
    index = share < opts.index_path_fraction
    verb = "under" if index else "at least"
    return index, f"the selection is {share:.1%} of the messages, {verb} indexPathFraction={opts.index_path_fraction}"


# ------------------------------------------------------------------ split sizes
def split_bytes(opts: ReadOptions, sources: list[QueueSource]) -> int:
    """Bytes per scan split: as large as ``maxSplitBytes`` allows (each Spark task costs
    tens of milliseconds), but small enough for ``minPartitions`` tasks, so that every
    core has work (default: twice the cores of the machine that plans); never below
    ``minSplitBytes``."""
    total = sum(s.layout.end_offset - s.layout.min_offset for s in sources if s.layout.storage_mode == "commitlog")
    parts = opts.min_partitions or 2 * (os.cpu_count() or 1)
    return min(max_split(opts), max(opts.min_split_bytes, -(-total // parts)))


def max_split(opts: ReadOptions) -> int:
    return max(opts.max_split_bytes, opts.min_split_bytes)


def clamp_notes(opts: ReadOptions) -> list[str]:
    """What planning changed of the options given, said once per query."""
    if opts.max_split_bytes < opts.min_split_bytes:
        return [
            f"option maxSplitBytes={opts.max_split_bytes} raised to minSplitBytes={opts.min_split_bytes}: "
            "below it each task costs more than it reads (set minSplitBytes to go lower)"
        ]
    return []


@dataclass
class Plan:
    """The selection, every task's split, and what was decided, in words (``explain``)."""

    selection: Selection
    splits: list[Split]
    lines: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # options clamped: also logged as warnings

    def describe(self) -> str:
        return "\n".join(self.lines + [f"note: {n}" for n in self.notes])


def _bounded(
    opts: ReadOptions, splits: list[Split], plan_one: Callable[[int], list[Split]], size: int, notes: list[str]
) -> list[Split]:
    """Re-plan with larger splits while there are more than ``maxPartitions`` tasks."""
    first = len(splits)
    while len(splits) > opts.max_partitions and size < 1 << 40:
        size *= 2
        splits = plan_one(size)
    if len(splits) != first:
        notes.append(
            f"{first:,} tasks would exceed maxPartitions={opts.max_partitions:,}: "
            f"planned {len(splits):,} tasks of up to {size:,} bytes instead"
        )
    return splits


def _plan_source(
    opts: ReadOptions, src: QueueSource, sel: Selection, size: int, network: bool, notes: list[str]
) -> tuple[list[Split], str]:
    everything = sel.all_queues and set(sel.topics) >= set(src.layout.topics)
    narrow = not everything or opts.read_path == "index" or src.layout.storage_mode != "commitlog"
    pieces = index_pieces(src, sel) if narrow else None
    index, why = _path_choice(opts, src, sel, pieces)
    if not index:
        splits: list[Split] = list(scan_splits(src.layout, network, size))
        splits = _bounded(opts, splits, lambda b: list(scan_splits(src.layout, network, b)), size, notes)
        return splits, f"{src.layout.source}: scan path ({why}): {len(splits)} task(s) of up to {size:,} log bytes"
    got = pieces if pieces is not None else index_pieces(src, sel)
    avg = max(1, (src.layout.end_offset - src.layout.min_offset) // max(1, src.message_count()))
    per_split = max(1, size // avg)  # messages of about one scan split's bytes
    splits = list(index_splits(src, network, got, per_split))
    splits = _bounded(
        opts, splits, lambda b: list(index_splits(src, network, got, max(per_split, b // avg))), size, notes
    )
    queues = len({(t, q) for t, q, _a, _b in got})
    return splits, f"{src.layout.source}: index path ({why}): {queues} queue(s) in {len(splits)} task(s)"


def plan(opts: ReadOptions, sources: list[QueueSource], network: bool) -> Plan:
    """The selection and every task's split, over all sources (brokers)."""
    sel = select(opts, sources)
    size = split_bytes(opts, sources)
    result = Plan(sel, [], notes=clamp_notes(opts))
    for src in sources:
        splits, line = _plan_source(opts, src, sel, size, network, result.notes)
        result.splits += splits
        result.lines.append(line)
    for note in result.notes:
        log.warning("%s", note)
    log.info("%s", result.describe())
    return result


__all__ = [
    "DataLossError",
    "IndexSplit",
    "Plan",
    "QueueSource",
    "ScanSplit",
    "Selection",
    "Split",
    "plan",
    "resolve_topics",
    "scan_splits",
    "select",
    "selected_ranges",
    "split_bytes",
]

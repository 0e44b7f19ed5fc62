"""Opening a log: find its segments, then trust them (clean) or validate them (unclean).

Invariants:
- Everything here runs inside :meth:`CommitLog.open`, before the log is handed to any
  other thread, so it uses the :class:`LogState` without taking its lock.
- After a clean open every segment but the last is sealed and every boundary index
  is loaded or rebuilt; nothing is validated (the checkpoint said it was all synced).
- After an unclean open the log ends at the last valid record at or after the
  checkpoint's segment: a torn or corrupt tail and every segment after it are
  durably removed (file cut, fsync, directory fsync), and the active segment is
  never sealed (a sealed one is followed by a fresh segment).
"""

from __future__ import annotations

import logging
import os
from typing import Callable

from ._scan import ScanResult, scan
from ._segment import Segment, fsync_dir, parse_segment_name
from ._segments import SegmentSet
from ._state import LogState

log = logging.getLogger("clmq.commitlog")


def load_segments(state: LogState) -> None:
    """Open every segment file of the directory (creating the first one if none)."""
    directory, interval = state.directory, state.config.boundary_interval_bytes
    directory.mkdir(parents=True, exist_ok=True)
    bases = sorted(b for n in os.listdir(directory) if (b := parse_segment_name(n)) is not None)
    segments = [Segment(directory, b, interval) for b in bases]
    if not segments:
        segments = [Segment(directory, 0, interval, create=True)]
        fsync_dir(directory)
    state.snapshot = SegmentSet.of(segments)


def open_clean(state: LogState) -> None:
    """After a clean shutdown: seal all but the last segment, load the boundary indexes."""
    for seg in state.snapshot.segments[:-1]:
        seg.sealed = True
    for seg in state.snapshot.segments:
        _load_boundaries(state, seg)


def recover(state: LogState, checkpoint_offset: int | None, roll: Callable[[], None]) -> None:
    """Validate from the segment holding ``checkpoint_offset`` (from the first without
    one) and durably cut the log at the first problem; ``roll`` starts a new segment."""
    snapshot = state.snapshot
    segments = list(snapshot.segments)
    first = 0 if checkpoint_offset is None else snapshot.index(checkpoint_offset)
    for seg in segments[:first]:
        seg.sealed = True
        _load_boundaries(state, seg)
    for i in range(first, len(segments)):
        seg = segments[i]
        result = scan(seg, state.config.max_message_bytes, verify=True)
        seg.boundaries.rewrite(result.starts)
        nxt = segments[i + 1] if i + 1 < len(segments) else None
        problem = _tail_problem(seg, result, nxt)
        if problem is None and result.sealed:
            seg.sealed = True
            continue
        if problem is not None:
            _truncate_tail(state, segments, i, result, problem)
        break  # the active segment (intact to its end, or just cut there)
    if state.snapshot.active.sealed:
        roll()


def _load_boundaries(state: LogState, seg: Segment) -> None:
    if not seg.boundaries.load():
        seg.boundaries.rewrite(scan(seg, state.config.max_message_bytes, verify=False).starts)


def _tail_problem(seg: Segment, result: ScanResult, nxt: Segment | None) -> str | None:
    """Why the log must be cut in ``seg``; None when ``seg`` is intact and fits its place
    (sealed and continued by ``nxt``, or the unsealed last segment)."""
    expected_next = seg.base + (seg.size if result.sealed else result.end)
    if result.problem is not None:
        return result.problem
    if result.sealed and (nxt is None or nxt.base == expected_next):
        return None
    if not result.sealed and nxt is None:
        return None
    if not result.sealed:
        return "segment not sealed but followed by another"
    return f"next segment starts at {nxt.base if nxt else '-'}, expected {expected_next}"


def _truncate_tail(state: LogState, segments: list[Segment], i: int, result: ScanResult, reason: str) -> None:
    """Durably cut ``segments[i]`` at ``result.end`` and delete every later segment."""
    seg = segments[i]
    dropped = seg.size - result.end + sum(s.size for s in segments[i + 1 :])
    log.warning(
        "commitlog recovery: truncated %s at offset %d (file position %d): %s; dropped %d bytes",
        seg.path, seg.base + result.end, result.end, reason, dropped,
    )  # fmt: skip
    for later in segments[i + 1 :]:
        later.close()  # no reader exists yet: close at once, no graveyard
        later.delete()
    seg.truncate(result.end)
    seg.sealed = False
    state.snapshot = SegmentSet.of(segments[: i + 1])
    fsync_dir(state.directory)

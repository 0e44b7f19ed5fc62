"""Opening a log: find its segments, verify them against what was promised, then trust
them (clean) or validate their tail (unclean).

Invariants:
- Everything here runs inside :meth:`CommitLog.open`, before the log is handed to any
  other thread, so it uses the :class:`LogState` without taking its lock.
- Every open, clean or not, checks the chain: each non-last segment's length equals
  its successor's base minus its own base (a sealed segment is extended to its full
  size). A mismatch (a segment truncated or extended in the middle of the log, a
  segment file missing) raises :class:`LogDamageError` naming the file and the byte
  range, never a silent cut. The one leniency: at an unclean open, when every later
  segment is empty and the mismatch lies at or past the checkpoint (a crash while
  rolling), the tail validation below cuts it like any torn tail.
- A clean open trusts the sealed segments' records (every read checks their CRC) but
  verifies the end: the active segment must end exactly at ``expected_end`` (the
  checkpoint's durable offset, when the caller has one) and its records from the last
  boundary-index position on must be whole with good CRCs. Otherwise
  :class:`LogDamageError` with the missing or damaged range. (A shortened newest
  segment opened cleanly would make new records reuse old offsets.)
- An unclean open validates from the start of the checkpoint's segment and durably
  cuts a torn or corrupt tail: later segments are removed and the directory fsynced
  first, then the file is cut and fsynced. Only bytes at or after
  ``checkpoint_offset`` (never promised durable) are cut: damage below it, or a log
  that ends before it, raises :class:`LogDamageError` and nothing is changed.
- Boundary indexes (derived data) are verified by checksum at every open; those
  missing, damaged or another segment's are rebuilt by a scan, those of the old format
  (unchecked u32s) converted when every position is a record start (its magic and
  embedded offset read there) and rebuilt otherwise; the open says so in one log line
  with counts. After any open every segment but the
  last is sealed, and so the last is never sealed (a sealed one is followed by a fresh
  segment).
"""

from __future__ import annotations

import itertools
import logging
import os
import struct
from collections import Counter
from typing import Callable

from clmq.common import RECORD_MAGIC, LogDamageError

from ._progress import report_progress
from ._scan import ScanResult, scan
from ._segment import Segment, fsync_dir, parse_segment_name, segment_name
from ._segments import SegmentSet
from ._state import LogState

log = logging.getLogger("clmq.commitlog")

_START = struct.Struct("<IIIQ")  # a record's total size, magic, CRC, commit-log offset


class Repairs:
    """What an open rebuilt from the log (derived data only), said in one line."""

    def __init__(self) -> None:
        self.boundaries: Counter[str] = Counter()  # why -> how many indexes rebuilt

    def note(self, problem: str, converted: bool) -> None:
        """One index rebuilt for ``problem`` (by a scan, unless ``converted`` from the
        old format's checked positions)."""
        if problem == "old format":
            problem += ", converted" if converted else ", rescanned"
        self.boundaries[problem] += 1

    def report(self, state: LogState) -> None:
        """Log the repairs, if any, in one line with counts."""
        if self.boundaries:
            whys = ", ".join(f"{why}: {n}" for why, n in sorted(self.boundaries.items()))
            log.warning(
                "commitlog open %s: rebuilt %d boundary indexes (%s)",
                state.directory,
                sum(self.boundaries.values()),
                whys,
            )


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


def open_clean(state: LogState, expected_end: int | None, roll: Callable[[], None], repairs: Repairs) -> None:
    """After a clean shutdown: check the chain and the end, seal all but the last
    segment, load (or rebuild) the boundary indexes."""
    check_chain(state, None)
    segments = state.snapshot.segments
    for seg in segments[:-1]:
        seg.sealed = True
        _load_boundaries(state, seg, repairs)
    active = segments[-1]
    if expected_end is not None and active.end != expected_end:
        raise _end_damage(state, active, expected_end, "was closed cleanly at")
    _verify_tail(state, active, repairs)
    if active.sealed:
        roll()


VALIDATING = "validating the CommitLog (CRC of every record past the checkpoint)"


def recover(state: LogState, checkpoint_offset: int | None, roll: Callable[[], None], repairs: Repairs) -> None:
    """Validate from the segment holding ``checkpoint_offset`` (from the first without
    one) and durably cut the log at the first problem past it; ``roll`` starts a new
    segment."""
    promised = checkpoint_offset or 0
    check_chain(state, promised)
    snapshot = state.snapshot
    segments = list(snapshot.segments)
    first = 0 if checkpoint_offset is None else snapshot.index(checkpoint_offset)
    for seg in segments[:first]:
        seg.sealed = True
        _load_boundaries(state, seg, repairs)
    to_check = sum(seg.end for seg in segments[first:])
    checked = 0
    for i in range(first, len(segments)):
        seg = segments[i]
        report_progress(VALIDATING, checked, to_check)
        result = scan(seg, state.config.max_message_bytes, verify=True)
        checked += seg.end
        nxt = segments[i + 1] if i + 1 < len(segments) else None
        problem = _tail_problem(seg, result, nxt)
        if problem is not None and seg.base + result.end < promised:
            raise LogDamageError(
                str(seg.path),
                seg.base + result.end,
                promised,
                f"{problem} (below the checkpoint's durable offset {promised})",
            )
        seg.boundaries.rewrite(result.starts)
        if problem is None and result.sealed:
            seg.sealed = True
            continue
        if problem is not None:
            _truncate_tail(state, segments, i, result, problem)
        break  # the active segment (intact to its end, or just cut there)
    report_progress(VALIDATING, to_check, to_check)
    active = state.snapshot.active
    if active.end < promised:
        raise _end_damage(state, active, promised, "has a checkpoint promising it durable up to")
    if active.sealed:
        roll()


def check_chain(state: LogState, promised: int | None) -> None:
    """Every non-last segment must end where its successor starts. ``promised`` is None
    for a clean open, else the checkpoint's durable offset (see the module docstring)."""
    segments = state.snapshot.segments
    for i, (seg, nxt) in enumerate(itertools.pairwise(segments)):
        if seg.size == nxt.base - seg.base:
            continue
        crash_while_rolling = all(s.size == 0 for s in segments[i + 1 :]) and min(seg.end, nxt.base) >= (promised or 0)
        if promised is not None and crash_while_rolling:
            return  # the tail validation cuts it
        raise _chain_damage(state, seg, nxt)


def _chain_damage(state: LogState, seg: Segment, nxt: Segment) -> LogDamageError:
    expected = nxt.base - seg.base
    if seg.size > expected:
        return LogDamageError(
            str(seg.path),
            nxt.base,
            seg.end,
            f"segment extended: {seg.size} bytes, but the next segment starts at {nxt.base}, "
            f"{seg.size - expected} bytes earlier",
        )
    if seg.size == state.config.segment_bytes:  # a whole segment, then a gap: a file is gone
        missing = state.directory / segment_name(seg.end)
        return LogDamageError(
            str(missing),
            seg.end,
            nxt.base,
            f"segment file missing: {seg.path.name} ends at {seg.end}, the next one starts at {nxt.base}",
        )
    return LogDamageError(
        str(seg.path),
        seg.end,
        nxt.base,
        f"segment truncated: {seg.size} bytes, but the next segment starts at {nxt.base} "
        f"({expected - seg.size} bytes missing)",
    )


def _end_damage(state: LogState, active: Segment, promised: int, what: str) -> LogDamageError:
    if active.end < promised:
        whole = active.size == state.config.segment_bytes  # the next segment file is gone
        where = state.directory / segment_name(active.end) if whole else active.path
        return LogDamageError(
            str(where),
            active.end,
            promised,
            f"the log ends at {active.end} but {what} {promised}: {promised - active.end} bytes missing",
        )
    return LogDamageError(
        str(active.path),
        promised,
        active.end,
        f"the log {what} {promised} but goes on to {active.end}: "
        f"{active.end - promised} bytes that were never written by it",
    )


def _verify_tail(state: LogState, seg: Segment, repairs: Repairs) -> None:
    """The active segment's last records, from its last boundary position (the whole
    segment when its index must be rebuilt), must be whole with good CRCs."""
    problem = seg.boundaries.load(seg.size)
    known = _trusted_positions(state, seg, problem, sealed=False)
    start = known[-1] if known else 0
    result = scan(seg, state.config.max_message_bytes, verify=True, start=start)
    if result.problem is not None:
        raise LogDamageError(str(seg.path), seg.base + result.end, seg.end, f"clean open: {result.problem}")
    if problem is not None:
        repairs.note(problem, bool(known))
        seg.boundaries.rewrite([*known, *result.starts])  # rewrite() drops the repeated start
    seg.sealed = result.sealed


def _load_boundaries(state: LogState, seg: Segment, repairs: Repairs) -> None:
    problem = seg.boundaries.load(seg.size)
    if problem is not None:
        known = _trusted_positions(state, seg, problem, sealed=True)
        repairs.note(problem, bool(known))
        seg.boundaries.rewrite(known or scan(seg, state.config.max_message_bytes, verify=False).starts)


def _trusted_positions(state: LogState, seg: Segment, problem: str | None, sealed: bool) -> list[int]:
    """The index positions that may be trusted after ``load``: all of a good index; those
    of an old-format one when they are dense enough to be whole (no gap a mark would
    have filled; to the end too when the segment is ``sealed``) and each is a record
    start (magic and embedded offset read there: a few hundred small reads instead of
    a scan of the segment); else none."""
    if problem is None:
        return list(seg.boundaries.positions)
    legacy = seg.boundaries.legacy
    if legacy is None:
        return []
    config = state.config
    # The first record start at or after a mark lies within one record of it.
    max_gap = config.boundary_interval_bytes + 2 * config.max_message_bytes
    ends = [0, *legacy, seg.size] if sealed else [0, *legacy]
    if any(b - a > max_gap for a, b in itertools.pairwise(ends)):
        return []
    for pos in legacy:
        head = seg.read(pos, _START.size)
        if len(head) < _START.size:
            return []
        _size, magic, _crc, offset = _START.unpack(head)
        if magic != RECORD_MAGIC or offset != seg.base + pos:
            return []
    return list(legacy)


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
    """Durably cut ``segments[i]`` at ``result.end`` and delete every later segment
    (removed, directory fsynced, then the file cut: a crash in between leaves the
    torn tail of a last segment, never a short segment in the middle)."""
    seg = segments[i]
    dropped = seg.size - result.end + sum(s.size for s in segments[i + 1 :])
    log.warning(
        "commitlog recovery: truncated %s at offset %d (file position %d): %s; dropped %d bytes never promised durable",
        seg.path,
        seg.base + result.end,
        result.end,
        reason,
        dropped,
    )
    for later in segments[i + 1 :]:
        later.close()  # no reader exists yet: close at once, no graveyard
        later.delete()
    state.snapshot = SegmentSet.of(segments[: i + 1])
    if len(segments) > i + 1:
        fsync_dir(state.directory)
    seg.truncate(result.end)
    seg.sealed = False

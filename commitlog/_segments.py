"""The set of segments of one log, as an immutable snapshot.

Invariants:
- ``segments`` is ordered by base and contiguous (each base is the previous segment's
  ``base + size``); ``bases[i] == segments[i].base`` always, because both are built
  together here and a ``SegmentSet`` is never modified, only replaced.
- A snapshot is never empty: the last segment is the active one.
- Only the membership is frozen. The :class:`Segment` objects themselves are shared
  between snapshots and stay mutable (the active one's ``size`` grows, ``sealed`` and
  ``fd`` change); see :class:`clmq.commitlog._state.LogState` for who may touch them.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from typing import Iterable

from ._segment import Segment


@dataclass(frozen=True, slots=True)
class SegmentSet:
    """Segments oldest first, with their bases for bisection."""

    segments: tuple[Segment, ...]
    bases: tuple[int, ...]

    @classmethod
    def of(cls, segments: Iterable[Segment]) -> SegmentSet:
        """The snapshot of ``segments`` (already in log order)."""
        segs = tuple(segments)
        return cls(segs, tuple(s.base for s in segs))

    @property
    def active(self) -> Segment:
        """The last segment, the only one that grows."""
        return self.segments[-1]

    @property
    def min_offset(self) -> int:
        """The first offset still in the log."""
        return self.segments[0].base

    def find(self, offset: int) -> Segment | None:
        """The segment whose range starts at or before ``offset``; None before the first.

        Past the active segment's end this still answers the active segment: callers
        bound their reads by the log's end themselves.
        """
        i = bisect_right(self.bases, offset) - 1
        return self.segments[i] if i >= 0 else None

    def index(self, offset: int) -> int:
        """The position of the segment holding ``offset`` (0 when before the first)."""
        return max(0, bisect_right(self.bases, offset) - 1)

    def extended(self, segment: Segment) -> SegmentSet:
        """A new snapshot with ``segment`` appended as the active one."""
        return SegmentSet((*self.segments, segment), (*self.bases, segment.base))

    def head(self, count: int) -> SegmentSet:
        """A new snapshot of the first ``count`` segments (the tail cut off)."""
        return SegmentSet(self.segments[:count], self.bases[:count])

    def tail(self, start: int) -> SegmentSet:
        """A new snapshot from position ``start`` on (old segments dropped)."""
        return SegmentSet(self.segments[start:], self.bases[start:])

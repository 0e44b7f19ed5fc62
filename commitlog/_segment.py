"""One CommitLog segment file and its sparse boundary index.

Invariants:
- A segment is named ``<20-digit base offset>.log``; the record at file position ``p``
  has log offset ``base + p``.
- Files are not preallocated: the file length is the write position, so a clean
  restart needs no scan to find the end.
- A *sealed* segment ends with a blank marker and is then extended (sparsely) to the
  configured segment size, so that ``base + length`` is the next segment's base.
- The boundary index (``<base>.bidx``) lists, as little-endian u32 file positions in
  increasing order, the first record start at or after every ``interval`` bytes. It is
  derived data: rebuilt by a scan whenever it is missing or the segment was recovered.
"""

from __future__ import annotations

import itertools
import logging
import os
from array import array
from pathlib import Path

SEGMENT_SUFFIX = ".log"
BOUNDARY_SUFFIX = ".bidx"

log = logging.getLogger("clmq.commitlog")


def segment_name(base: int) -> str:
    return f"{base:020d}{SEGMENT_SUFFIX}"


def parse_segment_name(name: str) -> int | None:
    stem, _dot, suffix = name.partition(".")
    if "." + suffix != SEGMENT_SUFFIX or len(stem) != 20 or not stem.isdigit():
        return None
    return int(stem)


def fsync_dir(path: Path) -> None:
    """Make file creations, renames and deletions in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class BoundaryIndex:
    """Sparse record-start positions of one segment, for splitting it without a scan."""

    def __init__(self, path: Path, interval: int) -> None:
        self.path = path
        self.interval = interval
        self.positions = array("I")
        self._next_mark = interval
        self._stale = False  # the file is behind memory; do not append to it

    def load(self) -> bool:
        """Read the file; False when missing or malformed (the caller rebuilds it)."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return False
        if len(data) % 4:
            return False
        positions = array("I")
        positions.frombytes(data)
        if any(b <= a for a, b in itertools.pairwise(positions)):
            return False
        self.positions = positions
        self._next_mark = (positions[-1] // self.interval + 1) * self.interval if positions else self.interval
        return True

    def note(self, starts: list[int]) -> bytes:
        """Record the starts (file positions, increasing) that cross a mark; return new bytes."""
        new = array("I")
        for start in starts:
            if start >= self._next_mark:
                new.append(start)
                self._next_mark = (start // self.interval + 1) * self.interval
        if new:
            self.positions.extend(new)
        return new.tobytes()

    def append_to_file(self, data: bytes) -> None:
        if data and not self._stale:
            try:
                with open(self.path, "ab") as f:
                    f.write(data)
            except OSError as e:
                self._give_up_file(e)

    def rewrite(self, starts: list[int]) -> None:
        """Replace the index with one built from a full list of record starts."""
        self.positions = array("I")
        self._next_mark = self.interval
        self.note(starts)
        tmp = self.path.with_suffix(".bidx.tmp")
        try:
            tmp.write_bytes(self.positions.tobytes())
            os.replace(tmp, self.path)
            self._stale = False
        except OSError as e:
            tmp.unlink(missing_ok=True)
            self._give_up_file(e)

    def _give_up_file(self, error: OSError) -> None:
        # Derived data: never fail an append or an open over it. Keep the positions in
        # memory and remove the file, so that the next open rebuilds it by a scan.
        log.warning("boundary index %s not written (%s); kept in memory, rebuilt at next open", self.path, error)
        self._stale = True
        self.path.unlink(missing_ok=True)

    def truncate(self, end: int) -> None:
        """Drop positions at or after ``end`` (after the segment was truncated)."""
        keep = [p for p in self.positions if p < end]
        if len(keep) != len(self.positions):
            self.rewrite(keep)


class Segment:
    """An open segment file: positional reads and writes, durable truncation."""

    def __init__(self, directory: Path, base: int, boundary_interval: int, create: bool = False) -> None:
        self.base = base
        self.path = directory / segment_name(base)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        self.fd = os.open(self.path, flags, 0o644)
        self.size = os.fstat(self.fd).st_size  # write position == file length
        self.sealed = False
        self.boundaries = BoundaryIndex(directory / (segment_name(base)[:-4] + BOUNDARY_SUFFIX), boundary_interval)

    @property
    def end(self) -> int:
        return self.base + self.size

    def write(self, pos: int, data: bytes | bytearray | memoryview) -> None:
        """Write all of ``data`` at file position ``pos`` (loops over short writes)."""
        view = memoryview(data)
        while view:
            n = os.pwrite(self.fd, view, pos)
            view = view[n:]
            pos += n

    def read(self, pos: int, n: int) -> bytes:
        return os.pread(self.fd, n, pos)

    def truncate(self, size: int) -> None:
        """Cut the file to ``size`` bytes and make the cut durable."""
        os.ftruncate(self.fd, size)
        os.fsync(self.fd)
        self.size = size
        self.boundaries.truncate(size)

    def seal(self, segment_bytes: int) -> None:
        """Extend a segment that ends in a blank marker to its full (sparse) size."""
        if self.size < segment_bytes:
            os.ftruncate(self.fd, segment_bytes)
            self.size = segment_bytes
        self.sealed = True

    def sync(self) -> None:
        os.fdatasync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def delete(self) -> None:
        """Unlink the files; the descriptor stays open for readers still using it."""
        self.path.unlink(missing_ok=True)
        self.boundaries.path.unlink(missing_ok=True)

"""One CommitLog segment file and its sparse boundary index.

Invariants:
- A segment is named ``<20-digit base offset>.log``; the record at file position ``p``
  has log offset ``base + p``.
- Files are not preallocated: the file length is the write position, so a clean
  restart needs no scan to find the end.
- A *sealed* segment ends with a blank marker and is then extended (sparsely) to the
  configured segment size, so that ``base + length`` is the next segment's base.
- The boundary index (``<base>.bidx``) lists, in increasing order, the file position
  of the first record start at or after every ``interval`` bytes; each entry carries a
  CRC32C of (segment base, position) and the file a checksummed header naming the
  base. It is derived data: written without fsync, verified at every open, and rebuilt
  by a scan whenever it is missing, damaged, another segment's, or its segment was
  recovered; one of the old format (plain u32s) is converted once its positions are
  checked to be record starts. A new segment gets a header-only index
  at once, so a missing index always means damage.
- Every read, write, truncation and sync of a segment or index file goes through
  :data:`clmq.commitlog.fileops.OPS` (the fault-injection seam); opening, closing, stat and
  unlinking use :mod:`os` directly.
"""

from __future__ import annotations

import itertools
import logging
import os
import struct
from array import array
from pathlib import Path
from typing import Iterable

from crc32c import crc32c

from . import fileops

SEGMENT_SUFFIX = ".log"
BOUNDARY_SUFFIX = ".bidx"

BOUNDARY_MAGIC = b"CLBI"
BOUNDARY_VERSION = 1
HEADER_START = struct.Struct("<4sHHQ")  # magic, version, reserved, segment base
HEADER = struct.Struct("<4sHHQI")  # ... and the CRC32C of the bytes before it
ENTRY = struct.Struct("<II")  # file position, CRC32C of _BASE_POS(base, position)
_BASE_POS = struct.Struct("<QI")
_U32 = struct.Struct("<I")

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
        fileops.OPS.fsync(fd)
    finally:
        os.close(fd)


class BoundaryIndex:
    """Sparse record-start positions of one segment, for splitting it without a scan.

    The file is a 20-byte header (``HEADER``: magic, version, the segment's base, a
    CRC32C of those) followed by 8-byte entries (``ENTRY``: a file position and the
    CRC32C of the base and that position), so that a flipped byte, a torn entry, or
    another segment's index (a different base) is recognised and rebuilt.
    """

    def __init__(self, path: Path, interval: int, base: int) -> None:
        self.path = path
        self.interval = interval
        self.base = base
        self.positions = array("I")
        self._next_mark = interval
        self._stale = False  # the file is behind memory; do not append to it
        # After load() answered "old format": the positions of the old (unchecked) file,
        # for the opener to check against the segment and convert instead of a scan.
        self.legacy: array[int] | None = None

    def load(self, size: int) -> str | None:
        """Read and verify the file against a segment of ``size`` bytes; None when it is
        good, else why not (``missing``, ``damaged``, ``foreign``, ``unrecognised``, or
        ``old format``: then :attr:`legacy` holds its unchecked positions): the caller
        rebuilds it."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return "missing"
        self.legacy = None
        positions, problem = decode_boundaries(data, self.base, size)
        if positions is None:
            if problem == "unrecognised":
                self.legacy = decode_legacy(data, size)
            return problem if self.legacy is None else "old format"
        self.positions = positions
        self._next_mark = (positions[-1] // self.interval + 1) * self.interval if positions else self.interval
        self._stale = False
        return None

    def note(self, starts: list[int]) -> bytes:
        """Record the starts (file positions, increasing) that cross a mark; return the
        encoded entries to append to the file (empty when none crossed one)."""
        new: list[int] = []
        for start in starts:
            if start >= self._next_mark:
                new.append(start)
                self._next_mark = (start // self.interval + 1) * self.interval
        if not new:
            return b""
        self.positions.extend(new)
        return encode_entries(self.base, new)

    def append_to_file(self, data: bytes) -> None:
        """Append encoded entries (from :meth:`note`); never fails the caller."""
        if data and not self._stale:
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
                try:
                    at = os.fstat(fd).st_size
                    fileops.write_all(fd, data if at else encode_header(self.base) + data, at)
                finally:
                    os.close(fd)
            except OSError as e:
                self._give_up_file(e)

    def rewrite(self, starts: list[int]) -> None:
        """Replace the index with one built from a full list of record starts."""
        self.positions = array("I")
        self._next_mark = self.interval
        self.note(starts)
        tmp = self.path.with_suffix(".bidx.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                fileops.write_all(fd, encode_header(self.base) + encode_entries(self.base, self.positions), 0)
            finally:
                os.close(fd)
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


def encode_header(base: int) -> bytes:
    """The boundary index header of the segment based at ``base``."""
    head = HEADER_START.pack(BOUNDARY_MAGIC, BOUNDARY_VERSION, 0, base)
    return head + _U32.pack(crc32c(head))


def encode_entries(base: int, positions: Iterable[int]) -> bytes:
    """Boundary index entries: each position with the CRC32C of (base, position)."""
    out = bytearray()
    for pos in positions:
        out += ENTRY.pack(pos, crc32c(_BASE_POS.pack(base, pos)))
    return bytes(out)


def read_boundary_index(path: Path | str, base: int) -> list[int]:
    """The record-start file positions in the boundary index at ``path`` of the segment
    based at ``base``, for readers outside the store (a Spark planner) that take them
    as hints and check the records they land on.

    Entries are read up to the first one that fails its check (a broker may be
    appending one right now); an index of the old format (plain u32s) is taken as it
    is; a missing, unreadable or another segment's index gives ``[]``.
    """
    try:
        data = Path(path).read_bytes()
    except OSError:
        return []
    if data[:4] != BOUNDARY_MAGIC:
        legacy = decode_legacy(data, 1 << 32)
        return list(legacy) if legacy is not None else []
    if len(data) < HEADER.size:
        return []
    _magic, version, _reserved, file_base, crc = HEADER.unpack_from(data)
    if crc != crc32c(data[: HEADER_START.size]) or version != BOUNDARY_VERSION or file_base != base:
        return []
    out: list[int] = []
    whole = (len(data) - HEADER.size) // ENTRY.size * ENTRY.size
    for pos, entry_crc in ENTRY.iter_unpack(memoryview(data)[HEADER.size : HEADER.size + whole]):
        if entry_crc != crc32c(_BASE_POS.pack(base, pos)) or (out and pos <= out[-1]):
            break
        out.append(pos)
    return out


def decode_legacy(data: bytes, size: int) -> array[int] | None:
    """The positions of an index of the old format (increasing u32s, no checksum) for a
    segment of ``size`` bytes; None when the bytes cannot be one."""
    if len(data) % 4:
        return None
    positions = array("I")
    positions.frombytes(data)
    if any(b <= a for a, b in itertools.pairwise(positions)) or (positions and positions[-1] >= size):
        return None
    return positions


def decode_boundaries(data: bytes, base: int, size: int) -> tuple[array[int] | None, str]:
    """The positions of a boundary index file of the segment at ``base`` holding
    ``size`` bytes, or None and why they cannot be trusted."""
    if len(data) < HEADER.size or data[:4] != BOUNDARY_MAGIC:
        return None, "unrecognised"
    _magic, version, _reserved, file_base, crc = HEADER.unpack_from(data)
    if crc != crc32c(data[: HEADER_START.size]) or version != BOUNDARY_VERSION:
        return None, "damaged"
    if file_base != base:
        return None, "foreign"
    body = memoryview(data)[HEADER.size :]
    if len(body) % ENTRY.size:
        return None, "damaged"
    positions = array("I")
    last = -1
    for pos, entry_crc in ENTRY.iter_unpack(body):
        if entry_crc != crc32c(_BASE_POS.pack(base, pos)) or pos <= last or pos >= size:
            return None, "damaged"
        positions.append(pos)
        last = pos
    return positions, ""


class Segment:
    """An open segment file: positional reads and writes, durable truncation.

    Every read, write, truncation, sync and close goes through :data:`fileops.OPS`.
    """

    def __init__(self, directory: Path, base: int, boundary_interval: int, create: bool = False) -> None:
        self.base = base
        self.path = directory / segment_name(base)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        self.fd = os.open(self.path, flags, 0o644)
        self.size = os.fstat(self.fd).st_size  # write position == file length
        self.sealed = False
        self.boundaries = BoundaryIndex(
            directory / (segment_name(base)[:-4] + BOUNDARY_SUFFIX), boundary_interval, base
        )
        if create:  # an empty index, so that a missing one always means damage
            self.boundaries.rewrite([])

    @property
    def end(self) -> int:
        return self.base + self.size

    def write(self, pos: int, data: bytes | bytearray | memoryview) -> None:
        """Write all of ``data`` at file position ``pos`` (loops over short writes)."""
        fileops.write_all(self.fd, data, pos)

    def read(self, pos: int, n: int) -> bytes:
        return fileops.OPS.pread(self.fd, n, pos)

    def truncate(self, size: int) -> None:
        """Cut the file to ``size`` bytes and make the cut durable."""
        fileops.OPS.ftruncate(self.fd, size)
        fileops.OPS.fsync(self.fd)
        self.size = size
        self.boundaries.truncate(size)

    def seal(self, segment_bytes: int) -> None:
        """Extend a segment that ends in a blank marker to its full (sparse) size."""
        if self.size < segment_bytes:
            fileops.OPS.ftruncate(self.fd, segment_bytes)
            self.size = segment_bytes
        self.sealed = True

    def sync(self) -> None:
        fileops.OPS.fdatasync(self.fd)

    def close(self) -> None:
        # fd is -1 before the descriptor closes: a flush that finds its fsync refused
        # (EBADF) then always sees why; closed first, it could look in between.
        fd, self.fd = self.fd, -1
        if fd >= 0:
            fileops.OPS.close(fd)

    def delete(self) -> None:
        """Unlink the files; the descriptor stays open for readers still using it."""
        self.path.unlink(missing_ok=True)
        self.boundaries.path.unlink(missing_ok=True)

"""One key-index file: RocketMQ's IndexFile, a hash table on disk.

Layout (little-endian)::

    off        size            field
      0           56           header (below)
     56   4 x slots            hash slots: u32, the newest entry of the slot (1-based; 0: none)
      -  20 x entries          entries, in log order

    header: u32 magic, u32 crc32c (of header bytes [8, 56)), u32 slot_count,
            u32 max_entries, u32 entry_count, u32 reserved, i64 begin_ms, i64 end_ms
            (store times of the first and newest entry), i64 begin_offset (the log
            offset this file starts indexing at), i64 end_offset (indexed up to:
            every record below it is in this file or an older one)
    entry:  u32 key hash, i64 commit-log offset, i32 store time in seconds since
            begin_ms // 1000, u32 previous entry of the same slot (1-based; 0: none)

An entry's previous link always names an older entry, so a slot's chain runs newest
first and ends. Only the header's ``entry_count`` entries count; bytes past them (a
round written after the last persist) are cut when the file is opened.

The active file keeps its slot table in memory (4 bytes a slot) and writes the pages
that changed at :meth:`IndexFile.persist`; a sealed file is read with ``pread`` only.
Every file operation goes through ``commitlog.fileops.OPS``.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import crc32c
import numpy as np

from clmq.commitlog import fileops

INDEX_MAGIC = 0x636C6D69  # b"clmi"
HEADER = struct.Struct("<IIIIIIqqqq")
HEADER_SIZE = HEADER.size
ENTRY_SIZE = 20
INDEX_ENTRY_DTYPE = np.dtype({"names": ["hash", "offset", "dt", "prev"], "formats": ["<u4", "<i8", "<i4", "<u4"]})
assert INDEX_ENTRY_DTYPE.itemsize == ENTRY_SIZE
SLOT_PAGE_BYTES = 4096  # the active file's slot table is written back in pages of this size
# The slot table is read in pieces of this size: below glibc malloc's mmap threshold (128 KiB),
# so no transient as large as the table raises that threshold for the process's lifetime.
SLOT_READ_BYTES = 64 * 1024
SUFFIX = ".idx"


def index_file_name(begin_offset: int) -> str:
    """A file's name: the log offset it starts indexing at, 20 digits."""
    return f"{begin_offset:020d}{SUFFIX}"


class IndexHeader:
    """An index file's header, decoded (``ok``: magic and CRC good)."""

    __slots__ = ("begin_ms", "begin_offset", "count", "end_ms", "end_offset", "max_entries", "ok", "slots")
    begin_ms: int
    begin_offset: int
    count: int
    end_ms: int
    end_offset: int
    max_entries: int
    ok: bool
    slots: int

    def __init__(self, raw: bytes) -> None:
        self.ok = len(raw) == HEADER_SIZE
        if not self.ok:
            raw = bytes(HEADER_SIZE)
        magic, crc, self.slots, self.max_entries, self.count, _r, self.begin_ms, self.end_ms, b, e = HEADER.unpack(raw)
        self.begin_offset, self.end_offset = b, e
        self.ok = self.ok and magic == INDEX_MAGIC and crc == crc32c.crc32c(raw[8:])

    def pack(self) -> bytes:
        fields = (self.slots, self.max_entries, self.count, 0, self.begin_ms, self.end_ms)
        body = HEADER.pack(0, 0, *fields, self.begin_offset, self.end_offset)[8:]
        return struct.pack("<II", INDEX_MAGIC, crc32c.crc32c(body)) + body


def new_header(slots: int, max_entries: int, begin_offset: int) -> IndexHeader:
    h = IndexHeader(b"")
    h.ok, h.slots, h.max_entries, h.count = True, slots, max_entries, 0
    h.begin_ms, h.end_ms, h.begin_offset, h.end_offset = 0, 0, begin_offset, begin_offset
    return h


def slot_of(hashes: np.ndarray, slots: int) -> np.ndarray:
    return (hashes.astype(np.uint64) % np.uint64(slots)).astype(np.int64)


class IndexFile:
    """One index file, open. The active one (``slot_table`` loaded) takes entries."""

    def __init__(self, path: Path, fd: int, header: IndexHeader) -> None:
        self.path = path
        self.fd = fd
        self.header = header
        self.slot_table: np.ndarray | None = None  # the active file's slots, in memory
        self._dirty: np.ndarray | None = None  # its slot pages changed since the last persist

    # ------------------------------------------------------------------ opening
    @classmethod
    def create(cls, directory: Path, slots: int, max_entries: int, begin_offset: int) -> IndexFile:
        """A new, empty active file (header and a zeroed slot table, sparse)."""
        path = directory / index_file_name(begin_offset)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        f = cls(path, fd, new_header(slots, max_entries, begin_offset))
        try:
            fileops.OPS.ftruncate(fd, f.entries_pos)
            fileops.write_all(fd, f.header.pack(), 0)
        except OSError:  # a disk full: no half-made file left behind (created again later)
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        f.slot_table = np.zeros(slots, dtype=np.uint32)
        f._dirty = np.zeros(-(-slots * 4 // SLOT_PAGE_BYTES), dtype=bool)
        return f

    @classmethod
    def open(cls, path: Path) -> IndexFile:
        """An existing file, sealed (call :meth:`activate` to add to it)."""
        fd = os.open(path, os.O_RDWR)
        return cls(path, fd, IndexHeader(fileops.OPS.pread(fd, HEADER_SIZE, 0)))

    @property
    def entries_pos(self) -> int:
        return HEADER_SIZE + 4 * self.header.slots

    @property
    def full(self) -> bool:
        return self.header.count >= self.header.max_entries

    def activate(self) -> None:
        """Load the slot table to add entries; cut bytes past the header's count and
        repair slots that name entries past it (a persist cut short by a crash)."""
        h = self.header
        table = self._read_slots()
        fileops.OPS.ftruncate(self.fd, self.entries_pos + ENTRY_SIZE * h.count)
        self.slot_table = table
        self._dirty = np.zeros(-(-h.slots * 4 // SLOT_PAGE_BYTES), dtype=bool)
        if int(table.max(initial=0)) > h.count:
            self.rebuild_slots()

    def _read_slots(self) -> np.ndarray:
        """The slot table from the file, read in pieces straight into the array (a
        short file leaves the rest zero)."""
        table = np.zeros(self.header.slots, dtype=np.uint32)
        view = table.data.cast("B")
        for lo in range(0, len(view), SLOT_READ_BYTES):
            want = min(SLOT_READ_BYTES, len(view) - lo)
            raw = fileops.OPS.pread(self.fd, want, HEADER_SIZE + lo)
            whole = len(raw) // 4 * 4
            view[lo : lo + whole] = raw[:whole]
            if len(raw) < want:
                break
        return table

    def rebuild_slots(self) -> None:
        """The slot table again from the entries (each slot: its newest entry)."""
        assert self.slot_table is not None and self._dirty is not None
        entries = self.read_entries(0, self.header.count)
        self.slot_table[:] = 0
        if len(entries):
            numbers = np.arange(1, len(entries) + 1, dtype=np.uint32)
            np.maximum.at(self.slot_table, slot_of(entries["hash"], self.header.slots), numbers)
        self._dirty[:] = True

    # ------------------------------------------------------------------ writing
    def append(self, hashes: np.ndarray, offsets: np.ndarray, times_ms: np.ndarray) -> int:
        """Add entries (in log order) up to the file's capacity; returns how many it
        took. A write error leaves the file as it was (and raises)."""
        assert self.slot_table is not None and self._dirty is not None
        h = self.header
        n = min(len(hashes), h.max_entries - h.count)
        if n <= 0:
            return 0
        hashes, offsets, times_ms = hashes[:n], offsets[:n], times_ms[:n]
        if h.count == 0:
            h.begin_ms = int(times_ms[0])
        rows = np.empty(n, dtype=INDEX_ENTRY_DTYPE)
        rows["hash"], rows["offset"] = hashes, offsets
        rows["dt"] = np.clip(times_ms // 1000 - h.begin_ms // 1000, -(2**31), 2**31 - 1)
        slots = slot_of(hashes, h.slots)
        numbers = np.arange(h.count + 1, h.count + n + 1, dtype=np.uint32)
        heads = self.slot_table[slots]  # a copy: put back if the entries cannot be written
        rows["prev"] = self._links(slots, numbers)
        try:
            fileops.write_all(self.fd, rows.tobytes(), self.entries_pos + ENTRY_SIZE * h.count)
        except OSError:  # the slots must not name entries that are not there
            self.slot_table[slots] = heads
            raise
        self._dirty[slots * 4 // SLOT_PAGE_BYTES] = True
        h.count += n
        h.end_ms = max(h.end_ms, int(times_ms.max()))
        return n

    def _links(self, slots: np.ndarray, numbers: np.ndarray) -> np.ndarray:
        """Link each new entry to its previous one (the slot's head before this batch,
        or the batch's own previous entry of the slot) and make the newest of each slot
        its head. Only entries whose slot occurs more than once in the batch are sorted
        (found with the table as scratch: a repeated index in an assignment keeps the
        last value; an entry that is not both the first and the last of its slot in the
        batch shares it)."""
        table = self.slot_table
        assert table is not None
        prev: np.ndarray = table[slots]  # the chain's head before this batch
        table[slots[::-1]] = numbers[::-1]
        first = table[slots] == numbers  # the batch's oldest entry of its slot
        table[slots] = numbers  # the newest entry of each slot is its head now
        shared = np.flatnonzero(~(first & (table[slots] == numbers)))  # slots the batch uses more than once
        if len(shared):
            order = shared[np.argsort(slots[shared], kind="stable")]
            same = np.flatnonzero(slots[order[1:]] == slots[order[:-1]])
            prev[order[same + 1]] = numbers[order[same]]
        return prev

    def persist(self, sync: bool = True) -> None:
        """Entries first (durable), then the changed slot pages, then the header. The
        slots are written from the table itself, not a copy (a 20 MB transient each
        checkpoint): the caller keeps appends out meanwhile (:class:`KeyIndex`'s lock)."""
        if sync:
            fileops.OPS.fdatasync(self.fd)
        if self.slot_table is not None and self._dirty is not None and self._dirty.any():
            raw = self.slot_table.data.cast("B")  # no copy: the caller holds the index's lock
            pages = np.flatnonzero(self._dirty).tolist()
            if len(pages) > len(self._dirty) // 4:  # random slots dirty most pages: one write of the table
                fileops.write_all(self.fd, raw, HEADER_SIZE)
            for page in pages if len(pages) <= len(self._dirty) // 4 else []:
                lo = page * SLOT_PAGE_BYTES
                fileops.write_all(self.fd, raw[lo : lo + SLOT_PAGE_BYTES], HEADER_SIZE + lo)
            self._dirty[:] = False
        fileops.write_all(self.fd, self.header.pack(), 0)
        if sync:
            fileops.OPS.fdatasync(self.fd)

    def mark_all_dirty(self) -> None:
        """Write the whole slot table with the next persist."""
        if self._dirty is not None:
            self._dirty[:] = True

    def seal(self) -> None:
        """Persist everything and drop the slot table from memory."""
        self.persist(sync=True)
        self.slot_table, self._dirty = None, None

    def cut_after(self, count: int) -> None:
        """Drop entries ``count`` and later (newest first, each the head of its slot's
        chain when it goes: the slot then names its previous entry). Active files only."""
        assert self.slot_table is not None and self._dirty is not None
        h = self.header
        gone = self.read_entries(count, h.count)
        for number in range(h.count, count, -1):
            row = gone[number - count - 1]
            s = int(slot_of(np.array([row["hash"]]), h.slots)[0])
            if self.slot_table[s] == number:
                self.slot_table[s] = row["prev"]
                self._dirty[s * 4 // SLOT_PAGE_BYTES] = True
        h.count = count
        fileops.OPS.ftruncate(self.fd, self.entries_pos + ENTRY_SIZE * count)

    # ------------------------------------------------------------------ reading
    def slot(self, s: int) -> int:
        """The newest entry of slot ``s`` (1-based; 0: none)."""
        if self.slot_table is not None:
            return int(self.slot_table[s])
        raw = fileops.OPS.pread(self.fd, 4, HEADER_SIZE + 4 * s)
        return int.from_bytes(raw, "little") if len(raw) == 4 else 0

    def entry(self, number: int) -> np.void | None:
        """Entry ``number`` (1-based), or None past the file's end."""
        raw = fileops.OPS.pread(self.fd, ENTRY_SIZE, self.entries_pos + ENTRY_SIZE * (number - 1))
        if len(raw) != ENTRY_SIZE:
            return None
        row: np.void = np.frombuffer(raw, dtype=INDEX_ENTRY_DTYPE)[0]
        return row

    def read_entries(self, first: int, end: int) -> np.ndarray:
        """Entries ``[first, end)`` (0-based) as a structured array (short if the file is)."""
        if end <= first:
            return np.empty(0, dtype=INDEX_ENTRY_DTYPE)
        raw = fileops.OPS.pread(self.fd, ENTRY_SIZE * (end - first), self.entries_pos + ENTRY_SIZE * first)
        return np.frombuffer(raw[: len(raw) // ENTRY_SIZE * ENTRY_SIZE], dtype=INDEX_ENTRY_DTYPE)

    def close(self) -> None:
        os.close(self.fd)

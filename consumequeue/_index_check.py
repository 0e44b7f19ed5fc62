"""The offline check of a store's key-index files (``clmq store check``): read-only.

Per file, in name order: the name (20 digits, ``.idx``), the header (magic, CRC32C),
its begin offset against the name and against the previous file's end (the files
cover the log without gaps), the entry count against the capacity and the file's
size; every slot (at most the entry count, and its head entry hashes to it); every
entry (its previous link names an older entry of the same slot, its commit-log offset
lies in the file's range (up to its end offset included: a record whose entries go on
in the next file), offsets never go down). Each problem names the file, the
position in it, what was expected and what was found. The newest file's slots may
name entries past its count (a persist cut short by a crash): the open repairs that,
so it is not damage.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from clmq.commitlog import fileops

from ._index_file import ENTRY_SIZE, HEADER_SIZE, INDEX_ENTRY_DTYPE, SUFFIX, IndexFile, slot_of

CHECK_CHUNK_ENTRIES = 1 << 20  # entries read at once by the check


@dataclass(frozen=True, slots=True)
class IndexProblem:
    """One damaged key-index file: where (byte position in the file) and what."""

    file: str
    position: int
    reason: str


def check_index_dir(directory: Path) -> list[IndexProblem]:
    """Every problem of the key-index files under ``directory`` (none if it is absent)."""
    if not directory.is_dir():
        return []
    problems: list[IndexProblem] = []
    paths = sorted(directory.glob(f"*{SUFFIX}"))
    previous_end: int | None = None
    for n, path in enumerate(paths):
        if not (path.stem.isdigit() and len(path.stem) == 20):
            problems.append(IndexProblem(str(path), 0, f"name: expected 20 digits{SUFFIX}, found {path.name!r}"))
            continue
        f = IndexFile.open(path)
        try:
            found = _check_file(f, previous_end, newest=n == len(paths) - 1)
        finally:
            f.close()
        problems += found
        previous_end = f.header.end_offset if not found else None
    return problems


def _check_file(f: IndexFile, previous_end: int | None, newest: bool) -> list[IndexProblem]:
    h, name = f.header, str(f.path)
    size = f.path.stat().st_size
    if not h.ok:
        return [IndexProblem(name, 0, f"header: magic or CRC32C wrong (file of {size} bytes)")]
    expect_begin = int(f.path.stem)
    if h.begin_offset != expect_begin:
        return [IndexProblem(name, 0, f"begin offset: expected {expect_begin} (the name), found {h.begin_offset}")]
    if previous_end is not None and h.begin_offset != previous_end:
        return [
            IndexProblem(
                name, 0, f"begin offset: expected {previous_end} (the end of the previous file), found {h.begin_offset}"
            )
        ]
    if h.slots < 1 or h.count > h.max_entries or h.end_offset < h.begin_offset:
        return [
            IndexProblem(
                name,
                0,
                f"header: {h.slots} slots, {h.count} of {h.max_entries} entries, "
                f"offsets {h.begin_offset}..{h.end_offset}",
            )
        ]
    need = f.entries_pos + ENTRY_SIZE * h.count
    if size < need:
        return [IndexProblem(name, size, f"size: expected at least {need} bytes for {h.count} entries, found {size}")]
    hashes = np.empty(h.count, dtype=np.uint32)
    problem = _check_entries(f, hashes)
    return [problem] if problem else [p for p in [_check_slots(f, hashes, newest)] if p]


def _check_entries(f: IndexFile, hashes: np.ndarray) -> IndexProblem | None:
    """Links and offsets of every entry, chunk by chunk; fills ``hashes``."""
    h, last_offset = f.header, f.header.begin_offset
    for first in range(0, h.count, CHECK_CHUNK_ENTRIES):
        rows = f.read_entries(first, min(h.count, first + CHECK_CHUNK_ENTRIES))
        hashes[first : first + len(rows)] = rows["hash"]
        found = _entry_problem(rows, first, last_offset, (h.begin_offset, h.end_offset))
        if found is not None:
            i, what = found
            return IndexProblem(str(f.path), f.entries_pos + ENTRY_SIZE * (first + i), f"entry {first + i + 1}: {what}")
        last_offset = int(rows["offset"][-1]) if len(rows) else last_offset
    return _check_chains(f, hashes)


def _entry_problem(rows: np.ndarray, first: int, last_offset: int, span: tuple[int, int]) -> tuple[int, str] | None:
    """The first bad entry of a chunk (its index in the chunk, what is wrong)."""
    numbers = np.arange(first + 1, first + len(rows) + 1, dtype=np.int64)
    prev = rows["prev"].astype(np.int64)
    offsets = rows["offset"]
    bad = np.flatnonzero(prev >= numbers)
    if len(bad):
        i = int(bad[0])
        return i, f"previous link: expected below {numbers[i]}, found {prev[i]}"
    bad = np.flatnonzero((offsets < span[0]) | (offsets > span[1]))  # at the end: a record the next file goes on with
    if len(bad):
        i = int(bad[0])
        return i, f"commit-log offset: expected in [{span[0]}, {span[1]}], found {offsets[i]}"
    bad = np.flatnonzero(np.diff(np.concatenate([[last_offset], offsets])) < 0)
    if len(bad):
        i = int(bad[0])
        return i, f"commit-log offset: expected at least the previous entry's, found {offsets[i]}"
    return None


def _check_chains(f: IndexFile, hashes: np.ndarray) -> IndexProblem | None:
    """Every previous link names an entry of the same slot."""
    slots = slot_of(hashes, f.header.slots)
    for first in range(0, f.header.count, CHECK_CHUNK_ENTRIES):
        rows = f.read_entries(first, min(f.header.count, first + CHECK_CHUNK_ENTRIES))
        prev = rows["prev"].astype(np.int64)
        mine = slots[first : first + len(rows)]
        linked = prev > 0
        bad = np.flatnonzero(linked & (slots[np.maximum(prev - 1, 0)] != mine))
        if len(bad):
            i = int(bad[0])
            return IndexProblem(
                str(f.path),
                f.entries_pos + ENTRY_SIZE * (first + i),
                f"entry {first + i + 1}: previous link {prev[i]} is in slot {slots[prev[i] - 1]}, "
                f"expected slot {mine[i]}",
            )
    return None


def _check_slots(f: IndexFile, hashes: np.ndarray, newest: bool) -> IndexProblem | None:
    """Every slot names an entry of its own (at most the count; the newest file's may
    name more: the open repairs that)."""
    h = f.header
    raw = fileops.OPS.pread(f.fd, 4 * h.slots, HEADER_SIZE)
    table = np.zeros(h.slots, dtype=np.int64)
    table[: len(raw) // 4] = np.frombuffer(raw[: len(raw) // 4 * 4], dtype="<u4")
    over = np.flatnonzero(table > h.count)
    if len(over) and not newest:
        s = int(over[0])
        return IndexProblem(
            str(f.path), HEADER_SIZE + 4 * s, f"slot {s}: expected an entry up to {h.count}, found {table[s]}"
        )
    heads = np.flatnonzero((table > 0) & (table <= h.count))
    wrong = heads[slot_of(hashes[table[heads] - 1], h.slots) != heads]
    if len(wrong):
        s = int(wrong[0])
        got = int(slot_of(hashes[table[s] - 1 : table[s]], h.slots)[0])
        return IndexProblem(
            str(f.path),
            HEADER_SIZE + 4 * s,
            f"slot {s}: expected an entry of slot {s}, found entry {table[s]} of slot {got}",
        )
    return None


assert INDEX_ENTRY_DTYPE.itemsize == ENTRY_SIZE

"""Vectorised reading of record headers: a whole chunk of the log at once.

Only the walk from one record to the next is sequential (each record's size says where
the next starts); everything else is gathered column-wise with numpy. The dispatcher,
recovery rebuilds and the Spark reader use this.
"""

from __future__ import annotations

import struct
from itertools import chain
from operator import itemgetter
from typing import Any

import numpy as np
import numpy.ma  # np.unique imports it at its first call otherwise: a stall in a broker's first round

from ._record import (
    BLANK_MAGIC,
    HEADER_SIZE,
    OFF_BODY_LEN,
    OFF_BORN_HOST,
    OFF_BORN_PORT,
    OFF_BORN_TS,
    OFF_COMMITLOG_OFFSET,
    OFF_CRC,
    OFF_FLAGS,
    OFF_KEYS_LEN,
    OFF_MAGIC,
    OFF_PROPS_LEN,
    OFF_QUEUE_ID,
    OFF_QUEUE_OFFSET,
    OFF_RECONSUME,
    OFF_STORE_HOST,
    OFF_STORE_PORT,
    OFF_STORE_TS,
    OFF_TAGS_LEN,
    OFF_TOPIC_LEN,
    OFF_TOTAL_SIZE,
    RECORD_MAGIC,
)

HEADER_DTYPE = np.dtype(
    {
        "names": [
            "total_size",
            "magic",
            "crc",
            "commitlog_offset",
            "queue_offset",
            "queue_id",
            "flags",
            "born_ts",
            "store_ts",
            "born_host",
            "born_port",
            "store_host",
            "store_port",
            "reconsume_times",
            "topic_len",
            "tags_len",
            "keys_len",
            "props_len",
            "body_len",
        ],
        "formats": [
            "<u4",
            "<u4",
            "<u4",
            "<u8",
            "<u8",
            "<u4",
            "<u4",
            "<u8",
            "<u8",
            "V16",
            "<u2",
            "V16",
            "<u2",
            "<u4",
            "<u2",
            "<u2",
            "<u2",
            "<u4",
            "<u4",
        ],
        "offsets": [
            OFF_TOTAL_SIZE,
            OFF_MAGIC,
            OFF_CRC,
            OFF_COMMITLOG_OFFSET,
            OFF_QUEUE_OFFSET,
            OFF_QUEUE_ID,
            OFF_FLAGS,
            OFF_BORN_TS,
            OFF_STORE_TS,
            OFF_BORN_HOST,
            OFF_BORN_PORT,
            OFF_STORE_HOST,
            OFF_STORE_PORT,
            OFF_RECONSUME,
            OFF_TOPIC_LEN,
            OFF_TAGS_LEN,
            OFF_KEYS_LEN,
            OFF_PROPS_LEN,
            OFF_BODY_LEN,
        ],
        "itemsize": HEADER_SIZE,
    }
)
assert HEADER_DTYPE.itemsize == HEADER_SIZE
# Field name -> (dtype, offset). ``dtype.fields`` is typed Optional (None for dtypes
# without fields); this one has fields, so narrow it once here for the gathers below.
_fields = HEADER_DTYPE.fields
assert _fields is not None
_FIELDS: dict[str, tuple[np.dtype[Any], int]] = {name: (spec[0], spec[1]) for name, spec in _fields.items()}

_HEAD = struct.Struct("<II")
_COUNT_OF_RUN = itemgetter(1)  # (position, count, size) -> count


class Walk:
    """Where the records of a buffer start, and why the walk stopped.

    Records are described as runs ``(first position, count, size)``: maximal stretches of
    back-to-back records of one size (a run of same-size records is found with one
    vectorised check instead of one Python step per record).
    """

    __slots__ = ("reason", "runs", "stop")

    def __init__(self, runs: list[tuple[int, int, int]], stop: int, reason: str) -> None:
        self.runs = runs
        self.stop = stop  # position after the last whole record
        self.reason = reason  # "end" (ran out of bytes), "blank" (marker at stop) or "corrupt"

    @property
    def count(self) -> int:
        return sum(map(_COUNT_OF_RUN, self.runs))

    @property
    def starts(self) -> np.ndarray:
        """Buffer positions of every record (int64), computed for all runs at once."""
        if not self.runs:
            return np.empty(0, dtype=np.int64)
        if len(self.runs) == 1:
            p, c, s = self.runs[0]
            return np.arange(p, p + c * s, s, dtype=np.int64)
        flat = chain.from_iterable(self.runs)
        cols = np.fromiter(flat, np.int64, 3 * len(self.runs)).reshape(-1, 3)  # position, count, size
        counts = cols[:, 1]
        if int(counts.sum()) == len(cols):  # every run one record long (sizes vary throughout)
            return np.ascontiguousarray(cols[:, 0])
        run_of = np.repeat(np.arange(len(cols)), counts)  # each record's run
        firsts = np.cumsum(counts) - counts  # index of each run's first record
        within = np.arange(len(run_of), dtype=np.int64) - firsts[run_of]
        starts: np.ndarray = cols[run_of, 0] + within * cols[run_of, 2]
        return starts


_SPECULATE = 8  # after this many same-size records in a row, check further ones vectorised
_GALLOP_FIRST_RECORDS = 64  # records checked by the first vectorised step; doubled while all fit


def walk_records(data: bytes | bytearray | memoryview, pos: int = 0, max_size: int = 1 << 32) -> Walk:
    """Follow total-size fields from ``pos``; stop at a blank marker, a bad header or the end.

    Record by record in a tight loop while sizes vary; once :data:`_SPECULATE` records of
    one size follow each other, the next ones are checked vectorised in windows that start
    at :data:`_GALLOP_FIRST_RECORDS` records and double while every record fits, so the
    work stays proportional to the records walked (never to the bytes left in ``data``).
    """
    runs: list[tuple[int, int, int]] = []
    head, record_magic, header_size, speculate = _HEAD.unpack_from, RECORD_MAGIC, HEADER_SIZE, _SPECULATE
    n = len(data)
    run_pos, run_count, run_size = pos, 0, 0  # the run being extended
    while n - pos >= 8:
        size, magic = head(data, pos)
        if magic != record_magic:
            reason = "blank" if magic == BLANK_MAGIC else "corrupt"
            return _close(runs, run_pos, run_count, run_size, pos, reason)
        if size < header_size or size > max_size:
            return _close(runs, run_pos, run_count, run_size, pos, "corrupt")
        if size > n - pos:
            break
        if size != run_size:
            if run_count:
                runs.append((run_pos, run_count, run_size))
            run_pos, run_count, run_size = pos, 0, size
        run_count += 1
        pos += size
        if run_count == speculate:
            more = _gallop(data, pos, size)
            run_count += more
            pos += more * size
    return _close(runs, run_pos, run_count, run_size, pos, "end")


def _close(runs: list[tuple[int, int, int]], run_pos: int, count: int, size: int, stop: int, reason: str) -> Walk:
    """The walk, with the run being extended appended to ``runs``."""
    if count:
        runs.append((run_pos, count, size))
    return Walk(runs, stop, reason)


def _gallop(data: bytes | bytearray | memoryview, pos: int, size: int) -> int:
    """How many whole records of ``size`` follow back to back from ``pos`` (maybe 0),
    checked in doubling windows so that a short run costs a short check."""
    n = len(data)
    window = _GALLOP_FIRST_RECORDS
    found = 0
    while True:
        fit = min(window, (n - pos) // size)
        if fit <= 0:
            return found
        ok = _same_size_prefix(data, pos, size, fit)
        found += ok
        if ok < fit:
            return found
        pos += fit * size
        window *= 2


def _same_size_prefix(data: bytes | bytearray | memoryview, pos: int, size: int, fit: int) -> int:
    """How many of the ``fit`` slots of ``size`` bytes from ``pos`` hold a record of that
    size, counted from the first until one does not (read in place: no copy of the data)."""
    sizes = np.ndarray((fit,), "<u4", data, pos, (size,))
    magics = np.ndarray((fit,), "<u4", data, pos + 4, (size,))
    ok = (sizes == size) & (magics == RECORD_MAGIC)
    return fit if ok.all() else int(np.argmin(ok))


def gather_headers(buf: np.ndarray, walk: Walk) -> np.ndarray:
    """The headers of the walked records as a structured array."""
    rows = _gather_rows(buf, walk, 0, HEADER_SIZE)
    return rows.view(HEADER_DTYPE).reshape(len(rows))


def _gather_rows(buf: np.ndarray, walk: Walk, lo: int, hi: int) -> np.ndarray:
    """Bytes ``[lo, hi)`` of every walked record as a (records, hi - lo) array: per run
    when runs are long (same-size records), by one fancy index when sizes vary."""
    if not walk.runs:
        return np.empty((0, hi - lo), np.uint8)
    if _short_runs(walk):  # per-run slicing would be a Python loop per record
        return buf[walk.starts[:, None] + np.arange(lo, hi)]
    return np.concatenate([_run_rows(buf, p, c, s, lo, hi) for p, c, s in walk.runs])


def _short_runs(walk: Walk) -> bool:
    """Whether runs average under 8 records (sizes vary): gather by record, not by run."""
    return len(walk.runs) * 8 > walk.count


def _run_rows(buf: np.ndarray, pos: int, count: int, size: int, lo: int, hi: int) -> np.ndarray:
    """Bytes ``[lo, hi)`` of each record of a same-size run, as a (count, hi - lo) array."""
    return np.ascontiguousarray(buf[pos : pos + count * size].reshape(count, size)[:, lo:hi])


def gather_fields(buf: np.ndarray, walk: Walk, names: list[str]) -> dict[str, np.ndarray]:
    """Only the named header columns (cheaper than :func:`gather_headers`)."""
    if walk.runs and _short_runs(walk) and buf.flags.c_contiguous:
        starts = walk.starts
        return {name: _gather_column(buf, starts, name) for name in names}
    spans = [_FIELDS[name][1] for name in names]
    lo = min(spans)
    hi = max(_FIELDS[name][1] + _FIELDS[name][0].itemsize for name in names)
    rows = _gather_rows(buf, walk, lo, hi)
    out: dict[str, np.ndarray] = {}
    for name in names:
        dtype, offset = _FIELDS[name]
        out[name] = (
            np.ascontiguousarray(rows[:, offset - lo : offset - lo + dtype.itemsize]).view(dtype).reshape(len(rows))
        )
    return out


def _gather_column(buf: np.ndarray, starts: np.ndarray, name: str) -> np.ndarray:
    """One header field of every record at ``starts``, read as that field's type in place:
    a view of ``buf`` holding one (unaligned) value at every byte offset, indexed once."""
    dtype, offset = _FIELDS[name]
    at_every_byte = np.ndarray((len(buf) - dtype.itemsize + 1,), dtype, buf, 0, (1,))
    column: np.ndarray = at_every_byte[starts + offset]
    return column


def gather_strings(buf: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> tuple[list[bytes], np.ndarray]:
    """Variable-length fields: the distinct values and, per record, an index into them.

    Fields such as topics and tags repeat heavily, so each distinct value is turned into
    a Python object once. Records are grouped by length, then deduplicated as rows.
    """
    n = len(offsets)
    inverse = np.zeros(n, dtype=np.int64)
    values: list[bytes] = []
    for length in np.unique(lengths).tolist():
        sel = np.flatnonzero(lengths == length)
        if length == 0:
            uniq_rows, inv = [b""], np.zeros(len(sel), dtype=np.int64)
        else:
            uniq_rows, inv = _dedupe_rows(buf[offsets[sel, None] + np.arange(length, dtype=np.int64)])
        inverse[sel] = np.asarray(inv).reshape(-1) + len(values)
        values.extend(uniq_rows)
    return values, inverse


_MIX = np.uint64(0x100000001B3)


def _dedupe_rows(rows: np.ndarray) -> tuple[list[bytes], np.ndarray]:
    """Distinct rows of an (n, width) uint8 array, and each row's index among them."""
    if (rows == rows[0]).all():  # the common case: one topic, one tag per chunk
        return [rows[0].tobytes()], np.zeros(len(rows), dtype=np.int64)
    n, width = rows.shape
    padded = np.zeros((n, -(-width // 8) * 8), dtype=np.uint8)
    padded[:, :width] = rows
    words = padded.view("<u8")
    code = words[:, 0].copy()
    for j in range(1, words.shape[1]):
        code = (code * _MIX) ^ words[:, j]  # wraps mod 2**64, as intended
    _, first, inv = np.unique(code, return_index=True, return_inverse=True)
    reps = rows[first]
    if not (rows == reps[inv]).all():  # a hash collision: take the exact (slower) path
        uniq, inv = np.unique(rows, axis=0, return_inverse=True)
        return [u.tobytes() for u in uniq], inv.reshape(-1)
    return [r.tobytes() for r in reps], inv.reshape(-1)

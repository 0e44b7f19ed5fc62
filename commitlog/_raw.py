"""Validating already-formatted bytes (a follower copying its leader) before writing them.

Invariants:
- Accepted bytes are whole records and blank markers; each record passes
  :func:`check_record` (CRC included), carries the log offset where it lands, and
  leaves room for a blank marker in its segment; each blank marker fills its segment
  exactly. Nothing is written here: a :class:`CorruptRecordError` means "write none".
  The error names the first bad record (or marker) of the chunk, as a record-by-record
  walk would.
- Queue offsets are taken from the records into the caller's table, with the old
  values noted in ``undo`` (-1: the key was new) so that the caller can restore them.
  They are taken only once every record has passed, so that a refused chunk leaves
  the table as it was.

How (a follower copies whole chunks of MiBs, so per-record Python is what limits its
catch-up): the chunk is walked once per segment with :func:`walk_records` (runs of
same-size records are found vectorised), every check but the CRC is done column-wise
(``_raw_columns``), the CRC is one call per record, and queue offsets are taken once
per distinct queue. A chunk of a few records skips numpy (its per-call cost is more
than the work) and checks each record with :func:`check_record`.
"""

from __future__ import annotations

import struct

import numpy as np

from clmq.common import (
    BLANK_MAGIC,
    BLANK_SIZE,
    HEADER_SIZE,
    OFF_COMMITLOG_OFFSET,
    OFF_QUEUE_OFFSET,
    OFF_TOPIC_LEN,
    CorruptRecordError,
    check_record,
    walk_records,
)

from ._encoder import QueueKey
from ._raw_columns import Span, check_columns
from ._scan import SIZE_MAGIC, u64_at

_QUEUE = struct.Struct("<QI")  # queue offset, queue id (adjacent header fields)
_U16 = struct.Struct("<H")
SMALL_RAW_RECORDS = 64  # chunks of at most this many records are checked without numpy (~crossover)

# A run of bytes to write into one segment: the bytes, the file positions of the records
# in it, and whether it ends with a blank marker (the segment is then full).
Piece = tuple[bytes, list[int], bool]


def split_raw(
    data: bytes,
    offset: int,
    seg_base: int,
    seg_pos: int,
    segment_bytes: int,
    table: dict[QueueKey, int],
    undo: dict[QueueKey, int],
    small_records: int = SMALL_RAW_RECORDS,
) -> list[Piece]:
    """Validate raw bytes landing at ``offset`` (file position ``seg_pos`` of the
    segment based at ``seg_base``) and cut them at blank markers. Chunks of at most
    ``small_records`` records are checked record by record, larger ones column-wise
    (the same checks and errors: the choice is only about speed)."""
    where = f"raw append at {offset}"
    spans, stop_error = _lay_out(data, offset, seg_base, seg_pos, segment_bytes)
    if sum(s.count for s in spans) <= small_records:
        latest = _check_small(data, spans, where, offset, segment_bytes)
    else:
        latest = _check_many(data, spans, where, offset, segment_bytes)
    if stop_error is not None:  # after the records before it: those are reported first
        raise stop_error
    _take_queue_offsets(latest, table, undo)
    return [(data[s.start : s.end], (s.starts + s.file_delta).tolist(), s.sealed) for s in spans]


def _lay_out(
    data: bytes, offset: int, seg_base: int, seg_pos: int, segment_bytes: int
) -> tuple[list[Span], CorruptRecordError | None]:
    """Walk the chunk's record sizes, one segment's share (span) at a time.

    Returns the spans and the error found where the walk stopped early (a blank marker
    of the wrong size, a header that does not walk, stray bytes), if any: it is raised
    only if every record before it passes."""
    spans: list[Span] = []
    n, start, base, pos0 = len(data), 0, seg_base, seg_pos
    while True:
        walk = walk_records(data, start)
        p = walk.stop
        span = Span(start, p, base, pos0 - start, walk.runs)
        if walk.reason != "blank":
            if start < n:
                spans.append(span)
            return spans, (_stop_error(data, p, f"raw append at {offset}", offset + p) if p < n else None)
        spans.append(span)
        size = SIZE_MAGIC.unpack_from(data, p)[0]
        room = segment_bytes - span.file_delta - p
        if size != room:
            return spans, CorruptRecordError(f"raw append at {offset}", offset + p, "blank size", str(room), str(size))
        span.end, span.sealed = p + BLANK_SIZE, True
        start, base, pos0 = p + BLANK_SIZE, base + segment_bytes, 0


def _stop_error(data: bytes, p: int, where: str, at: int) -> CorruptRecordError:
    """The error for bytes at ``p`` that the walk could not step over (not a marker)."""
    if len(data) - p < BLANK_SIZE:
        return CorruptRecordError(where, at, "record", "whole records", f"{len(data) - p} stray bytes")
    try:
        check_record(data, p, where, at)  # a bad magic, size or header: it raises
    except CorruptRecordError as e:
        return e
    raise AssertionError(f"the walk stopped at {p} before a valid record")


def _check_small(data: bytes, spans: list[Span], where: str, offset: int, segment_bytes: int) -> dict[QueueKey, int]:
    """Check each record in turn; return each queue's highest queue offset."""
    latest: dict[QueueKey, int] = {}
    topics: dict[bytes, str] = {}
    for s in spans:
        for p in s.starts.tolist():
            _check_placed(data, p, where, offset + p, s.base + s.file_delta + p, segment_bytes - s.file_delta - p)
            q_off, qid = _QUEUE.unpack_from(data, p + OFF_QUEUE_OFFSET)
            t = p + HEADER_SIZE
            raw = data[t : t + _U16.unpack_from(data, p + OFF_TOPIC_LEN)[0]]
            topic = topics.get(raw)
            if topic is None:
                topic = topics[raw] = _decode_topic(raw, where, offset + p)
            key = (topic, qid)
            if latest.get(key, -1) < q_off:
                latest[key] = q_off
    return latest


def _check_many(data: bytes, spans: list[Span], where: str, offset: int, segment_bytes: int) -> dict[QueueKey, int]:
    """Check the records column-wise; raise for the first bad one (exactly as
    :func:`_check_small` would); return each queue's highest queue offset."""
    found = check_columns(data, spans, segment_bytes)
    names: list[str] = []
    for i, raw in enumerate(found.topics):
        try:
            names.append(raw.decode())
        except UnicodeDecodeError:
            first = int(np.argmax(found.topic_index == i))  # only the records before found.bad are here
            p = int(found.starts[first])
            raise CorruptRecordError(where, offset + p, "topic", "UTF-8", repr(raw)) from None
    if found.bad < len(found.starts):
        p = int(found.starts[found.bad])
        s = next(s for s in spans if s.start <= p < s.end)
        _check_placed(data, p, where, offset + p, s.base + s.file_delta + p, segment_bytes - s.file_delta - p)
        raise AssertionError(f"record at {p} failed a column check and passed the scalar one")
    return {(names[t], qid): q for t, qid, q in found.latest}


def _check_placed(data: bytes, p: int, where: str, at: int, expected_offset: int, room: int) -> None:
    """The record at ``data[p:]`` is valid, says it lands at ``expected_offset`` and fits
    the ``room`` left in its segment with a blank marker after it."""
    size = check_record(data, p, where, at)
    found = u64_at(data, p + OFF_COMMITLOG_OFFSET)
    if found != expected_offset:
        raise CorruptRecordError(where, at, "commitlog offset", str(expected_offset), str(found))
    if size + BLANK_SIZE > room:
        raise CorruptRecordError(where, at, "segment room", f"<= {room - BLANK_SIZE}", str(size))


def _decode_topic(raw: bytes, where: str, at: int) -> str:
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise CorruptRecordError(where, at, "topic", "UTF-8", repr(raw)) from None


def _take_queue_offsets(latest: dict[QueueKey, int], table: dict[QueueKey, int], undo: dict[QueueKey, int]) -> None:
    """Advance each queue past its highest queue offset, noting old values in ``undo``."""
    for key, q_off in latest.items():
        old = table.get(key)
        undo.setdefault(key, -1 if old is None else old)
        if old is None or old <= q_off:
            table[key] = q_off + 1


def whole_prefix(data: bytes | memoryview, max_record_bytes: int) -> tuple[int, int, bool]:
    """How much of a chunk of raw log bytes is whole records: ``(length, needed,
    sealed)``. ``length`` bytes are whole records, ending with a blank marker when
    ``sealed`` (the rest of such a chunk is the segment's unused tail: ignore it);
    ``needed`` is the total size of the record cut at the end (0 if none), so that the
    next read can ask for at least that much. Only sizes are read here; the records
    are checked (CRC included) by :func:`split_raw` when they are appended. A size
    that no record can have raises :class:`CorruptRecordError`."""
    p, n = walk_records(data, 0, max_record_bytes).stop, len(data)  # the vectorised part;
    while n - p >= BLANK_SIZE:  # what stopped it (a marker, a cut record, a bad size) is read here
        size, magic = SIZE_MAGIC.unpack_from(data, p)
        if magic == BLANK_MAGIC:
            return p + BLANK_SIZE, 0, True
        if size < HEADER_SIZE or size > max_record_bytes:
            raise CorruptRecordError("raw chunk", p, "record size", f"{HEADER_SIZE}..{max_record_bytes}", str(size))
        if n - p < size:
            return p, size, False
        p += size
    return p, (HEADER_SIZE if p < n else 0), False

"""Validating already-formatted bytes (a follower copying its leader) before writing them.

Invariants:
- Accepted bytes are whole records and blank markers; each record passes
  :func:`check_record` (CRC included), carries the log offset where it lands, and
  leaves room for a blank marker in its segment; each blank marker fills its segment
  exactly. Nothing is written here: a :class:`CorruptRecordError` means "write none".
- Queue offsets are taken from the records into the caller's table, with the old
  values noted in ``undo`` (-1: the key was new) so that the caller can restore them.
"""

from __future__ import annotations

import struct

from ._encoder import QueueKey
from ._errors import CorruptRecordError
from ._record import (
    BLANK_MAGIC,
    BLANK_SIZE,
    HEADER_SIZE,
    OFF_COMMITLOG_OFFSET,
    OFF_QUEUE_ID,
    OFF_QUEUE_OFFSET,
    OFF_TOPIC_LEN,
    check_record,
)
from ._scan import SIZE_MAGIC, u64_at

_U32 = struct.Struct("<I")

# A run of bytes to write into one segment: the bytes, the file positions of the records
# in it, and whether it ends with a blank marker (the segment is then full).
Piece = tuple[bytes, list[int], bool]


def split_raw(data: bytes, offset: int, seg_base: int, seg_pos: int, segment_bytes: int,
              table: dict[QueueKey, int], undo: dict[QueueKey, int]) -> list[Piece]:  # fmt: skip
    """Validate raw bytes landing at ``offset`` (file position ``seg_pos`` of the
    segment based at ``seg_base``) and cut them at blank markers."""
    pieces: list[Piece] = []
    base, pos, p, piece_start = seg_base, seg_pos, 0, 0
    starts: list[int] = []
    where = f"raw append at {offset}"
    while p < len(data):
        if len(data) - p < BLANK_SIZE:
            raise CorruptRecordError(where, offset + p, "record", "whole records", f"{len(data) - p} stray bytes")
        size, magic = SIZE_MAGIC.unpack_from(data, p)
        if magic == BLANK_MAGIC:
            if size != segment_bytes - pos:
                raise CorruptRecordError(where, offset + p, "blank size", str(segment_bytes - pos), str(size))
            pieces.append((data[piece_start : p + BLANK_SIZE], starts, True))
            p += BLANK_SIZE
            base, pos, piece_start, starts = base + segment_bytes, 0, p, []
            continue
        _check_placed(data, p, where, offset + p, base + pos, segment_bytes - pos)
        _take_queue_offset(data, p, table, undo)
        starts.append(pos)
        p, pos = p + size, pos + size
    if piece_start < len(data):
        pieces.append((data[piece_start:], starts, False))
    return pieces


def _check_placed(data: bytes, p: int, where: str, at: int, expected_offset: int, room: int) -> None:
    """The record at ``data[p:]`` is valid, says it lands at ``expected_offset`` and fits
    the ``room`` left in its segment with a blank marker after it."""
    size = check_record(data, p, where, at)
    found = u64_at(data, p + OFF_COMMITLOG_OFFSET)
    if found != expected_offset:
        raise CorruptRecordError(where, at, "commitlog offset", str(expected_offset), str(found))
    if size + BLANK_SIZE > room:
        raise CorruptRecordError(where, at, "segment room", f"<= {room - BLANK_SIZE}", str(size))


def _take_queue_offset(data: bytes, p: int, table: dict[QueueKey, int], undo: dict[QueueKey, int]) -> None:
    """Advance the record's queue past its queue offset, noting the old value in ``undo``."""
    key = (_topic_at(data, p), _U32.unpack_from(data, p + OFF_QUEUE_ID)[0])
    old = table.get(key, 0)
    undo.setdefault(key, old if key in table else -1)
    table[key] = max(old, u64_at(data, p + OFF_QUEUE_OFFSET) + 1)


def _topic_at(data: bytes | memoryview, pos: int) -> str:
    tlen = int.from_bytes(data[pos + OFF_TOPIC_LEN : pos + OFF_TOPIC_LEN + 2], "little")
    return bytes(data[pos + HEADER_SIZE : pos + HEADER_SIZE + tlen]).decode()


def whole_prefix(data: bytes | memoryview, max_record_bytes: int) -> tuple[int, int, bool]:
    """How much of a chunk of raw log bytes is whole records: ``(length, needed,
    sealed)``. ``length`` bytes are whole records, ending with a blank marker when
    ``sealed`` (the rest of such a chunk is the segment's unused tail: ignore it);
    ``needed`` is the total size of the record cut at the end (0 if none), so that the
    next read can ask for at least that much. Only sizes are read here; the records
    are checked (CRC included) by :func:`split_raw` when they are appended. A size
    that no record can have raises :class:`CorruptRecordError`."""
    p, n = 0, len(data)
    while n - p >= BLANK_SIZE:
        size, magic = SIZE_MAGIC.unpack_from(data, p)
        if magic == BLANK_MAGIC:
            return p + BLANK_SIZE, 0, True
        if size < HEADER_SIZE or size > max_record_bytes:
            raise CorruptRecordError("raw chunk", p, "record size", f"{HEADER_SIZE}..{max_record_bytes}", str(size))
        if n - p < size:
            return p, size, False
        p += size
    return p, (HEADER_SIZE if p < n else 0), False

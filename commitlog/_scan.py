"""Walking a segment's records from its start, optionally validating each one.

Pure reads of one segment file: nothing here writes, locks or changes a segment, so
recovery may call it on any segment it has not yet published to readers.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import crc32c as _crc32c
import numpy as np

from clmq.common import (
    CRC_START,
    HEADER_SIZE,
    OFF_COMMITLOG_OFFSET,
    CorruptRecordError,
    Walk,
    check_record,
    gather_fields,
    walk_records,
)

from ._segment import Segment

_U32 = struct.Struct("<I")
SIZE_MAGIC = struct.Struct("<II")
_CHECKED = ["total_size", "crc", "commitlog_offset", "topic_len", "tags_len", "keys_len", "props_len", "body_len"]
_LENGTHS = ("topic_len", "tags_len", "keys_len", "props_len", "body_len")


@dataclass(frozen=True, slots=True)
class ScanResult:
    """What a validating walk of one segment found."""

    end: int  # file position after the last valid record (or blank marker)
    starts: list[int]  # file positions of valid records
    sealed: bool  # ended with a blank marker
    problem: str | None  # why the walk stopped before the file's end, if it did


def u64_at(data: bytes | memoryview, pos: int) -> int:
    """The little-endian u64 at ``data[pos:]``."""
    return int.from_bytes(data[pos : pos + 8], "little")


def scan(seg: Segment, max_message_bytes: int, verify: bool, start: int = 0) -> ScanResult:
    """Walk a segment's records from file position ``start`` (a record start; the
    segment's start by default), with CRC checks when ``verify``."""
    chunk = max(8 << 20, max_message_bytes + HEADER_SIZE)
    starts: list[int] = []
    pos, length = start, seg.size
    while pos < length:
        data = seg.read(pos, min(chunk, length - pos))
        walk = walk_records(data, 0, max_message_bytes)
        rel = walk.starts
        bad = _first_invalid(seg, data, pos, walk) if verify else None
        if bad is not None:
            starts.extend((rel[rel < bad[0] - pos] + pos).tolist())
            return ScanResult(bad[0], starts, False, bad[1])
        starts.extend((rel + pos).tolist())
        end = pos + walk.stop
        if walk.reason == "blank":
            remaining = SIZE_MAGIC.unpack_from(data, walk.stop)[0]
            if remaining != length - end:
                return ScanResult(end, starts, False, f"blank marker claims {remaining} bytes, {length - end} remain")
            return ScanResult(length, starts, True, None)
        if walk.reason == "corrupt":
            return ScanResult(end, starts, False, _describe(seg, data, walk.stop, end))
        if walk.stop == 0:  # not even one whole record: torn at the end of the file
            size = _U32.unpack_from(data, 0)[0] if len(data) >= 4 else 0
            return ScanResult(pos, starts, False, f"torn record: {size} bytes at position {pos}, file ends at {length}")
        pos = end
    return ScanResult(pos, starts, False, None)


def _first_invalid(seg: Segment, data: bytes, pos: int, walk: Walk) -> tuple[int, str] | None:
    """The first walked record that fails its checks, vectorised but for the CRC itself."""
    if not walk.runs:
        return None
    buf = np.frombuffer(data, dtype=np.uint8)
    rel = walk.starts
    h = gather_fields(buf, walk, _CHECKED)
    lengths = sum(h[f].astype(np.int64) for f in _LENGTHS)
    ok = (lengths + HEADER_SIZE == h["total_size"]) & (h["commitlog_offset"] == rel + (seg.base + pos))
    limit = int(np.argmin(ok)) if not ok.all() else len(rel)
    view, crc, crcs = memoryview(data), _crc32c.crc32c, h["crc"].tolist()
    for i, (start, size) in enumerate(zip(rel[:limit].tolist(), h["total_size"][:limit].tolist())):
        if crc(view[start + CRC_START : start + size]) != crcs[i]:
            limit = i
            break
    if limit == len(rel):
        return None
    at = int(rel[limit])
    return pos + at, _describe(seg, data, at, pos + at)


def _describe(seg: Segment, data: bytes, at: int, file_pos: int) -> str:
    """The precise error for the bad record at ``data[at:]``."""
    try:
        check_record(data, at, str(seg.path), seg.base + file_pos)
        found = u64_at(data, at + OFF_COMMITLOG_OFFSET)
        return str(
            CorruptRecordError(
                str(seg.path), seg.base + file_pos, "commitlog offset", str(seg.base + file_pos), str(found)
            )
        )
    except CorruptRecordError as e:
        return str(e)

"""Column-wise checks of a chunk of raw records (see ``_raw``): one numpy pass over the
headers, one CRC call per record, queue offsets per distinct queue."""

from __future__ import annotations

from typing import Any

import crc32c as _crc32c
import numpy as np

from clmq.common import BLANK_SIZE, CRC_START, HEADER_DTYPE, HEADER_SIZE, Walk, gather_fields, gather_strings

_FIELDS = [
    "total_size",
    "crc",
    "commitlog_offset",
    "queue_offset",
    "queue_id",
    "topic_len",
    "tags_len",
    "keys_len",
    "props_len",
    "body_len",
]
_fields = HEADER_DTYPE.fields
assert _fields is not None
_SPECS: dict[str, tuple[np.dtype[Any], int]] = {name: (_fields[name][0], _fields[name][1]) for name in _FIELDS}
_LENGTHS = ("topic_len", "tags_len", "keys_len", "props_len", "body_len")


class Span:
    """One segment's share of a chunk: data ``[start, end)``, its walked records, and
    how a data position maps to the log (``base + file_delta + p``) and to the segment
    file (``file_delta + p``)."""

    __slots__ = ("base", "end", "file_delta", "runs", "sealed", "start")

    def __init__(self, start: int, end: int, base: int, file_delta: int, runs: list[tuple[int, int, int]]) -> None:
        self.start, self.end, self.base, self.file_delta, self.runs = start, end, base, file_delta, runs
        self.sealed = False  # ends with a blank marker that fills its segment

    @property
    def count(self) -> int:
        return sum(c for _, c, _ in self.runs)

    @property
    def starts(self) -> np.ndarray:
        """Data positions of the span's records (int64)."""
        return Walk(self.runs, self.end, "end").starts


class Found:
    """What :func:`check_columns` found: ``bad`` is the index of the first record that
    fails a check (``len(starts)`` if none); ``topics``/``topic_index`` cover the
    records before it; ``latest`` is ``(topic index, queue id, highest queue offset)``
    per distinct queue, filled only when no record failed."""

    __slots__ = ("bad", "latest", "starts", "topic_index", "topics")

    def __init__(
        self,
        starts: np.ndarray,
        bad: int,
        topics: list[bytes],
        topic_index: np.ndarray,
        latest: list[tuple[int, int, int]],
    ) -> None:
        self.starts, self.bad, self.topics, self.topic_index, self.latest = starts, bad, topics, topic_index, latest


def check_columns(data: bytes, spans: list[Span], segment_bytes: int) -> Found:
    """Check every walked record of ``spans``: field lengths, CRC, embedded log offset
    and room for a blank marker (sizes and magics were checked by the walk)."""
    walk = Walk([r for s in spans for r in s.runs], len(data), "end")
    counts = [s.count for s in spans]
    starts = walk.starts
    buf = np.frombuffer(data, dtype=np.uint8)
    heads = _header_fields(data, buf, walk)
    sizes = heads["total_size"].astype(np.int64)
    file_at = starts + np.repeat(np.array([s.file_delta for s in spans], dtype=np.int64), counts)
    log_at = file_at + np.repeat(np.array([s.base for s in spans], dtype=np.int64), counts)
    ok = sum((heads[name].astype(np.int64) for name in _LENGTHS), np.int64(HEADER_SIZE)) == sizes
    ok &= heads["commitlog_offset"] == log_at.astype(np.uint64)
    ok &= file_at + sizes + BLANK_SIZE <= segment_bytes
    ok &= _crcs(data, starts, sizes) == heads["crc"]
    bad = len(starts) if ok.all() else int(np.argmin(ok))
    topic_lens = heads["topic_len"][:bad].astype(np.int64)
    topics, topic_index = gather_strings(buf, starts[:bad] + HEADER_SIZE, topic_lens)
    latest = _latest(topic_index, heads["queue_id"], heads["queue_offset"]) if bad == len(starts) else []
    return Found(starts, bad, topics, topic_index, latest)


def _header_fields(data: bytes, buf: np.ndarray, walk: Walk) -> dict[str, np.ndarray]:
    """The checked header columns: strided views straight over the chunk when records
    come in long runs of one size (nothing copied), else gathered row-wise."""
    if len(walk.runs) * 8 > walk.count:
        return gather_fields(buf, walk, _FIELDS)
    out: dict[str, np.ndarray] = {}
    for name in _FIELDS:
        dtype, off = _SPECS[name]
        parts = [np.ndarray((c,), dtype, data, p + off, (s,)) for p, c, s in walk.runs]
        out[name] = parts[0] if len(parts) == 1 else np.concatenate(parts)
    return out


def _crcs(data: bytes, starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """CRC32C of bytes ``[CRC_START, size)`` of each record: the one per-record call."""
    spans = map(slice, (starts + CRC_START).tolist(), (starts + sizes).tolist())
    got = map(_crc32c.crc32c, map(memoryview(data).__getitem__, spans))  # no bytecode per record: ~20% faster
    return np.array(list(got), dtype=np.uint32)


def _latest(topic_index: np.ndarray, queue_ids: np.ndarray, queue_offsets: np.ndarray) -> list[tuple[int, int, int]]:
    """``(topic index, queue id, highest queue offset)`` of each distinct queue."""
    codes = (topic_index.astype(np.uint64) << np.uint64(32)) | queue_ids.astype(np.uint64)
    order = np.lexsort((queue_offsets, codes))  # by queue, then queue offset: each queue's last is its highest
    codes, q_offs = codes[order], queue_offsets[order]
    last = np.flatnonzero(np.append(codes[1:] != codes[:-1], True))
    keys = codes[last]
    return list(zip((keys >> np.uint64(32)).tolist(), (keys & np.uint64(0xFFFFFFFF)).tolist(), q_offs[last].tolist()))

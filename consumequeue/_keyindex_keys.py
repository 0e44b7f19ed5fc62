"""Which keys a record is indexed under, and their 32-bit hashes, column-wise.

A record is indexed under ``topic#key`` for each of its keys and ``topic#uniq`` for
its ``UNIQ_KEY`` property. ``keys`` is split on ASCII whitespace (RocketMQ splits on
spaces; clmq's scan by key always split with ``str.split()``, which agrees for ASCII),
empty parts dropped.

The hash is computed over the key's bytes in 8-byte words with numpy, seeded by the
topic, so that a chunk of thousands of records is hashed in a few array operations;
:func:`key_hash` is the same function for one key (a query). Collisions are harmless:
every candidate is checked against its record.
"""

from __future__ import annotations

import re
import struct

import numpy as np
import xxhash

from clmq.common import HEADER_SIZE, Walk, decode_properties, gather_fields, gather_strings

UNIQ_KEY = "UNIQ_KEY"  # the property naming a message uniquely (set by the producer)
_UNIQ_NAME = UNIQ_KEY.encode()
# A producer's properties when UNIQ_KEY is the only one: u16 name length, name, u32 value length.
_UNIQ_HEAD = len(_UNIQ_NAME).to_bytes(2, "little") + _UNIQ_NAME
_P1 = np.uint64(0x9E3779B97F4A7C15)
_P2 = np.uint64(0xC2B2AE3D27D4EB4F)
_WHITESPACE = np.frombuffer(b" \t\n\r\x0b\x0c", dtype=np.uint8)
_TOKEN = re.compile(rb"\S+")
_FIELDS = ["store_ts", "topic_len", "tags_len", "keys_len", "props_len"]


def topic_seed(topic: bytes) -> int:
    return xxhash.xxh64_intdigest(topic + b"#")


def hash_rows(seeds: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """32-bit hashes of equal-length keys (an (n, width) uint8 array), one seed each."""
    n, width = rows.shape
    padded = np.zeros((n, -(-width // 8) * 8), dtype=np.uint8)
    padded[:, :width] = rows
    words = padded.view("<u8")
    h = seeds.astype(np.uint64) ^ (np.full(n, width, dtype=np.uint64) * _P2)
    for j in range(words.shape[1]):
        h = (h ^ words[:, j]) * _P1  # wraps mod 2**64, as intended
    h ^= h >> np.uint64(29)
    h *= _P2
    h ^= h >> np.uint64(32)
    return (h & np.uint64(0xFFFFFFFF)).astype(np.uint32)


def key_hash(topic: str, key: str) -> int:
    """The hash of ``topic#key`` (what a query looks up)."""
    raw = np.frombuffer(key.encode(), dtype=np.uint8).reshape(1, -1)
    return int(hash_rows(np.array([topic_seed(topic.encode())], dtype=np.uint64), raw)[0])


class KeyColumns:
    """A chunk's index entries before they are placed: per entry the record's number
    in the chunk, where the key's bytes start in the chunk and how long they are."""

    def __init__(self) -> None:
        self.record: list[np.ndarray] = []
        self.start: list[np.ndarray] = []
        self.length: list[np.ndarray] = []

    def add(self, record: np.ndarray, start: np.ndarray, length: np.ndarray) -> None:
        self.record.append(record.astype(np.int64))
        self.start.append(start.astype(np.int64))
        self.length.append(length.astype(np.int64))

    def columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if not self.record:
            empty = np.empty(0, dtype=np.int64)
            return empty, empty, empty
        return np.concatenate(self.record), np.concatenate(self.start), np.concatenate(self.length)


def chunk_keys(data: memoryview, walk: Walk) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every index entry of a walked chunk, in log order: ``(hashes, record positions
    in the chunk, store times in ms)``."""
    buf = np.frombuffer(data, dtype=np.uint8)
    starts = walk.starts
    heads = gather_fields(buf, walk, _FIELDS)
    topic_len = heads["topic_len"].astype(np.int64)
    keys_at = starts + HEADER_SIZE + topic_len + heads["tags_len"].astype(np.int64)
    keys_len = heads["keys_len"].astype(np.int64)
    props_at = keys_at + keys_len
    props_len = heads["props_len"].astype(np.int64)
    topics, topic_idx = gather_strings(buf, starts + HEADER_SIZE, topic_len)
    seeds = np.array([topic_seed(t) for t in topics], dtype=np.uint64)[topic_idx]
    found = KeyColumns()
    _plain_keys(buf, keys_at, keys_len, found)
    _uniq_keys(buf, data, props_at, props_len, found)
    rec, start, length = found.columns()
    if not len(rec):
        return np.empty(0, np.uint32), np.empty(0, np.int64), np.empty(0, np.int64)
    order = np.argsort(rec, kind="stable")
    rec, start, length = rec[order], start[order], length[order]
    hashes = np.empty(len(rec), dtype=np.uint32)
    for width in np.unique(length).tolist():
        sel = np.flatnonzero(length == width)
        rows = buf[start[sel, None] + np.arange(width, dtype=np.int64)]
        hashes[sel] = hash_rows(seeds[rec[sel]], rows)
    return hashes, starts[rec], heads["store_ts"].astype(np.int64)[rec]


def _plain_keys(buf: np.ndarray, at: np.ndarray, length: np.ndarray, found: KeyColumns) -> None:
    """Keys fields without whitespace are one key each (column-wise); the rest are split."""
    has = np.flatnonzero(length > 0)
    if not len(has):
        return
    single = np.ones(len(has), dtype=bool)
    for width in np.unique(length[has]).tolist():
        sel = np.flatnonzero(length[has] == width)
        rows = buf[at[has][sel, None] + np.arange(width, dtype=np.int64)]
        single[sel] = ~np.isin(rows, _WHITESPACE).any(axis=1)
    found.add(has[single], at[has][single], length[has][single])
    for i in has[~single].tolist():
        lo = int(at[i])
        parts = [(m.start(), m.end() - m.start()) for m in _TOKEN.finditer(buf[lo : lo + int(length[i])].tobytes())]
        if parts:
            found.add(np.full(len(parts), i), np.array([lo + p for p, _ in parts]), np.array([n for _, n in parts]))


def _uniq_keys(buf: np.ndarray, data: memoryview, at: np.ndarray, length: np.ndarray, found: KeyColumns) -> None:
    """UNIQ_KEY values: column-wise when it is the only property (a producer's usual
    message), else found by walking the properties."""
    has = np.flatnonzero(length > 0)
    if not len(has):
        return
    head = len(_UNIQ_HEAD) + 4
    fast = np.zeros(len(has), dtype=bool)
    ok = length[has] > head
    if ok.any():
        cand = has[ok]
        rows = buf[at[cand, None] + np.arange(len(_UNIQ_HEAD), dtype=np.int64)]
        named = (rows == np.frombuffer(_UNIQ_HEAD, dtype=np.uint8)).all(axis=1)
        vlen = buf[at[cand, None] + len(_UNIQ_HEAD) + np.arange(4)].astype(np.int64) @ (256 ** np.arange(4))
        fast[np.flatnonzero(ok)] = named & (vlen == length[cand] - head)
    one = has[fast]
    found.add(one, at[one] + head, length[one] - head)
    for i in has[~fast].tolist():
        lo, n = int(at[i]), int(length[i])
        span = _uniq_span(data[lo : lo + n])
        if span is not None:
            found.add(np.array([i]), np.array([lo + span[0]]), np.array([span[1]]))


def _uniq_span(props: memoryview) -> tuple[int, int] | None:
    """Where UNIQ_KEY's value lies in encoded properties (start, length), or None."""
    try:
        if UNIQ_KEY not in decode_properties(props):
            return None
    except (ValueError, IndexError, struct.error):
        return None  # not properties (damage): the record is not indexed by id
    pos, end = 0, len(props)
    while pos < end:
        klen = int.from_bytes(props[pos : pos + 2], "little")
        name = bytes(props[pos + 2 : pos + 2 + klen])
        pos += 2 + klen
        vlen = int.from_bytes(props[pos : pos + 4], "little")
        pos += 4
        if name == _UNIQ_NAME:
            return (pos, vlen) if vlen else None
        pos += vlen
    return None

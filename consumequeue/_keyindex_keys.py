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
from dataclasses import dataclass

import numpy as np
import xxhash

from clmq.common import HEADER_SIZE, Walk, gather_fields, gather_strings

UNIQ_KEY = "UNIQ_KEY"  # the property naming a message uniquely (set by the producer)
_UNIQ_NAME = UNIQ_KEY.encode()
# A producer's properties when UNIQ_KEY is the only one: u16 name length, name, u32 value length.
_UNIQ_HEAD = len(_UNIQ_NAME).to_bytes(2, "little") + _UNIQ_NAME
_P1 = np.uint64(0x9E3779B97F4A7C15)
_P2 = np.uint64(0xC2B2AE3D27D4EB4F)
_WHITESPACE = np.frombuffer(b" \t\n\r\x0b\x0c", dtype=np.uint8)
_TOKEN = re.compile(rb"\S+")
INDEX_FIELDS = ["store_ts", "topic_len", "tags_len", "keys_len", "props_len"]
MIN_STRIDED_RUN = 32  # runs of at least this many same-size records are read as strided views


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
    in the chunk, where the key's bytes start in the chunk and how long they are (or,
    for entries hashed already, the hash)."""

    def __init__(self) -> None:
        self.record: list[np.ndarray] = []
        self.start: list[np.ndarray] = []
        self.length: list[np.ndarray] = []
        self.hashed: list[tuple[np.ndarray, np.ndarray]] = []  # (records, hashes)

    def add(self, record: np.ndarray, start: np.ndarray, length: np.ndarray) -> None:
        self.record.append(record.astype(np.int64))
        self.start.append(start.astype(np.int64))
        self.length.append(length.astype(np.int64))

    def columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if not self.record:
            empty = np.empty(0, dtype=np.int64)
            return empty, empty, empty
        return np.concatenate(self.record), np.concatenate(self.start), np.concatenate(self.length)


@dataclass
class ChunkFields:
    """The columns of a chunk's records the index needs (the dispatcher's, when it has them)."""

    heads: dict[str, np.ndarray]  # at least INDEX_FIELDS
    topics: list[bytes]
    topic_idx: np.ndarray


def chunk_fields(buf: np.ndarray, walk: Walk) -> ChunkFields:
    heads = gather_fields(buf, walk, INDEX_FIELDS)
    topics, idx = gather_strings(buf, walk.starts + HEADER_SIZE, heads["topic_len"].astype(np.int64))
    return ChunkFields(heads, topics, idx)


def chunk_keys(
    data: memoryview, walk: Walk, fields: ChunkFields | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every index entry of a walked chunk, in log order: ``(hashes, record positions
    in the chunk, store times in ms)``. Runs of same-size records laid out alike are
    read as strided views; other records field by field."""
    buf = np.frombuffer(data, dtype=np.uint8)
    starts = walk.starts
    f = fields or chunk_fields(buf, walk)
    heads = f.heads
    keys_at = starts + HEADER_SIZE + heads["topic_len"].astype(np.int64) + heads["tags_len"].astype(np.int64)
    keys_len = heads["keys_len"].astype(np.int64)
    props_at = keys_at + keys_len
    props_len = heads["props_len"].astype(np.int64)
    seeds = np.array([topic_seed(t) for t in f.topics], dtype=np.uint64)[f.topic_idx]
    found = KeyColumns()
    layout = (keys_at - starts, keys_len, props_at - starts, props_len, f.topic_idx)
    rest = np.ones(len(starts), dtype=bool)
    first = 0
    for p, c, size in walk.runs:
        if c >= MIN_STRIDED_RUN and _strided_run(buf[p : p + c * size].reshape(c, size), first, layout, seeds, found):
            rest[first : first + c] = False
        first += c
    todo = np.flatnonzero(rest)
    _plain_keys(buf, keys_at, keys_len, found, todo)
    _uniq_keys(buf, props_at, props_len, found, todo)
    return _place(buf, found, seeds, starts, heads["store_ts"].astype(np.int64))


def _place(
    buf: np.ndarray, found: KeyColumns, seeds: np.ndarray, starts: np.ndarray, store_ts: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Hash what is not hashed yet, then every entry in record order."""
    rec, start, length = found.columns()
    recs, hashes = [rec], [np.empty(len(rec), dtype=np.uint32)]
    for width in np.unique(length).tolist():
        sel = np.flatnonzero(length == width)
        rows = buf[start[sel, None] + np.arange(width, dtype=np.int64)]
        hashes[0][sel] = hash_rows(seeds[rec[sel]], rows)
    for r, h in found.hashed:
        recs.append(r)
        hashes.append(h)
    rec_all, hash_all = np.concatenate(recs), np.concatenate(hashes)
    if len(rec):  # entries read field by field: put them among the runs' (already in record order)
        order = np.argsort(rec_all, kind="stable")
        rec_all, hash_all = rec_all[order], hash_all[order]
    return hash_all, starts[rec_all], store_ts[rec_all]


def _strided_run(
    view: np.ndarray,
    first: int,
    layout: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    seeds: np.ndarray,
    found: KeyColumns,
) -> bool:
    """Hash a run of same-size records whose keys and properties lie at the same place
    in each (one topic, one key without whitespace, UNIQ_KEY the only property); False
    (nothing added) when the run is not like that."""
    c = len(view)
    cols = [col[first : first + c] for col in layout]
    if any(int(col.min()) != int(col.max()) for col in cols):
        return False
    rk, kl, rp, pl = (int(col[0]) for col in cols[:4])
    head = len(_UNIQ_HEAD) + 4
    keys = view[:, rk : rk + kl]
    if kl and bool((keys <= 32).any()):  # whitespace (or a control byte): split field by field
        return False
    uniq = pl > head
    if pl and not uniq:
        return False
    if uniq:
        named = view[:, rp : rp + len(_UNIQ_HEAD)] == np.frombuffer(_UNIQ_HEAD, dtype=np.uint8)
        vlen = view[:, rp + len(_UNIQ_HEAD) : rp + head].astype(np.int64) @ (256 ** np.arange(4, dtype=np.int64))
        if not (named.all() and bool((vlen == pl - head).all())):
            return False
    recs = np.arange(first, first + c, dtype=np.int64)
    seed = seeds[first : first + c]
    parts = [hash_rows(seed, keys)] if kl else []
    if uniq:
        parts.append(hash_rows(seed, view[:, rp + head : rp + pl]))
    if parts:  # in record order: a record's key, then its UNIQ_KEY
        found.hashed.append((np.repeat(recs, len(parts)), np.stack(parts, axis=1).reshape(-1)))
    return True


def _plain_keys(buf: np.ndarray, at: np.ndarray, length: np.ndarray, found: KeyColumns, todo: np.ndarray) -> None:
    """Keys fields without whitespace are one key each (column-wise); the rest are split."""
    has = todo[length[todo] > 0]
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


def _uniq_keys(buf: np.ndarray, at: np.ndarray, length: np.ndarray, found: KeyColumns, todo: np.ndarray) -> None:
    """UNIQ_KEY values, found by walking every record's properties in lockstep, one
    property per step (column-wise, so a chunk costs a few array operations per
    property and no Python object per record). The last UNIQ_KEY of a record counts (as
    when its properties are decoded); a record whose properties do not parse (damage)
    or whose UNIQ_KEY is empty is not indexed by it."""
    has = todo[length[todo] > 0]
    pos, end = at[has], at[has] + length[has]
    value_at = np.full(len(has), -1, dtype=np.int64)
    value_len = np.zeros(len(has), dtype=np.int64)
    bad = np.zeros(len(has), dtype=bool)
    live = np.arange(len(has))
    while len(live):
        p, e = pos[live], end[live]
        name_len = _uint(buf, p, 2, e)
        value_pos = p + 2 + name_len
        vlen = _uint(buf, value_pos, 4, e)
        nxt = value_pos + 4 + vlen
        broken = (name_len < 0) | (vlen < 0) | (nxt > e)
        bad[live[broken]] = True
        ok = ~broken
        is_uniq = ok & (name_len == len(_UNIQ_NAME))
        is_uniq[is_uniq] = _is_uniq_name(buf, p[is_uniq] + 2)
        value_at[live[is_uniq]], value_len[live[is_uniq]] = value_pos[is_uniq] + 4, vlen[is_uniq]
        pos[live[ok]] = nxt[ok]
        live = live[ok & (nxt < e)]
    keep = ~bad & (value_len > 0)
    found.add(has[keep], value_at[keep], value_len[keep])


def _uint(buf: np.ndarray, at: np.ndarray, width: int, end: np.ndarray) -> np.ndarray:
    """The little-endian unsigned integers of ``width`` bytes at ``at``; -1 where they
    would run past ``end``."""
    inside = at + width <= end
    value = np.full(len(at), -1, dtype=np.int64)
    idx = at[inside, None] + np.arange(width, dtype=np.int64)
    value[inside] = buf[idx].astype(np.int64) @ (256 ** np.arange(width, dtype=np.int64))
    return value


def _is_uniq_name(buf: np.ndarray, at: np.ndarray) -> np.ndarray:
    """Which property names of UNIQ_KEY's length (at ``at``, in bounds) are UNIQ_KEY."""
    rows = buf[at[:, None] + np.arange(len(_UNIQ_NAME), dtype=np.int64)]
    same: np.ndarray = (rows == np.frombuffer(_UNIQ_NAME, dtype=np.uint8)).all(axis=1)
    return same

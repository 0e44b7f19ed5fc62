"""Decoding many records at once: header columns with numpy, strings decoded once per
distinct value, a CRC per record. About three times faster than decoding one by one,
which matters to consumers (every pulled message passes through here).

When the optional compiled decoder (``_cdecode``, built from common/_cdecode.c where a
C compiler was there at install) is importable, well-formed input is decoded by it
(about 3 times faster again); anything else is decoded here, which raises the error
naming the damaged record. ``CLMQ_PURE_PYTHON=1`` in the environment turns it off."""

from __future__ import annotations

from types import ModuleType

import crc32c as _crc32c
import numpy as np

from ._columns import gather_headers, gather_strings, walk_records
from ._compiled import COMPILED as _COMPILED
from ._lazy import LazyRecord
from ._record import CRC_START, HEADER_SIZE, Host, Record, check_record, decode_host


def _compiled() -> ModuleType | None:
    """The compiled decoder, set up to make LazyRecords; None when not built or turned off."""
    if _COMPILED is not None:
        _COMPILED.setup(LazyRecord, Record, decode_host)
    return _COMPILED


COMPILED = _compiled()


def _texts(buf: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> list[str]:
    values, idx = gather_strings(buf, offsets, lengths)
    decoded = [v.decode() for v in values]
    return [decoded[i] for i in idx.tolist()]


def _hosts(ips: list[bytes], ports: np.ndarray) -> list[Host]:
    if ips and ips.count(ips[0]) == len(ips) and (ports == ports[0]).all():  # the usual case: one host
        return [decode_host(ips[0], int(ports[0]))] * len(ips)
    cache: dict[tuple[bytes, int], Host] = {}
    out = []
    for ip, port in zip(ips, ports.tolist()):
        host = cache.get((ip, port))
        if host is None:
            host = cache[(ip, port)] = decode_host(ip, port)
        out.append(host)
    return out


def decode_records_many(data: bytes, where: str = "<buffer>", base_offset: int = 0) -> list[Record]:
    """Every record of ``data`` (back to back, nothing else), CRC-checked. A damaged
    record raises :class:`CorruptRecordError` naming ``where`` and its offset
    (``base_offset`` + position)."""
    if COMPILED is not None:
        records: list[Record] | None = COMPILED.decode(data)
        if records is not None:
            return records
    return decode_records_python(data, where, base_offset)


def decode_records_python(data: bytes, where: str = "<buffer>", base_offset: int = 0) -> list[Record]:
    """:func:`decode_records_many` without the compiled decoder (its oracle in tests)."""
    walk = walk_records(data)
    if walk.reason != "end" or walk.stop != len(data):
        check_record(data, walk.stop, where, base_offset + walk.stop)  # raises, saying what is wrong
    if not walk.runs:
        return []
    buf = np.frombuffer(data, dtype=np.uint8)
    h = gather_headers(buf, walk)
    starts = walk.starts
    sizes = h["total_size"].astype(np.int64)
    tl, gl, kl = (h[f].astype(np.int64) for f in ("topic_len", "tags_len", "keys_len"))
    pl, bl = h["props_len"].astype(np.int64), h["body_len"].astype(np.int64)
    bad = np.flatnonzero(HEADER_SIZE + tl + gl + kl + pl + bl != sizes)
    mv = memoryview(data)
    starts_l, sizes_l = starts.tolist(), sizes.tolist()
    crc = _crc32c.crc32c
    actual = np.fromiter((crc(mv[s + CRC_START : s + z]) for s, z in zip(starts_l, sizes_l)), np.uint32, len(starts_l))
    crc_bad = np.flatnonzero(actual != h["crc"])
    if len(bad) or len(crc_bad):
        first = min(int(x[0]) for x in (bad, crc_bad) if len(x))
        p = starts_l[first]
        check_record(data, p, where, base_offset + p)
    return _build(h, mv, buf, starts, tl, gl, kl, pl, bl)


def _build(
    h: np.ndarray,
    mv: memoryview,
    buf: np.ndarray,
    starts: np.ndarray,
    tl: np.ndarray,
    gl: np.ndarray,
    kl: np.ndarray,
    pl: np.ndarray,
    bl: np.ndarray,
) -> list[Record]:
    p_topic = starts + HEADER_SIZE
    p_tags = p_topic + tl
    p_keys = p_tags + gl
    p_props = p_keys + kl
    p_body = p_props + pl
    topics, tags, keys = _texts(buf, p_topic, tl), _texts(buf, p_tags, gl), _texts(buf, p_keys, kl)
    born, store = _hosts(h["born_host"].tolist(), h["born_port"]), _hosts(h["store_host"].tolist(), h["store_port"])
    cols = [
        h[f].tolist()
        for f in (
            "queue_id",
            "queue_offset",
            "commitlog_offset",
            "total_size",
            "flags",
            "born_ts",
            "store_ts",
            "reconsume_times",
        )
    ]
    qid, qoff, cloff, size, flags, born_ts, store_ts, recon = cols
    data = mv.obj if isinstance(mv.obj, bytes) else bytes(mv)  # slicing bytes copies once
    bodies = [data[a : a + n] for a, n in zip(p_body.tolist(), bl.tolist())]
    # Properties stay encoded until read (LazyRecord): most are never looked at.
    props = [data[a : a + n] for a, n in zip(p_props.tolist(), pl.tolist())]
    # map() builds the records without a Python-level loop body: about a third faster
    return list(
        map(
            LazyRecord,
            topics,
            qid,
            qoff,
            cloff,
            size,
            bodies,
            tags,
            keys,
            props,
            flags,
            born_ts,
            store_ts,
            born,
            store,
            recon,
        )
    )

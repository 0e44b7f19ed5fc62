"""Where a scan task's Python time goes, phase by phase (``clmq bench spark`` reports it).

It runs the reader's own functions over the first ``sample_bytes`` of a store's log, in
this process, and times each phase in CPU nanoseconds per row: the header walk, the
header gather, the CRC32C checks, the selection mask, and the building of each Arrow
column. What Spark adds on top (the worker's Arrow transfer, the JVM's conversion) is
the difference between the benchmark's CPU per row and this sum.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np
import pyarrow as pa

from clmq.common import Walk, walk_records

from ._arrow import COLUMNS, Fields, arrow_schema, build_batch
from ._local import LocalStore
from ._options import parse_options
from ._scan import Filter, check_crcs, headers_at
from ._select import select

CHUNK_BYTES = 4 << 20  # as a scan task reads


def parse_profile(store: str, sample_bytes: int = 64 << 20, repeats: int = 3) -> dict[str, float]:
    """CPU ns per row of each phase (``columns`` holds each column's own cost)."""
    src = LocalStore(store)
    try:
        chunks = _chunks(src, sample_bytes)
        filt = Filter(select(parse_options({"path": store}), [src]), src.layout.source)
    finally:
        src.close()
    rows = sum(len(w.starts) for _data, w in chunks)
    if chunks:  # Arrow's first kernel calls in a process cost milliseconds: not a per-row cost
        _phases(chunks[0][0], chunks[0][1].starts, filt, {})
    spent: dict[str, float] = {}
    for _ in range(repeats):
        for data, walk in chunks:
            _phases(data, walk.starts, filt, spent)
    return {name: seconds * 1e9 / max(1, rows * repeats) for name, seconds in spent.items()}


def _chunks(src: LocalStore, sample_bytes: int) -> list[tuple[bytes, Walk]]:
    out: list[tuple[bytes, Walk]] = []
    for seg in src.layout.segments:
        pos = seg.base
        while pos < seg.data_end and sum(len(d) for d, _w in out) < sample_bytes:
            data = src.read(seg.base, pos, min(CHUNK_BYTES, seg.data_end - pos))
            walk = walk_records(data)
            if walk.stop == 0:
                break
            out.append((data, walk))
            pos += walk.stop
    return out


def _phases(data: bytes, starts: np.ndarray, filt: Filter, spent: dict[str, float]) -> None:
    def timed(name: str, action: Callable[[], Any]) -> Any:
        t = time.process_time()
        result = action()
        spent[name] = spent.get(name, 0.0) + time.process_time() - t
        return result

    buf = np.frombuffer(data, np.uint8)
    timed("walk", lambda: walk_records(data))
    h: np.ndarray = timed("headers", lambda: headers_at(buf, starts))
    timed("crc32c", lambda: check_crcs(data, starts, h, -1))
    timed("mask", lambda: filt.mask(buf, starts, h))
    timed("fields", lambda: Fields(starts, h))
    for name in COLUMNS:
        schema = arrow_schema([name])

        def column(schema: pa.Schema = schema) -> pa.RecordBatch:
            return build_batch(data, buf, starts, h, schema)

        timed(f"column {name}", column)

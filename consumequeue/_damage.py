"""Which queues and queue offsets a damaged range of the log affects (the error path).

When log bytes that were promised are gone, the store refuses to open and names the
messages lost: for each queue, the queue offsets whose entries point into the damaged
range. Read straight from the queue files, vectorised; slow for a large store, but
it runs only when the store will not open anyway.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ._entries import ENTRY_DTYPE, ENTRY_SIZE

AffectedQueue = tuple[str, int, int, int]  # topic, queue id, first and last queue offset


def affected_queues(root: Path, start: int, end: int) -> list[AffectedQueue]:
    """``(topic, queue id, first, last)`` for every queue under ``root`` with entries
    whose records overlap the log offsets ``[start, end)``, sorted."""
    out: list[AffectedQueue] = []
    if not root.is_dir():
        return out
    for topic in sorted(os.listdir(root)):
        tdir = root / topic
        if not tdir.is_dir():
            continue
        for name in sorted((n for n in os.listdir(tdir) if n.isdigit()), key=int):
            hit = _hit_range(tdir / name, start, end)
            if hit is not None:
                out.append((topic, int(name), *hit))
    return out


def _hit_range(qdir: Path, start: int, end: int) -> tuple[int, int] | None:
    """The first and last queue offset of ``qdir`` pointing into ``[start, end)``."""
    lo: int | None = None
    hi = -1
    for fname in sorted(n for n in os.listdir(qdir) if len(n) == 20 and n.isdigit()):
        path = qdir / fname
        rows = np.fromfile(path, dtype=ENTRY_DTYPE, count=os.path.getsize(path) // ENTRY_SIZE)
        offs = rows["offset"].astype(np.int64)
        hit = np.flatnonzero((rows["size"] > 0) & (offs < end) & (offs + rows["size"] > start))
        if len(hit):
            lo = int(fname) + int(hit[0]) if lo is None else lo
            hi = int(fname) + int(hit[-1])
    return None if lo is None else (lo, hi)

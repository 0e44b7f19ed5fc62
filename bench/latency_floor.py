"""The floor under sync-flush latency on this machine's disk, with no broker at all.

A message acknowledged after an fsync waits at least for the first fsync that starts
after it arrived: one already running does not cover it. So the device's fsync times,
weighted by how long each one lasts (a slow one holds every message that arrives
during it), bound the p99 any broker can reach with sync flush here. This measures
them as an ideal group commit would: back to back, each writing what arrived during the
previous one, at the case's rate, appended to a file in the directory the brokers use
(as the commit log grows its segment: each fdatasync also commits the new size); then it places
arrivals at that rate on the timeline and reads their waits.
"""

from __future__ import annotations

import bisect
import os
import time
from pathlib import Path
from typing import Any

PROBE_FILE_BYTES = 64 << 20  # appended to as a log segment is, then cut to 0: the disk use stays fixed


def floor_waits(syncs: list[tuple[float, float]], rate: int) -> list[float]:
    """Each arrival's wait (s) until the end of the first sync that starts at or after
    it, arrivals every 1/``rate`` s from the first sync's start to the last one's."""
    starts = [s for s, _e in syncs]
    waits = []
    t, step, last = starts[0], 1.0 / rate, starts[-1]
    while t <= last:
        j = bisect.bisect_left(starts, t)
        waits.append(syncs[j][1] - t)
        t += step
    return waits


def _quantiles_ms(values: list[float]) -> dict[str, float]:
    v = sorted(values)

    def q(p: float) -> float:
        return round(v[min(len(v) - 1, int(p * len(v)))] * 1e3, 3)

    return {"p50_ms": q(0.5), "p99_ms": q(0.99), "p99_9_ms": q(0.999), "max_ms": round(v[-1] * 1e3, 3)}


def _group_commits(path: Path, seconds: float, rate: int, message_bytes: int) -> list[tuple[float, float]]:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        syncs: list[tuple[float, float]] = []
        offset, took, end = 0, 0.0, time.monotonic() + seconds
        while time.monotonic() < end:
            size = max(message_bytes, int(rate * took * message_bytes))  # what arrived meanwhile
            size = min(size, PROBE_FILE_BYTES // 4)
            if offset + size > PROBE_FILE_BYTES:
                os.ftruncate(fd, 0)
                offset = 0
            os.pwrite(fd, b"\xa5" * size, offset)
            offset += size
            start = time.monotonic()
            os.fdatasync(fd)
            syncs.append((start, time.monotonic()))
            took = syncs[-1][1] - start
        return syncs
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


def measure_floor(directory: Path, seconds: float, rate: int, message_bytes: int) -> dict[str, Any]:
    """The fdatasync times of ``seconds`` of back-to-back group commits in
    ``directory`` at ``rate`` msgs/s of ``message_bytes``, and the waits of arrivals at
    that rate: the floor of a sync-flush acknowledgement on this disk."""
    syncs = _group_commits(directory / "fsync-floor.probe", seconds, rate, message_bytes)
    if len(syncs) < 2:
        raise RuntimeError(f"one fdatasync took the whole {seconds} s: no floor to tell")
    return {
        "rate": rate,
        "seconds": seconds,
        "fdatasyncs": len(syncs),
        "fdatasync": _quantiles_ms([e - s for s, e in syncs]),
        "floor": _quantiles_ms(floor_waits(syncs, rate)),
    }

"""The vectorised header walk against a plain record-by-record walk.

``walk_records`` walks record by record while sizes vary and checks long same-size runs
vectorised in doubling windows. Whatever the mix, its runs, starts, count, stop and
reason must be those of the simplest possible walk: follow each header's total size,
stop at a blank marker, a bad magic, an impossible size or the end of the bytes.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from clmq.common import HEADER_SIZE, RECORD_MAGIC, gather_fields, gather_headers, walk_records
from clmq.common._record import BLANK_MAGIC

_HEAD = struct.Struct("<II")
_MAX_SIZE_BYTES = 1 << 32


def reference_walk(data: bytes, pos: int, max_size: int) -> tuple[list[tuple[int, int]], int, str]:
    """``([(start, size), ...], stop, reason)``, one Python step per record."""
    records: list[tuple[int, int]] = []
    while len(data) - pos >= 8:
        size, magic = _HEAD.unpack_from(data, pos)
        if magic != RECORD_MAGIC:
            return records, pos, "blank" if magic == BLANK_MAGIC else "corrupt"
        if size < HEADER_SIZE or size > max_size:
            return records, pos, "corrupt"
        if size > len(data) - pos:
            break
        records.append((pos, size))
        pos += size
    return records, pos, "end"


def _record(size: int, fill: int) -> bytes:
    """A record slot: a valid header start (total size, magic), then filler."""
    return _HEAD.pack(size, RECORD_MAGIC) + bytes([fill]) * (size - 8)


# A log as stretches of same-size records: short stretches (sizes vary record to record)
# and long ones (so that the vectorised windows, 64 records and more, are exercised).
stretches = st.lists(
    st.tuples(
        st.integers(HEADER_SIZE, HEADER_SIZE + 200),
        st.one_of(st.integers(1, 3), st.integers(1, 300)),
    ),
    min_size=0,
    max_size=25,
)

# What a damaged header says: (total size field, magic field); None keeps that field.
damage = st.one_of(
    st.tuples(st.integers(0, 2**32 - 1), st.just(BLANK_MAGIC)),  # blank marker
    st.tuples(st.none(), st.integers(0, 2**32 - 1)),  # any magic (mostly corrupt)
    st.tuples(st.integers(0, HEADER_SIZE - 1), st.just(RECORD_MAGIC)),  # too small
    st.tuples(st.integers(HEADER_SIZE, HEADER_SIZE + 400), st.just(RECORD_MAGIC)),  # wrong size
    st.tuples(st.integers(2**31, 2**32 - 1), st.just(RECORD_MAGIC)),  # beyond max / the end
)


def _build(parts: list[tuple[int, int]], fill: int) -> tuple[bytes, list[int]]:
    """The log's bytes and every record's start."""
    out = bytearray()
    starts: list[int] = []
    for size, repeat in parts:
        for _ in range(repeat):
            starts.append(len(out))
            out += _record(size, fill)
    return bytes(out), starts


def _assert_same(data: bytes | bytearray | memoryview, pos: int, max_size: int) -> None:
    """The walk equals the reference walk on ``data`` from ``pos``."""
    expected, stop, reason = reference_walk(bytes(data), pos, max_size)
    walk = walk_records(data, pos, max_size)
    assert (walk.stop, walk.reason) == (stop, reason)
    assert walk.count == len(expected)
    assert walk.starts.dtype == np.int64
    assert walk.starts.tolist() == [p for p, _ in expected]
    flat = [(p + i * s, s) for p, c, s in walk.runs for i in range(c)]
    assert flat == expected
    for (p0, c0, s0), (p1, _, s1) in zip(walk.runs, walk.runs[1:], strict=False):
        assert p0 + c0 * s0 == p1 and s0 != s1  # runs are maximal and back to back
    assert all(c >= 1 for _, c, _ in walk.runs)


@given(
    stretches,
    st.lists(st.tuples(st.integers(0, 10_000), damage), max_size=3),
    st.integers(0, 10**7),
    st.integers(0, 255),
    st.sampled_from([_MAX_SIZE_BYTES, HEADER_SIZE + 100, HEADER_SIZE + 250]),
    st.integers(0, 3),
)
@settings(max_examples=300, deadline=None)
def test_walk_equals_reference(
    parts: list[tuple[int, int]],
    damages: list[tuple[int, tuple[int | None, int]]],
    cut: int,
    fill: int,
    max_size: int,
    skip: int,
) -> None:
    data, starts = _build(parts, fill)
    buf = bytearray(data)
    for at, (size, magic) in damages:
        if starts:
            p = starts[at % len(starts)]
            _HEAD.pack_into(buf, p, _HEAD.unpack_from(buf, p)[0] if size is None else size, magic)
    buf = buf[: cut % (len(buf) + 1)]  # truncated anywhere, even inside a header
    pos = starts[skip % len(starts)] if starts and starts[skip % len(starts)] <= len(buf) else 0
    _assert_same(bytes(buf), pos, max_size)
    _assert_same(memoryview(buf), pos, max_size)  # the dispatcher hands memoryviews over the map


@given(st.lists(st.integers(HEADER_SIZE, HEADER_SIZE + 64), min_size=1, max_size=400), st.integers(0, 255))
@settings(max_examples=100, deadline=None)
def test_varying_sizes_are_one_run_each_when_neighbours_differ(sizes: list[int], fill: int) -> None:
    data, _ = _build([(s, 1) for s in sizes], fill)
    walk = walk_records(data)
    assert (walk.stop, walk.reason, walk.count) == (len(data), "end", len(sizes))
    merged = [s for i, s in enumerate(sizes) if i == 0 or sizes[i - 1] != s]
    assert [s for _, _, s in walk.runs] == merged


def test_long_run_broken_deep_inside_a_window_is_found_exactly() -> None:
    """A different size at record 1000 of a same-size stretch (inside a doubled window)."""
    data, starts = _build([(HEADER_SIZE + 10, 5000)], 7)
    buf = bytearray(data)
    _HEAD.pack_into(buf, starts[1000], HEADER_SIZE + 3, RECORD_MAGIC)
    _assert_same(bytes(buf), 0, _MAX_SIZE_BYTES)
    _HEAD.pack_into(buf, starts[1000], 0, BLANK_MAGIC)
    walk = walk_records(bytes(buf))
    assert (walk.runs, walk.stop, walk.reason) == ([(0, 1000, HEADER_SIZE + 10)], starts[1000], "blank")


def test_empty_and_tiny_buffers() -> None:
    for data in (b"", b"\x00" * 7, _record(HEADER_SIZE, 0)[: HEADER_SIZE - 1]):
        walk = walk_records(data)
        assert (walk.runs, walk.count, walk.reason) == ([], 0, "end")
        assert walk.starts.tolist() == []


def test_bench_store_varied_case_rebuilds_records_of_varying_sizes(tmp_path: Path) -> None:
    """``clmq bench store --rebuild-varied-body-bytes``: the store it rebuilds really has
    sizes varying record to record, and every record is re-dispatched."""
    from clmq.bench.store import _batches, bench_rebuild

    sizes = {len(m.body) for batch in _batches(100, 10, 1000, 2, (50, 1000)) for m in batch}
    assert len(sizes) > 500 and min(sizes) >= 50 and max(sizes) <= 1000
    figures = bench_rebuild(tmp_path, 2000, 100, 10, (50, 1000))
    assert (figures.messages, figures.body_bytes) == (2000, "50-1000")
    assert figures.redispatch_records_per_s > 0 and figures.log_mb > 2000 * 50 / 1e6


@given(stretches, st.integers(0, 255), st.sampled_from([["queue_id"], ["store_ts", "body_len"], ["total_size"]]))
@settings(max_examples=100, deadline=None)
def test_gathered_headers_are_each_records_own(parts: list[tuple[int, int]], fill: int, names: list[str]) -> None:
    """Columns gathered after the walk (by run, or by one fancy index when runs are short)
    hold each record's own header bytes."""
    data, starts = _build(parts, fill)
    buf = bytearray(data)
    for i, p in enumerate(starts):  # a distinct header per record, sizes and magic kept
        buf[p + 8 : p + HEADER_SIZE] = bytes((i + j) % 251 for j in range(HEADER_SIZE - 8))
    arr = np.frombuffer(bytes(buf), dtype=np.uint8)
    walk = walk_records(bytes(buf))
    heads = gather_headers(arr, walk)
    assert [h.tobytes() for h in heads] == [bytes(buf[p : p + HEADER_SIZE]) for p in starts]
    fields = gather_fields(arr, walk, names)
    for name in names:
        assert fields[name].tolist() == heads[name].tolist()

"""A follower's validation of replicated bytes (``clmq.commitlog._raw.split_raw``).

The column-wise implementation must accept exactly the chunks that the record-by-record
one (kept below as the reference) accepted, cut them into the same pieces, take the
same queue offsets, and refuse every damaged chunk with the same error (file, offset,
check, expected, actual) naming the same first bad record — with nothing written and
the queue-offset table untouched.
"""

from __future__ import annotations

import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, cast

import crc32c
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from clmq.commitlog import AppendStatus, CommitLog, CommitLogConfig
from clmq.commitlog._encoder import QueueKey, restore_offsets
from clmq.commitlog._raw import SMALL_RAW_RECORDS, Piece, split_raw, whole_prefix
from clmq.common import BLANK_MAGIC, CorruptRecordError, Message
from clmq.common._record import (
    BLANK_SIZE,
    CRC_START,
    HEADER_SIZE,
    OFF_COMMITLOG_OFFSET,
    OFF_QUEUE_ID,
    OFF_QUEUE_OFFSET,
    OFF_TOPIC_LEN,
    check_record,
)

SEG = 4096
CFG = CommitLogConfig(segment_bytes=SEG, max_message_bytes=1500, boundary_interval_bytes=1024)
Split = Callable[[bytes, int, int, int, int, dict[QueueKey, int], dict[QueueKey, int]], list[Piece]]


# ------------------------------------------------------------ the reference (before)
def reference_split_raw(
    data: bytes,
    offset: int,
    seg_base: int,
    seg_pos: int,
    segment_bytes: int,
    table: dict[QueueKey, int],
    undo: dict[QueueKey, int],
) -> list[Piece]:
    """The record-by-record split_raw this module's implementation replaced."""
    pieces: list[Piece] = []
    base, pos, p, piece_start = seg_base, seg_pos, 0, 0
    starts: list[int] = []
    where = f"raw append at {offset}"
    while p < len(data):
        if len(data) - p < BLANK_SIZE:
            raise CorruptRecordError(where, offset + p, "record", "whole records", f"{len(data) - p} stray bytes")
        size, magic = struct.unpack_from("<II", data, p)
        if magic == BLANK_MAGIC:
            if size != segment_bytes - pos:
                raise CorruptRecordError(where, offset + p, "blank size", str(segment_bytes - pos), str(size))
            pieces.append((data[piece_start : p + BLANK_SIZE], starts, True))
            p += BLANK_SIZE
            base, pos, piece_start, starts = base + segment_bytes, 0, p, []
            continue
        _reference_check_placed(data, p, where, offset + p, base + pos, segment_bytes - pos)
        tlen = struct.unpack_from("<H", data, p + OFF_TOPIC_LEN)[0]
        key = (data[p + HEADER_SIZE : p + HEADER_SIZE + tlen].decode(), _u32(data, p + OFF_QUEUE_ID))
        old = table.get(key, 0)
        undo.setdefault(key, old if key in table else -1)
        table[key] = max(old, _u64(data, p + OFF_QUEUE_OFFSET) + 1)
        starts.append(pos)
        p, pos = p + size, pos + size
    if piece_start < len(data):
        pieces.append((data[piece_start:], starts, False))
    return pieces


def _reference_check_placed(data: bytes, p: int, where: str, at: int, expected_offset: int, room: int) -> None:
    size = check_record(data, p, where, at)
    found = _u64(data, p + OFF_COMMITLOG_OFFSET)
    if found != expected_offset:
        raise CorruptRecordError(where, at, "commitlog offset", str(expected_offset), str(found))
    if size + BLANK_SIZE > room:
        raise CorruptRecordError(where, at, "segment room", f"<= {room - BLANK_SIZE}", str(size))


def reference_whole_prefix(data: bytes, max_record_bytes: int) -> tuple[int, int, bool]:
    p, n = 0, len(data)
    while n - p >= BLANK_SIZE:
        size, magic = struct.unpack_from("<II", data, p)
        if magic == BLANK_MAGIC:
            return p + BLANK_SIZE, 0, True
        if size < HEADER_SIZE or size > max_record_bytes:
            raise CorruptRecordError("raw chunk", p, "record size", f"{HEADER_SIZE}..{max_record_bytes}", str(size))
        if n - p < size:
            return p, size, False
        p += size
    return p, (HEADER_SIZE if p < n else 0), False


def _u32(data: bytes, p: int) -> int:
    return int(struct.unpack_from("<I", data, p)[0])


def _u64(data: bytes, p: int) -> int:
    return int(struct.unpack_from("<Q", data, p)[0])


# ------------------------------------------------------------- a leader's bytes
@dataclass
class Stream:
    """A leader log's segments back to back, each up to and including its blank marker:
    what a follower receives. ``places`` maps the stream position of every record and
    marker to ``(log offset, segment base, file position)``."""

    data: bytes
    records: list[int]
    markers: list[int]
    places: dict[int, tuple[int, int, int]]


def leader_stream(batches: list[list[Message]], cfg: CommitLogConfig = CFG) -> Stream:
    with tempfile.TemporaryDirectory() as d:
        log = CommitLog.open(Path(d), cfg, clean=False, checkpoint_offset=None)
        for batch in batches:
            assert log.append(batch).ok
        segments = [(base, path.read_bytes()[:length]) for base, length, path in log.segments()]
        log.close()
    out, records, markers, places = bytearray(), [], [], {}
    for base, raw in segments:
        p = 0
        while len(raw) - p >= BLANK_SIZE:
            size, magic = struct.unpack_from("<II", raw, p)
            places[len(out) + p] = (base + p, base, p)
            if magic == BLANK_MAGIC:  # the rest of a sealed segment's file is unused
                markers.append(len(out) + p)
                p += BLANK_SIZE
                break
            records.append(len(out) + p)
            p += size
        out += raw[:p]
    return Stream(bytes(out), records, markers, places)


@dataclass
class Chunk:
    data: bytes
    offset: int
    seg_base: int
    seg_pos: int
    records: list[int]  # chunk positions of whole records
    markers: list[int]  # chunk positions of whole blank markers


def chunk_of(stream: Stream, start: int, end: int) -> Chunk:
    offset, base, pos = stream.places[start]
    inside = [p - start for p in stream.records if start <= p and p + _u32(stream.data, p) <= end]
    marks = [p - start for p in stream.markers if start <= p and p + BLANK_SIZE <= end]
    return Chunk(stream.data[start:end], offset, base, pos, inside, marks)


Outcome = tuple[object, ...]


def outcome(split: Split, chunk: Chunk, table: dict[QueueKey, int], segment_bytes: int = SEG) -> Outcome:
    """What a split does: its pieces and table changes, or its error; on an error, the
    table after the caller's restore."""
    t, undo = dict(table), {}
    try:
        pieces = split(chunk.data, chunk.offset, chunk.seg_base, chunk.seg_pos, segment_bytes, t, undo)
    except CorruptRecordError as e:
        if split is not reference_split_raw:  # the new split takes nothing from a refused chunk
            assert t == table and undo == {}
        restore_offsets(t, undo)
        assert t == table
        return ("refused", e.file, e.offset, e.check, e.expected, e.actual)
    return ("ok", pieces, t, undo)


def columns_only(*args: Any) -> list[Piece]:
    return split_raw(*args, small_records=0)


def records_only(*args: Any) -> list[Piece]:
    return split_raw(*args, small_records=1 << 62)


def same(chunk: Chunk, table: dict[QueueKey, int], segment_bytes: int = SEG) -> Outcome:
    """The outcome of ``split_raw``, checked against the reference, with each of its two
    paths (column-wise, record by record) forced whatever the chunk's record count."""
    new = outcome(split_raw, chunk, table, segment_bytes)
    assert new == outcome(reference_split_raw, chunk, table, segment_bytes)
    assert new == outcome(columns_only, chunk, table, segment_bytes)
    assert new == outcome(records_only, chunk, table, segment_bytes)
    return new


# ---------------------------------------------------------------- strategies
TOPICS = ["t", "orders", "tópico-ü", "x" * 120]
messages = st.builds(
    Message,
    topic=st.sampled_from(TOPICS),
    queue_id=st.integers(0, 6) | st.just(0xFFFF_FFFF),
    body=st.integers(0, 700).map(lambda n: b"b" * n) | st.binary(max_size=40),
    tags=st.sampled_from(["", "TagA", "ü"]),
    keys=st.text(max_size=6),
    properties=st.dictionaries(st.text(max_size=4), st.text(max_size=6), max_size=2),
)
batches = st.lists(st.lists(messages, min_size=1, max_size=12), min_size=1, max_size=10)
# old values near the chunk's queue offsets: below, equal to and above its highest
tables = st.dictionaries(st.tuples(st.sampled_from(TOPICS), st.integers(0, 6)), st.integers(0, 12), max_size=8)
HYP = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def chunks(draw: st.DrawFn) -> Chunk:
    """A chunk from any record or marker to any byte after it (cut records included)."""
    stream = leader_stream(draw(batches))
    start = draw(st.sampled_from(sorted(stream.records + stream.markers)))
    end = draw(st.integers(start + 1, len(stream.data)) | st.just(len(stream.data)))
    return chunk_of(stream, start, end)


@st.composite
def whole_chunks(draw: st.DrawFn) -> Chunk:
    """A chunk of whole records and markers only (the bytes a follower appends)."""
    stream = leader_stream(draw(batches))
    items = sorted(stream.records + stream.markers)
    i = draw(st.integers(0, len(items) - 1))
    j = draw(st.integers(i + 1, len(items)))
    return chunk_of(stream, items[i], items[j] if j < len(items) else len(stream.data))


def rewrite(data: bytes, p: int, fmt: str, at: int, value: int, recrc: bool = True) -> bytes:
    """``data`` with a header field of the record at ``p`` changed (CRC kept valid)."""
    out = bytearray(data)
    struct.pack_into(fmt, out, p + at, value)
    if recrc:
        size = _u32(out, p)
        struct.pack_into("<I", out, p + 8, crc32c.crc32c(bytes(out[p + CRC_START : p + size])))
    return bytes(out)


def with_data(chunk: Chunk, data: bytes) -> Chunk:
    return Chunk(data, chunk.offset, chunk.seg_base, chunk.seg_pos, chunk.records, chunk.markers)


# ------------------------------------------------------------------- equivalence
@HYP
@given(chunks(), tables)
def test_any_chunk_is_split_or_refused_exactly_as_before(chunk: Chunk, table: dict[QueueKey, int]) -> None:
    result = same(chunk, table)
    whole = chunk.data[: max([p + _u32(chunk.data, p) for p in chunk.records] + [m + 8 for m in chunk.markers] + [0])]
    if len(whole) == len(chunk.data):
        assert result[0] == "ok"


@HYP
@given(whole_chunks(), tables)
def test_whole_chunks_are_accepted_with_their_queue_offsets(chunk: Chunk, table: dict[QueueKey, int]) -> None:
    result = same(chunk, table)
    assert result[0] == "ok"
    pieces = cast(list[Piece], result[1])
    assert b"".join(piece for piece, _, _ in pieces) == chunk.data
    assert sum(len(starts) for _, starts, _ in pieces) == len(chunk.records)


@HYP
@given(chunks())
def test_whole_prefix_is_unchanged(chunk: Chunk) -> None:
    for data in (chunk.data, chunk.data[: len(chunk.data) // 2]):
        assert _whole_prefix_outcome(whole_prefix, data) == _whole_prefix_outcome(reference_whole_prefix, data)


def _whole_prefix_outcome(fn: Callable[[bytes, int], tuple[int, int, bool]], data: bytes) -> object:
    try:
        return fn(data, CFG.max_message_bytes)
    except CorruptRecordError as e:
        return str(e)


# ------------------------------------------------------------------------ damage
@HYP
@given(whole_chunks(), tables, st.data())
def test_a_bit_flipped_anywhere_is_refused_as_before(
    chunk: Chunk, table: dict[QueueKey, int], data: st.DataObject
) -> None:
    p = data.draw(st.integers(0, len(chunk.data) - 1), label="byte")
    flipped = bytearray(chunk.data)
    flipped[p] ^= 1 << data.draw(st.integers(0, 7), label="bit")
    assert same(with_data(chunk, bytes(flipped)), table)[0] == "refused"
    assert _whole_prefix_outcome(whole_prefix, bytes(flipped)) == _whole_prefix_outcome(
        reference_whole_prefix, bytes(flipped)
    )


@HYP
@given(whole_chunks(), tables, st.data())
def test_a_wrong_embedded_offset_is_refused_as_before(
    chunk: Chunk, table: dict[QueueKey, int], data: st.DataObject
) -> None:
    assume(chunk.records)  # a chunk can be a lone blank marker (drawn about 1 run in 100)
    p = data.draw(st.sampled_from(chunk.records), label="record")
    found = _u64(chunk.data, p + OFF_COMMITLOG_OFFSET)
    wrong = data.draw(st.integers(0, 2**64 - 1).filter(lambda v: v != found), label="offset")
    result = same(with_data(chunk, rewrite(chunk.data, p, "<Q", OFF_COMMITLOG_OFFSET, wrong)), table)
    assert result[2:4] == (chunk.offset + p, "commitlog offset")


@HYP
@given(whole_chunks(), tables, st.data())
def test_a_size_past_the_chunk_is_refused_as_before(
    chunk: Chunk, table: dict[QueueKey, int], data: st.DataObject
) -> None:
    assume(chunk.records)  # a chunk can be a lone blank marker (drawn about 1 run in 100)
    p = data.draw(st.sampled_from(chunk.records), label="record")
    size = data.draw(st.integers(len(chunk.data) - p + 1, 0xFFFF_FFFF), label="size")
    result = same(with_data(chunk, rewrite(chunk.data, p, "<I", 0, size, recrc=False)), table)
    assert result[2:4] in {(chunk.offset + p, "total size"), (chunk.offset + p, "record header")}


@HYP
@given(whole_chunks(), tables, st.data())
def test_a_blank_marker_of_the_wrong_size_is_refused_as_before(
    chunk: Chunk, table: dict[QueueKey, int], data: st.DataObject
) -> None:
    if not chunk.markers:
        return
    p = data.draw(st.sampled_from(chunk.markers), label="marker")
    right = _u32(chunk.data, p)
    wrong = data.draw(st.integers(0, 0xFFFF_FFFF).filter(lambda v: v != right), label="size")
    damaged = bytearray(chunk.data)
    struct.pack_into("<I", damaged, p, wrong)
    assert same(with_data(chunk, bytes(damaged)), table)[2:4] == (chunk.offset + p, "blank size")


@HYP
@given(whole_chunks(), tables, st.integers(-3000, 3000), st.integers(-2048, 2048))
def test_a_chunk_placed_wrongly_is_refused_as_before(
    chunk: Chunk, table: dict[QueueKey, int], shift: int, seg_delta: int
) -> None:
    """Offsets, segment positions and segment sizes that do not match the bytes: the
    embedded offsets, the room checks and the marker sizes all see it."""
    moved = Chunk(chunk.data, chunk.offset, chunk.seg_base, max(0, chunk.seg_pos + shift), chunk.records, chunk.markers)
    same(moved, table)
    same(chunk, table, max(BLANK_SIZE, SEG + seg_delta))


def test_queue_offsets_only_grow_and_undo_keeps_the_old_values() -> None:
    """Per queue, the table ends at (highest queue offset in the chunk) + 1 unless it
    was already higher; ``undo`` holds the old value, -1 for a queue it did not have."""
    chunk = _many(300)
    highest: dict[QueueKey, int] = {}
    for p in chunk.records:
        tlen = struct.unpack_from("<H", chunk.data, p + OFF_TOPIC_LEN)[0]
        key = (chunk.data[p + HEADER_SIZE : p + HEADER_SIZE + tlen].decode(), _u32(chunk.data, p + OFF_QUEUE_ID))
        highest[key] = max(highest.get(key, 0), _u64(chunk.data, p + OFF_QUEUE_OFFSET))
    keys = sorted(highest)
    table = {
        keys[0]: highest[keys[0]] - 1,
        keys[1]: highest[keys[1]],
        keys[2]: highest[keys[2]] + 1,
        keys[3]: highest[keys[3]] + 2,
        ("elsewhere", 3): 5,
    }
    result = same(chunk, table)
    assert result[0] == "ok"
    taken, undo = result[2], result[3]
    assert taken == {**{k: q + 1 for k, q in highest.items()}, keys[3]: highest[keys[3]] + 2, ("elsewhere", 3): 5}
    assert undo == {k: table.get(k, -1) for k in highest}


# ---------------------------------------------------- both paths, many records
def _many(count: int) -> Chunk:
    msgs = [Message(TOPICS[i % 3], i % 5, b"m" * (i * 37 % 300)) for i in range(count)]
    stream = leader_stream([msgs[i : i + 20] for i in range(0, count, 20)])
    return chunk_of(stream, 0, len(stream.data))


@pytest.mark.parametrize("count", [1, SMALL_RAW_RECORDS, SMALL_RAW_RECORDS + 1, 300])
def test_every_damage_class_on_small_and_large_chunks(count: int) -> None:
    """Each damage at the first, a middle and the last record: the numpy path (large
    chunks) and the record-by-record path (small ones) both name the same record."""
    chunk = _many(count)
    table = {("t", 0): 3, ("orders", 1): 10**6}
    assert same(chunk, table)[0] == "ok"
    for p in sorted({chunk.records[0], chunk.records[len(chunk.records) // 2], chunk.records[-1]}):
        size = _u32(chunk.data, p)
        damages = {
            "crc32c": bytes(chunk.data[: p + size - 1])
            + bytes([chunk.data[p + size - 1] ^ 0x40])
            + chunk.data[p + size :],
            "commitlog offset": rewrite(chunk.data, p, "<Q", OFF_COMMITLOG_OFFSET, chunk.offset + p + 1),
            "total size": rewrite(chunk.data, p, "<I", 0, len(chunk.data) - p + 1, recrc=False),
            "field lengths": rewrite(chunk.data, p, "<I", 102, _u32(chunk.data, p + 102) + 1),
            "magic": rewrite(chunk.data, p, "<I", 4, 0x636C6D07, recrc=False),
        }
        for check, damaged in damages.items():
            result = same(with_data(chunk, damaged), table)
            assert result[0] == "refused" and result[2:4] == (chunk.offset + p, check), (check, result)


@pytest.mark.parametrize("count", [3, 200])
def test_a_topic_that_is_not_utf8_is_refused_and_takes_nothing(count: int) -> None:
    """A record whose CRC passes but whose topic is not UTF-8 (the reference raised a
    UnicodeDecodeError after taking earlier queue offsets): refused, table untouched."""
    chunk = _many(count)
    p = chunk.records[len(chunk.records) // 2]
    tlen = struct.unpack_from("<H", chunk.data, p + OFF_TOPIC_LEN)[0]
    bad = bytearray(chunk.data)
    bad[p + HEADER_SIZE : p + HEADER_SIZE + tlen] = b"\xff" * tlen
    size = _u32(bad, p)
    struct.pack_into("<I", bad, p + 8, crc32c.crc32c(bytes(bad[p + CRC_START : p + size])))
    table: dict[QueueKey, int] = {("t", 0): 1}
    assert outcome(split_raw, with_data(chunk, bytes(bad)), table)[:4] == (
        "refused",
        f"raw append at {chunk.offset}",
        chunk.offset + p,
        "topic",
    )


# ------------------------------------------------------------ through the log
DAMAGES = ["flip-first", "flip-middle", "flip-last", "offset", "size", "blank"]


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_chunk_writes_nothing_and_the_good_one_follows(tmp_path: Path, damage: str) -> None:
    """Through ``CommitLog.append_raw`` on real files: a refused chunk leaves the
    follower's files, end and queue offsets as they were; the intact chunk then makes
    it byte-identical to the leader."""
    msgs = [Message(TOPICS[i % 4], i % 7, b"r" * (i * 53 % 900)) for i in range(120)]
    stream = leader_stream([msgs[i : i + 10] for i in range(0, 120, 10)])
    follower = CommitLog.open(tmp_path / "f", CFG, clean=False, checkpoint_offset=None)
    head = chunk_of(stream, 0, stream.markers[0] + BLANK_SIZE)  # a first segment, then the rest
    assert follower.append_raw(0, head.data).ok
    rest = chunk_of(stream, stream.markers[0] + BLANK_SIZE, len(stream.data))
    bad = _damage(rest, damage)
    before = (follower.write_offset, follower.queue_offset_table(), _files(follower))
    res = follower.append_raw(rest.offset, bad)
    assert res.status is AppendStatus.INVALID_MESSAGE
    assert (follower.write_offset, follower.queue_offset_table(), _files(follower)) == before
    assert follower.append_raw(rest.offset, rest.data).ok
    assert follower.write_offset == stream.places[stream.records[-1]][0] + _u32(stream.data, stream.records[-1])
    with tempfile.TemporaryDirectory() as d:
        leader = CommitLog.open(Path(d), CFG, clean=False, checkpoint_offset=None)
        for i in range(0, 120, 10):
            leader.append(msgs[i : i + 10])
        assert follower.queue_offset_table() == leader.queue_offset_table()
        assert [s[:2] for s in follower.segments()] == [s[:2] for s in leader.segments()]
        leader.close()
    follower.close()


def _damage(chunk: Chunk, damage: str) -> bytes:
    out = bytearray(chunk.data)
    if damage.startswith("flip-"):
        p = {"first": 20, "middle": len(out) // 2, "last": len(out) - 1}[damage[5:]]
        out[p] ^= 0x10
        return bytes(out)
    p = chunk.records[len(chunk.records) // 2]
    if damage == "offset":
        return rewrite(chunk.data, p, "<Q", OFF_COMMITLOG_OFFSET, chunk.offset + p + 8)
    if damage == "size":
        return rewrite(chunk.data, p, "<I", 0, len(out) - p + 100, recrc=False)
    struct.pack_into("<I", out, chunk.markers[0], _u32(chunk.data, chunk.markers[0]) - 8)
    return bytes(out)


def _files(log: CommitLog) -> list[tuple[int, bytes]]:
    return [(base, path.read_bytes()) for base, _, path in log.segments()]

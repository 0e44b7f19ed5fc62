"""CommitLog behaviour on real files: rollover, reads, replication hooks, flushing, retention."""

from __future__ import annotations

import os
import re
import struct
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import clmq
from clmq.commitlog import AppendStatus, CommitLog, CommitLogConfig, FlushMode
from clmq.commitlog._encoder import BatchEncoder, EncodeError
from clmq.common import (
    BLANK_MAGIC,
    ConfigError,
    CorruptRecordError,
    Message,
    PackedMessages,
    PackError,
    decode_records_many,
    pack_messages,
    unpack_messages,
)
from tests.waiting import wait_until

from .conftest import msgs

CFG = CommitLogConfig(segment_bytes=32 * 1024, max_message_bytes=4096, boundary_interval_bytes=4096)


def open_log(path: Path, cfg: CommitLogConfig = CFG, clean: bool = False) -> CommitLog:
    return CommitLog.open(path, cfg, clean=clean, checkpoint_offset=None)


def test_records_never_cross_segments_and_sealed_segments_end_in_blank(tmp_path: Path) -> None:
    lg = open_log(tmp_path)
    for i in range(20):  # varied sizes so that the remainders differ
        assert lg.append(msgs("t", 7, 2, size=100 + 137 * i, start=i * 7)).ok
    segs = lg.segments()
    assert len(segs) > 5
    for base, length, path in segs[:-1]:
        assert length == CFG.segment_bytes and os.path.getsize(path) == CFG.segment_bytes
        assert path.name == f"{base:020d}.log"
    records = list(lg.iter_records())
    assert len(records) == 140
    for rec in records:
        base = max(b for b, _, _ in segs if b <= rec.commitlog_offset)
        assert rec.commitlog_offset + rec.size <= base + CFG.segment_bytes - 8
    # the byte after each segment's last record is a blank marker filling the rest
    for base, _, path in segs[:-1]:
        last = max(
            (r for r in records if base <= r.commitlog_offset < base + CFG.segment_bytes),
            key=lambda r: r.commitlog_offset,
        )
        raw = path.read_bytes()
        pos = last.commitlog_offset - base + last.size
        assert struct.unpack_from("<II", raw, pos) == (CFG.segment_bytes - pos, BLANK_MAGIC)
    lg.close()


def test_queue_offsets_are_dense_per_queue(tmp_path: Path) -> None:
    lg = open_log(tmp_path)
    r1 = lg.append(msgs("a", 10, 3))
    r2 = lg.append([Message("b", 0, b"x"), Message("a", 0, b"y")])
    assert r1.queue_offsets == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]
    assert r2.queue_offsets == [0, 4]
    assert [r.queue_offset for r in lg.iter_records() if (r.topic, r.queue_id) == ("a", 0)] == [0, 1, 2, 3, 4]
    lg.close()


def test_read_record_by_offset_and_boundaries_are_record_starts(tmp_path: Path) -> None:
    lg = open_log(tmp_path)
    res = lg.append(msgs("t", 300, 4, size=300))
    for off in res.commitlog_offsets[::37]:
        assert lg.read_record(off).commitlog_offset == off
    starts = set(res.commitlog_offsets)
    for base, _length, _ in lg.segments():
        bounds = lg.boundaries(base)
        assert bounds and all(b in starts for b in bounds)
        gaps = [b - a for a, b in zip([base, *bounds], bounds)]
        assert all(g <= CFG.boundary_interval_bytes + CFG.max_message_bytes for g in gaps)
    assert lg.read_record(lg.write_offset) is None
    lg.close()


def test_boundary_index_is_rebuilt_when_missing(tmp_path: Path) -> None:
    lg = open_log(tmp_path)
    lg.append(msgs("t", 200, 4, size=300))
    expected = {b: lg.boundaries(b) for b, _, _ in lg.segments()}
    lg.close()
    for p in tmp_path.glob("*.bidx"):
        p.unlink()
    lg = open_log(tmp_path, clean=True)
    assert {b: lg.boundaries(b) for b, _, _ in lg.segments()} == expected
    lg.close()


def test_oversized_message_is_a_result_and_writes_nothing(tmp_path: Path) -> None:
    lg = open_log(tmp_path)
    end = lg.write_offset
    res = lg.append([Message("t", 0, b"ok"), Message("t", 0, b"x" * 5000)])
    assert res.status is AppendStatus.MESSAGE_TOO_LARGE and "max_message_bytes=4096" in res.error
    assert lg.write_offset == end and lg.queue_offset_table() == {}
    lg.close()


def test_config_rejects_messages_larger_than_a_segment() -> None:
    with pytest.raises(ConfigError, match="does not fit a segment"):
        CommitLogConfig(segment_bytes=1024, max_message_bytes=2048)


def test_raw_append_copies_a_log_byte_for_byte(tmp_path: Path) -> None:
    leader = open_log(tmp_path / "leader")
    follower = open_log(tmp_path / "follower")
    for i in range(10):
        leader.append(msgs("t", 30, 3, size=200 + i * 50, start=i * 30))
    pos = 0
    while pos < leader.write_offset:  # ship in chunks the way replication will
        at, data = leader.read_chunk(pos, 5000)
        cut = _whole_records(data)
        res = follower.append_raw(at, data[:cut])
        assert res.ok, res.error
        pos = follower.write_offset
    assert [s[:2] for s in follower.segments()] == [s[:2] for s in leader.segments()]
    for (_, _, a), (_, _, b) in zip(leader.segments(), follower.segments()):
        assert a.read_bytes() == b.read_bytes()
    assert follower.queue_offset_table() == leader.queue_offset_table()
    leader.close()
    follower.close()


def _whole_records(data: bytes) -> int:
    p = 0
    while len(data) - p >= 8:
        size, magic = struct.unpack_from("<II", data, p)
        if magic == BLANK_MAGIC:
            return p + 8
        if size > len(data) - p:
            break
        p += size
    return p


def test_raw_append_rejects_bad_bytes_and_wrong_offsets(tmp_path: Path) -> None:
    src = open_log(tmp_path / "src")
    src.append(msgs("t", 5, 1))
    data = bytearray(src.read_chunk(0, 10_000)[1])
    dst = open_log(tmp_path / "dst")
    assert dst.append_raw(7, bytes(data)).status is AppendStatus.OFFSET_MISMATCH
    data[150] ^= 0xFF
    res = dst.append_raw(0, bytes(data))
    assert res.status is AppendStatus.INVALID_MESSAGE and "crc32c" in res.error
    assert dst.write_offset == 0
    src.close()
    dst.close()


def test_truncate_is_durable_and_continues_cleanly(tmp_path: Path) -> None:
    lg = open_log(tmp_path)
    res = lg.append(msgs("t", 200, 2, size=500))
    cut = res.commitlog_offsets[120]
    lg.truncate(cut)
    assert lg.write_offset == cut
    assert len(list(lg.iter_records())) == 120
    lg.close()
    lg = open_log(tmp_path)  # unclean open: a full validation finds nothing past the cut
    assert lg.write_offset == cut and len(list(lg.iter_records())) == 120
    lg.close()


def test_corrupt_record_in_old_data_is_reported_on_read(tmp_path: Path) -> None:
    lg = open_log(tmp_path)
    res = lg.append(msgs("t", 100, 1, size=400))
    lg.close()
    base, _, path = open_log(tmp_path, clean=True).segments()[0]
    victim = res.commitlog_offsets[3]
    with open(path, "r+b") as f:
        f.seek(victim - base + 200)
        f.write(b"\xff")
    lg = open_log(tmp_path, clean=True)
    with pytest.raises(CorruptRecordError) as info:
        lg.read_record(victim)
    assert info.value.offset == victim and info.value.file == str(path) and info.value.check == "crc32c"
    with pytest.raises(CorruptRecordError):
        list(lg.iter_records())
    lg.close()


@pytest.mark.parametrize(
    "mode, waits", [(FlushMode.SYNC, True), (FlushMode.ASYNC, False), ("sync", True), ("async", False)]
)
def test_a_put_waits_for_fsync_exactly_in_sync_flush_mode(mode: FlushMode, waits: bool) -> None:
    assert CommitLogConfig(flush_mode=mode).acks_wait_for_fsync is waits


def test_whether_a_put_waits_for_fsync_is_decided_in_one_place() -> None:
    """Only ``CommitLogConfig.acks_wait_for_fsync`` compares the flush mode; the store,
    the flush loop, the partition store and the broker's puts all ask it."""
    root = Path(clmq.__file__).parent
    deciding = re.compile(r"flush_mode\s+(is|==|!=)\s|\s(is(\s+not)?|==|!=)\s+FlushMode\.")  # a comparison
    found = []
    for directory, dirs, files in os.walk(root, followlinks=True):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if name.endswith(".py"):
                path = Path(directory, name)
                found += [
                    f"{path.relative_to(root)}: {line.strip()}"
                    for line in path.read_text().splitlines()
                    if deciding.search(line)
                ]
    assert found == ["commitlog/_config.py: return self.flush_mode is FlushMode.SYNC"], found


def test_group_commit_shares_fsyncs_and_acks_only_durable_bytes(tmp_path: Path) -> None:
    cfg = CommitLogConfig(flush_mode=FlushMode.SYNC, segment_bytes=1 << 20, max_message_bytes=4096)
    lg = open_log(tmp_path, cfg)
    syncs = []
    original = lg.flush

    def counting_flush() -> int:
        syncs.append(1)
        return original()

    lg.flush = counting_flush  # type: ignore[method-assign]
    stop = threading.Event()
    flusher = threading.Thread(target=lg.run_flusher, args=(stop,))
    flusher.start()
    acked: list[bool] = []

    def writer(i: int) -> None:
        for _ in range(25):
            res = lg.append([Message("t", i, b"x" * 100)])
            assert lg.wait_durable(res.end_offset, 5)
            acked.append(lg.durable_offset >= res.end_offset)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    flusher.join()
    assert len(acked) == 200 and all(acked)
    assert 0 < len(syncs) < 200  # many appends shared one fsync
    lg.close()


def test_sync_mode_starts_the_fsync_at_the_write_not_when_someone_waits(tmp_path: Path) -> None:
    """A broker registers its wait only after hopping back to its event loop; the fsync
    should already be under way by then."""
    cfg = CommitLogConfig(
        flush_mode=FlushMode.SYNC, flush_interval_ms=60_000, segment_bytes=1 << 20, max_message_bytes=4096
    )
    lg = open_log(tmp_path, cfg)
    stop = threading.Event()
    flusher = threading.Thread(target=lg.run_flusher, args=(stop,))
    flusher.start()
    try:
        # Not a wait: lets the flusher go to sleep on its interval, a minute away, so that
        # the append below must wake it (a thread blocked on its interval has no event to
        # wait for; should the append come first, the fsync is due at once all the same).
        time.sleep(0.05)
        end = lg.append([Message("t", 0, b"x" * 100)]).end_offset
        # polled, not lg.wait_durable(): nobody may wait, for waiting asks for the fsync
        wait_until(lambda: lg.durable_offset >= end, 5, "the fsync of the append, with nobody waiting for it")
        assert lg.durable_offset >= end
    finally:
        stop.set()
        lg.wake_flusher()
        flusher.join()
        lg.close()


def test_on_durable_callbacks_fire_in_offset_order(tmp_path: Path) -> None:
    lg = open_log(tmp_path)
    fired: list[int] = []
    ends = [lg.append([Message("t", 0, b"x")]).end_offset for _ in range(3)]
    for end in reversed(ends):
        lg.on_durable(end, lambda end=end: fired.append(end))
    assert fired == []
    lg.flush()
    assert fired == ends
    lg.on_durable(1, lambda: fired.append(-1))  # already durable: called at once
    assert fired[-1] == -1
    lg.close()


def test_retention_deletes_whole_old_segments_never_the_active_one(tmp_path: Path) -> None:
    cfg = CommitLogConfig(
        segment_bytes=32 * 1024, max_message_bytes=4096, retention_bytes=100 * 1024, retention_ms=None
    )
    lg = open_log(tmp_path, cfg)
    for i in range(20):
        lg.append(msgs("t", 20, 1, size=900, start=i * 20))
    before = lg.segments()
    assert lg.delete_expired() > 0
    after = lg.segments()
    assert sum(n for _, n, _ in after) <= 100 * 1024 + 32 * 1024
    assert after[-1] == before[-1] and lg.min_offset == after[0][0] > 0
    assert lg.read_record(0) is None
    assert not any(p.exists() for _, _, p in before[: len(before) - len(after)])
    # an old segment deleted by age as well
    cfg_age = CommitLogConfig(segment_bytes=32 * 1024, max_message_bytes=4096, retention_ms=1000)
    lg.close()
    lg = CommitLog.open(tmp_path, cfg_age, clean=True, checkpoint_offset=None)
    assert lg.delete_expired(now=time.time() + 10) == len(after) - 1
    assert len(lg.segments()) == 1
    lg.close()


def _packed(messages: list[Message], topic: str = "t") -> PackedMessages:
    return PackedMessages(topic, pack_messages(messages), ("10.0.0.7", 4321))


def test_packed_appends_store_what_message_appends_do_across_segments(tmp_path: Path) -> None:
    """The producer's packed bytes become the same records as message objects, split
    over segments the same way, with offsets dense per queue across batches."""
    lg = open_log(tmp_path / "packed")
    ref = open_log(tmp_path / "objects")
    for i in range(12):
        batch = [
            Message(
                "t",
                q % 3,
                b"%d-%d" % (i, q) * (50 + 40 * i),
                f"T{q}",
                f"k{i}",
                {"p": str(q)},
                flags=q,
                born_timestamp_ms=1000 + i,
                born_host=("10.0.0.7", 4321),
            )
            for q in range(7)
        ]
        res = lg.append_packed([_packed(batch[:3]), _packed(batch[3:])], [3, 3])
        assert res.ok and res.batch_sizes == [3, 4]
        assert ref.append(batch).ok
    assert len(lg.segments()) >= 3 and [(b, n) for b, n, _ in lg.segments()] == [(b, n) for b, n, _ in ref.segments()]
    ignore = {"store_timestamp_ms"}
    got = [{k: v for k, v in vars_of(r).items() if k not in ignore} for r in lg.iter_records()]
    want = [{k: v for k, v in vars_of(r).items() if k not in ignore} for r in ref.iter_records()]
    assert got == want and len(got) == 84
    assert lg.queue_offset_table() == {("t", 0): 36, ("t", 1): 24, ("t", 2): 24}
    lg.close()
    ref.close()


def vars_of(record: object) -> dict:
    return {k: getattr(record, k) for k in record.__dataclass_fields__}  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "damage, status, text",
    [
        (lambda b: b[:-3], AppendStatus.MALFORMED_BATCH, "runs past the batch"),
        (lambda b: b + b"\x01\x02", AppendStatus.MALFORMED_BATCH, "runs past the batch"),
        (lambda b: b"", AppendStatus.INVALID_MESSAGE, "empty batch"),
        (lambda b: b + pack_messages([Message("t", 5, b"x")]), AppendStatus.INVALID_QUEUE_ID, "queue id 5 not in 0..1"),
        (
            lambda b: b + pack_messages([Message("t", 0, b"x" * 5000)]),
            AppendStatus.MESSAGE_TOO_LARGE,
            "max_message_bytes=4096",
        ),
        (
            lambda b: b + pack_messages([Message("t", 0, b"x", tags="\u00e9")]).replace("\u00e9".encode(), b"\xff\xfe"),
            AppendStatus.MALFORMED_BATCH,
            "utf-8",
        ),
        (
            lambda b: (
                b + pack_messages([Message("t", 0, b"x", properties={"k": "v"})]).replace(b"\x01\x00k", b"\x09\x00k")
            ),
            AppendStatus.MALFORMED_BATCH,
            "properties",
        ),
    ],
)
def test_bad_packed_bytes_are_a_result_and_write_nothing(
    tmp_path: Path, damage, status: AppendStatus, text: str
) -> None:
    lg = open_log(tmp_path)
    assert lg.append_packed([_packed([Message("t", 1, b"first")])], [2]).ok
    end, table = lg.write_offset, lg.queue_offset_table()
    good = _packed([Message("t", 0, b"fine"), Message("t", 1, b"fine")])
    res = lg.append_packed([good, PackedMessages("t", damage(pack_messages([Message("t", 1, b"ok")])))], [2, 2])
    assert res.status is status and text in res.error.lower()
    assert lg.write_offset == end and lg.queue_offset_table() == table  # the good batch was not taken either
    res = lg.append_packed([good], [2])
    assert res.ok and res.queue_offsets == [0, 1]
    lg.close()


@given(data=st.binary(max_size=400), tail=st.binary(max_size=64))
@settings(max_examples=300, deadline=None)
def test_packed_appends_accept_exactly_what_decodes(data: bytes, tail: bytes) -> None:
    """Any bytes: the append either stores records that read back as the messages the
    bytes decode to, or fails with a result, never an exception; and it fails exactly
    when decoding them fails (queue ids and sizes within the limits here)."""
    valid = pack_messages([Message("t", 1, b"x" * 10, "TagA", "k", {"p": "v"})])
    raw = data if len(data) % 2 else valid + tail  # half random, half a valid batch with junk after it
    encoder = BatchEncoder(1 << 30, 1 << 20, ("127.0.0.1", 1))
    try:
        expected = unpack_messages(PackedMessages("t", raw))
    except PackError:
        expected = None
    try:
        batch = encoder.encode_packed([PackedMessages("t", raw)], [1 << 32], 0, 0, {}, {}, 5)
    except EncodeError as e:
        assert expected is None or not expected, e  # refused what decodes only when it is empty
        return
    assert expected is not None
    records = decode_records_many(bytes(batch.groups[0].data))
    assert [(r.queue_id, r.body, r.tags, r.keys, r.properties, r.flags) for r in records] == [
        (m.queue_id, m.body, m.tags, m.keys, m.properties, m.flags) for m in expected
    ]

"""Recovery after damage: the store holds exactly the valid prefix of the log, the
queues agree with a full scan of it, and new appends continue every queue's offsets."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path

import pytest

from clmq.broker.store import Store
from clmq.common import CorruptRecordError, Message

from .conftest import small_config

QUEUES = 6


@dataclass(frozen=True)
class Sent:
    offset: int
    size: int
    queue_id: int
    queue_offset: int
    body: bytes


def fill(store_dir: Path, rng: random.Random) -> list[Sent]:
    """Write random batches over several segments, then stop as a crash would."""
    s = Store.open(small_config(store_dir, segment_bytes=32 * 1024, max_message_bytes=4096, cq_entries_per_file=16))
    s.create_topic("t", QUEUES)
    sent: list[Sent] = []
    for b in range(rng.randint(20, 40)):
        batch = [
            Message("t", rng.randrange(QUEUES), rng.randbytes(rng.randint(1, 900)), tags=rng.choice("ABC"))
            for _ in range(rng.randint(1, 12))
        ]
        res = s.put_batch(batch)
        assert res.ok
        if b % 7 == 0:
            s.checkpoint()  # a checkpoint somewhere in the middle, like the housekeeping thread
        sent += [Sent(o, 0, m.queue_id, q, m.body) for o, q, m in zip(res.commitlog_offsets, res.queue_offsets, batch)]
    sent = [Sent(x.offset, 0, x.queue_id, x.queue_offset, x.body) for x in sent]
    s.dispatcher.catch_up()
    s.checkpoint()
    sizes = {r.commitlog_offset: r.size for r in s.log.iter_records()}
    s.abandon()
    return [Sent(x.offset, sizes[x.offset], x.queue_id, x.queue_offset, x.body) for x in sent]


def newest_segment(store_dir: Path, sent: list[Sent]) -> tuple[Path, int]:
    last = max(x.offset for x in sent)
    seg = max(p for p in (store_dir / "commitlog").glob("*.log") if int(p.stem) <= last)
    return seg, int(seg.stem)


def reopen_and_check(store_dir: Path, expected: list[Sent]) -> None:
    cfg = small_config(store_dir, segment_bytes=32 * 1024, max_message_bytes=4096, cq_entries_per_file=16)
    with Store.open(cfg) as s:
        scan = list(s.log.iter_records())
        assert [(r.commitlog_offset, r.queue_id, r.queue_offset, r.body) for r in scan] == [
            (x.offset, x.queue_id, x.queue_offset, x.body) for x in expected
        ]
        for q in range(QUEUES):
            in_log = [(r.commitlog_offset, r.queue_offset) for r in scan if r.queue_id == q]
            got = s.get("t", q, 0, 10_000).messages
            assert [(r.commitlog_offset, r.queue_offset) for r in got] == in_log
            res = s.put(Message("t", q, b"after recovery"))
            assert res.queue_offsets == [len(in_log)]  # no reuse, no gap
        s.dispatcher.catch_up()
        counts = [s.max_offset("t", q) for q in range(QUEUES)]
    with Store.open(cfg) as s:  # and the repaired state survives another restart
        assert [s.max_offset("t", q) for q in range(QUEUES)] == counts


SEEDS = range(int(os.environ.get("CLMQ_TEST_SEEDS", "6")))  # more locally: CLMQ_TEST_SEEDS=50


@pytest.mark.parametrize("seed", SEEDS)
def test_garbled_bytes_in_the_newest_segment(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    sent = fill(tmp_path, rng)
    seg, base = newest_segment(tmp_path, sent)
    in_seg = [x for x in sent if x.offset >= base]
    hits = sorted(
        rng.randrange(in_seg[0].offset, in_seg[-1].offset + in_seg[-1].size) for _ in range(rng.randint(1, 3))
    )
    with open(seg, "r+b") as f:
        for pos in hits:
            f.seek(pos - base)
            old = f.read(1)[0]
            f.seek(pos - base)
            f.write(bytes([old ^ rng.randint(1, 255)]))
    reopen_and_check(tmp_path, [x for x in sent if x.offset + x.size <= hits[0]])


@pytest.mark.parametrize("seed", SEEDS)
def test_truncated_newest_segment(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    sent = fill(tmp_path, rng)
    seg, base = newest_segment(tmp_path, sent)
    cut = rng.randrange(0, os.path.getsize(seg))
    os.truncate(seg, cut)
    reopen_and_check(tmp_path, [x for x in sent if x.offset + x.size <= base + cut])


@pytest.mark.parametrize("seed", SEEDS)
def test_deleted_and_truncated_queue_files_are_rebuilt(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    sent = fill(tmp_path, rng)
    files = sorted(p for p in (tmp_path / "consumequeue").rglob("0*") if p.is_file())
    for path in rng.sample(files, k=max(1, len(files) // 3)):
        if rng.random() < 0.5:
            path.unlink()
        else:
            os.truncate(path, rng.randrange(0, os.path.getsize(path) + 1))
    if rng.random() < 0.5:  # sometimes a whole queue directory is gone
        victim = tmp_path / "consumequeue" / "t" / str(rng.randrange(QUEUES))
        for p in victim.glob("*"):
            p.unlink()
        victim.rmdir() if victim.exists() else None
    reopen_and_check(tmp_path, sent)


@pytest.mark.parametrize("seed", SEEDS)
def test_deleted_checkpoint_with_damage_everywhere(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    sent = fill(tmp_path, rng)
    (tmp_path / "checkpoint").unlink()
    seg, base = newest_segment(tmp_path, sent)
    cut = rng.randrange(0, os.path.getsize(seg))
    os.truncate(seg, cut)
    for path in rng.sample(sorted(p for p in (tmp_path / "consumequeue").rglob("0*") if p.is_file()), k=2):
        path.unlink()
    reopen_and_check(tmp_path, [x for x in sent if x.offset + x.size <= base + cut])


def test_abort_marker_alone_triggers_validation(tmp_path: Path) -> None:
    sent = fill(tmp_path, random.Random(99))
    assert (tmp_path / "abort").exists()
    reopen_and_check(tmp_path, sent)
    assert not (tmp_path / "abort").exists()  # a clean close removes it


def test_corrupt_old_record_is_reported_when_read_never_returned(tmp_path: Path) -> None:
    sent = fill(tmp_path, random.Random(5))
    reopen_and_check(tmp_path, sent)  # clean state first
    victim = sent[2]
    seg = max(p for p in (tmp_path / "commitlog").glob("*.log") if int(p.stem) <= victim.offset)
    with open(seg, "r+b") as f:
        f.seek(victim.offset - int(seg.stem) + victim.size - 1)
        f.write(b"\x00" if victim.body[-1:] != b"\x00" else b"\x01")
    cfg = small_config(tmp_path, segment_bytes=32 * 1024, max_message_bytes=4096, cq_entries_per_file=16)
    with Store.open(cfg) as s:  # a clean open does not rescan old data ...
        with pytest.raises(CorruptRecordError) as info:
            s.get("t", victim.queue_id, victim.queue_offset, 5)
        assert info.value.offset == victim.offset and info.value.file == str(seg)
        assert "crc32c expected" in str(info.value)

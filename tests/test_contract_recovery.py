"""Recovery contract for both storage modes: after damage to the newest data file of a
log, every queue holds exactly its valid prefix and new appends continue its offsets."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from clmq.broker.store import Store
from clmq.common import Message

from .conftest import small_config

QUEUES = 5
SEEDS = range(int(os.environ.get("CLMQ_TEST_SEEDS", "4")))
Location = tuple[Path, int, int]  # data file, position in it, size


def config(path: Path, mode: str):  # type: ignore[no-untyped-def]
    return small_config(path, segment_bytes=24 * 1024, max_message_bytes=4096, cq_entries_per_file=16, mode=mode)


def fill(path: Path, mode: str, rng: random.Random) -> dict[int, list[tuple[bytes, Location]]]:
    """Random batches; returns each queue's messages with where they landed. Ends as a crash."""
    s = Store.open(config(path, mode))
    s.create_topic("t", QUEUES)
    for _ in range(rng.randint(15, 30)):
        batch = [
            Message("t", rng.randrange(QUEUES), rng.randbytes(rng.randint(1, 700))) for _ in range(rng.randint(1, 15))
        ]
        assert s.put_batch(batch).ok
    s.catch_up()
    sent = {q: [(r.body, _location(path, mode, r)) for r in s.get("t", q, 0, 100_000).messages] for q in range(QUEUES)}
    s.flush()
    s.abandon()
    return sent


def _location(path: Path, mode: str, rec) -> Location:  # type: ignore[no-untyped-def]
    if mode == "commitlog":
        seg = max(p for p in (path / "commitlog").glob("*.log") if int(p.stem) <= rec.commitlog_offset)
        return seg, rec.commitlog_offset - int(seg.stem), rec.size
    part = path / "partitions" / f"t-{rec.queue_id}"
    seg = max(p for p in part.glob("*.log") if int(p.stem) <= rec.queue_offset)
    return seg, rec.commitlog_offset, rec.size  # partition records hold their file position


def newest_file(sent: dict[int, list[tuple[bytes, Location]]], rng: random.Random, mode: str) -> Path:
    """The newest data file of the log (commit log), or of a random queue's log (partitions)."""
    queues = [q for q in sent if sent[q]] if mode != "commitlog" else list(sent)
    q = rng.choice(queues)
    return max(loc[0] for qq in ([q] if mode != "commitlog" else queues) for _, loc in sent[qq])


def check(path: Path, mode: str, expected: dict[int, list[bytes]]) -> None:
    with Store.open(config(path, mode)) as s:
        for q in range(QUEUES):
            got = s.get("t", q, 0, 100_000).messages
            assert [m.body for m in got] == expected[q], f"queue {q}"
            assert [m.queue_offset for m in got] == list(range(len(got)))
            assert s.put(Message("t", q, b"next")).queue_offsets == [len(got)]  # no reuse, no gap


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("damage", ["garble", "truncate"])
def test_damaged_newest_file_leaves_exactly_the_valid_prefix(tmp_path: Path, mode: str, seed: int, damage: str) -> None:
    rng = random.Random(seed)
    sent = fill(tmp_path, mode, rng)
    victim = newest_file(sent, rng, mode)
    spans = sorted(loc[1:] for q in sent for _, loc in sent[q] if loc[0] == victim)
    if damage == "truncate":
        cut = rng.randrange(0, os.path.getsize(victim))
        os.truncate(victim, cut)
    else:
        cut = rng.randrange(spans[0][0], spans[-1][0] + spans[-1][1])
        with open(victim, "r+b") as f:
            f.seek(cut)
            byte = f.read(1)[0]
            f.seek(cut)
            f.write(bytes([byte ^ 0x5A]))
    expected = {q: [b for b, (f, pos, size) in msgs if f != victim or pos + size <= cut] for q, msgs in sent.items()}
    check(tmp_path, mode, expected)


@pytest.mark.parametrize("seed", SEEDS)
def test_lost_checkpoint_and_derived_files_are_rebuilt(tmp_path: Path, mode: str, seed: int) -> None:
    rng = random.Random(seed)
    sent = fill(tmp_path, mode, rng)
    for name in ("checkpoint", "recovery-points"):
        (tmp_path / name).unlink(missing_ok=True)
    derived = [
        p
        for p in tmp_path.rglob("*")
        if p.is_file() and (p.suffix in (".bidx", ".index", ".timeindex") or "consumequeue" in p.parts)
    ]
    for p in rng.sample(derived, k=(len(derived) + 1) // 2):
        p.unlink()
    check(tmp_path, mode, {q: [b for b, _ in msgs] for q, msgs in sent.items()})

"""The checkpoint costs the queues that changed, and says exactly what the full walk said.

The housekeeping checkpoint used to walk every loaded queue every second (extents,
the oldest entry of every small waiting tail) and encode the whole per-queue table.
Now the consume-queue set reports the queues whose extent changed, the waiting tails
are kept in a heap, and the table's rows stay encoded. These tests hold the new path
to the old one's answers on real stores and files: the same table, the same
re-dispatch start, the same bytes on disk, and the same recovery after a crash.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from clmq.broker.store import Store
from clmq.broker.store._checkpoint import Checkpoint, CheckpointRows
from clmq.commitlog import QueueKey, load_json, write_json
from clmq.common import Message
from clmq.consumequeue import ConsumeQueueSet
from clmq.consumequeue._entries import ENTRY, ENTRY_DTYPE

from .conftest import small_config

FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _config(path: Path, **more: object) -> object:
    return small_config(path, cq_entries_per_file=8, cq_flush_min_bytes=100, **more)


# --------------------------------------------------------------- the encoding
topics = st.text(min_size=1, max_size=12).filter(lambda t: "/" not in t)
tables = st.dictionaries(
    st.tuples(topics, st.integers(0, 2**31)),
    st.tuples(st.integers(0, 2**40), st.integers(0, 2**40)),
    max_size=30,
)


@FAST
@given(first=tables, later=tables, durable=st.integers(0, 2**50), dispatched=st.integers(0, 2**50))
def test_kept_rows_write_the_bytes_json_dumps_writes(
    tmp_path: Path,
    first: dict[QueueKey, tuple[int, int]],
    later: dict[QueueKey, tuple[int, int]],
    durable: int,
    dispatched: int,
) -> None:
    """Rows kept across a change write the same file as encoding the whole table, and
    the loader reads it back equal: the format did not change."""
    rows = CheckpointRows()
    table = dict(first)
    rows.track(table, {})
    table.update(later)
    rows.track(table, later)  # only the changed rows are encoded again
    kept, whole = tmp_path / "kept" / "checkpoint", tmp_path / "whole" / "checkpoint"
    kept.parent.mkdir(exist_ok=True)
    whole.parent.mkdir(exist_ok=True)
    Checkpoint(durable, dispatched, dict(table), rows=rows).save(kept)
    assert not rows.stale
    write_json(
        whole,
        {
            "version": 1,
            "log_durable": durable,
            "dispatched": dispatched,
            "queues": [[t, q, f, n] for (t, q), (f, n) in table.items()],
        },
    )
    assert kept.read_bytes() == whole.read_bytes()
    assert Checkpoint.load(kept) == Checkpoint(durable, dispatched, table)


def test_rows_go_stale_only_when_a_row_changes() -> None:
    rows, table = CheckpointRows(), {("t", 0): (0, 3), ("t", 1): (0, 5)}
    rows.track(table, {})
    rows.saved()
    rows.track(table, {("t", 0): (0, 3)})  # reported, but the same extent (a queue loaded)
    assert not rows.stale
    table[("t", 1)] = (0, 6)
    rows.track(table, {("t", 1): (0, 6)})
    assert rows.stale
    rows.saved()
    rows.track(dict(table), {})  # another table object: encoded anew
    assert rows.stale
    assert json.loads(b"[" + rows.joined() + b"]") == [["t", 0, 0, 3], ["t", 1, 0, 6]]


# ------------------------------------------------- the consume-queue set's side
def _entry(phys: int) -> bytes:
    return ENTRY.pack(phys, 10, 0)


def _dispatch(queues: ConsumeQueueSet, q: int, first: int, phys: list[int]) -> None:
    """One dispatch round giving queue ``q`` of topic "t" entries from ``first`` on."""
    code = queues.topic_id("t") << 32 | q
    codes = np.full(len(phys), code, dtype=np.uint64)
    offsets = np.arange(first, first + len(phys), dtype=np.int64)
    entries = np.frombuffer(b"".join(_entry(p) for p in phys), dtype=ENTRY_DTYPE)
    queues.add_round(codes, offsets, entries)


def test_changed_extents_name_only_the_queues_that_changed(tmp_path: Path) -> None:
    queues = ConsumeQueueSet(tmp_path, 8, 64)
    queues.discover()
    for q in range(200):
        _dispatch(queues, q, 0, [100 * q])
    queues.flush()
    assert len(queues.changed_extents()) == 200  # the first call: every loaded queue
    assert queues.changed_extents() == {}  # idle: nothing to visit
    _dispatch(queues, 7, 1, [50_000])
    assert queues.flush(min_bytes=100) == 50_000  # a small tail waits: its extent did not move
    assert queues.changed_extents() == {}
    queues.flush()
    assert queues.changed_extents() == {("t", 7): (0, 2)}
    assert queues.changed_extents() == queues.changed_extents() == {}
    assert queues.extents()[("t", 7)] == (0, 2)


@FAST
@example([("a", 0, 2), ("a", 1, 1), ("t", 0, 3)])  # a waiting tail truncated away: its heap item is stale
@given(st.lists(st.tuples(st.sampled_from("afft"), st.integers(0, 5), st.integers(1, 6)), max_size=40))
def test_oldest_waiting_entry_is_what_a_walk_of_every_tail_finds(
    tmp_path_factory: object, ops: list[tuple[str, int, int]]
) -> None:
    """Appends, partial flushes, full flushes and truncations in any order: the oldest
    entry only memory holds is the minimum over every queue, as the old walk found it."""
    root = tmp_path_factory.mktemp("cq")  # type: ignore[attr-defined]
    queues = ConsumeQueueSet(root, 8, 64)
    queues.discover()
    phys = 0
    for op, q, n in ops:
        cq = queues.queue("t", q)
        if op == "a":
            _dispatch(queues, q, cq.next_offset, [phys + 10 * i for i in range(n)])
            phys += 10 * n
        elif op == "t":
            cq.truncate(max(0, cq.next_offset - n))
        full = op == "t" and n % 2 == 0
        got = queues.flush(min_bytes=0 if full else 20 * 4)
        walk = [o for o in (queues.queue("t", i).oldest_pending() for i in range(6)) if o is not None]
        assert got == (min(walk) if walk else None)


# ------------------------------------------------------------- the store's side
def _old_table(s: Store, manifest: dict[QueueKey, tuple[int, int]]) -> dict[QueueKey, tuple[int, int]]:
    """What the checkpoint recorded before: the open's table, then every loaded queue's extent."""
    return {**manifest, **s._parts.queues.extents()}


def test_the_carried_table_is_the_full_walk_and_idle_writes_nothing(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    with Store.open(cfg) as s:
        s.create_topic("t", 300)
        for q in range(300):
            assert s.put(Message("t", q, b"m%d" % q)).ok
    with Store.open(cfg) as s:  # clean: the table of unloaded queues comes from the checkpoint
        opened = dict(s._parts.manifest)
        rng = random.Random(7)
        for round_ in range(6):
            for q in rng.sample(range(300), 20):
                assert s.put(Message("t", q, b"r%d" % round_)).ok
            s.catch_up()
            cp = s.checkpoint() if round_ % 2 else s.checkpoint(full=False)
            assert cp.queues == _old_table(s, opened)
            assert Checkpoint.load(tmp_path / "checkpoint") == cp
        path = tmp_path / "checkpoint"
        before = path.stat().st_mtime_ns, path.stat().st_ino
        assert s.checkpoint() is cp  # idle: nothing changed, nothing written
        assert (path.stat().st_mtime_ns, path.stat().st_ino) == before


def test_a_crash_after_carried_checkpoints_loses_nothing(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    sent: dict[int, list[bytes]] = {q: [] for q in range(40)}
    with Store.open(cfg) as s:
        s.create_topic("t", 40)
        for q in range(40):
            for i in range(3):
                body = b"a%d-%d" % (q, i)
                assert s.put(Message("t", q, body)).ok
                sent[q].append(body)
    s = Store.open(cfg)  # most queues stay unloaded: their rows are carried from the open
    for q in (3, 17):
        for i in range(12):  # past cq_flush_min_bytes: written by a partial checkpoint
            body = b"b%d-%d" % (q, i)
            assert s.put(Message("t", q, body)).ok
            sent[q].append(body)
        s.catch_up()
        s.checkpoint(full=False)
    assert s.put(Message("t", 5, b"tail")).ok  # only in memory at the crash
    sent[5].append(b"tail")
    s.catch_up()
    s.checkpoint()
    saved = load_json(tmp_path / "checkpoint").value
    assert len(saved["queues"]) == 40
    s.abandon()
    with Store.open(cfg) as s:
        for q in range(40):
            assert [r.body for r in s.get("t", q, 0, 100).messages] == sent[q]

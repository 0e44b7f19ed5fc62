"""Transactions' durable state and the rebuild at start (or promotion).

Everything is in the CommitLog: half messages (``%TRANS_HALF%`` queue 0), their ends
and checks (``%TRANS_OP%`` queues 0 commit, 1 rollback, 2 check: each entry's tag code
is the half message's commit-log offset), and committed messages (each carries
``TRAN_HALF``, its half message's offset). A rebuild reads the half queue's entries
minus the ended ones (20-byte entries, no record read for an ended half), counts the
check entries of those still pending, and reads each pending half's record once (its
group, real topic and queue, time).

A commit appends the real message and its op record in one store call, the message
first; a crash inside a segment roll (the one place an append is split between two
files) or a follower's partial copy can keep the message and lose its op. The
checkpoint (``transaction/checkpoint.json``, a checked file with its previous
generation, saved after a log flush) therefore records ``mark_offset``, the log's end
when it was taken: every commit below it is whole on disk. A start reads the log from
the mark (or the oldest pending half, if later) for ``TRAN_HALF``; a pending half found
committed there gets its missing op record (``Rebuilt.orphans``), never a second
message. ``half_from`` (the half queue's offset below which nothing was pending),
``floor_offset`` (the oldest pending half, retention's floor while no leader runs here)
and ``ops_from`` (where the op queues stood before that half was stored: ``OpMarks``)
spare a start the whole half queue and the whole op queues.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Container

import numpy as np

from clmq.broker.store import MetadataSource, Store, load_json, write_json
from clmq.common import (
    PROP_REAL_QID,
    PROP_REAL_TOPIC,
    PROP_TRAN_GROUP,
    PROP_TRAN_HALF,
    TRANS_HALF_TOPIC,
    TRANS_OP_CHECK,
    TRANS_OP_COMMIT,
    TRANS_OP_ROLLBACK,
    TRANS_OP_TOPIC,
    CorruptRecordError,
    Record,
    decode_record,
    walk_records,
)
from clmq.consumequeue import ENTRY_DTYPE, HOLE_TAG, START_TAG

from .._dedup import UNIQ_KEY
from ._pending import COMMITTED, ENDED_KEPT, ROLLED_BACK, Half, PendingSet

log = logging.getLogger("clmq.transactions")

HALF_QUEUE = 0
HALF_QUEUES = 1
OP_QUEUES = 3
READ_ENTRIES = 65_536  # queue entries read per step
SCAN_BYTES = 4 << 20  # log bytes read per step when looking for commits after the mark
_MARKER = PROP_TRAN_HALF.encode()


@dataclass
class TransactionCheckpoint:
    """What a start may skip: the saved ``transaction/checkpoint.json`` (module docstring)."""

    mark_offset: int = 0  # the log's end when taken: every commit below it has its op record
    half_from: int = 0  # %TRANS_HALF% queue 0: nothing pending below this queue offset
    floor_offset: int = 0  # the oldest pending half's commit-log offset (or the mark, none pending)
    # %TRANS_OP% queues 0, 1, 2: every op record of a half at or past floor_offset is at
    # or past these queue offsets (a start reads the op queues from here, not whole).
    ops_from: tuple[int, int, int] = (0, 0, 0)

    def to_json(self) -> dict[str, Any]:
        """The checkpoint as saved (version 1)."""
        return {"version": 1, **asdict(self), "ops_from": list(self.ops_from)}

    @staticmethod
    def from_json(value: dict[str, Any]) -> TransactionCheckpoint:
        """A saved checkpoint; ValueError (or KeyError, TypeError) if it is not one."""
        if value.get("version") != 1:
            raise ValueError(f"version {value.get('version')!r}, expected 1")
        ops = [int(x) for x in value.get("ops_from", (0, 0, 0))]
        if len(ops) != OP_QUEUES:
            raise ValueError(f"ops_from must hold {OP_QUEUES} offsets, got {ops}")
        return TransactionCheckpoint(
            int(value["mark_offset"]), int(value["half_from"]), int(value["floor_offset"]), (ops[0], ops[1], ops[2])
        )


def checkpoint_path(store: Store) -> Path:
    """Where the checkpoint lives in the store's directory."""
    return store.directory / "transaction" / "checkpoint.json"


def load_checkpoint(store: Store) -> TransactionCheckpoint:
    """The saved checkpoint; with none, one that makes a start read the whole log."""
    loaded = load_json(checkpoint_path(store), validate=_problem)
    if loaded.source in (MetadataSource.CURRENT, MetadataSource.PREVIOUS):
        return TransactionCheckpoint.from_json(loaded.value)
    if loaded.source is MetadataSource.DAMAGED:
        log.warning("transactions: no usable checkpoint (%s); rebuilding from the whole log", loaded.describe())
    return TransactionCheckpoint(store.log.min_offset, 0, store.log.min_offset, (0, 0, 0))


def save_checkpoint(store: Store, cp: TransactionCheckpoint) -> None:
    """Save ``cp`` as a checked file keeping its previous generation."""
    path = checkpoint_path(store)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, cp.to_json())


def _problem(value: dict[str, Any]) -> str | None:
    try:
        TransactionCheckpoint.from_json(value)
    except (KeyError, TypeError, ValueError) as e:
        return f"not a transaction checkpoint ({type(e).__name__}: {e})"
    return None


def read_entries(store: Store, topic: str, queue_id: int, start: int) -> tuple[int, np.ndarray]:
    """Entries of ``topic``'s queue ``queue_id`` from ``start`` (raised to the first held)."""
    if not store.queue_exists(topic, queue_id):
        return start, np.empty(0, dtype=ENTRY_DTYPE)
    first, raw = store.queues.queue(topic, queue_id).read_entries(start, READ_ENTRIES)
    entries: np.ndarray = np.frombuffer(raw, dtype=ENTRY_DTYPE)
    return first, entries


def real(entries: np.ndarray) -> np.ndarray:
    """A mask of the entries that point at records (not holes or start markers)."""
    tags = entries["tag"]
    mask: np.ndarray = (entries["size"] > 0) & (tags != HOLE_TAG) & (tags != START_TAG)
    return mask


def op_ends(store: Store) -> tuple[int, int, int]:
    """Where each ``%TRANS_OP%`` queue ends now (what the queues show)."""
    ends = [store.max_offset(TRANS_OP_TOPIC, q) if store.queue_exists(TRANS_OP_TOPIC, q) else 0 for q in range(3)]
    return ends[0], ends[1], ends[2]


class OpMarks:
    """Samples (log end W, op queue ends E) taken by the leader at each look, E read
    first: a half stored at or past W is appended after E was read, and its op records
    after it, so they lie at or past E. A checkpoint's ``ops_from`` is the E of the
    latest sample with W at or below its ``floor_offset``. Older samples are dropped;
    past ``MAX_SAMPLES`` every other old one is (still correct: an older E is lower)."""

    MAX_SAMPLES = 64

    def __init__(self, base: TransactionCheckpoint) -> None:
        self.samples: list[tuple[int, tuple[int, int, int]]] = [(base.floor_offset, base.ops_from)]

    def add(self, log_end: int, ends: tuple[int, int, int]) -> None:
        """A sample taken at a look: the log's end and the op queues' ends read before it."""
        self.samples.append((log_end, ends))
        if len(self.samples) > self.MAX_SAMPLES:
            half = len(self.samples) // 2
            self.samples = self.samples[:half:2] + self.samples[half:]

    def ops_from(self, floor_offset: int) -> tuple[int, int, int]:
        """The op queue offsets every op of a half at or past ``floor_offset`` is at or past."""
        usable = [i for i, (w, _) in enumerate(self.samples) if w <= floor_offset]
        if not usable:
            return (0, 0, 0)
        self.samples = self.samples[usable[-1] :]
        return self.samples[0][1]


def op_tags(store: Store, queue_id: int, start: int = 0) -> np.ndarray:
    """The tag codes (half offsets) of the entries of ``%TRANS_OP%`` ``queue_id`` from ``start``."""
    return op_entries(store, queue_id, start)[1]


def op_entries(store: Store, queue_id: int, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(commit-log offsets of the op records, their tag codes: the half offsets) of
    ``%TRANS_OP%`` ``queue_id`` from ``start``."""
    where, tags, at = [], [], start
    while True:
        first, entries = read_entries(store, TRANS_OP_TOPIC, queue_id, at)
        if not len(entries):
            break
        mask = real(entries)
        where.append(entries["offset"][mask].astype(np.int64))
        tags.append(entries["tag"][mask].astype(np.int64))
        at = first + len(entries)
    if not tags:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    return np.concatenate(where), np.concatenate(tags)


def queue_number(text: str) -> int | None:
    """``text`` as a queue id or offset: ASCII digits only (``"²".isdigit()`` is true,
    ``int("²")`` raises); None if it is not one."""
    return int(text) if text.isascii() and text.isdigit() else None


def half_from_record(record: Record, queue_offset: int) -> Half | None:
    """The pending half a ``%TRANS_HALF%`` record stands for (None: not one)."""
    p = record.properties
    group, topic = p.get(PROP_TRAN_GROUP, ""), p.get(PROP_REAL_TOPIC, "")
    qid = queue_number(p.get(PROP_REAL_QID, ""))
    if record.topic != TRANS_HALF_TOPIC or not group or not topic or qid is None:
        return None
    return Half(record.commitlog_offset, record.size, queue_offset, group, topic, qid, record.store_timestamp_ms)


@dataclass
class Rebuilt:
    """A rebuild's result: the pending set, and the halves to end as committed first."""

    halves: PendingSet
    orphans: list[int] = field(default_factory=list)  # pending halves found committed after the mark


def rebuild(store: Store, cp: TransactionCheckpoint, ended_kept: int = ENDED_KEPT) -> Rebuilt:
    """The pending set as the checkpoint and the log say (runs in a thread)."""
    halves = PendingSet(ended_kept)
    visible = store.dispatcher.dispatched_offset  # every half below it is in the queue now
    ended = _remember_ends(store, halves, cp)
    at = cp.half_from
    while True:
        first, entries = read_entries(store, TRANS_HALF_TOPIC, HALF_QUEUE, at)
        if not len(entries):
            break
        offsets = np.arange(first, first + len(entries))
        keep = real(entries) & ~np.isin(entries["offset"].astype(np.int64), ended)
        for q, off, size in zip(
            offsets[keep].tolist(), entries["offset"][keep].tolist(), entries["size"][keep].tolist()
        ):
            _read_half(store, halves, q, off, size)
        halves.read_to = int(entries["offset"][-1]) + int(entries["size"][-1])
        at = first + len(entries)
    halves.queue_read = at
    halves.read_to = max(halves.read_to, visible)
    _count_checks(store, halves, cp.ops_from[TRANS_OP_CHECK])
    orphans = []
    if halves.pending:
        start = max(cp.mark_offset, min(halves.pending))
        found = committed_since(store, start, halves.pending)
        orphans = sorted({c.half_offset for c in found if _commits(store, halves.pending.get(c.half_offset), c)})
    log.info(
        "transactions: %d half messages pending, %d committed after the checkpoint without their op record",
        len(halves.pending),
        len(orphans),
    )
    return Rebuilt(halves, orphans)


def _remember_ends(store: Store, halves: PendingSet, cp: TransactionCheckpoint) -> np.ndarray:
    """Every half offset ended since ``cp.ops_from``; the latest ``ended_kept`` of them
    (in log order, commits and rollbacks together) remembered in ``halves``."""
    c_at, c_tags = op_entries(store, TRANS_OP_COMMIT, cp.ops_from[TRANS_OP_COMMIT])
    r_at, r_tags = op_entries(store, TRANS_OP_ROLLBACK, cp.ops_from[TRANS_OP_ROLLBACK])
    at, tags = np.concatenate([c_at, r_at]), np.concatenate([c_tags, r_tags])
    committed = np.concatenate([np.ones(len(c_at), dtype=bool), np.zeros(len(r_at), dtype=bool)])
    latest = np.argsort(at, kind="stable")[-halves.ended_kept :]
    for tag, was_commit in zip(tags[latest].tolist(), committed[latest].tolist()):
        halves.remember(tag, COMMITTED if was_commit else ROLLED_BACK)
    return tags


def _read_half(store: Store, halves: PendingSet, q: int, off: int, size: int) -> None:
    try:
        record = store.log.read_record(off, size)
    except CorruptRecordError as e:
        log.error("transactions: the half message at %d is damaged, left out: %s", off, e)
        return
    half = None if record is None else half_from_record(record, q)
    if half is not None:
        halves.add(half)


def _count_checks(store: Store, halves: PendingSet, start: int) -> None:
    if not halves.pending:
        return
    tags = op_tags(store, TRANS_OP_CHECK, start)
    found, counts = np.unique(tags, return_counts=True)
    for off, n in zip(found.tolist(), counts.tolist()):
        half = halves.pending.get(off)
        if half is not None:
            half.checks = n


@dataclass
class Committed:
    """A record carrying ``TRAN_HALF``: what it says it commits, where it is, what it holds."""

    half_offset: int
    topic: str
    queue_id: int
    uniq_key: str
    body: bytes


def _commits(store: Store, half: Half | None, found: Committed) -> bool:
    """A record carrying ``TRAN_HALF`` is that half's commit only if it is the half's
    committed copy: in its real queue, with the half's UNIQ_KEY and body (a plain send
    carrying someone's ``TRAN_HALF`` is no commit of it)."""
    if half is None or half.topic != found.topic or half.queue_id != found.queue_id:
        return False
    try:
        record = store.log.read_record(half.offset, half.size)
    except CorruptRecordError:
        return False
    return (
        record is not None
        and record.properties.get(UNIQ_KEY, "") == found.uniq_key
        and bytes(record.body) == found.body
    )


def committed_since(store: Store, mark: int, wanted: Container[int]) -> list[Committed]:
    """Every record carrying ``TRAN_HALF`` of a half in ``wanted`` in the log from
    ``mark`` to its end (the others' bodies are not kept)."""
    found: list[Committed] = []
    at, end = max(mark, store.log.min_offset), store.log.write_offset
    chunk = max(SCAN_BYTES, 2 * store.log.config.max_message_bytes)
    while at < end:
        at, data = store.log.map_chunk(at, chunk, end)
        walk = walk_records(data, 0, store.log.config.max_message_bytes)
        if bytes(data).find(_MARKER) >= 0:
            for p in walk.starts.tolist():
                record = decode_record(data, p)
                src = queue_number(record.properties.get(PROP_TRAN_HALF, ""))
                if src is not None and src in wanted:
                    uniq = record.properties.get(UNIQ_KEY, "")
                    found.append(Committed(src, record.topic, record.queue_id, uniq, bytes(record.body)))
        at = at + walk.stop if walk.reason != "blank" and walk.stop > 0 else store.log.next_segment_base(at)
    return found

"""The timer's durable state and its rebuild at start (or promotion).

Everything the timer knows is in the CommitLog: scheduled messages (``%TIMER%``
queue 0, the entry's tag code is the due time), cancel markers (queue 1, the same),
and what it delivered (each delivered message carries ``TIMER_SRC``, its scheduled
record's commit-log offset). The checkpoint (``timer/checkpoint.json``, a checked file
with its previous generation) only says how far that is done, so that a start does not
read the whole log:

- ``done_ms``: every scheduled message due at or before it, among queue offsets below
  ``enqueued``, is delivered (or cancelled);
- ``mark_offset``: the log's end when ``done_ms`` was last moved: whatever the timer
  delivered since is above it, and a start finds it by reading the log from there for
  ``TIMER_SRC`` (at most a checkpoint interval of writes): those are not delivered again;
- ``enqueued``: queue 0's offset the timer had read up to. An entry above it may be
  due before ``done_ms`` (it came late): it is delivered at once after a start.
- ``pending_from``: queue 0 has nothing pending below it, so a start reads the queue
  from there, not from its first retained entry.

The log is flushed before a checkpoint is written, so a checkpoint never claims a
delivery the disk may lose. Exactly once, across crashes, follows.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from clmq.broker.store import MetadataSource, Store, load_json, write_json
from clmq.common import PROP_CANCEL_OF, PROP_TIMER_SRC, TIMER_TOPIC, decode_record, walk_records
from clmq.consumequeue import ENTRY_DTYPE, HOLE_TAG, START_TAG

from ._wheel import TimerWheel

log = logging.getLogger("clmq.timer")

SCHEDULED_QUEUE = 0  # %TIMER% queue of scheduled messages
CANCEL_QUEUE = 1  # %TIMER% queue of cancel markers
TIMER_QUEUES = 2
READ_ENTRIES = 65_536  # queue entries read per step
SCAN_BYTES = 4 << 20  # log bytes read per step when looking for deliveries after the mark
_MARKER = PROP_TIMER_SRC.encode()


@dataclass
class TimerCheckpoint:
    done_ms: int = -1
    mark_offset: int = 0
    enqueued: int = 0
    pending_from: int = 0  # queue 0 has nothing pending below this (a start reads from here)

    def to_json(self) -> dict[str, Any]:
        return {"version": 1, **asdict(self)}

    @staticmethod
    def from_json(value: dict[str, Any]) -> TimerCheckpoint:
        if value.get("version") != 1:
            raise ValueError(f"version {value.get('version')!r}, expected 1")
        return TimerCheckpoint(
            int(value["done_ms"]), int(value["mark_offset"]), int(value["enqueued"]), int(value.get("pending_from", 0))
        )


def checkpoint_path(store: Store) -> Path:
    return store.directory / "timer" / "checkpoint.json"


def load_checkpoint(store: Store) -> TimerCheckpoint:
    """The saved checkpoint; with none (the timer never ran here), one that makes the
    rebuild read the whole log: correct, and only slow for a store that has
    scheduled messages and lost its checkpoint."""
    loaded = load_json(checkpoint_path(store), validate=_problem)
    if loaded.source in (MetadataSource.CURRENT, MetadataSource.PREVIOUS):
        return TimerCheckpoint.from_json(loaded.value)
    if loaded.source is MetadataSource.DAMAGED:
        log.warning("timer: no usable checkpoint (%s); rebuilding from the whole log", loaded.describe())
    return TimerCheckpoint(-1, store.log.min_offset, 0)


def save_checkpoint(store: Store, cp: TimerCheckpoint) -> None:
    path = checkpoint_path(store)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, cp.to_json())


def _problem(value: dict[str, Any]) -> str | None:
    try:
        TimerCheckpoint.from_json(value)
    except (KeyError, TypeError, ValueError) as e:
        return f"not a timer checkpoint ({type(e).__name__}: {e})"
    return None


def read_entries(store: Store, queue_id: int, start: int, limit: int = READ_ENTRIES) -> tuple[int, np.ndarray]:
    """Entries of ``%TIMER%`` queue ``queue_id`` from ``start`` (raised to the first
    held): ``(first offset, entries)``."""
    if not store.queue_exists(TIMER_TOPIC, queue_id):
        return start, np.empty(0, dtype=ENTRY_DTYPE)
    first, raw = store.queues.queue(TIMER_TOPIC, queue_id).read_entries(start, limit)
    entries: np.ndarray = np.frombuffer(raw, dtype=ENTRY_DTYPE)
    return first, entries


def real(entries: np.ndarray) -> np.ndarray:
    """A mask of the entries that point at records (not holes or start markers)."""
    tags = entries["tag"]
    mask: np.ndarray = (entries["size"] > 0) & (tags != HOLE_TAG) & (tags != START_TAG)
    return mask


def pending_mask(entries: np.ndarray, offsets: np.ndarray, enqueued: int, done_ms: int) -> np.ndarray:
    """The entries (at queue ``offsets``) a checkpoint leaves pending: real ones not yet
    read when it was taken (at or past ``enqueued``), or due after ``done_ms``."""
    mask: np.ndarray = real(entries) & ((offsets >= enqueued) | (entries["tag"].astype(np.int64) > done_ms))
    return mask


def first_record_from(store: Store, start: int) -> int | None:
    """The lowest commit-log offset among queue 0's records from ``start`` on (past any
    run of holes a repair left); None if there is none."""
    while True:
        first, entries = read_entries(store, SCHEDULED_QUEUE, start, 4096)
        if not len(entries):
            return None
        offsets = entries["offset"][real(entries)]
        if len(offsets):
            return int(offsets.min())
        start = first + len(entries)


@dataclass
class Rebuilt:
    wheel: TimerWheel
    enqueued: int  # queue 0's next offset to read
    cancels_read: int  # queue 1's next offset to read
    cancelled: set[int]  # commit-log offsets of scheduled records cancelled and not yet due
    delivered: set[int]  # commit-log offsets of scheduled records delivered after the mark
    skip_below: int = 0  # the checkpoint's enqueued and done_ms: an entry below the one and
    skip_done_ms: int = -1  # due at or before the other is delivered (read late or not)


def rebuild(store: Store, cp: TimerCheckpoint, window_s: int, now_s: int) -> Rebuilt:
    """The wheel and sets as the checkpoint and the log say (runs in a thread). The
    wheel starts at the current second: what fell due while the broker was down (or a
    follower) is delivered at once."""
    wheel = TimerWheel(window_s, max(cp.done_ms // 1000, now_s))
    nxt, at, lowest = cp.enqueued, min(cp.pending_from, cp.enqueued), None
    kept_offsets: list[np.ndarray] = []
    while True:
        first, entries = read_entries(store, SCHEDULED_QUEUE, at)
        if not len(entries):
            break
        offsets = np.arange(first, first + len(entries))
        keep = pending_mask(entries, offsets, cp.enqueued, cp.done_ms)
        wheel.add_many(offsets[keep], (entries["tag"][keep] // 1000).astype(np.int64))
        kept_offsets.append(entries["offset"][keep])
        if lowest is None and keep.any():
            lowest = int(entries["offset"][keep][0])  # queue order is log order
        at = nxt = first + len(entries)
    cancelled, cancels_read = read_cancels(store, 0, cp.done_ms)
    # A delivery comes after its scheduled record in the log: the look for deliveries
    # starts at the oldest pending record if that is later than the mark (a store
    # without a checkpoint does not read its whole log), and nothing pending, none.
    delivered = delivered_since(store, max(cp.mark_offset, lowest)) if lowest is not None else set()
    if delivered:  # only those still pending matter (and they leave the set as they come due)
        found = np.fromiter(delivered, dtype=np.uint64, count=len(delivered))
        delivered = set(found[np.isin(found, np.concatenate(kept_offsets))].tolist())
    log.info(
        "timer: %d scheduled messages pending, %d cancelled, %d delivered after the checkpoint",
        wheel.pending + len(wheel.overflow),
        len(cancelled),
        len(delivered),
    )
    return Rebuilt(wheel, nxt, cancels_read, cancelled, delivered, cp.enqueued, cp.done_ms)


def read_cancels(store: Store, start: int, after_ms: int) -> tuple[set[int], int]:
    """The scheduled records cancelled by markers from ``start`` on, due after
    ``after_ms``; and the cancel queue's next offset."""
    cancelled: set[int] = set()
    at = start
    while True:
        first, entries = read_entries(store, CANCEL_QUEUE, at)
        if not len(entries):
            return cancelled, at
        keep = real(entries) & (entries["tag"].astype(np.int64) > after_ms)
        for off, size in zip(entries["offset"][keep].tolist(), entries["size"][keep].tolist()):
            record = store.log.read_record(off, size)
            if record is not None and record.properties.get(PROP_CANCEL_OF, "").isdigit():
                cancelled.add(int(record.properties[PROP_CANCEL_OF]))
        at = first + len(entries)


def delivered_since(store: Store, mark: int) -> set[int]:
    """``TIMER_SRC`` of every record in the log from ``mark`` to its end."""
    found: set[int] = set()
    at, end = max(mark, store.log.min_offset), store.log.write_offset
    chunk = max(SCAN_BYTES, 2 * store.log.config.max_message_bytes)
    while at < end:
        at, data = store.log.map_chunk(at, chunk, end)
        walk = walk_records(data, 0, store.log.config.max_message_bytes)
        if bytes(data).find(_MARKER) >= 0:
            for p in walk.starts.tolist():
                src = decode_record(data, p).properties.get(PROP_TIMER_SRC, "")
                if src.isdigit():
                    found.add(int(src))
        at = at + walk.stop if walk.reason != "blank" and walk.stop > 0 else store.log.next_segment_base(at)
    return found

"""POP's durable state: the checkpoint file and the replay of ``%POP%`` queue 0.

Every pop appends CK records and every accepted acknowledgement an ACK record to
``%POP%`` queue 0 before it is answered (``_records``). The checkpoint
(``pop/checkpoint.json``, a checked file with its previous generation, saved after a
log flush) holds the whole in-flight state and ``applied_to``: every ``%POP%`` record
below that queue offset is reflected in it. A start (or a promotion) loads it and
applies the records from ``applied_to`` on; applying a record twice changes nothing
(``_inflight``), so ``applied_to`` may be low, never high. ``log_from`` (the
commit-log offset of the record at ``applied_to``) is retention's floor.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from clmq.broker.store import MetadataSource, Store, load_json, write_json
from clmq.common import POP_TOPIC, CorruptRecordError
from clmq.consumequeue import ENTRY_DTYPE, HOLE_TAG, START_TAG

from ._inflight import PopState
from ._records import POP_QUEUE, decode_pop_record

log = logging.getLogger("clmq.pop")

READ_ENTRIES = 65_536  # queue entries read per step


@dataclass
class PopCheckpoint:
    """The saved ``pop/checkpoint.json`` (module docstring)."""

    applied_to: int = 0
    log_from: int = 0
    state: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The checkpoint as saved (version 1)."""
        return {"version": 1, "applied_to": self.applied_to, "log_from": self.log_from, "state": self.state}

    @staticmethod
    def from_json(value: dict[str, Any]) -> PopCheckpoint:
        """A saved checkpoint; ValueError (or KeyError, TypeError) if it is not one."""
        if value.get("version") != 1:
            raise ValueError(f"version {value.get('version')!r}, expected 1")
        state = value["state"]
        PopState.from_json(state)  # checks it
        return PopCheckpoint(int(value["applied_to"]), int(value["log_from"]), state)


def checkpoint_path(store: Store) -> Path:
    """Where the checkpoint lives in the store's directory."""
    return store.directory / "pop" / "checkpoint.json"


def load_checkpoint(store: Store) -> PopCheckpoint:
    """The saved checkpoint; with none, one that replays ``%POP%`` from its start."""
    loaded = load_json(checkpoint_path(store), validate=_problem)
    if loaded.source in (MetadataSource.CURRENT, MetadataSource.PREVIOUS):
        return PopCheckpoint.from_json(loaded.value)
    if loaded.source is MetadataSource.DAMAGED:
        log.warning("pop: no usable checkpoint (%s); replaying %s from its start", loaded.describe(), POP_TOPIC)
    return PopCheckpoint(0, store.log.min_offset)


def save_checkpoint(store: Store, cp: PopCheckpoint) -> None:
    """Save ``cp`` as a checked file keeping its previous generation."""
    path = checkpoint_path(store)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, cp.to_json())


def _problem(value: dict[str, Any]) -> str | None:
    try:
        PopCheckpoint.from_json(value)
    except (KeyError, TypeError, ValueError) as e:
        return f"not a POP checkpoint ({type(e).__name__}: {e})"
    return None


def read_entries(
    store: Store, topic: str, queue_id: int, start: int, count: int = READ_ENTRIES
) -> tuple[int, np.ndarray]:
    """Up to ``count`` entries of a queue from ``start`` (raised to the first held)."""
    if not store.queue_exists(topic, queue_id):
        return start, np.empty(0, dtype=ENTRY_DTYPE)
    first, raw = store.queues.queue(topic, queue_id).read_entries(start, count)
    entries: np.ndarray = np.frombuffer(raw, dtype=ENTRY_DTYPE)
    return first, entries


def real(entries: np.ndarray) -> np.ndarray:
    """A mask of the entries that point at records (not holes or start markers)."""
    tags = entries["tag"]
    mask: np.ndarray = (entries["size"] > 0) & (tags != HOLE_TAG) & (tags != START_TAG)
    return mask


def replay(store: Store, cp: PopCheckpoint) -> tuple[PopState, int]:
    """The state the checkpoint and ``%POP%`` queue 0 from its ``applied_to`` say, and
    the queue offset read to (runs in a thread)."""
    state = PopState.from_json(cp.state)
    at, applied = cp.applied_to, 0
    while True:
        first, entries = read_entries(store, POP_TOPIC, POP_QUEUE, at)
        if not len(entries):
            break
        keep = real(entries)
        for i, (off, size) in enumerate(zip(entries["offset"].tolist(), entries["size"].tolist())):
            if keep[i]:
                applied += _apply_one(store, state, off, size, first + i)
        at = first + len(entries)
    log.info("pop: state rebuilt from the checkpoint and %d %s records", applied, POP_TOPIC)
    return state, at


def _apply_one(store: Store, state: PopState, off: int, size: int, queue_offset: int) -> int:
    try:
        record = store.log.read_record(off, size)
        meaning = None if record is None else decode_pop_record(record.tags, bytes(record.body))
    except (CorruptRecordError, ValueError, KeyError, TypeError) as e:
        log.error("pop: the %s record at %d is unusable, skipped: %s", POP_TOPIC, off, e)
        return 0
    if meaning is None:
        return 0
    state.apply(meaning, queue_offset)
    return 1


def log_offset_at(store: Store, queue_offset: int, fallback: int) -> int:
    """The commit-log offset of ``%POP%``'s record at ``queue_offset`` (``fallback``: none yet)."""
    _first, entries = read_entries(store, POP_TOPIC, POP_QUEUE, queue_offset, 1)
    return int(entries["offset"][0]) if len(entries) else fallback

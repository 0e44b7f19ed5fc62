"""The store's checkpoint and clean-shutdown marker.

- ``abort`` exists while a store is open; it is created *before* loading starts, so a
  crash during loading also counts as unclean. A clean close removes it.
- ``checkpoint`` (a checked metadata file, see ``clmq.commitlog._durable_file``) records what is
  known on disk: ``log_durable`` (the commit log is fsynced up to here),
  ``dispatched`` (every consume-queue entry of records below it is in the queue files)
  and, per queue, the next offset at that moment, so that deleted or truncated queue
  files are noticed. If it is damaged, its previous generation is used and marked
  (``from_previous``): older, so still true, but the open must validate as after an
  unclean stop. Neither generation good: no checkpoint, a full recovery.

Writing it costs the queues that changed: the housekeeping carries the per-queue table
forward and keeps each row JSON-encoded in :class:`CheckpointRows` until its queue
changes (at 65,536 queues ``json.dumps`` of the whole table took about 50 ms; joining
kept rows, a few). The bytes are exactly what ``json.dumps`` would write: the format
is unchanged.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from clmq.commitlog import MetadataSource, QueueKey, fsync_dir, load_json, write_json, write_json_body

CHECKPOINT_VERSION = 1


@dataclass
class Checkpoint:
    log_durable: int
    dispatched: int
    queues: dict[QueueKey, tuple[int, int]] = field(default_factory=dict)  # (first, next)
    # Loaded from the previous generation (the current file was missing or damaged):
    # the store must treat the open as unclean. Not part of the content (==).
    from_previous: bool = field(default=False, compare=False)
    # The same table's rows, kept encoded by the housekeeping (None: encode them here).
    rows: CheckpointRows | None = field(default=None, compare=False, repr=False)

    @classmethod
    def load(cls, path: Path) -> Checkpoint | None:
        """The checkpoint at ``path`` (or its previous generation, marked), or None if
        neither generation is there and good: then the open is a full recovery."""
        parsed: list[Checkpoint] = []  # what the validator parsed: a checkpoint has no need of two parses

        def validate(raw: dict[str, Any]) -> str | None:
            checkpoint = _parse(raw)
            if checkpoint is None:
                return _problem(raw)
            parsed.append(checkpoint)
            return None

        loaded = load_json(path, validate=validate)
        if not loaded.ok:
            return None
        checkpoint = parsed[-1]  # the generation load_json chose is the last that validated
        checkpoint.from_previous = loaded.source is MetadataSource.PREVIOUS
        return checkpoint

    def save(self, path: Path) -> None:
        """Write it (with its previous generation kept, see ``write_json``)."""
        if self.rows is not None:
            head = b'{"version":%d,"log_durable":%d,"dispatched":%d,"queues":['
            body = head % (CHECKPOINT_VERSION, self.log_durable, self.dispatched)
            write_json_body(path, body + self.rows.joined() + b"]}")
            self.rows.saved()
            return
        write_json(
            path,
            {
                "version": CHECKPOINT_VERSION,
                "log_durable": self.log_durable,
                "dispatched": self.dispatched,
                "queues": [[t, q, f, n] for (t, q), (f, n) in self.queues.items()],
            },
        )


class CheckpointRows:
    """A checkpoint's per-queue table as JSON rows, each encoded once per change.

    Tracks one table (a dict the caller updates in place and then reports here); a
    different table object is encoded anew whole. ``stale``: some row changed since
    the last successful save."""

    def __init__(self) -> None:
        self._rows: dict[QueueKey, bytes] = {}
        self._topics: dict[str, bytes] = {}
        self._table: Mapping[QueueKey, tuple[int, int]] | None = None
        self.stale = True

    def track(self, table: Mapping[QueueKey, tuple[int, int]], changed: Mapping[QueueKey, tuple[int, int]]) -> None:
        """``table`` (after ``changed`` was applied to it) is what the rows must say."""
        if table is not self._table:
            self._table, self._rows, self.stale = table, {}, True
            changed = table
        rows, topics = self._rows, self._topics
        for key, (first, nxt) in changed.items():
            topic, queue_id = key
            name = topics.get(topic)
            if name is None:
                name = topics[topic] = json.dumps(topic).encode()
            row = b"[%s,%d,%d,%d]" % (name, queue_id, first, nxt)
            if rows.get(key) != row:
                rows[key] = row
                self.stale = True

    def joined(self) -> bytes:
        return b",".join(self._rows.values())

    def saved(self) -> None:
        self.stale = False


def _parse(raw: dict[str, Any]) -> Checkpoint | None:
    try:
        if raw["version"] != CHECKPOINT_VERSION:
            return None
        queues = {(str(t), int(q)): (int(f), int(n)) for t, q, f, n in raw["queues"]}
        return Checkpoint(int(raw["log_durable"]), int(raw["dispatched"]), queues)
    except (TypeError, KeyError, ValueError):
        return None


def _problem(raw: dict[str, Any]) -> str:
    """Why a parsed file that :func:`_parse` refused is not a checkpoint of this version."""
    if raw.get("version") != CHECKPOINT_VERSION:
        return f"version {raw.get('version')!r}, expected {CHECKPOINT_VERSION}"
    return "not a checkpoint (fields missing or of the wrong type)"


class AbortMarker:
    """Present while the store is open; its presence at open means an unclean stop."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "abort"

    def was_unclean(self) -> bool:
        return self.path.exists()

    def create(self) -> None:
        # Empty on purpose: creating it needs no data block, so it works on a full disk.
        self.path.touch()
        fsync_dir(self.path.parent)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
        fsync_dir(self.path.parent)

"""The store's checkpoint and clean-shutdown marker.

- ``abort`` exists while a store is open; it is created *before* loading starts, so a
  crash during loading also counts as unclean. A clean close removes it.
- ``checkpoint`` (JSON, replaced atomically) records what is known on disk:
  ``log_durable`` (the commit log is fsynced up to here), ``dispatched`` (every
  consume-queue entry of records below it is in the queue files) and, per queue, the
  next offset at that moment, so that deleted or truncated queue files are noticed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from commitlog import QueueKey, fsync_dir

from ._durable_file import read_json, write_json

CHECKPOINT_VERSION = 1


@dataclass
class Checkpoint:
    log_durable: int
    dispatched: int
    queues: dict[QueueKey, tuple[int, int]] = field(default_factory=dict)  # (first, next)

    @classmethod
    def load(cls, path: Path) -> Checkpoint | None:
        raw = read_json(path)
        if not isinstance(raw, dict):  # missing, not JSON, or not an object: no checkpoint
            return None
        try:
            if raw["version"] != CHECKPOINT_VERSION:
                return None
            queues = {(str(t), int(q)): (int(f), int(n)) for t, q, f, n in raw["queues"]}
            return cls(int(raw["log_durable"]), int(raw["dispatched"]), queues)
        except (TypeError, KeyError, ValueError):
            return None

    def save(self, path: Path) -> None:
        write_json(path, {
            "version": CHECKPOINT_VERSION,
            "log_durable": self.log_durable,
            "dispatched": self.dispatched,
            "queues": [[t, q, f, n] for (t, q), (f, n) in self.queues.items()],
        })  # fmt: skip


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

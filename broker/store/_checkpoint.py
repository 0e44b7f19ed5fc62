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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clmq.commitlog import MetadataSource, QueueKey, fsync_dir, load_json, write_json

CHECKPOINT_VERSION = 1


@dataclass
class Checkpoint:
    log_durable: int
    dispatched: int
    queues: dict[QueueKey, tuple[int, int]] = field(default_factory=dict)  # (first, next)
    # Loaded from the previous generation (the current file was missing or damaged):
    # the store must treat the open as unclean. Not part of the content (==).
    from_previous: bool = field(default=False, compare=False)

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
        write_json(
            path,
            {
                "version": CHECKPOINT_VERSION,
                "log_durable": self.log_durable,
                "dispatched": self.dispatched,
                "queues": [[t, q, f, n] for (t, q), (f, n) in self.queues.items()],
            },
        )


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

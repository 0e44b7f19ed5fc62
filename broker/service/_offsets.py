"""Consumer-group offsets: committed in memory, persisted as one checked metadata file
(``clmq.broker.store.write_json``: atomic, with a checksum and the previous generation; every
``offset_flush_interval_ms`` and at shutdown) and restored at start.

A crash loses at most the commits of the last interval: consumers then see those
messages again, which at-least-once delivery allows; nothing is skipped. A damaged
file falls back to the previous generation (older commits: again, messages seen
twice, none skipped). If both generations are damaged the broker refuses to start
(:class:`MetadataError`) rather than restart every group from scratch unasked.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any, Callable

from clmq.broker.store import MetadataSource, load_json, previous_path, write_json
from clmq.common import MetadataError

OffsetKey = tuple[str, str, int]  # group, topic, queue id
OFFSETS_VERSION = 2  # the format this broker writes (it reads 1 and 2; `clmq store offsets --write-v1` goes back)

log = logging.getLogger("clmq.broker")


class ConsumerOffsets:
    """Committed offsets per (group, topic): a map queue id -> offset each, so that a
    flush writes each (group, topic) as two lists of integers (format version 2) rather
    than a row per queue: with 65,536 queues committed, rows cost a quarter of a second
    of the broker's CPU every ``offset_flush_interval_ms``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._offsets: dict[tuple[str, str], dict[int, int]] = {}
        self._dirty = False
        for (group, topic, queue_id), offset in _load(path).items():
            self._offsets.setdefault((group, topic), {})[queue_id] = offset

    def commit(self, group: str, topic: str, queue_id: int, offset: int) -> None:
        """Record ``offset`` (the next one the group reads) as committed for the queue, in
        memory; on disk at the next :meth:`flush`."""
        with self._lock:
            queues = self._offsets.get((group, topic))
            if queues is None:
                queues = self._offsets[(group, topic)] = {}
            queues[queue_id] = offset
            self._dirty = True

    def query(self, group: str, topic: str, queue_id: int) -> int:
        """The committed offset, or -1 if the group never committed one."""
        queues = self._offsets.get((group, topic))
        return -1 if queues is None else queues.get(queue_id, -1)

    def all(self) -> dict[OffsetKey, int]:
        """Every committed offset, keyed (group, topic, queue id)."""
        with self._lock:
            return {(g, t, q): o for (g, t), queues in self._offsets.items() for q, o in queues.items()}

    def groups(self) -> list[str]:
        """The groups with committed offsets, sorted."""
        return sorted({g for g, _t in list(self._offsets)})

    def of_group(self, group: str) -> dict[tuple[str, int], int]:
        """Every committed offset of ``group``, keyed (topic, queue id)."""
        with self._lock:
            mine = [(t, dict(queues)) for (g, t), queues in self._offsets.items() if g == group]
        return {(t, q): o for t, queues in mine for q, o in queues.items()}

    def lists(self) -> list[list[Any]]:
        """Every (group, topic)'s offsets as ``[group, topic, [queue ids], [offsets]]``
        (the file's version-2 rows; a copy made at C speed under the lock)."""
        with self._lock:
            return [[g, t, list(queues), list(queues.values())] for (g, t), queues in self._offsets.items() if queues]

    def drop_group(self, group: str) -> int:
        """Forget every committed offset of ``group``; how many there were."""
        with self._lock:
            keys = [k for k in self._offsets if k[0] == group]
            dropped = sum(len(self._offsets.pop(key)) for key in keys)
            self._dirty = True
        return dropped

    def drop_topic(self, topic: str) -> None:
        """Forget every group's committed offsets of ``topic`` (the topic was deleted)."""
        with self._lock:
            for key in [k for k in self._offsets if k[1] == topic]:
                del self._offsets[key]
            self._dirty = True

    def clamp(self, max_offset: Callable[[str, int], int | None]) -> int:
        """Lower committed offsets past their queue's end to the end (``max_offset`` gives
        it, or None for a queue that no longer exists: left alone); returns how many.

        Only a lost log tail (``clmq store repair``, a follower's truncation) leaves a
        group past the end. Left there, the group would skip the new messages that take
        the dropped offsets: as Kafka and RocketMQ do, the broker moves it back at start.
        """
        lowered = 0
        with self._lock:
            for (group, topic), queues in self._offsets.items():
                for queue_id, offset in list(queues.items()):
                    end = max_offset(topic, queue_id)
                    if end is not None and offset > end:
                        log.warning(
                            "consumer group %s: committed offset %d of %s/%d is past the queue's end %d "
                            "(log cut by a repair?); moved back to %d",
                            group,
                            offset,
                            topic,
                            queue_id,
                            end,
                            end,
                        )
                        queues[queue_id] = end
                        lowered += 1
            self._dirty = self._dirty or lowered > 0
        return lowered

    def flush(self) -> bool:
        """Persist if anything changed; returns whether a file was written."""
        with self._write_lock:  # one writer at a time: they share the temporary file
            with self._lock:
                if not self._dirty:
                    return False
                rows = [
                    [g, t, list(queues), list(queues.values())] for (g, t), queues in self._offsets.items() if queues
                ]
                self._dirty = False
            try:
                write_json(self.path, {"version": OFFSETS_VERSION, "offsets": rows})
            except OSError:
                self._dirty = True  # try again next time
                raise
            return True


def _rows_v1(value: dict[str, Any]) -> dict[OffsetKey, int]:
    """The offsets of a version-1 file (written before issue 34, and by
    :func:`write_version_1`): a row ``[group, topic, queue id, offset]`` per queue. What a
    broker from before issue 34 reads; raises ValueError/TypeError if it is not one."""
    if value.get("version") != 1:
        raise ValueError(f"version {value.get('version')!r}, expected 1")
    return {(str(g), str(t), int(q)): int(o) for g, t, q, o in value["offsets"]}


def _rows(value: dict[str, Any]) -> dict[OffsetKey, int]:
    """The offsets in a parsed file; raises ValueError/TypeError if it is not one.
    Version 1: see :func:`_rows_v1`; version 2: a row ``[group, topic, [queue ids],
    [offsets]]`` per (group, topic)."""
    version = value.get("version")
    if version == 1:
        return _rows_v1(value)
    if version != OFFSETS_VERSION:
        raise ValueError(f"version {version!r}, expected 1 or {OFFSETS_VERSION}")
    out: dict[OffsetKey, int] = {}
    for g, t, qids, offsets in value["offsets"]:
        if not isinstance(qids, list) or not isinstance(offsets, list) or len(qids) != len(offsets):
            raise ValueError(f"{g}/{t}: queue ids and offsets are not two lists of one length")
        out.update(((str(g), str(t), int(q)), int(o)) for q, o in zip(qids, offsets))
    return out


def _newer(value: dict[str, Any]) -> int | None:
    """The version of a file written by a newer broker (one this broker cannot read), or None."""
    version = value.get("version")
    if isinstance(version, int) and not isinstance(version, bool) and version > OFFSETS_VERSION:
        return version
    return None


def _problem(value: dict[str, Any]) -> str | None:
    if _newer(value) is not None:
        return None  # whole, only not ours to read: _load says so rather than call it damage
    try:
        _rows(value)
    except (KeyError, TypeError, ValueError) as e:
        return f"not a consumer offsets file ({type(e).__name__}: {e})"
    return None


def _load(path: Path) -> dict[OffsetKey, int]:
    """The committed offsets in ``path`` (or its previous generation); none if neither
    was ever written; :class:`MetadataError` if neither generation is good, or if the
    one to read was written by a newer broker."""
    loaded = load_json(path, validate=_problem)
    if loaded.source is MetadataSource.DAMAGED:
        prev = previous_path(path)
        raise MetadataError(
            f"consumer offsets: neither {path} nor {prev} is usable ({loaded.describe()}). "
            f"To start every consumer group from its configured start position instead, delete both files "
            f"({path}, {prev}) and start the broker again; or restore them from a backup"
        )
    if not loaded.ok:
        return {}
    newer = _newer(loaded.value)
    if newer is not None:
        raise MetadataError(
            f"consumer offsets: {path} was written by a newer broker (version {newer}); this broker reads "
            f"versions 1 and {OFFSETS_VERSION}. Run the newer broker again, or convert the file with its "
            f'`clmq store offsets` before going back (docs/operations.md, "Going back to an earlier release")'
        )
    return _rows(loaded.value)


def write_version_1(path: Path) -> int | None:
    """Rewrite the consumer offsets file ``path``, both generations, as version 1: what
    brokers from before issue 34 read (they take a version-2 file for damage). Only
    while no broker has the store open (the caller holds its lock). Returns how many
    offsets were written, or None if there is no offsets file (nothing written).
    :class:`MetadataError` as a broker's start for a file that cannot be read."""
    if not path.exists() and not previous_path(path).exists():
        return None
    rows = [[g, t, q, o] for (g, t, q), o in sorted(_load(path).items())]
    for _generation in range(2):  # the current file, then again: the first becomes the previous one
        write_json(path, {"version": 1, "offsets": rows})
    return len(rows)

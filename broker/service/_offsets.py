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

log = logging.getLogger("clmq.broker")


class ConsumerOffsets:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._offsets: dict[OffsetKey, int] = {}
        self._dirty = False
        self._offsets.update(_load(path))

    def commit(self, group: str, topic: str, queue_id: int, offset: int) -> None:
        with self._lock:
            self._offsets[(group, topic, queue_id)] = offset
            self._dirty = True

    def query(self, group: str, topic: str, queue_id: int) -> int:
        """The committed offset, or -1 if the group never committed one."""
        return self._offsets.get((group, topic, queue_id), -1)

    def groups(self) -> list[str]:
        return sorted({g for g, _t, _q in list(self._offsets)})

    def of_group(self, group: str) -> dict[tuple[str, int], int]:
        return {(t, q): o for (g, t, q), o in list(self._offsets.items()) if g == group}

    def drop_group(self, group: str) -> int:
        """Forget every committed offset of ``group``; how many there were."""
        with self._lock:
            keys = [k for k in self._offsets if k[0] == group]
            for key in keys:
                del self._offsets[key]
            self._dirty = True
        return len(keys)

    def drop_topic(self, topic: str) -> None:
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
            for (group, topic, queue_id), offset in list(self._offsets.items()):
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
                    self._offsets[(group, topic, queue_id)] = end
                    lowered += 1
            self._dirty = self._dirty or lowered > 0
        return lowered

    def flush(self) -> bool:
        """Persist if anything changed; returns whether a file was written."""
        with self._write_lock:  # one writer at a time: they share the temporary file
            with self._lock:
                if not self._dirty:
                    return False
                rows = [[g, t, q, o] for (g, t, q), o in sorted(self._offsets.items())]
                self._dirty = False
            try:
                write_json(self.path, {"version": 1, "offsets": rows})
            except OSError:
                self._dirty = True  # try again next time
                raise
            return True


def _rows(value: dict[str, Any]) -> dict[OffsetKey, int]:
    """The offsets in a parsed file; raises ValueError/TypeError if it is not one."""
    if value.get("version") != 1:
        raise ValueError(f"version {value.get('version')!r}, expected 1")
    return {(str(g), str(t), int(q)): int(o) for g, t, q, o in value["offsets"]}


def _problem(value: dict[str, Any]) -> str | None:
    try:
        _rows(value)
    except (KeyError, TypeError, ValueError) as e:
        return f"not a consumer offsets file ({type(e).__name__}: {e})"
    return None


def _load(path: Path) -> dict[OffsetKey, int]:
    """The committed offsets in ``path`` (or its previous generation); none if neither
    was ever written; :class:`MetadataError` if neither generation is good."""
    loaded = load_json(path, validate=_problem)
    if loaded.source is MetadataSource.DAMAGED:
        prev = previous_path(path)
        raise MetadataError(
            f"consumer offsets: neither {path} nor {prev} is usable ({loaded.describe()}). "
            f"To start every consumer group from its configured start position instead, delete both files "
            f"({path}, {prev}) and start the broker again; or restore them from a backup"
        )
    return _rows(loaded.value) if loaded.ok else {}

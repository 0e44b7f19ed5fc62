"""Consumer-group offsets: committed in memory, persisted by atomic replace of one
JSON file (every ``offset_flush_interval_ms`` and at shutdown) and restored at start.

A crash loses at most the commits of the last interval: consumers then see those
messages again, which at-least-once delivery allows; nothing is skipped.
"""

from __future__ import annotations

import threading
from pathlib import Path

from broker.store import read_json, write_json

OffsetKey = tuple[str, str, int]  # group, topic, queue id


class ConsumerOffsets:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._offsets: dict[OffsetKey, int] = {}
        self._dirty = False
        data = read_json(path)
        for group, topic, qid, offset in (data or {}).get("offsets", []):
            self._offsets[(group, topic, int(qid))] = int(offset)

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

    def drop_topic(self, topic: str) -> None:
        with self._lock:
            for key in [k for k in self._offsets if k[1] == topic]:
                del self._offsets[key]
            self._dirty = True

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

"""The store's topic table: which topics exist and how many queues each has."""

from __future__ import annotations

import re
import threading
from pathlib import Path

from ._durable_file import read_json, write_json

# Topic names become directory names: a conservative alphabet, RocketMQ's plus '%'
# for its system topics (%RETRY%group, %DLQ%group).
_TOPIC_RE = re.compile(r"[A-Za-z0-9_.%|-]{1,127}")
MAX_QUEUES_PER_TOPIC = 65_536


def topic_name_error(name: object) -> str | None:
    """Why ``name`` cannot be a topic, or None if it can."""
    if not isinstance(name, str) or not name:
        return "topic name is empty"
    if not _TOPIC_RE.fullmatch(name) or name in (".", ".."):
        return f"invalid topic name {name!r}: use 1-127 characters of A-Z a-z 0-9 _ . % | -"
    return None


class TopicTable:
    """Topics and their queue counts, persisted to ``topics.json``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        loaded = read_json(path)
        self._topics: dict[str, int] = dict(loaded.get("topics", {})) if isinstance(loaded, dict) else {}

    def queue_count(self, topic: str) -> int | None:
        return self._topics.get(topic)

    def all(self) -> dict[str, int]:
        return dict(self._topics)

    def create(self, topic: str, queue_count: int) -> None:
        """Create or resize a topic (queues are only ever added, never removed)."""
        error = topic_name_error(topic)
        if error:
            raise ValueError(error)
        if not 1 <= queue_count <= MAX_QUEUES_PER_TOPIC:
            raise ValueError(f"queue count {queue_count} outside 1..{MAX_QUEUES_PER_TOPIC}")
        with self._lock:
            self._topics[topic] = max(queue_count, self._topics.get(topic, 0))
            write_json(self.path, {"version": 1, "topics": self._topics})

    def delete(self, topic: str) -> bool:
        with self._lock:
            if self._topics.pop(topic, None) is None:
                return False
            write_json(self.path, {"version": 1, "topics": self._topics})
            return True

"""The store's topic table: which topics exist and how many queues each has.

Topics never vanish because ``topics.json`` is damaged: the table falls back to the
previous generation, and adds every topic that has data on disk (consume-queue
directories ``consumequeue/<topic>/<queue id>/``, partition directories
``partitions/<topic>-<queue id>/``, the checkpoint's and the recovery points' queue
lists), so that a topic created after the previous generation was written is kept
too. If neither generation is good, the table is rebuilt from those alone, with a
warning giving the counts, and rewritten.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from pathlib import Path
from typing import Any, Iterable

from clmq.commitlog import MetadataSource, QueueKey, load_json, read_json, write_json

from ._checkpoint import Checkpoint

log = logging.getLogger("clmq.store")

# Topic names become directory names: a conservative alphabet, RocketMQ's plus '%'
# for its system topics (%RETRY%group, %DLQ%group).
_TOPIC_RE = re.compile(r"[A-Za-z0-9_.%|-]{1,127}")
MAX_QUEUES_PER_TOPIC = 65_536
TOPICS_VERSION = 1


def topic_name_error(name: object) -> str | None:
    """Why ``name`` cannot be a topic, or None if it can."""
    if not isinstance(name, str) or not name:
        return "topic name is empty"
    if not _TOPIC_RE.fullmatch(name) or name in (".", ".."):
        return f"invalid topic name {name!r}: use 1-127 characters of A-Z a-z 0-9 _ . % | -"
    return None


def _topic_error(topic: object, queue_count: object) -> str | None:
    """Why (topic, queue_count) cannot be in the table, or None."""
    error = topic_name_error(topic)
    if error:
        return error
    if not isinstance(queue_count, int) or isinstance(queue_count, bool):
        return f"queue count {queue_count!r} of topic {topic!r} is not an integer"
    if not 1 <= queue_count <= MAX_QUEUES_PER_TOPIC:
        return f"queue count {queue_count} outside 1..{MAX_QUEUES_PER_TOPIC}"
    return None


def _table_problem(value: Any) -> str | None:
    """Why a parsed ``topics.json`` is not a topic table, or None."""
    if value.get("version") != TOPICS_VERSION:
        return f"version {value.get('version')!r}, expected {TOPICS_VERSION}"
    topics = value.get("topics")
    if not isinstance(topics, dict):
        return "no topics object"
    for topic, count in topics.items():
        error = _topic_error(topic, count)
        if error:
            return error
    return None


class TopicTable:
    """Topics and their queue counts, persisted to ``topics.json`` in the store's
    data directory (the path's parent, which is also where the table looks for data
    when the file is damaged)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self.source = MetadataSource.CURRENT  # where the table came from at load (set by _load)
        self.reconstructed: dict[str, int] = {}  # topics (or queues) added from the data on disk at load
        self._topics: dict[str, int] = self._load()

    def _load(self) -> dict[str, int]:
        loaded = load_json(self.path, validate=_table_problem)
        self.source = loaded.source
        if loaded.source is MetadataSource.CURRENT:
            return dict(loaded.value["topics"])
        found = topics_on_disk(self.path.parent)
        if loaded.source is MetadataSource.MISSING and not found:
            return {}  # a new store, or one that never had a topic
        topics = dict(loaded.value["topics"]) if loaded.ok else {}
        added = self.reconstructed = {t: n for t, n in found.items() if topics.get(t, 0) < n}
        topics.update(added)
        why = loaded.describe() if loaded.problems else f"{self.path}: missing"
        base = "the previous generation" if loaded.ok else "no good generation of the file"
        log.warning(
            "topics: %s; %d topic(s) from %s, %d topic(s) with %d queue(s) reconstructed from the data on "
            "disk (a reconstructed topic gets its highest queue id with data + 1 queues: create it again "
            "with its full queue count if it had more)",
            why,
            len(topics) - len(added),
            base,
            len(added),
            sum(added.values()),
        )
        if topics:
            try:
                write_json(self.path, _document(topics))
            except OSError as e:  # the table is whole in memory; the next change writes it
                log.warning("topics: could not rewrite %s: %s", self.path, e)
        return topics

    def queue_count(self, topic: str) -> int | None:
        return self._topics.get(topic)

    def has_queue(self, topic: str, queue_id: int) -> bool:
        """Whether the topic exists and has a queue ``queue_id``."""
        count = self._topics.get(topic)
        return count is not None and 0 <= queue_id < count

    def all(self) -> dict[str, int]:
        return dict(self._topics)

    def create(self, topic: str, queue_count: int) -> None:
        """Create or resize a topic (queues are only ever added, never removed)."""
        error = _topic_error(topic, queue_count)
        if error:
            raise ValueError(error)
        with self._lock:
            self._save({**self._topics, topic: max(queue_count, self._topics.get(topic, 0))})

    def delete(self, topic: str) -> bool:
        with self._lock:
            if topic not in self._topics:
                return False
            self._save({t: n for t, n in self._topics.items() if t != topic})
            return True

    def replace(self, topics: dict[str, int]) -> None:
        """Make ``topics`` the whole table (``clmq store repair`` rebuilds it by scanning
        the log). Raises ValueError, changing nothing, if a name or count is invalid."""
        for topic, count in topics.items():
            error = _topic_error(topic, count)
            if error:
                raise ValueError(error)
        with self._lock:
            self._save(dict(topics))

    def _save(self, topics: dict[str, int]) -> None:
        """Write, then swap in: a write that fails (OSError) leaves the table as it was."""
        write_json(self.path, _document(topics))
        self._topics = topics


def _document(topics: dict[str, int]) -> dict[str, Any]:
    return {"version": TOPICS_VERSION, "topics": topics}


def topics_on_disk(directory: Path) -> dict[str, int]:
    """The topics the store in ``directory`` has data for, each with its highest queue
    id + 1 queues: from the consume-queue and partition directories and the queue lists
    of the checkpoint and the recovery points."""
    keys = [*_queue_dirs(directory), *_partition_dirs(directory), *_checkpointed(directory)]
    topics: dict[str, int] = {}
    for topic, qid in keys:
        if topic_name_error(topic) is None and 0 <= qid < MAX_QUEUES_PER_TOPIC:
            topics[topic] = max(topics.get(topic, 0), qid + 1)
    return topics


def _listdir(directory: Path) -> list[str]:
    try:
        return os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _queue_dirs(directory: Path) -> Iterable[QueueKey]:
    root = directory / "consumequeue"
    for topic in _listdir(root):
        yield from ((topic, int(q)) for q in _listdir(root / topic) if q.isdigit())


def _partition_dirs(directory: Path) -> Iterable[QueueKey]:
    for name in _listdir(directory / "partitions"):
        topic, _, qid = name.rpartition("-")
        if qid.isdigit() and (directory / "partitions" / name).is_dir():
            yield topic, int(qid)


def _checkpointed(directory: Path) -> Iterable[QueueKey]:
    checkpoint = Checkpoint.load(directory / "checkpoint")
    if checkpoint is not None:
        yield from checkpoint.queues
    points = read_json(directory / "recovery-points")
    try:
        yield from ((str(t), int(q)) for t, q, _n in (points or {}).get("points", []))
    except (TypeError, ValueError):
        return  # damaged: the partition directories say the same

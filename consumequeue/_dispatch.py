"""The set of consume queues, and the dispatcher that builds them by tailing the log."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Callable

import xxhash

import numpy as np

from commitlog import HEADER_SIZE, CommitLog, QueueKey, gather_fields, gather_strings, walk_records

from ._files import FileCache
from ._queue import ENTRY_DTYPE, ConsumeQueue

log = logging.getLogger("clmq.dispatch")

_FIELDS = ["total_size", "commitlog_offset", "queue_offset", "queue_id", "topic_len", "tags_len"]
MAX_CHUNK_BYTES = 32 << 20  # while lagging, read more at once: longer runs per queue


def tag_hash(tag: str | bytes) -> int:
    """The 8-byte tag code stored in consume-queue entries (0 for no tag)."""
    if not tag:
        return 0
    return xxhash.xxh64_intdigest(tag.encode() if isinstance(tag, str) else tag)


class ConsumeQueueSet:
    """Every consume queue under ``root/<topic>/<queue id>/``, created on demand."""

    def __init__(self, root: Path, entries_per_file: int, max_open_files: int) -> None:
        self.root = root
        self.entries_per_file = entries_per_file
        self.files = FileCache(max_open_files)
        self._queues: dict[QueueKey, ConsumeQueue] = {}
        self._dirty: set[ConsumeQueue] = set()
        self._lock = threading.Lock()
        root.mkdir(parents=True, exist_ok=True)

    def queue(self, topic: str, queue_id: int) -> ConsumeQueue:
        key = (topic, queue_id)
        cq = self._queues.get(key)
        if cq is None:
            with self._lock:
                cq = self._queues.get(key)
                if cq is None:
                    cq = ConsumeQueue(self.root / topic / str(queue_id), topic, queue_id, self.entries_per_file, self.files)
                    self._queues[key] = cq
        return cq

    def discover(self) -> list[QueueKey]:
        """The queues that have a directory on disk (without loading them)."""
        keys: list[QueueKey] = []
        for topic in os.listdir(self.root):
            tdir = self.root / topic
            if tdir.is_dir():
                keys.extend((topic, int(q)) for q in os.listdir(tdir) if q.isdigit())
        return keys

    def known(self) -> list[QueueKey]:
        return list(self._queues)

    def append(self, key: QueueKey, first: int, entries: bytes | bytearray) -> None:
        self.append_runs({key: (first, entries)})

    def append_runs(self, runs: dict[QueueKey, tuple[int, bytes]]) -> None:
        """Add runs of entries to their queues (one dispatch round's worth)."""
        queues, touched = self._queues, []
        for key, (first, entries) in runs.items():
            cq = queues.get(key) or self.queue(*key)
            if cq.append(first, entries):
                touched.append(cq)
        with self._lock:
            self._dirty.update(touched)

    def flush(self, sync: bool = False, min_bytes: int = 0) -> int | None:
        """Write queues' in-memory entries to their files: those holding at least
        ``min_bytes`` (0: all). Small writes to thousands of files cost more than they
        protect (the files are rebuilt from the log), so small tails wait.

        Returns the commit-log offset of the oldest entry still only in memory, or None.
        """
        with self._lock:
            dirty, self._dirty = self._dirty, set()
        waiting: list[ConsumeQueue] = []
        for cq in dirty:
            if cq.pending_bytes < min_bytes:
                waiting.append(cq)
                continue
            cq.flush()
            if sync:
                cq.sync()
        if waiting:
            with self._lock:
                self._dirty.update(waiting)
        oldest = [o for o in (cq.oldest_pending() for cq in waiting) if o is not None]
        return min(oldest) if oldest else None

    def next_offsets(self) -> dict[QueueKey, int]:
        """Next offset of every *loaded* queue."""
        return {key: cq.next_offset for key, cq in list(self._queues.items()) if cq.loaded}

    def extents(self) -> dict[QueueKey, tuple[int, int]]:
        """``(first, next)`` of the entries in the files, for every *loaded* queue."""
        return {key: cq.disk_extent() for key, cq in list(self._queues.items()) if cq.loaded}

    def close(self) -> None:
        self.flush()
        self.files.close()


class Dispatcher:
    """Builds consume-queue entries from the log, from ``dispatched_offset`` up to the
    log's confirmed offset. Appends never wait for it; waiters are woken per round.
    """

    def __init__(self, commitlog: CommitLog, queues: ConsumeQueueSet, start_offset: int,
                 chunk_bytes: int = 4 << 20) -> None:  # fmt: skip
        self.log = commitlog
        self.queues = queues
        self.dispatched_offset = max(start_offset, commitlog.min_offset)
        self.chunk_bytes = max(chunk_bytes, commitlog.config.max_message_bytes + HEADER_SIZE)
        self._listeners: list[Callable[[set[QueueKey]], None]] = []
        self._wake = threading.Event()
        self._round_lock = threading.Lock()
        self._topic_ids: dict[bytes, int] = {}
        self._topic_names: list[str] = []
        self._tags: dict[bytes, int] = {b"": 0}
        commitlog.add_append_listener(self._wake.set)

    @property
    def lag_bytes(self) -> int:
        return max(0, self.log.confirmed_offset - self.dispatched_offset)

    def add_listener(self, fn: Callable[[set[QueueKey]], None]) -> None:
        """Call ``fn(keys)`` with the queues that got entries, after every round."""
        self._listeners.append(fn)

    def dispatch_once(self) -> int:
        """Dispatch one chunk of the log; returns the number of records dispatched."""
        with self._round_lock:
            limit = self.log.confirmed_offset
            if self.dispatched_offset < self.log.min_offset:
                self.dispatched_offset = self.log.min_offset  # retention overtook us
            if self.dispatched_offset >= limit:
                return 0
            want = min(MAX_CHUNK_BYTES, max(self.chunk_bytes, limit - self.dispatched_offset))
            at, data = self.log.map_chunk(self.dispatched_offset, want, limit)
            groups, consumed, count = self._parse(at, data)
            self.queues.append_runs(groups)
            self.dispatched_offset = at + consumed if consumed >= 0 else self.log.next_segment_base(at)
        if groups:
            touched = set(groups)
            for fn in self._listeners:
                fn(touched)
        return count

    def _parse(self, at: int, data: memoryview) -> tuple[dict[QueueKey, tuple[int, bytes]], int, int]:
        """Parse a chunk column-wise and cut it into per-queue runs of entries.

        Returns ``(runs, bytes consumed or -1 at a blank marker, records)``.
        """
        walk = walk_records(data, 0, self.log.config.max_message_bytes)
        consumed = walk.stop
        if walk.reason == "blank":
            consumed = -1
        elif walk.reason == "corrupt" or (not walk.runs and len(data) >= self.chunk_bytes):
            consumed = self._resync(at, walk.stop)  # chunks hold any valid record: this one is not
        if not walk.runs:
            return {}, consumed, 0
        buf = np.frombuffer(data, dtype=np.uint8)
        starts = walk.starts
        heads = gather_fields(buf, walk, _FIELDS)
        topic_lens = heads["topic_len"].astype(np.int64)
        topics, topic_idx = gather_strings(buf, starts + HEADER_SIZE, topic_lens)
        tags, tag_idx = gather_strings(buf, starts + HEADER_SIZE + topic_lens, heads["tags_len"].astype(np.int64))
        tag_codes = np.array([self._tag_code(t) for t in tags], dtype=np.uint64)[tag_idx]
        topic_ids = np.array([self._topic_id(t) for t in topics], dtype=np.uint64)[topic_idx]
        return self._runs(heads, topic_ids, tag_codes), consumed, len(starts)

    def _runs(self, heads: dict[str, np.ndarray], topic_ids: np.ndarray, tag_codes: np.ndarray) -> dict[QueueKey, tuple[int, bytes]]:
        """Group entries by queue (stable, so log order is kept) into runs of offsets."""
        keys = (topic_ids << np.uint64(32)) | heads["queue_id"].astype(np.uint64)
        order = np.argsort(keys, kind="stable")
        entries = np.empty(len(keys), dtype=ENTRY_DTYPE)
        entries["offset"] = heads["commitlog_offset"]
        entries["size"] = heads["total_size"]
        entries["tag"] = tag_codes
        raw = entries[order].tobytes()
        skeys, qoffs = keys[order], heads["queue_offset"][order].astype(np.int64)
        cuts = np.flatnonzero((skeys[1:] != skeys[:-1]) | (qoffs[1:] != qoffs[:-1] + 1)) + 1
        bounds = [0, *cuts.tolist(), len(order)]
        runs: dict[QueueKey, tuple[int, bytes]] = {}
        names, qids, firsts = self._topic_names, (skeys & np.uint64(0xFFFFFFFF)).tolist(), qoffs.tolist()
        tids = (skeys >> np.uint64(32)).tolist()
        for a, b in zip(bounds, bounds[1:]):
            key = (names[tids[a]], qids[a])
            if key in runs:  # a second run of one queue in one chunk (a hole): apply the first now
                self.queues.append(key, *runs.pop(key))
            runs[key] = (firsts[a], raw[a * 20 : b * 20])
        return runs

    def _tag_code(self, raw: bytes) -> int:
        code = self._tags.get(raw)
        if code is None:
            if len(self._tags) > 100_000:
                self._tags = {b"": 0}
            code = self._tags[raw] = tag_hash(raw)
        return code

    def _topic_id(self, raw: bytes) -> int:
        tid = self._topic_ids.get(raw)
        if tid is None:
            tid = self._topic_ids[raw] = len(self._topic_names)
            self._topic_names.append(raw.decode())
        return tid

    def _resync(self, at: int, p: int) -> int:
        """Skip a damaged region to the next known record start (boundary index)."""
        bad = at + p
        seg_base = max((b for b, _, _ in self.log.segments() if b <= bad), default=bad)
        nxt = next((b for b in self.log.boundaries(seg_base) if b > bad), self.log.next_segment_base(bad))
        log.error("dispatch: corrupt record header at commitlog offset %d; skipping to %d", bad, nxt)
        return nxt - at

    def catch_up(self) -> int:
        """Dispatch until nothing is left below the confirmed offset."""
        total = 0
        while self.lag_bytes:
            total += self.dispatch_once()
        return total

    def run(self, stop: threading.Event, idle_wait_ms: int = 100) -> None:
        """The background loop: dispatch whenever the log grows, until ``stop`` is set."""
        while not stop.is_set():
            self._wake.clear()  # before the round: an append during it sets it again
            if not self.dispatch_once():
                self._wake.wait(idle_wait_ms / 1000)

    def wake(self) -> None:
        self._wake.set()


"""The set of consume queues, and the dispatcher that builds them by tailing the log."""

from __future__ import annotations

import logging
import os
import struct
import threading
from pathlib import Path
from typing import Callable

import xxhash

from commitlog import BLANK_MAGIC, HEADER_SIZE, RECORD_MAGIC, CommitLog, QueueKey

from ._files import FileCache
from ._queue import ENTRY, ConsumeQueue

log = logging.getLogger("clmq.dispatch")

_HEAD = struct.Struct("<II")  # total size, magic
_WHERE = struct.Struct("<QQI")  # commitlog offset, queue offset, queue id (at byte 12)
_LENS = struct.Struct("<HH")  # topic and tags lengths (at byte 92)


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
        cq = self.queue(*key)
        if cq.append(first, entries):
            with self._lock:
                self._dirty.add(cq)

    def flush(self, sync: bool = False) -> int:
        """Write every queue's in-memory entries to its files; returns how many queues."""
        with self._lock:
            dirty, self._dirty = self._dirty, set()
        for cq in dirty:
            cq.flush()
            if sync:
                cq.sync()
        return len(dirty)

    def next_offsets(self) -> dict[QueueKey, int]:
        return {key: cq.next_offset for key, cq in list(self._queues.items())}

    def extents(self) -> dict[QueueKey, tuple[int, int]]:
        """``(first, next)`` offsets of every loaded queue."""
        return {key: (cq.first_offset, cq.next_offset) for key, cq in list(self._queues.items())}

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
        self._topics: dict[bytes, str] = {}
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
            at, data = self.log.read_chunk(self.dispatched_offset, self.chunk_bytes, limit)
            groups, consumed, count = self._parse(at, data)
            for key, (first, entries) in groups.items():
                self.queues.append(key, first, entries)
            self.dispatched_offset = at + consumed if consumed >= 0 else self.log.next_segment_base(at)
        if groups:
            touched = set(groups)
            for fn in self._listeners:
                fn(touched)
        return count

    def _parse(self, at: int, data: bytes) -> tuple[dict[QueueKey, tuple[int, bytearray]], int, int]:
        """Walk whole records; group 20-byte entries by queue. The hot loop, kept flat.

        Returns ``(groups, bytes consumed or -1 at a blank marker, records)``.
        """
        groups: dict[QueueKey, tuple[int, bytearray]] = {}
        topics, tags = self._topics, self._tags
        head, where, lens, entry = _HEAD.unpack_from, _WHERE.unpack_from, _LENS.unpack_from, ENTRY.pack
        p, n, count = 0, len(data), 0
        while n - p >= 8:
            size, magic = head(data, p)
            if magic != RECORD_MAGIC:
                if magic == BLANK_MAGIC:
                    return groups, -1, count
                return groups, self._resync(at, p), count
            if size > n - p:
                break
            phys, qoff, qid = where(data, p + 12)
            tl, gl = lens(data, p + 92)
            t0 = p + HEADER_SIZE
            tb = data[t0 : t0 + tl]
            topic = topics.get(tb) or self._topic(tb)
            gb = data[t0 + tl : t0 + tl + gl]
            th = tags.get(gb)
            if th is None:
                th = tags[gb] = tag_hash(gb)
            key = (topic, qid)
            group = groups.get(key)
            if group is None or group[0] + len(group[1]) // 20 != qoff:
                if group is not None:  # offsets not contiguous within a chunk: flush the run
                    self.queues.append(key, group[0], group[1])
                group = groups[key] = (qoff, bytearray())
            group[1].extend(entry(phys, size, th))
            p += size
            count += 1
        if p == 0 and n >= 8:  # chunks hold any valid record: this size field is damaged
            return groups, self._resync(at, 0), count
        return groups, p, count

    def _topic(self, raw: bytes) -> str:
        topic = raw.decode()
        if len(self._topics) > 100_000:
            self._topics.clear()
        self._topics[raw] = topic
        return topic

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


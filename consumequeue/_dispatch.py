"""The dispatcher: builds consume-queue entries by tailing the log, vectorised.

Invariants:
- Entries are built only from records below the log's confirmed offset, in log order;
  re-dispatching a range is idempotent (queues skip entries they hold).
- Nothing in the loop catches errors but the key index's: an exception leaves
  :meth:`Dispatcher.dispatch_loop`, and the store's thread guard puts the store into its
  failed state. The key index is derived data: its write errors are counted by the
  index, which stays behind; later rounds re-read the log from its ``end_offset``
  (one chunk a round, up to ``MAX_CHUNK_BYTES``, after the index's retry interval)
  until it has caught up.
- A record header that does not walk (damage under a running store) is skipped to
  the next known record start with an error naming the offsets; the queue offsets it
  held become explicit hole markers in their queues (see ``_queue``), never zeros.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from typing import Callable

import numpy as np
import xxhash

from clmq.commitlog import CommitLog
from clmq.common import (
    HEADER_SIZE,
    OFF_QUEUE_ID,
    OFF_TOPIC_LEN,
    TIMER_TOPIC,
    TRANS_OP_TOPIC,
    Walk,
    gather_fields,
    gather_strings,
    timer_tag_code,
    walk_records,
)

from ._entries import ENTRY_DTYPE
from ._keyindex import KeyIndex
from ._keyindex_keys import INDEX_FIELDS, ChunkFields
from ._set import Arrivals, ConsumeQueueSet

log = logging.getLogger("clmq.dispatch")

# Topics whose tags hold a number that is the entry's tag code: %TIMER% (due time),
# %TRANS_OP% (the half message's commit-log offset).
_NUMBERED = (TIMER_TOPIC.encode(), TRANS_OP_TOPIC.encode())
_FIELDS = ["total_size", "commitlog_offset", "queue_offset", "queue_id", "topic_len", "tags_len"]
_FIELDS_INDEXED = _FIELDS + [f for f in INDEX_FIELDS if f not in _FIELDS]  # with the key index: one gather
SMALL_ROUND = 48  # rounds of at most this many records are parsed without numpy
_SMALL_HEAD = struct.Struct("<I8xQQI")  # total size, (magic, crc), commit-log offset, queue offset, queue id
_SMALL_LENS = struct.Struct("<HH")  # topic length, tags length
assert _SMALL_HEAD.size == OFF_QUEUE_ID + 4
MAX_CHUNK_BYTES = 32 << 20  # while lagging, read more at once: longer runs per queue
# After a round that caught up, the next one starts no sooner than this after it began
# (unless this many bytes wait): under a stream of small appends one round then covers
# many of them, instead of waking the thread (and taking the GIL from the event loop)
# for every one or two records. The first append after a quiet spell is dispatched at
# once, so a long-polled consumer waits at most this much longer, and only under load.
ROUND_INTERVAL_MS = 1.0
ROUND_EAGER_BYTES = 1 << 20


def tag_hash(tag: str | bytes) -> int:
    """The 8-byte tag code stored in consume-queue entries (0 for no tag)."""
    if not tag:
        return 0
    return xxhash.xxh64_intdigest(tag.encode() if isinstance(tag, str) else tag)


class Dispatcher:
    """Builds consume-queue entries from the log, from ``dispatched_offset`` up to the
    log's confirmed offset. Appends never wait for it; waiters are woken per round.
    """

    def __init__(
        self, commitlog: CommitLog, queues: ConsumeQueueSet, start_offset: int, chunk_bytes: int = 4 << 20
    ) -> None:
        self.log = commitlog
        self.queues = queues
        self.dispatched_offset = max(start_offset, commitlog.min_offset)
        self.chunk_bytes = max(chunk_bytes, commitlog.config.max_message_bytes + HEADER_SIZE)
        self._listeners: list[Callable[[Arrivals], None]] = []
        self._wake = threading.Event()
        self._round_lock = threading.Lock()
        self._topic_ids: dict[bytes, int] = {}  # raw topic name -> the queue set's id
        self._tags: dict[bytes, int] = {b"": 0}
        self.rounds = 0  # rounds that dispatched something (each wakes long polls once)
        self.index: KeyIndex | None = None  # the key index, built in the same rounds (set_index)
        self._walk: Walk | None = None  # the round's walk, for the key index
        self._fields: ChunkFields | None = None  # and its columns (rounds parsed column-wise)
        commitlog.add_append_listener(self._on_append)

    def set_index(self, index: KeyIndex) -> None:
        """Build ``index`` too: every round also indexes its records' keys (from the
        index's own ``end_offset`` on: records below it are indexed already)."""
        self.index = index

    @property
    def lag_bytes(self) -> int:
        return max(0, self.log.confirmed_offset - self.dispatched_offset)

    def add_listener(self, fn: Callable[[Arrivals], None]) -> None:
        """Call ``fn(arrivals)`` with the queues that got entries, after every round."""
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
            columns, consumed = self._parse(at, data)
            arrivals = self.queues.add_round(*columns) if columns else None
            self.dispatched_offset = at + consumed if consumed >= 0 else self.log.next_segment_base(at)
            if self.index is not None:
                self._index_round(at, data)
        self.rounds += 1
        if arrivals is not None:
            for fn in self._listeners:
                fn(arrivals)
        return len(columns[0]) if columns else 0

    def _parse(self, at: int, data: memoryview) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray] | None, int]:
        """Parse a chunk column-wise into ``(queue codes, queue offsets, entries)``.

        Returns ``(columns or None, bytes consumed or -1 at a blank marker)``.
        """
        walk = self._walk = walk_records(data, 0, self.log.config.max_message_bytes)
        consumed = walk.stop
        if walk.reason == "blank":
            consumed = -1
        elif walk.reason == "corrupt" or (not walk.runs and len(data) >= self.chunk_bytes):
            consumed = self._resync(at, walk.stop)  # chunks hold any valid record: this one is not
        if not walk.runs:
            return None, consumed
        if walk.count <= SMALL_ROUND:
            return self._parse_small(data, walk.starts.tolist()), consumed
        buf = np.frombuffer(data, dtype=np.uint8)
        starts = walk.starts
        heads = gather_fields(buf, walk, _FIELDS if self.index is None else _FIELDS_INDEXED)
        topic_lens = heads["topic_len"].astype(np.int64)
        topics, topic_idx = gather_strings(buf, starts + HEADER_SIZE, topic_lens)
        if self.index is not None:
            self._fields = ChunkFields(heads, topics, topic_idx)  # the key index reads the same columns
        tags, tag_idx = gather_strings(buf, starts + HEADER_SIZE + topic_lens, heads["tags_len"].astype(np.int64))
        entries = np.empty(len(starts), dtype=ENTRY_DTYPE)
        entries["offset"] = heads["commitlog_offset"]
        entries["size"] = heads["total_size"]
        topic_ids = np.array([self._topic_id(t) for t in topics], dtype=np.uint64)[topic_idx]
        if any(t in topics for t in _NUMBERED):  # e.g. scheduled messages: the tag code is the delivery time
            timer = np.isin(topic_ids, [self._topic_id(t) for t in _NUMBERED])
            hashed = np.zeros(len(tags), dtype=bool)  # a due time (one per ms) is neither hashed nor cached
            hashed[tag_idx[~timer]] = True
            codes_of = [self._tag_code(t) if h else 0 for t, h in zip(tags, hashed.tolist())]
            entries["tag"] = np.array(codes_of, dtype=np.uint64)[tag_idx]
            entries["tag"][timer] = [timer_tag_code(tags[i]) for i in tag_idx[timer].tolist()]
        else:
            entries["tag"] = np.array([self._tag_code(t) for t in tags], dtype=np.uint64)[tag_idx]
        codes = (topic_ids << np.uint64(32)) | heads["queue_id"].astype(np.uint64)
        return (codes, heads["queue_offset"].astype(np.int64), entries), consumed

    def _index_round(self, at: int, data: memoryview) -> None:
        """Index the round's records (those the index does not hold yet); if the index
        is behind the round (an earlier write failed), a chunk of the log before it."""
        index = self.index
        assert index is not None and self._walk is not None
        walk, fields, self._walk, self._fields = self._walk, self._fields, None, None
        if not index.may_write:
            return
        try:
            if index.end_offset < at and not self._index_backlog(at):
                return  # still behind: the next round goes on
            if self.dispatched_offset > index.end_offset:
                index.add_chunk(at, data, walk, self.dispatched_offset, fields)
            index.note_success()
        except OSError as e:  # ENOSPC, EIO: the index stays at its end; the store goes on
            index.note_failure(e)

    def _index_backlog(self, upto: int) -> bool:
        """Index one chunk of the log from the index's end (records it missed); True
        when it reached ``upto``."""
        index = self.index
        assert index is not None
        if index.end_offset < self.log.min_offset:
            index.advance(self.log.min_offset)  # retention took the rest
        start = index.end_offset
        if start >= upto:
            return True
        at, data = self.log.map_chunk(start, min(MAX_CHUNK_BYTES, max(self.chunk_bytes, upto - start)), upto)
        walk = walk_records(data, 0, self.log.config.max_message_bytes)
        consumed = walk.stop
        if walk.reason == "blank":
            consumed = self.log.next_segment_base(at) - at
        elif walk.reason == "corrupt" or (not walk.runs and len(data) >= self.chunk_bytes):
            consumed = self._resync(at, walk.stop)
        index.add_chunk(at, data, walk, min(at + consumed, upto))
        return index.end_offset >= upto

    def index_backlog_once(self) -> bool:
        """While idle: one chunk of the log the index missed; True if it did some."""
        index = self.index
        if index is None or index.end_offset >= self.dispatched_offset or not index.may_write:
            return False
        with self._round_lock:
            before = index.end_offset
            try:
                self._index_backlog(self.dispatched_offset)
                index.note_success()
            except OSError as e:
                index.note_failure(e)
            return index.end_offset > before

    def _parse_small(self, data: memoryview, starts: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The same columns, record by record: for a few records, numpy's per-call cost
        is more than the work (a round of 10 records: ~15 us instead of ~150 us)."""
        codes, qoffs, rows = [], [], []
        for p in starts:
            size, cl_off, q_off, qid = _SMALL_HEAD.unpack_from(data, p)
            tl, gl = _SMALL_LENS.unpack_from(data, p + OFF_TOPIC_LEN)
            t = p + HEADER_SIZE
            topic, tag = bytes(data[t : t + tl]), bytes(data[t + tl : t + tl + gl])
            codes.append(self._topic_id(topic) << 32 | qid)
            qoffs.append(q_off)
            rows.append((cl_off, size, timer_tag_code(tag) if topic in _NUMBERED else self._tag_code(tag)))
        return (np.array(codes, dtype=np.uint64), np.array(qoffs, dtype=np.int64), np.array(rows, dtype=ENTRY_DTYPE))

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
            tid = self._topic_ids[raw] = self.queues.topic_id(raw.decode())
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
        while self.index_backlog_once():  # a key index behind (a write failed): while it works
            pass
        return total

    def dispatch_loop(
        self, stop: threading.Event, idle_wait_ms: int = 100, round_interval_ms: float = ROUND_INTERVAL_MS
    ) -> None:
        """The background loop: dispatch whenever the log grows, until ``stop`` is set;
        after a round that caught up, the next begins ``round_interval_ms`` after it at
        the earliest (sooner when ``ROUND_EAGER_BYTES`` wait)."""
        interval_s = round_interval_ms / 1000
        while not stop.is_set():
            self._wake.clear()  # before the round: an append during it sets it again
            began = time.monotonic()
            if not self.dispatch_once():
                if not self.index_backlog_once():
                    self._wake.wait(idle_wait_ms / 1000)
                continue
            rest_s = interval_s - (time.monotonic() - began)
            if rest_s > 0 and self.lag_bytes < ROUND_EAGER_BYTES:
                stop.wait(rest_s)  # appends meanwhile gather for the next round

    def _on_append(self) -> None:
        """The log's append listener (on the appending thread): a set event is not set
        again (``Event.set`` takes a lock and notifies, per append)."""
        if not self._wake.is_set():
            self._wake.set()

    def wake(self) -> None:
        self._wake.set()

"""The dispatcher: builds consume-queue entries by tailing the log, vectorised.

Invariants:
- Entries are built only from records below the log's confirmed offset, in log order;
  re-dispatching a range is idempotent (queues skip entries they hold).
- Nothing in the loop catches errors but the key index's: an exception leaves
  :meth:`Dispatcher.dispatch_loop`, and the store's thread guard puts the store into its
  failed state. The key index is derived data, fed in batches over several rounds
  (:mod:`._index_feed`): its write errors are counted by the index, which stays behind;
  later rounds re-read the log from its ``end_offset`` (one chunk a round, up to
  ``MAX_CHUNK_BYTES``, after the index's retry interval) until it has caught up.
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
from ._index_feed import INDEX_BATCH_BYTES, INDEX_BATCH_INTERVAL_MS, MAX_CHUNK_BYTES, QUERY_CATCH_UP_BYTES, IndexFeed
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
# After a round that caught up, the next one starts no sooner than this after it began
# (unless this many bytes wait): under a stream of small appends one round then covers
# many of them, instead of waking the thread (and taking the GIL from the event loop)
# for every one or two records. The first append after a quiet spell is dispatched at
# once, so a long-polled consumer waits at most this much longer, and only under load;
# and a reader that starts waiting for entries (:meth:`Dispatcher.hurry`: a long poll
# that found nothing) ends the pause at once, so that what it waits for is not held back.
ROUND_INTERVAL_MS = 1.0
ROUND_EAGER_BYTES = 1 << 20
SMALL_READ_BYTES = 64 << 10  # a round of at most this many bytes reads a copy, not a memory map


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
        self,
        commitlog: CommitLog,
        queues: ConsumeQueueSet,
        start_offset: int,
        chunk_bytes: int = 4 << 20,
        index_batch_interval_ms: float = INDEX_BATCH_INTERVAL_MS,
        index_batch_bytes: int = INDEX_BATCH_BYTES,
    ) -> None:
        self.log = commitlog
        self.queues = queues
        self.dispatched_offset = max(start_offset, commitlog.min_offset)
        self.chunk_bytes = max(chunk_bytes, commitlog.config.max_message_bytes + HEADER_SIZE)
        self._listeners: list[Callable[[Arrivals], None]] = []
        self._wake = threading.Event()
        self._hurry = threading.Event()  # a reader waits: no pause before the next round
        self.hurried = 0  # pauses between rounds ended early (a reader waiting: hurry; or wake)
        self._round_lock = threading.Lock()
        self._topic_ids: dict[bytes, int] = {}  # raw topic name -> the queue set's id
        self._tags: dict[bytes, int] = {b"": 0}
        self.rounds = 0  # rounds that dispatched something (each wakes long polls once)
        self.loop_passes = 0  # passes of dispatch_loop (a round, a backlog chunk or an idle wait each)
        self.index: KeyIndex | None = None  # the key index, fed from the same rounds (set_index)
        self._feed: IndexFeed | None = None  # and when it is fed (gathered over rounds)
        self._index_batch = (index_batch_interval_ms, index_batch_bytes)
        self._walk: Walk | None = None  # the round's walk, for the key index
        self._fields: ChunkFields | None = None  # and its columns (large rounds parsed column-wise)
        self._damage_logged: set[int] = set()  # damaged record offsets already logged (at most 64 kept)
        commitlog.add_append_listener(self._on_append)

    def set_index(self, index: KeyIndex) -> None:
        """Build ``index`` too, from the index's own ``end_offset`` on (records below it
        are indexed already), in batches of several rounds (:mod:`._index_feed`)."""
        self.index = index
        self._feed = IndexFeed(self.log, index, self.chunk_bytes, self._resync, *self._index_batch)

    def index_now(self, max_failed_bytes: int = QUERY_CATCH_UP_BYTES) -> int:
        """Bring the key index up to the log's confirmed offset now (a look-up is about
        to run, and must see every message stored before it), indexing at most about
        ``max_failed_bytes`` of a backlog that failed index writes left behind; returns
        the bytes of log still not indexed (0 unless index writes fail or failed, or
        without an index)."""
        if self._feed is None:
            return 0
        with self._round_lock:
            return self._feed.catch_up_to(self.log.confirmed_offset, max_failed_bytes)

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
            at, data = self._read_round(limit)
            columns, consumed = self._parse(at, data)
            arrivals = self.queues.add_round(*columns) if columns else None
            self.dispatched_offset = at + consumed if consumed >= 0 else self.log.next_segment_base(at)
            walk, fields, self._walk, self._fields = self._walk, self._fields, None, None
            if self._feed is not None and walk is not None:
                self._feed.on_round(at, data, walk, fields, self.dispatched_offset)
        self.rounds += 1
        if arrivals is not None:
            for fn in self._listeners:
                fn(arrivals)
        self.index_backlog_once()  # the key index's waiting records, once due: after the wake-ups
        return len(columns[0]) if columns else 0

    def _read_round(self, limit: int) -> tuple[int, memoryview]:
        """The round's bytes of log: a copy when few (a ``pread`` costs ~1.5 us, a memory
        map and its unmap ~11 us), else a memory map of up to ``MAX_CHUNK_BYTES``."""
        start = self.dispatched_offset
        if limit - start <= SMALL_READ_BYTES:
            at, raw = self.log.read_chunk(start, limit - start, limit)
            return at, memoryview(raw)
        return self.log.map_chunk(start, min(MAX_CHUNK_BYTES, max(self.chunk_bytes, limit - start)), limit)

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
        indexed = self._feed is not None and self._feed.wants_columns(walk.stop)
        heads = gather_fields(buf, walk, _FIELDS_INDEXED if indexed else _FIELDS)
        topic_lens = heads["topic_len"].astype(np.int64)
        topics, topic_idx = gather_strings(buf, starts + HEADER_SIZE, topic_lens)
        if indexed:
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

    def index_backlog_once(self, force: bool = False) -> bool:
        """While idle: one chunk of the log the index has not taken yet, once those
        records are due (``force``: whether or not); True if it did some."""
        feed = self._feed
        if feed is None or feed.index.end_offset >= self.dispatched_offset:
            return False
        with self._round_lock:
            return feed.backlog_once(self.dispatched_offset, force)

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
        """Skip a damaged region to the next known record start (boundary index); the
        error is logged once per damaged offset (the key index's catch-up and the
        round both meet it)."""
        bad = at + p
        seg_base = max((b for b, _, _ in self.log.segments() if b <= bad), default=bad)
        nxt = next((b for b in self.log.boundaries(seg_base) if b > bad), self.log.next_segment_base(bad))
        if bad not in self._damage_logged:
            if len(self._damage_logged) >= 64:
                self._damage_logged.clear()
            self._damage_logged.add(bad)
            log.error("dispatch: corrupt record header at commitlog offset %d; skipping to %d", bad, nxt)
        return nxt - at

    def catch_up(self) -> int:
        """Dispatch until nothing is left below the confirmed offset."""
        total = 0
        while self.lag_bytes:
            total += self.dispatch_once()
        while self.index_backlog_once(force=True):  # the key index's waiting records (or a failed write's)
            pass
        return total

    def dispatch_loop(
        self, stop: threading.Event, idle_wait_ms: int = 100, round_interval_ms: float = ROUND_INTERVAL_MS
    ) -> None:
        """The background loop: dispatch whenever the log grows, until ``stop`` is set;
        after a round that caught up, the next begins ``round_interval_ms`` after it at
        the earliest (sooner when ``ROUND_EAGER_BYTES`` wait, or a reader starts waiting
        for entries: :meth:`hurry`)."""
        interval_s = round_interval_ms / 1000
        while not stop.is_set():
            self.loop_passes += 1
            self._wake.clear()  # before the round: an append during it sets it again
            self._hurry.clear()  # this round serves the readers waiting now
            began = time.monotonic()
            if not self.dispatch_once():
                if not self.index_backlog_once():
                    self._wake.wait(self._idle_wait_s(idle_wait_ms / 1000))
                continue
            rest_s = interval_s - (time.monotonic() - began)
            # Appends meanwhile gather for the next round, unless a reader starts
            # waiting for entries: then they are dispatched at once.
            if rest_s > 0 and self.lag_bytes < ROUND_EAGER_BYTES and self._hurry.wait(rest_s):
                self.hurried += 1

    def _idle_wait_s(self, longest_s: float) -> float:
        """How long an idle loop sleeps: until an append, or the key index's waiting records fall due."""
        feed = self._feed
        return longest_s if feed is None else feed.wait_s(self.dispatched_offset, longest_s)

    def _on_append(self) -> None:
        """The log's append listener (on the appending thread): a set event is not set
        again (``Event.set`` takes a lock and notifies, per append)."""
        if not self._wake.is_set():
            self._wake.set()

    def wake(self) -> None:
        """Start a round now, idle or pausing between rounds (appends, a stop)."""
        self._wake.set()
        self._hurry.set()

    def hurry(self) -> None:
        """A reader starts waiting for new entries (a long poll that found nothing):
        end the pause between rounds now, so that records appended since the last
        round are dispatched (and wake it) without waiting out ``round_interval_ms``.
        Called on any thread; cheap when already hurried."""
        if not self._hurry.is_set():
            self._hurry.set()

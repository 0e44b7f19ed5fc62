"""What the dispatcher feeds the key index, and when: gathered over several rounds.

A dispatch round's fixed cost was mostly the key index's (``chunk_keys``: some forty
numpy calls, ~200 us, whether the round held one record or a thousand), paid on every
round (up to one a millisecond) with the GIL held. The consume-queue entries that long
polls wait for are still built every round; the key index is built in batches instead:

- a round that by itself holds at least ``batch_bytes`` of log (and finds the index
  caught up) is indexed at once, from the columns the dispatcher already parsed;
- otherwise the records wait: the index is brought up to the dispatched offset when
  ``batch_bytes`` wait or the oldest waiting record has waited ``batch_interval_ms``,
  in one pass over the log (:meth:`IndexFeed.backlog_once`, a chunk at a time);
- a query first brings the index up to the log's confirmed offset
  (:meth:`IndexFeed.catch_up_to`), however far behind the dispatcher is, so neither the
  batching nor a dispatcher behind a burst hides a message from a look-up. Only a
  backlog that failed index writes left behind is bounded: a query indexes at most
  ``index_query_catch_up_bytes`` of it (it holds the dispatcher's rounds meanwhile),
  then answers and says how far the index is behind.
- while due records cannot be written (the retry wait after a failed write, or a
  persist holding the index), the idle dispatcher sleeps until the retry time or
  ``INDEX_BUSY_RETRY_MS`` (:meth:`IndexFeed.wait_s`), never spins.

Invariants:
- The index's ``end_offset`` never passes the log's confirmed offset; it lags the
  dispatcher by at most ``batch_interval_ms`` (or ``batch_bytes``) while index writes work.
- A write error is counted by the index (``note_failure``) and never raised to the
  dispatcher; the index stays behind and is fed from its ``end_offset`` when writes
  work again (after the index's retry interval). ``_failed_upto`` marks how far the
  records left behind meanwhile reach (what a query's catch-up bounds).
"""

from __future__ import annotations

import time
from typing import Callable

from clmq.commitlog import CommitLog
from clmq.common import Walk, walk_records

from ._keyindex import KeyIndex
from ._keyindex_keys import ChunkFields

MAX_CHUNK_BYTES = 32 << 20  # the most of the log one backlog pass reads at once
# The key index is brought up to the dispatcher at least this often while records wait
# (the bound on how far it lags the consume queues; queries never see the lag).
INDEX_BATCH_INTERVAL_MS = 20.0
INDEX_BATCH_BYTES = 1 << 20  # ... or as soon as this many bytes of log wait to be indexed
# A look-up first indexes everything that waits; of a backlog failed index writes left
# behind, about this much at most (StoreConfig.index_query_catch_up_bytes's default): then
# it answers and says how far the index is behind, rather than hold up the dispatcher's
# rounds while it indexes a long backlog.
QUERY_CATCH_UP_BYTES = 8 << 20
# A persist holds the index (its fdatasync): records due meanwhile are tried again after this.
INDEX_BUSY_RETRY_MS = 20.0


class IndexFeed:
    """Feeds ``index`` from the dispatcher's thread (and from a query's, under the
    dispatcher's round lock: the caller holds it for every method here)."""

    def __init__(
        self,
        commitlog: CommitLog,
        index: KeyIndex,
        chunk_bytes: int,
        resync: Callable[[int, int], int],
        batch_interval_ms: float = INDEX_BATCH_INTERVAL_MS,
        batch_bytes: int = INDEX_BATCH_BYTES,
    ) -> None:
        self.log = commitlog
        self.index = index
        self.chunk_bytes = chunk_bytes
        self._resync = resync  # the dispatcher's: skip a damaged region to the next known record start
        self.batch_interval_s = batch_interval_ms / 1000
        self.batch_bytes = batch_bytes
        self._waiting_since: float | None = None  # monotonic time the oldest unindexed record was dispatched
        self._failed_upto = 0  # records below this were left unindexed while index writes failed
        self.batches = 0  # passes that indexed something (rounds inline, backlog chunks, queries' catch-ups)

    def wants_columns(self, round_bytes: int) -> bool:
        """Whether a round of this many bytes would be indexed inline (its columns wanted)."""
        return round_bytes >= self.batch_bytes

    def on_round(self, at: int, data: memoryview, walk: Walk, fields: ChunkFields | None, upto: int) -> None:
        """After a round dispatched ``[at, upto)`` (``data``, walked): index it now if it
        is a batch by itself (and the index is caught up to it); else its records wait
        (the clock starts), for :meth:`backlog_once` once they are due."""
        index = self.index
        if index.end_offset < at or upto - at < self.batch_bytes or not index.may_write or index.busy:
            self._due(upto)  # a persist (its fdatasync) may hold the index: the records wait, the round does not
            return
        try:
            if upto > index.end_offset:
                index.add_chunk(at, data, walk, upto, fields)
                self.batches += 1
            self._waiting_since = None
            index.note_success()
        except OSError as e:  # ENOSPC, EIO: the index stays at its end; the store goes on
            self._failed(e, upto)

    def _failed(self, error: OSError, upto: int) -> None:
        """A write failed: counted by the index; the records below ``upto`` it left wait."""
        self.index.note_failure(error)
        self._failed_upto = max(self._failed_upto, upto)

    def _due(self, upto: int, now: float | None = None) -> bool:
        """Records below ``upto`` wait to be indexed and are due (enough bytes, or the
        oldest waited long enough); starts the clock for newly waiting ones."""
        waiting = upto - self.index.end_offset
        if waiting <= 0:
            self._waiting_since = None
            return False
        if self.index.failing:
            self._failed_upto = max(self._failed_upto, upto)  # dispatched while writes fail: left behind
        now = time.monotonic() if now is None else now
        if self._waiting_since is None:
            self._waiting_since = now
        return waiting >= self.batch_bytes or now - self._waiting_since >= self.batch_interval_s or self.index.failing

    def wait_s(self, upto: int, longest_s: float) -> float:
        """How long the idle dispatcher may sleep before waiting records fall due and
        can be written: after a failed write, until the index's retry time; while a
        persist holds the index, ``INDEX_BUSY_RETRY_MS`` (never 0 while nothing can be
        written, or the idle loop would spin)."""
        index = self.index
        if index.end_offset >= upto:
            return longest_s
        if not index.may_write:
            return min(longest_s, index.retry_in_s)
        if index.failing:
            due_in = 0.0  # the retry is due now
        elif self._waiting_since is None:
            return longest_s
        else:
            due_in = self._waiting_since + self.batch_interval_s - time.monotonic()
        if index.busy:
            due_in = max(due_in, INDEX_BUSY_RETRY_MS / 1000)
        return min(longest_s, max(0.0, due_in))

    def backlog_once(self, upto: int, force: bool = False) -> bool:
        """While idle: one chunk of the records below ``upto`` not indexed yet, if they
        are due (``force``: whether or not); True if it indexed some."""
        index = self.index
        if index.end_offset >= upto or not index.may_write:
            if index.end_offset >= upto:
                self._waiting_since = None
            return False
        if not force and (index.busy or not self._due(upto)):
            return False
        before = index.end_offset
        try:
            self._backlog(upto)
            index.note_success()
        except OSError as e:
            self._failed(e, upto)
        return index.end_offset > before

    def catch_up_to(self, upto: int, max_failed_bytes: int = QUERY_CATCH_UP_BYTES) -> int:
        """Index the records below ``upto`` now (a query is about to run; the caller
        holds the dispatcher's round lock meanwhile): all of them, however far behind
        the dispatcher is, unless failed index writes left more than ``max_failed_bytes``
        of them: then about that much (a chunk at least). Returns the bytes still not
        indexed (0 unless index writes fail or failed)."""
        index = self.index
        if index.failing:
            self._failed_upto = max(self._failed_upto, upto)
        first = index.end_offset
        left = min(self._failed_upto, upto) - first  # what failed writes left behind
        budget = max(max_failed_bytes, self.chunk_bytes) if left > max_failed_bytes else None
        while index.end_offset < upto and index.may_write:
            done = index.end_offset - first
            if budget is not None and done >= budget:
                break  # the answer says how far behind; the next look-ups go on
            before = index.end_offset
            try:
                self._backlog(upto, MAX_CHUNK_BYTES if budget is None else budget - done)
                index.note_success()
            except OSError as e:
                self._failed(e, upto)
                break
            if index.end_offset <= before:
                break  # nothing read (a read that failed): the answer says how far behind
        return max(0, upto - index.end_offset)

    def _backlog(self, upto: int, most: int = MAX_CHUNK_BYTES) -> None:
        """Index one chunk of the log (at most ``most`` bytes, and at least ``chunk_bytes``)
        from the index's end towards ``upto`` (raises OSError)."""
        index = self.index
        if index.end_offset < self.log.min_offset:
            index.advance(self.log.min_offset)  # retention took the rest
        start = index.end_offset
        if start >= upto:
            return
        want = min(MAX_CHUNK_BYTES, max(most, self.chunk_bytes), max(self.chunk_bytes, upto - start))
        at, data = self.log.map_chunk(start, want, upto)
        walk = walk_records(data, 0, self.log.config.max_message_bytes)
        consumed = walk.stop
        if walk.reason == "blank":
            consumed = self.log.next_segment_base(at) - at
        elif walk.reason == "corrupt" or (not walk.runs and len(data) >= self.chunk_bytes):
            consumed = self._resync(at, walk.stop)
        index.add_chunk(at, data, walk, min(at + consumed, upto))
        self.batches += 1
        if index.end_offset >= upto:
            self._waiting_since = None

"""The set of consume queues, fed by the dispatcher one round at a time.

Why rounds are kept as arrays: with traffic spread over many queues, a dispatch round
touches about one queue per record, so any Python work per (round, queue) is paid per
message and throughput falls as queues grow. The dispatcher therefore hands over each
round as numpy columns (:meth:`ConsumeQueueSet.add_round`, O(1) Python work), and the
rounds are merged into the queues in bulk: one stable sort, then one ``append`` per
queue for all its entries of all pending rounds. A merge happens before anything reads
a queue (so readers always see every dispatched entry), when the housekeeping flush
runs, when the rounds hold ``MERGE_ENTRIES`` entries (bounding memory), and at once
for small rounds under light load (where per-queue work is cheap anyway).

Invariants:
- A merge applies rounds idempotently (a queue skips entries it has), so a merge that
  failed part-way is retried whole; queues given entries before the failure are still
  marked dirty, so they are flushed.
- A merge that fails in the dispatcher thread raises, and the thread's guard fails the
  store, except for a full disk (ENOSPC), after which the rounds are kept for the next
  merge: nothing is dropped or retried silently.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from pathlib import Path
from typing import Iterator

import numpy as np

from clmq.commitlog import QueueKey
from clmq.common import collector_paused

from ._files import FileCache
from ._queue import ConsumeQueue
from ._waiting import WaitingTails

log = logging.getLogger("clmq.consumequeue")

MERGE_ENTRIES = 1 << 20  # entries held in rounds before the dispatcher merges them itself
MERGE_NOW_ENTRIES = 64  # ... and rounds this small are merged at once
_QID_MASK = 0xFFFFFFFF


class Arrivals:
    """The queues one dispatch round gave entries to.

    Built into Python values only when asked: usually only long-poll waiters look, and
    they ask about their own queue (``key in arrivals``).
    """

    def __init__(self, codes: np.ndarray, owner: ConsumeQueueSet) -> None:
        self._codes = codes
        self._owner = owner
        self._set: set[int] | None = None

    def _code_set(self) -> set[int]:
        if self._set is None:
            self._set = set(np.unique(self._codes).tolist())
        return self._set

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, tuple) or len(key) != 2:
            return False
        tid = self._owner.known_topic_id(key[0])
        return tid is not None and (tid << 32 | key[1]) in self._code_set()

    def __iter__(self) -> Iterator[QueueKey]:
        names = self._owner.topic_names
        return ((names[c >> 32], c & _QID_MASK) for c in self._code_set())

    def __len__(self) -> int:
        return len(self._code_set())

    def __repr__(self) -> str:
        return f"Arrivals({sorted(self)!r})"


class ConsumeQueueSet:
    """Every consume queue under ``root/<topic>/<queue id>/``, created on demand.

    Queues are addressed by ``(topic, queue id)`` or, inside the dispatch path, by a
    code ``topic id << 32 | queue id`` with topic ids interned here.
    """

    def __init__(self, root: Path, entries_per_file: int, max_open_files: int) -> None:
        self.root = root
        self.entries_per_file = entries_per_file
        self.files = FileCache(max_open_files)
        self._queues: dict[QueueKey, ConsumeQueue] = {}
        self._by_code: dict[int, ConsumeQueue] = {}
        self._topic_ids: dict[str, int] = {}
        self.topic_names: list[str] = []
        self._dirty: set[ConsumeQueue] = set()  # appended to since the last flush looked
        self._waiting: WaitingTails[ConsumeQueue] = WaitingTails()  # small tails for a later flush (_flush_lock)
        self._flush_lock = threading.Lock()
        self._changed: set[ConsumeQueue] = set()  # disk extent changed (or loaded) since changed_extents()
        self._changed_lock = threading.Lock()
        self._rounds: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._round_entries = 0
        self.appended_entries = 0  # entries added to queues by merges (not re-dispatched duplicates)
        self._lock = threading.Lock()  # queue creation and topic interning
        self._merge_lock = threading.Lock()  # rounds and the dirty set
        self._all_discovered = False  # every queue with files on disk has an object here
        self._topic_dirs: dict[str, Path] = {}
        root.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------ addressing
    def topic_id(self, topic: str) -> int:
        """The interned id of ``topic`` (assigned on first use)."""
        tid = self._topic_ids.get(topic)
        if tid is None:
            with self._lock:
                tid = self._topic_ids.get(topic)
                if tid is None:
                    tid = self._topic_ids[topic] = len(self.topic_names)
                    self.topic_names.append(topic)
        return tid

    def known_topic_id(self, topic: str) -> int | None:
        return self._topic_ids.get(topic)

    def _queue(self, topic: str, queue_id: int) -> ConsumeQueue:
        key = (topic, queue_id)
        cq = self._queues.get(key)
        if cq is None:
            with self._lock:
                cq = self._queues.get(key)
                if cq is None:
                    tdir = self._topic_dirs.get(topic)
                    if tdir is None:  # a path join costs microseconds: one per topic, not two per queue
                        tdir = self._topic_dirs[topic] = self.root / topic
                    cq = ConsumeQueue(
                        (tdir, str(queue_id)),  # joined when first needed (a new queue has no files)
                        topic,
                        queue_id,
                        self.entries_per_file,
                        self.files,
                        no_files=self._all_discovered,
                        on_change=self._note_change,
                    )
                    self._queues[key] = cq
        return cq

    def _note_change(self, cq: ConsumeQueue) -> None:
        with self._changed_lock:
            self._changed.add(cq)

    def _queue_by_code(self, code: int) -> ConsumeQueue:
        cq = self._by_code.get(code)
        if cq is None:
            cq = self._by_code[code] = self._queue(self.topic_names[code >> 32], code & _QID_MASK)
        return cq

    def queue(self, topic: str, queue_id: int) -> ConsumeQueue:
        """The queue, holding every entry dispatched so far."""
        self.merge()
        return self._queue(topic, queue_id)

    def discover(self) -> list[QueueKey]:
        """The queues that have a directory on disk (without loading them).

        From then on a queue this set does not know has no files (only this process
        writes here), so its first use touches no disk: a consumer's first look-ups of
        thousands of new, empty queues would otherwise each list a missing directory,
        waiting behind a checkpoint that is creating thousands of others."""
        keys: list[QueueKey] = []
        for topic in os.listdir(self.root):
            tdir = self.root / topic
            if tdir.is_dir():
                keys.extend((topic, int(q)) for q in os.listdir(tdir) if q.isdigit())
        for key in keys:
            self._queue(*key)
        self._all_discovered = True
        return keys

    def known(self) -> list[QueueKey]:
        self.merge()
        return [key for key, _cq in self._snapshot()]

    def _snapshot(self) -> list[tuple[QueueKey, ConsumeQueue]]:
        """Every queue, copied under the creation lock. Why the lock, though the copy is
        one C call: a garbage collection can start inside it (each item is a new
        tuple) and run finalizers, Python code during which a reader thread creating a
        queue changes the dict ("dictionary changed size during iteration": it failed
        the housekeeping thread's checkpoint, and so the store)."""
        with self._lock:
            return list(self._queues.items())

    # ------------------------------------------------------------ dispatch path
    def add_round(self, codes: np.ndarray, queue_offsets: np.ndarray, entries: np.ndarray) -> Arrivals:
        """Take one dispatch round's entries, in log order: ``codes`` (uint64 queue
        codes), ``queue_offsets`` (int64) and ``entries`` (ENTRY_DTYPE)."""
        with self._merge_lock:
            self._rounds.append((codes, queue_offsets, entries))
            self._round_entries += len(codes)
            # A light load gives small rounds: applying them now costs little and saves
            # a long merge later (which would hold the GIL for milliseconds at once).
            if self._round_entries >= MERGE_ENTRIES or self._round_entries <= MERGE_NOW_ENTRIES:
                try:
                    self._merge_locked()
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise  # the dispatcher thread fails the store: nothing is retried silently
                    log.warning("merging dispatched entries: %s; kept for the next merge", e)
        return Arrivals(codes, self)

    def merge(self) -> None:
        """Apply every pending round to its queues."""
        if self._rounds:  # cheap check: cleared only once a merge has fully applied
            with self._merge_lock:
                self._merge_locked()

    def _merge_locked(self) -> None:
        rounds = self._rounds
        if not rounds:
            return
        codes, qoffs, entries = (np.concatenate(c) for c in zip(*rounds)) if len(rounds) > 1 else rounds[0]
        touched: list[ConsumeQueue] = []
        added = 0
        try:
            with collector_paused():  # the first round of a new topic makes all its queues here
                for code, first, run in _queue_runs(codes, qoffs, entries):
                    cq = self._by_code.get(code) or self._queue_by_code(code)
                    n = cq.append(first, run)  # idempotent: a retried merge skips what it has
                    if n:
                        touched.append(cq)
                        added += n
        finally:  # queues given entries before a failure must still be flushed
            self._dirty.update(touched)
            self.appended_entries += added
        self._rounds, self._round_entries = [], 0

    # ---------------------------------------------------------------- files
    def flush(self, sync: bool = False, min_bytes: int = 0) -> int | None:
        """Write queues' in-memory entries to their files: those holding at least
        ``min_bytes`` (0: all). Small writes to thousands of files cost more than they
        protect (the files are rebuilt from the log), so small tails wait.

        Costs the queues appended to since the last flush (and, with ``min_bytes`` 0,
        those waiting), not every queue with a tail.

        Returns the commit-log offset of the oldest entry still only in memory, or None.
        """
        with self._flush_lock:
            with self._merge_lock:
                self._merge_locked()
                dirty, self._dirty = self._dirty, set()
            if min_bytes <= 0:
                dirty.update(self._waiting.take_all())
            try:
                self._flush_queues(dirty, sync, min_bytes)
            except OSError:
                with self._merge_lock:  # nothing is lost: the unwritten stay dirty
                    self._dirty.update(dirty)
                raise
            return self._waiting.oldest()

    def _flush_queues(self, queues: set[ConsumeQueue], sync: bool, min_bytes: int) -> None:
        waiting = self._waiting
        for cq in queues:
            if cq.pending_bytes < min_bytes:
                waiting.add(cq)
                continue
            cq.flush()
            if sync:
                cq.sync()
            waiting.discard(cq)

    def next_offsets(self) -> dict[QueueKey, int]:
        """Next offset of every *loaded* queue."""
        self.merge()
        return {key: cq.next_offset for key, cq in self._snapshot() if cq.loaded}

    def extents(self) -> dict[QueueKey, tuple[int, int]]:
        """``(first, next)`` of the entries in the files, for every *loaded* queue."""
        self.merge()
        return {key: cq.disk_extent() for key, cq in self._snapshot() if cq.loaded}

    def changed_extents(self) -> dict[QueueKey, tuple[int, int]]:
        """:meth:`extents` of the queues whose extent may have changed, or that were
        loaded, since the last call (the first call: of every loaded queue). Every
        other loaded queue's extent is what an earlier call returned: a checkpoint
        carries its table forward and costs the queues that changed."""
        self.merge()
        with self._changed_lock:
            changed, self._changed = self._changed, set()
        try:
            return {(cq.topic, cq.queue_id): cq.disk_extent() for cq in changed}
        except BaseException:
            with self._changed_lock:  # asked again next time: nothing is missed
                self._changed.update(changed)
            raise

    def close(self) -> None:
        self.flush()
        self.files.close()


SMALL_MERGE_ENTRIES = 32  # at most this many entries are grouped in plain Python (numpy's per-call cost is more)


def _queue_runs(codes: np.ndarray, qoffs: np.ndarray, entries: np.ndarray) -> list[tuple[int, int, bytes]]:
    """The entries as runs ``(queue code, first queue offset, entries' bytes)``: by queue
    (stably: log order within a queue), a new run wherever the queue offsets skip."""
    if len(codes) == 0:
        return []
    if len(codes) <= SMALL_MERGE_ENTRIES:
        raw = entries.tobytes()
        code_of, qoff_of = codes.tolist(), qoffs.tolist()
        runs: list[tuple[int, int, bytes]] = []
        for i in sorted(range(len(code_of)), key=code_of.__getitem__):  # sorted() is stable
            code, q, row = code_of[i], qoff_of[i], raw[20 * i : 20 * i + 20]
            if runs and runs[-1][0] == code and runs[-1][1] + len(runs[-1][2]) // 20 == q:
                runs[-1] = (code, runs[-1][1], runs[-1][2] + row)
            else:
                runs.append((code, q, row))
        return runs
    order = np.argsort(codes, kind="stable")  # stable: log order within a queue
    codes, qoffs, raw = codes[order], qoffs[order], entries[order].tobytes()
    cuts = np.flatnonzero((codes[1:] != codes[:-1]) | (qoffs[1:] != qoffs[:-1] + 1)) + 1
    starts = np.concatenate(([0], cuts))
    ends = np.concatenate((cuts, [len(codes)])) * 20
    firsts = zip(codes[starts].tolist(), qoffs[starts].tolist(), (starts * 20).tolist(), ends.tolist())
    return [(code, first, raw[a:b]) for code, first, a, b in firsts]

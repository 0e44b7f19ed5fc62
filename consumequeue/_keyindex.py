"""The key index: messages by key and by UNIQ_KEY over the whole retained log.

A directory of :mod:`._index_file` files, each covering a contiguous range of the log
(its name is the offset it starts at), at most ``max_entries`` entries each; only the
newest (active) file takes entries and keeps its slot table in memory, so memory is
``4 x slots`` bytes however many messages are indexed (20 MB at RocketMQ's 5 M slots).

Invariants:
- Entries are added in log order by the dispatcher's thread; a record below
  :attr:`KeyIndex.end_offset` (indexed already) is never added again, so re-dispatch
  is idempotent.
- :meth:`persist` makes the files say "indexed up to ``end_offset``": the store's open
  re-dispatches from there (or from the first damaged file: that file and every newer
  one are deleted and rebuilt from the log).
- A query returns candidates only: the caller reads each record and compares its
  topic, keys and store time (a hash collision, an entry past a truncation).
- A query leases the files it walks: a file retired meanwhile (retention, a cut) is
  closed when its last reader lets go, never under one (its descriptor could be reused).
- A write error (ENOSPC, EIO) is counted (:attr:`KeyIndex.failures`), never raised to
  the dispatcher's loop: the index stays behind at its ``end_offset`` and the dispatcher
  re-reads the log from there when writes work again (:meth:`note_failure`).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Generator, Iterator

import numpy as np

from clmq.commitlog import fsync_dir
from clmq.common import Walk

from ._index_file import SUFFIX, IndexFile, index_file_name, slot_of
from ._keyindex_keys import ChunkFields, chunk_keys, key_hash

log = logging.getLogger("clmq.keyindex")


@dataclass(frozen=True)
class IndexSettings:
    slots: int = 1_000_000  # hash slots per file (4 B each, the active file's in memory)
    max_entries: int = 4_000_000  # entries per file (20 B each; 4 a slot, RocketMQ's ratio)


@dataclass(frozen=True)
class Candidate:
    """An entry whose hash matched: where the record should be, and its store second."""

    offset: int
    store_s: int


@dataclass
class WalkBudget:
    """How many chain entries a query may still read (a hot key's chain can hold
    millions, most outside a narrow time range); ``exhausted`` once it ran out."""

    steps: int
    exhausted: bool = False

    def take(self) -> bool:
        """Spend one step; False (and ``exhausted``) when none is left."""
        if self.steps <= 0:
            self.exhausted = True
            return False
        self.steps -= 1
        return True


INDEX_RETRY_INTERVAL_MS = 500  # after an index write error, the index is written again no sooner than this


class KeyIndex:
    """Every index file of a store (see the module docstring)."""

    def __init__(self, directory: Path, settings: IndexSettings, start_offset: int = 0) -> None:
        self.directory = directory
        self.settings = settings
        directory.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()  # the file list and the active file's slots
        self._files: list[IndexFile] = []
        self._readers: dict[int, int] = {}  # id(file) -> queries walking it (leases)
        self._retired: list[IndexFile] = []  # deleted while leased: closed by the last reader
        self.failures = 0  # index writes that failed (ENOSPC, EIO): the index fell behind
        self.last_failure = ""  # the newest of them, as text ("" none yet)
        self.failing = False  # the last write failed (logged once per burst)
        self._retry_at = 0.0  # monotonic time before which writes are not tried again
        self.retry_interval_ms = INDEX_RETRY_INTERVAL_MS  # after a failure, the next write no sooner
        self._durable = (0, start_offset)  # the active file's (count, end_offset) at its last good persist
        self.dropped_from: int | None = None  # the open found damage: rebuilt from here
        self._dir_changed = True  # files created or deleted since the directory was last fsynced
        self._load(start_offset)

    # ------------------------------------------------------------------ opening
    def _load(self, start_offset: int) -> None:
        paths = sorted(p for p in self.directory.glob(f"*{SUFFIX}") if p.stem.isdigit())
        files = [IndexFile.open(p) for p in paths]
        bad = next((i for i, f in enumerate(files) if not self._usable(f, files[i - 1] if i else None)), None)
        if files and bad != 0 and files[0].header.begin_offset > start_offset:
            bad = 0  # the oldest file is gone (a repair deleted it): the log before it was never indexed
        if bad is not None:  # that file and every newer one: rebuilt from the log
            self.dropped_from = int(files[bad].path.stem)
            log.warning("key index: %s is damaged; it and newer files are rebuilt from the log", files[bad].path)
            for f in files[bad:]:
                f.close()
                f.path.unlink()
            files = files[:bad]
        if not files:
            files = [IndexFile.create(self.directory, *self._shape(), start_offset)]
        elif files[-1].full:
            files.append(IndexFile.create(self.directory, *self._shape(), files[-1].header.end_offset))
        else:
            files[-1].activate()
        self._files = files
        self._mark_durable()

    @staticmethod
    def _usable(f: IndexFile, previous: IndexFile | None) -> bool:
        """Header good, named by its begin offset, continuing the previous file."""
        h = f.header
        return (
            h.ok
            and f.path.name == index_file_name(h.begin_offset)
            and h.count <= h.max_entries
            and h.slots > 0
            and (previous is None or previous.header.end_offset == h.begin_offset)
        )

    def _shape(self) -> tuple[int, int]:
        return self.settings.slots, self.settings.max_entries

    @property
    def end_offset(self) -> int:
        """Every record below this offset is indexed (re-dispatch starts here)."""
        return self._files[-1].header.end_offset

    @property
    def busy(self) -> bool:
        """Another thread holds the index (a persist writing and syncing its files):
        the dispatcher feeds it later rather than wait."""
        return self._lock.locked()

    @property
    def files(self) -> list[IndexFile]:
        return list(self._files)

    @property
    def entry_count(self) -> int:
        return sum(f.header.count for f in self._files)

    # ------------------------------------------------------------------ writing
    def add_chunk(self, at: int, data: memoryview, walk: Walk, upto: int, fields: ChunkFields | None = None) -> int:
        """Index the walked records of a chunk read at log offset ``at`` (``fields``:
        their columns, if the caller has them), then mark the log indexed up to
        ``upto``; returns the entries added."""
        added = 0
        keys = chunk_keys(data, walk, fields) if walk.runs else None
        with self._lock:  # one step: a failed persist's rewind comes before or after both
            if keys is not None:
                hashes, positions, times = keys
                offsets = positions + at
                keep = offsets >= self.end_offset
                added = self._add(hashes[keep], offsets[keep], times[keep])
            self._advance(upto)
        return added

    def add(self, hashes: np.ndarray, offsets: np.ndarray, times_ms: np.ndarray) -> int:
        """Add entries in log order, rolling to a new file when the active one is full."""
        with self._lock:
            return self._add(hashes, offsets, times_ms)

    def _add(self, hashes: np.ndarray, offsets: np.ndarray, times_ms: np.ndarray) -> int:
        """:meth:`add`, the lock held."""
        done = 0
        while done < len(hashes):
            active = self._files[-1]
            if active.full:
                try:
                    active.seal()
                except OSError:
                    self._rewind()  # not full any more: indexed again from the log
                    raise
                self._files.append(IndexFile.create(self.directory, *self._shape(), active.header.end_offset))
                self._mark_durable()
                self._dir_changed = True
                continue
            done += active.append(hashes[done:], offsets[done:], times_ms[done:])
            # Indexed up to the first record not wholly in: a record's entries may
            # span two files, and the newer one starts at that record.
            active.header.end_offset = int(offsets[done]) if done < len(hashes) else int(offsets[-1]) + 1
        return done

    def advance(self, upto: int) -> None:
        """Mark the log indexed up to ``upto`` (records below it hold no key)."""
        with self._lock:
            self._advance(upto)

    def _advance(self, upto: int) -> None:
        h = self._files[-1].header
        h.end_offset = max(h.end_offset, upto)

    def persist(self, sync: bool = True) -> None:
        """Make the active file durable (entries, then slots, then its header), and the
        directory when files were created or deleted. A write error is counted, not
        raised: the files keep saying the older ``end_offset`` (re-dispatch starts
        there) and the next persist writes again."""
        with self._lock:
            try:
                self._files[-1].persist(sync)
                if sync and self._dir_changed:
                    fsync_dir(self.directory)
                    self._dir_changed = False
            except OSError as e:
                self.note_failure(e)
                self._rewind()
            else:
                if sync:
                    self._mark_durable()

    def _mark_durable(self) -> None:
        h = self._files[-1].header
        self._durable = (h.count, h.end_offset)  # what the active file's last good persist made durable

    def _rewind(self) -> None:
        """After a failed persist, back to what the last good one made durable: after
        a failed ``fdatasync`` the kernel may have dropped pages it then calls clean, so
        the entries since are written again (re-indexed from the log) and the whole slot
        table with the next persist."""
        active = self._files[-1]
        count, end = self._durable
        if active.slot_table is None:
            return
        try:
            if active.header.count > count:
                active.cut_after(count)
        except OSError as e:  # the cut's ftruncate: entries past the count are overwritten anyway
            log.warning("key index: cutting %s back to %d entries: %s", active.path, count, e)
        active.header.end_offset = min(active.header.end_offset, end)
        active.mark_all_dirty()

    # ------------------------------------------------------------ write failures
    def note_failure(self, error: OSError) -> None:
        """Count a failed index write (logged once per burst); writes resume after
        ``retry_interval_ms``."""
        self.failures += 1
        self.last_failure = str(error)
        self._retry_at = time.monotonic() + self.retry_interval_ms / 1000
        if not self.failing:
            log.error("key index: writing %s failed (%s); lookups may miss the newest messages", self.directory, error)
        self.failing = True

    def note_success(self) -> None:
        if self.failing:
            log.warning("key index: writes work again (%d failed); indexing on from %d", self.failures, self.end_offset)
        self.failing = False

    @property
    def may_write(self) -> bool:
        """False while waiting out ``retry_interval_ms`` after a failure."""
        return not self.failing or time.monotonic() >= self._retry_at

    @property
    def retry_in_s(self) -> float:
        """Seconds until writes may be tried again (0 when they may be now)."""
        return max(0.0, self._retry_at - time.monotonic()) if self.failing else 0.0

    # ---------------------------------------------------------- log cut, retention
    def truncate(self, offset: int) -> None:
        """Forget every entry at or past ``offset`` (the log was cut there)."""
        with self._lock:
            if self.end_offset <= offset:
                return
            while len(self._files) > 1 and self._files[-1].header.begin_offset >= offset:
                self._retire(self._files.pop())
            active = self._files[-1]
            if active.slot_table is None:
                active.activate()
            entries = active.read_entries(0, active.header.count)
            active.cut_after(int(np.searchsorted(entries["offset"], offset)))
            active.header.end_offset = min(max(offset, active.header.begin_offset), active.header.end_offset)
            active.persist(sync=True)
            self._mark_durable()

    def restart_at(self, base: int) -> None:
        """The log now starts empty at ``base``: index on from there (old files age out)."""
        with self._lock:
            self._files[-1].header.end_offset = base

    def delete_before(self, min_offset: int) -> int:
        """Delete sealed files whose every record lies below the log's ``min_offset``."""
        with self._lock:
            gone = 0
            while len(self._files) > 1 and self._files[0].header.end_offset <= min_offset:
                self._retire(self._files.pop(0))
                gone += 1
        return gone

    def _retire(self, f: IndexFile) -> None:
        """Delete ``f``; close it now, or when the last query walking it lets go."""
        f.path.unlink(missing_ok=True)
        self._dir_changed = True
        if self._readers.get(id(f)):
            self._retired.append(f)
        else:
            f.close()

    def _lease(self, files: list[IndexFile]) -> None:
        for f in files:
            self._readers[id(f)] = self._readers.get(id(f), 0) + 1

    def _release(self, files: list[IndexFile]) -> None:
        with self._lock:
            for f in files:
                left = self._readers.pop(id(f)) - 1
                if left:
                    self._readers[id(f)] = left
                elif f in self._retired:
                    self._retired.remove(f)
                    f.close()

    # ------------------------------------------------------------------ reading
    def candidates(
        self,
        topic: str,
        key: str,
        since_ms: int | None = None,
        until_ms: int | None = None,
        budget: WalkBudget | None = None,
    ) -> Generator[Candidate, None, None]:
        """Entries whose hash is ``topic#key``'s within the time range, newest file
        first, reading at most ``budget`` chain entries. The files are leased until the
        iterator ends or is closed (close it when stopping early)."""
        h = key_hash(topic, key)
        since_s = None if since_ms is None else since_ms // 1000
        until_s = None if until_ms is None else until_ms // 1000
        budget = budget if budget is not None else WalkBudget(2**62)
        with self._lock:
            files = [(f, f.slot(int(slot_of(np.array([h]), f.header.slots)[0])), f.header.count) for f in self._files]
            self._lease([f for f, _, _ in files])
        try:
            for f, head, count in reversed(files):
                hd = f.header
                if count == 0 or (since_ms is not None and hd.end_ms < since_ms):
                    continue
                if until_ms is not None and hd.begin_ms > until_ms:
                    continue
                yield from _chain(f, head, count, h, since_s, until_s, budget)
                if budget.exhausted:
                    return
        finally:
            self._release([f for f, _, _ in files])

    def close(self) -> None:
        """Close every file (a file a query still walks: when it lets go)."""
        with self._lock:
            for f in self._files:
                if self._readers.get(id(f)):
                    self._retired.append(f)
                else:
                    f.close()
            self._files = []


def _chain(
    f: IndexFile, head: int, count: int, h: int, since_s: int | None, until_s: int | None, budget: WalkBudget
) -> Iterator[Candidate]:
    """Walk a slot's chain newest first; stop below ``since_s`` (entries only get older)
    or when ``budget`` runs out."""
    base_s = f.header.begin_ms // 1000
    number = head
    while 0 < number <= count and budget.take():
        row = f.entry(number)
        if row is None:
            return
        store_s = base_s + int(row["dt"])
        if since_s is not None and store_s < since_s:
            return
        if int(row["hash"]) == h and (until_s is None or store_s <= until_s):
            yield Candidate(int(row["offset"]), store_s)
        prev = int(row["prev"])
        if prev >= number:
            log.error("key index %s: entry %d links forward to %d; chain cut there", f.path, number, prev)
            return
        number = prev

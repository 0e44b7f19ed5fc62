"""The broker's read threads: a small pool of worker threads for the store reads of
pulls and look-ups, so that a slow disk read holds up its request, not the event loop;
and a second, small pool for *cold* pulls (data no longer in the page cache), so that a
consumer far behind never occupies the threads that serve the tail (:class:`ColdReads`).
"""

from __future__ import annotations

import logging
import os
import queue
import resource
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Generic, TypeVar

import trio

from clmq.broker.store import Span
from clmq.commitlog import pages_missing, read_exactly

T = TypeVar("T")
log = logging.getLogger(__name__)

MAX_BATCH = 64  # jobs a busy worker takes at once; their results go back to the event loop in one wake-up
IDLE_THREAD_S = 10.0  # a worker with nothing to do this long ends (a new one starts on demand)


class _Job(Generic[T]):
    __slots__ = ("args", "done", "error", "fn", "token", "value")

    def __init__(self, fn: Callable[..., T], args: tuple[Any, ...], token: trio.lowlevel.TrioToken) -> None:
        self.fn, self.args, self.token = fn, args, token
        self.done = trio.Event()
        self.value: T | None = None
        self.error: BaseException | None = None

    def execute(self) -> None:
        try:
            self.value = self.fn(*self.args)
        except BaseException as e:  # handed to the waiting task, raised there
            self.error = e


class ReadThreads:
    """At most ``size`` worker threads for the store reads of pulls and look-ups.

    Why not ``trio.to_thread.run_sync``: on this project's 2-core machine under load one
    hop cost about 130 us of CPU, more than the read of a pull; here a job is one queue
    put and, with several requests in flight, one wake-up of the event loop brings
    back the results of up to ``MAX_BATCH`` (8 concurrent pulls: 16 us per job against
    81 us). A worker takes a batch only when every thread is busy, so a slow read holds
    up no job that an idle thread could have run. Threads start on demand and end
    after ``idle_s`` idle (no shutdown hook needed).
    """

    def __init__(self, size: int, idle_s: float = IDLE_THREAD_S, name: str = "pull_read_threads") -> None:
        if size < 1:
            raise ValueError(f"{name}={size}: at least 1")
        self.size = size
        self.idle_s = idle_s
        self.name = name
        self.stats = ReadStats()  # shared with the cold pool: one place to read the broker's counters
        self._cold: ReadThreads | None = None
        self._jobs: queue.SimpleQueue[_Job[Any]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.threads = 0  # running now (at most ``size``)
        self._idle = 0  # of which waiting for a job

    async def in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a worker thread; its result or its exception."""
        job: _Job[T] = _Job(fn, args, trio.lowlevel.current_trio_token())
        self._jobs.put(job)
        with self._lock:
            start = self._idle == 0 and self.threads < self.size
            if start:
                self.threads += 1
        if start:
            threading.Thread(target=self._work, name=f"clmq-{self.name}", daemon=True).start()
        await job.done.wait()
        if job.error is not None:
            raise job.error
        return job.value  # type: ignore[return-value]  # set by execute() when no error

    def cold_pool(self, size: int) -> ReadThreads:
        """The pool for cold pulls (``cold_read_threads``), made on first use and shared
        by every caller; its counters are this pool's."""
        if self._cold is None:
            self._cold = ReadThreads(size, self.idle_s, "cold_read_threads")
            self._cold.stats = self.stats
        return self._cold

    def _work(self) -> None:
        try:
            self._serve()
        except BaseException:  # a bug here, not in a job (jobs keep their own errors): never a silent death
            log.exception("%s: a read thread failed", self.name)
            with self._lock:
                self.threads -= 1  # the next job starts a new thread
            raise

    def _serve(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            try:
                batch = [self._jobs.get(timeout=self.idle_s)]
            except queue.Empty:
                with self._lock:
                    self._idle -= 1
                    if self._jobs.empty():  # under the lock: a job put now finds no idle thread and starts one
                        self.threads -= 1
                        return
                continue
            with self._lock:
                self._idle -= 1
                busy = self._idle == 0 and self.threads >= self.size
            while busy and len(batch) < MAX_BATCH:  # everyone busy: take what waits, answer it in one wake-up
                try:
                    batch.append(self._jobs.get_nowait())
                except queue.Empty:
                    break
            for job in batch:
                job.execute()
            _deliver_soon(batch)


def _deliver_soon(batch: list[_Job[Any]]) -> None:
    by_token: dict[trio.lowlevel.TrioToken, list[_Job[Any]]] = {}
    for job in batch:
        by_token.setdefault(job.token, []).append(job)
    for token, jobs in by_token.items():
        try:
            token.run_sync_soon(_set_done, jobs)
        except trio.RunFinishedError:  # the broker's event loop is gone: nobody waits
            pass


def _set_done(jobs: list[_Job[Any]]) -> None:
    for job in jobs:
        job.done.set()


@dataclass
class ReadStats:
    """What the read threads did since the broker started (``Handlers._readers.stats``)."""

    hot_pulls: int = 0  # pulls read in the pull_read_threads
    cold_pulls: int = 0  # pulls read in the cold_read_threads (known cold before they were read)
    disk_pulls: int = 0  # pulls whose reads waited for the disk (found cold while read)
    cold_spans: int = 0  # spans read into bytes in a cold thread (not sendfile'd on the event loop)
    cold_bytes: int = 0
    resident_spans: int = 0  # spans found in the page cache: sent with sendfile
    unread_watches: int = 0  # pulls that may wait, not read before waiting: every queue at its end
    inline_pulls: int = 0  # small pulls of fresh records read on the event loop (:class:`FreshPositions`)


def _disk_reads() -> int:
    """Blocks this thread has read from the disk so far (page-cache hits do not count)."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_inblock


class ResidentSpan(Span):
    """A span found in the page cache by a read thread just now: ``send_spans`` sends
    it with ``sendfile`` without asking again."""

    __slots__ = ()
    resident = True


# ---------------------------------------------------------------------- cold pulls
Pull = tuple[list[list[Any]], list[Span], int]  # result rows, spans, messages found
_QueueAt = tuple[str, int, int]  # topic, queue id, offset


class ColdReads:
    """Runs a pull's reads in the hot pool or, when its data is cold, in the cold pool.

    A pull is cold when its reads waited for the disk (the thread's block-input count
    grew: a consume-queue file or record headers not cached) or some of its spans are
    not in the page cache. Its uncached spans are read into bytes in a cold thread (an
    error there is the pull's error reply), never ``sendfile``'d on the event loop.
    Each queue it read is remembered at its next offset, a consumer's next pull asks
    exactly that: that pull goes straight to the cold pool, without occupying a hot
    thread first. Only pulls found cold are remembered: a tail reader that met the disk
    once (a consume-queue page just evicted) goes back to the hot pool after one pull.
    At most ``memory`` positions are remembered (the oldest forgotten first).
    """

    def __init__(self, hot: ReadThreads, cold_threads: int, memory: int, distance_bytes: int) -> None:
        self.hot, self.cold = hot, hot.cold_pool(cold_threads)
        self.stats = hot.stats
        self.memory_max, self.distance_bytes = max(1, memory), distance_bytes
        self._memory: OrderedDict[_QueueAt, None] = OrderedDict()

    async def pull(self, fn: Callable[..., Pull], asks: list[Any], *args: Any) -> Pull:
        """``fn(asks, *args)`` (a pull's reads: rows, spans, count) in the right pool;
        every uncached span turned into bytes. OSError: a cold read failed."""
        known = self._recall(asks)
        pool = self.cold if known else self.hot
        rows, spans, found, cold = await pool.in_thread(self._checked, fn, known, asks, *args)
        if any(s.data is None and not isinstance(s, ResidentSpan) for s in spans):  # cold, read in the hot pool
            spans = await self.cold.in_thread(self._fill, spans)
        if cold:
            self._remember(asks, rows)
        return rows, spans, found

    def _checked(self, fn: Callable[..., Pull], known: bool, asks: list[Any], *args: Any) -> tuple[*Pull, bool]:
        before = _disk_reads()
        rows, spans, found = fn(asks, *args)
        disk = _disk_reads() > before
        spans, missing = self._classify(spans)
        if known:
            self.stats.cold_pulls += 1
            spans = self._fill(spans)
        else:
            self.stats.hot_pulls += 1
        self.stats.disk_pulls += disk
        return rows, spans, found, disk or missing

    def _classify(self, spans: list[Span]) -> tuple[list[Span], bool]:
        """The spans, those in the page cache as :class:`ResidentSpan`; whether any is not."""
        out: list[Span] = []
        missing = False
        fds: dict[str, int] = {}
        try:
            for s in spans:
                if s.data is not None or s.path is None:
                    out.append(s)
                    continue
                fd = fds.get(s.path)
                if fd is None:
                    fd = fds[s.path] = os.open(s.path, os.O_RDONLY)
                if self._cold_span(fd, s):
                    missing = True
                    out.append(s)
                else:
                    self.stats.resident_spans += 1
                    out.append(ResidentSpan(s.path, s.position, s.length))
        finally:
            for fd in fds.values():
                os.close(fd)
        return out, missing

    def _cold_span(self, fd: int, s: Span) -> bool:
        got = pages_missing(fd, s.position, s.length)
        if got is None:  # this system cannot tell: far from its file's end is cold
            return os.fstat(fd).st_size - s.position > self.distance_bytes
        return got

    def _fill(self, spans: list[Span]) -> list[Span]:
        """Every span not known cached read into bytes (in a cold thread)."""
        out: list[Span] = []
        for s in spans:
            if s.data is not None or s.path is None or isinstance(s, ResidentSpan):
                out.append(s)
                continue
            with open(s.path, "rb") as f:
                data = read_exactly(f.fileno(), s.position, s.length, s.path)
            self.stats.cold_spans += 1
            self.stats.cold_bytes += s.length
            out.append(Span(None, s.position, s.length, data))
        return out

    def _recall(self, asks: list[Any]) -> bool:
        memory = self._memory
        hit = False
        for a in asks:
            if memory.pop((a[0], a[1], a[2]), False) is None:  # popped: its next position is remembered anew
                hit = True
        return hit

    def _remember(self, asks: list[Any], rows: list[list[Any]]) -> None:
        """Each queue read (row: status, next_offset, count, ...) at its next offset."""
        memory = self._memory
        for a, row in zip(asks, rows):
            if row[2] > 0:
                memory[(a[0], a[1], row[1])] = None
        while len(memory) > self.memory_max:
            memory.popitem(last=False)


# ---------------------------------------------------------------------- fresh pulls
FRESH_MAX_AGE_S = 30.0  # a remembered position is fresh this long (a watch waits up to 15 s)
FRESH_MEMORY = 4096  # positions remembered at most (the oldest forgotten first)


class FreshPositions:
    """Where recent pulls left queues at their end: what a pull asks from such a
    position was appended after that answer, at most ``max_age_s`` ago, so its log
    pages are in the page cache and its queue entries in memory. A small pull that
    asks only from such positions is read on the event loop (:class:`Fetch`), without
    the hop to a read thread and back: two wake-ups, each waiting for the GIL on a busy
    broker (a consumer at the head of 8 queues at 10k msgs/s: such a read took 0.94 ms
    at the median in a thread, 0.34 ms of it the read's own CPU).

    A position is taken when it is asked (a pull from it moves on); the answer of a
    pull that leaves a queue at its end again remembers the new one.
    """

    def __init__(self, max_age_s: float = FRESH_MAX_AGE_S, memory: int = FRESH_MEMORY) -> None:
        self.max_age_s = max_age_s
        self.memory_max = max(1, memory)
        self._at: OrderedDict[_QueueAt, float] = OrderedDict()

    def note(self, asks: list[Any], rows: list[list[Any]], now: float) -> None:
        """Remember each queue a pull's answer left at its end (a row: status, next
        offset, count, bytes, max offset; a SKIPPED or unknown queue's max is -1 or 0
        below the offset asked, and is not remembered)."""
        at = self._at
        for a, row in zip(asks, rows):
            if row[0] in _AT_END_STATUSES and row[1] >= row[4] >= 0:
                key = (a[0], a[1], row[1])
                at[key] = now
                at.move_to_end(key)
        while len(at) > self.memory_max:
            at.popitem(last=False)

    def all_fresh(self, asks: list[Any], now: float) -> bool:
        """Whether every ask is at a remembered position, remembered less than
        ``max_age_s`` ago (those asked are forgotten: the answer says where next)."""
        at = self._at
        fresh = True
        for a in asks:
            when = at.pop((a[0], a[1], a[2]), None)
            if when is None or now - when > self.max_age_s:
                fresh = False
        return fresh


_AT_END_STATUSES = frozenset({"FOUND", "NO_MESSAGE", "NO_MATCHED_MESSAGE"})

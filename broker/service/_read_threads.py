"""The broker's read threads: a small pool of worker threads for the store reads of
pulls and look-ups, so that a slow disk read holds up its request, not the event loop.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Generic, TypeVar

import trio

T = TypeVar("T")

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

    def __init__(self, size: int, idle_s: float = IDLE_THREAD_S) -> None:
        if size < 1:
            raise ValueError(f"pull_read_threads={size}: at least 1")
        self.size = size
        self.idle_s = idle_s
        self._jobs: queue.SimpleQueue[_Job[Any]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.threads = 0  # running now (at most ``size``)
        self._idle = 0  # of which waiting for a job

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a worker thread; its result or its exception."""
        job: _Job[T] = _Job(fn, args, trio.lowlevel.current_trio_token())
        self._jobs.put(job)
        with self._lock:
            start = self._idle == 0 and self.threads < self.size
            if start:
                self.threads += 1
        if start:
            threading.Thread(target=self._work, name="clmq-pull-read", daemon=True).start()
        await job.done.wait()
        if job.error is not None:
            raise job.error
        return job.value  # type: ignore[return-value]  # set by execute() when no error

    def _work(self) -> None:
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

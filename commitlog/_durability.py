"""Tracking how far appended data is durable, and who waits for it (group commit).

Writers ask for a flush and wait (threads) or register a callback (event loops); the
flusher fsyncs everything written so far once, then publishes the new durable offset
and releases every waiter at or below it.

Invariants:
- ``value`` only grows through :meth:`DurableOffset.publish` (never past a value the
  caller has fsynced; the CommitLog's flushes are serialised by its flush lock) and
  only shrinks through :meth:`DurableOffset.lower` (a truncation).
- :meth:`DurableOffset.fail` is final: nothing is published afterwards, every waiter
  and callback is released at once, and they tell failure from success by
  :attr:`DurableOffset.failure`.
"""

from __future__ import annotations

import heapq
import threading
import time
from typing import Callable


class DurableOffset:
    """The durable offset, its waiters, and the "please flush" signal."""

    def __init__(self, start: int = 0) -> None:
        self.value = start
        self.flush_requested = threading.Event()
        self._cond = threading.Condition()
        self._callbacks: list[tuple[int, int, Callable[[], None]]] = []
        self._seq = 0
        self.failure: BaseException | None = None  # set once by fail(); final

    def publish(self, target: int) -> None:
        """Everything below ``target`` is fsynced: wake and call whoever waits for it."""
        ready: list[Callable[[], None]] = []
        with self._cond:
            if self.failure is not None:
                return
            if target > self.value:
                self.value = target
            while self._callbacks and self._callbacks[0][0] <= self.value:
                ready.append(heapq.heappop(self._callbacks)[2])
            self._cond.notify_all()
        for fn in ready:
            fn()

    def fail(self, error: BaseException) -> None:
        """Durability is lost for good: release every waiter and callback now (they
        read :attr:`failure`); the first error is kept."""
        with self._cond:
            if self.failure is None:
                self.failure = error
            ready = [cb for _off, _seq, cb in self._callbacks]
            self._callbacks.clear()
            self._cond.notify_all()
        for fn in ready:
            fn()

    def lower(self, offset: int) -> None:
        """After a truncation: nothing past ``offset`` exists, let alone durably."""
        with self._cond:
            self.value = min(self.value, offset)

    def wait(self, offset: int, timeout_s: float) -> bool:
        """Block until ``offset`` is durable; False on timeout or failure (see :attr:`failure`)."""
        if self.value >= offset:
            return True
        self.flush_requested.set()
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self.value < offset:
                if self.failure is not None:
                    return False
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def on_durable(self, offset: int, callback: Callable[[], None]) -> None:
        """Call ``callback`` (from the flushing thread) once ``offset`` is durable, or at
        once when durability failed (the callback checks :attr:`failure`)."""
        with self._cond:
            if self.value < offset and self.failure is None:
                self._seq += 1
                heapq.heappush(self._callbacks, (offset, self._seq, callback))
                self.flush_requested.set()
                return
        callback()

    def run_flusher(
        self, flush: Callable[[], object], pending: Callable[[], bool], stop: threading.Event, interval_s: float
    ) -> None:
        """The flush loop: flush when asked (group commit) or every ``interval_s``, until
        ``stop`` is set; then a last flush. An exception from ``flush`` (a
        :class:`StoreFailedError` after an fsync error) ends the loop: it propagates to
        the thread's runner, which puts the store into its failed state."""
        while not stop.is_set():
            self.flush_requested.wait(interval_s)
            self.flush_requested.clear()
            if pending():
                flush()
        flush()

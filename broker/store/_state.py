"""The state both storage modes share, in one place (as ``LogState`` is the log's).

Every part of a store (:class:`~._lifecycle.Lifecycle`, :class:`~._puts.PutPath`, and
each mode's own parts) holds the same :class:`StoreState` instead of a reference to the
store, so a part can be read without the store around it.

Who writes what, and who reads it without a lock:

- ``topics``: set once by :meth:`Lifecycle.begin_open` (the table has its own lock).
- ``durable``: the durable offset and its waiters. The partition mode publishes to the
  one made here; the CommitLog mode replaces it, at open and before any put, by its
  log's (:attr:`CommitLog.durability`), which the log's flusher publishes to.
- ``failed``: set once, under ``fail_lock``, by :meth:`fail`; final until reopened. Read
  without the lock (one attribute load), through :attr:`failure`.
- ``failure_listeners``: replaced whole when one is added (copy on write), so
  :meth:`fail` iterates a list nobody changes.
- ``closed``: set by ``close``/``abandon``; puts read it without a lock.
- ``stop``: set when the background threads are to stop.
- ``checkpoint_lock``: one checkpoint at a time (the housekeeping thread and callers:
  open, close, tests), or two could race on the temporary file and the older one could
  land last.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from clmq.commitlog import DurableOffset
from clmq.common import StoreFailedError

from ._config import StoreConfig
from ._topics import TopicTable

log = logging.getLogger("clmq.store")


class StoreState:
    """The shared state of one store (see the module docstring for the rules)."""

    __slots__ = (
        "checkpoint_lock",
        "closed",
        "config",
        "directory",
        "durable",
        "fail_lock",
        "failed",
        "failure_listeners",
        "stop",
        "topics",
    )

    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self.directory = config.data_dir
        self.topics: TopicTable  # set by Lifecycle.begin_open
        self.durable = DurableOffset()
        self.stop = threading.Event()
        self.closed = False
        self.checkpoint_lock = threading.Lock()
        self.fail_lock = threading.Lock()
        self.failed: StoreFailedError | None = None
        self.failure_listeners: list[Callable[[StoreFailedError], None]] = []

    @property
    def failure(self) -> StoreFailedError | None:
        """Why the store failed (None: it has not). Final until reopened. Includes a
        failure of the log's durability: the flushing thread records it (releasing sync
        waiters) before the exception reaches the thread's guard and :meth:`fail`, and a
        waiter released then must see a failed store, not a flush timeout."""
        failure = self.failed
        if failure is None:
            lost = self.durable.failure
            if lost is not None:
                return lost if isinstance(lost, StoreFailedError) else StoreFailedError("durability", lost)
        return failure

    def fail(self, where: str, error: BaseException) -> None:
        """Put the store into the failed state: pending and later puts fail at once with
        STORE_FAILED, :attr:`failure` says why. The first failure is kept."""
        with self.fail_lock:  # two threads failing at once: one failure, listeners told once
            first = self.failed is None
            if first:
                # The log's own StoreFailedError already says where: not wrapped twice.
                self.failed = error if isinstance(error, StoreFailedError) else StoreFailedError(where, error)
        failure = self.failure
        assert failure is not None
        if first:
            log.error("%s", failure, exc_info=error)
        self.durable.fail(failure)
        if first:
            for fn in self.failure_listeners:
                fn(failure)

    def add_failure_listener(self, fn: Callable[[StoreFailedError], None]) -> None:
        """Call ``fn(failure)`` once, from the failing thread, when the store fails; at
        once if it already has."""
        self.failure_listeners = [*self.failure_listeners, fn]
        failure = self.failure
        if failure is not None:
            fn(failure)

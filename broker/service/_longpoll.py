"""Long polling: pulls that found nothing wait here until the dispatcher reports new
entries for their queue, or their wait runs out. Woken by the dispatcher (a thread),
not by polling."""

from __future__ import annotations

from typing import Collection

import trio

QueueKey = tuple[str, int]


class PullWaiters:
    def __init__(self, token: trio.lowlevel.TrioToken) -> None:
        self._token = token
        self._waiters: dict[QueueKey, list[trio.Event]] = {}

    def on_arrivals(self, keys: Collection[QueueKey]) -> None:
        """Dispatcher-thread callback: cheap when nobody waits (the usual case under load)."""
        if self._waiters:
            try:
                self._token.run_sync_soon(self._wake, keys)
            except trio.RunFinishedError:
                pass

    def _wake(self, keys: Collection[QueueKey]) -> None:
        # The shorter side is walked: 65,536 queues watched and a few arrivals (or the
        # other way round) cost a few look-ups, not a walk over every watched queue.
        waiters = self._waiters
        if len(keys) < len(waiters):
            hit = [k for k in set(keys) if k in waiters]
        else:
            hit = [k for k in waiters if k in keys]
        for key in hit:
            for event in waiters.pop(key):
                event.set()

    def register(self, key: QueueKey) -> trio.Event:
        """An event set when ``key`` gets entries; register before re-checking, so that
        an arrival between the check and the wait is not missed."""
        event = trio.Event()
        self.add(key, event)
        return event

    def add(self, key: QueueKey, event: trio.Event) -> None:
        """Set ``event`` when ``key`` gets entries (one event may watch many queues)."""
        self._waiters.setdefault(key, []).append(event)

    def unregister(self, key: QueueKey, event: trio.Event) -> None:
        events = self._waiters.get(key)
        if events and event in events:
            events.remove(event)
            if not events:
                del self._waiters[key]

    @property
    def waiting(self) -> int:
        return sum(len(v) for v in self._waiters.values())

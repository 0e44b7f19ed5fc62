"""A store's lifecycle, whatever its mode: the data directory's lock and abort marker
around an open, and the background threads, each guarded so that its death is the
store's failure (:meth:`StoreState.fail`), never a silence."""

from __future__ import annotations

import fcntl
import os
import threading
from typing import Callable

from ._checkpoint import AbortMarker
from ._config import StoreLockedError
from ._state import StoreState
from ._topics import TopicTable


class Lifecycle:
    """Opens and closes a store's directory and runs its background threads."""

    def __init__(self, state: StoreState) -> None:
        self._state = state
        self._threads: list[threading.Thread] = []
        self._lock_fd = -1
        self._abort = AbortMarker(state.directory)

    def begin_open(self) -> bool:
        """Lock the directory and mark it open; returns True after an unclean stop."""
        directory = self._state.directory
        directory.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(directory / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise StoreLockedError(f"data directory {directory} is in use by another process") from None
        unclean = self._abort.was_unclean()
        self._abort.create()  # before loading: a crash while loading is an unclean stop too
        self._state.topics = TopicTable(directory / "topics.json")
        return unclean

    def start_threads(self, targets: list[tuple[str, Callable[[], None]]]) -> None:
        """Start a daemon thread per ``(name, loop)``, each under :meth:`_guarded`."""
        for name, target in targets:
            thread = threading.Thread(target=self._guarded, args=(name, target), name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def _guarded(self, name: str, target: Callable[[], None]) -> None:
        """Run a background thread's loop; its death is the store's failure, never a silence."""
        try:
            target()
        except BaseException as e:
            self._state.fail(name, e)

    def stop_threads(self, wake: Callable[[], None]) -> None:
        """Set ``stop``, ``wake`` the threads (each mode knows its own) and join them."""
        self._state.stop.set()
        wake()
        for thread in self._threads:
            thread.join()
        self._threads = []

    def end_close(self, clean: bool) -> None:
        """Release the directory; only a ``clean`` close removes the abort marker."""
        if clean:
            self._abort.remove()
        os.close(self._lock_fd)

"""The timer's checkpoint as the running timer keeps it: the one on disk, the newest
that may be saved next, saving it (after a flush), and a follower adopting its
leader's. What a checkpoint says and why: ``_state``."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import trio

from clmq.broker.store import Store

from ._state import TimerCheckpoint, load_checkpoint, save_checkpoint

log = logging.getLogger("clmq.timer")


class Checkpoints:
    """``saved``: the last checkpoint on disk (a follower's: its leader's, adopted);
    ``snapshot``: the newest state that may be saved next."""

    def __init__(self, store: Store | None, interval_s: float, on_saved: Callable[[], None]) -> None:
        self.store = store
        self.saved = load_checkpoint(store) if store is not None else TimerCheckpoint()
        self.snapshot = self.saved
        self.interval_s = interval_s  # timer_checkpoint_interval_ms
        self.on_saved = on_saved  # followers copy the new checkpoint (the metadata changed)
        self._last_save = 0.0

    def restart(self, cp: TimerCheckpoint) -> None:
        """The timer starts from ``cp`` (just loaded)."""
        self.snapshot = self.saved = cp

    async def save_when_due(self) -> None:
        """Save the snapshot if ``interval_s`` passed since the last save."""
        if time.monotonic() - self._last_save >= self.interval_s:
            await self._save()

    async def _save(self) -> None:
        store = self.store
        assert store is not None
        cp = self.snapshot
        if cp == self.saved:
            self._last_save = time.monotonic()
            return
        await trio.to_thread.run_sync(store.flush)  # nothing the checkpoint claims may be lost
        await trio.to_thread.run_sync(save_checkpoint, store, cp)
        self.saved = cp
        self._last_save = time.monotonic()
        self.on_saved()

    def adopt(self, value: dict[str, Any]) -> None:
        """A follower takes its leader's checkpoint (in a worker thread), once its own
        log holds everything the checkpoint counts as delivered (``mark_offset``):
        promoted, it then neither loses nor repeats a delivery."""
        store = self.store
        assert store is not None
        try:
            cp = TimerCheckpoint.from_json(value)
        except (KeyError, TypeError, ValueError) as e:
            log.warning("timer: the leader's checkpoint is unusable (%s); keeping ours", e)
            return
        if cp.mark_offset <= store.log.write_offset and cp != self.saved:
            try:
                save_checkpoint(store, cp)
            except OSError as e:  # replication goes on; the checkpoint is adopted next time
                log.warning("timer: cannot save the leader's checkpoint: %s", e)
                return
            self.saved = cp

    def after_truncation(self) -> None:
        """A follower's log was cut to its leader's: a checkpoint that counts deliveries
        past the new end is dropped (a start then reads the log for them)."""
        store = self.store
        assert store is not None
        if (
            load_checkpoint(store).mark_offset <= store.log.write_offset
        ):  # the file: after a restart, it is all there is
            return
        self.saved = TimerCheckpoint(-1, store.log.min_offset, 0, 0)
        try:
            save_checkpoint(store, self.saved)
        except OSError as e:
            log.warning("timer: cannot reset the checkpoint after a truncation: %s", e)

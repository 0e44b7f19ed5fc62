"""The broker's timer: scheduled messages (delayed sends, retries) delivered once each,
at their time, into their real queues. See ``_state`` for what is durable and
why a crash or a fail-over delivers nothing twice, and ``_wheel`` for the wheel.

One task, on the leader only (a follower's log gets the deliveries by replication):
every ``timer_tick_ms`` it reads the ``%TIMER%`` entries written since its last look
into the wheel (or, due this second or earlier, straight into the due heap: by due
time, ``_due``), moves the wheel's second into the heap when it begins, and delivers
what is due from the heap in batches through the append lane. Every batch starts
with a snapshot of how far delivery is done (``done_ms``, the log's end): the next
checkpoint saves the latest, after a flush (``_checkpoints``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import trio

from clmq.broker.store import Store
from clmq.common import TIMER_TOPIC, StoreError
from clmq.protocol.transport import RequestError

from .._context import BrokerContext
from ._checkpoints import Checkpoints
from ._delivery import Delivery, Due, TimerStats
from ._due import DueHeap
from ._state import (
    SCHEDULED_QUEUE,
    Rebuilt,
    TimerCheckpoint,
    first_record_from,
    load_checkpoint,
    pending_mask,
    read_cancels,
    read_entries,
    rebuild,
)

log = logging.getLogger("clmq.timer")

FAILURE_RETRY_S = 1.0  # after a disk or store error, the timer starts again this much later
WINDOW_MARGIN_S = 3600  # the wheel spans timer_max_delay_ms and this much more


def wall_ms() -> int:
    return int(time.time() * 1000)


class Timer:
    """Use :meth:`tick_loop` as a task of the broker's nursery."""

    def __init__(self, ctx: BrokerContext) -> None:
        self.ctx = ctx
        self.config = ctx.config
        self.store: Store | None = ctx.store if isinstance(ctx.store, Store) else None
        self.state: Rebuilt | None = None
        self.due = DueHeap()  # due now or this second, and the batch being appended
        self.checkpoints = Checkpoints(self.store, self.config.timer_checkpoint_interval_ms / 1000, ctx.metadata.bump)
        self.stats = TimerStats()
        self.failure = ""  # the last error that stopped the timer ("" while it works)
        # The latest due time of what was handled: a snapshot may say "done up to T" only
        # for T at or past it (a batch can split equal due times; a late entry can come
        # due before what was already delivered).
        self._max_due = -1  # the latest due time handled (a cancel of one due before it is too late)
        # Batches appended whose latest due time is past the last snapshot's done_ms:
        # (log end before the batch, its latest due). A snapshot's mark stays at or
        # below the first of them, so that a start finds their deliveries in the log.
        self._batches: list[tuple[int, int]] = []
        self._start_mark = 0  # the loaded checkpoint's mark, while deliveries found after it are pending
        self.window_s = self.config.timer_max_delay_ms // 1000 + WINDOW_MARGIN_S
        if self.store is not None:
            self.delivery = Delivery(ctx, self.store, self.stats)
            self.store.log.hold_retention(self.retention_floor)

    @property
    def pending(self) -> int:
        """Scheduled messages not yet delivered (-1: this broker's timer is not running)."""
        if self.state is None:
            return -1
        return self.state.wheel.pending + len(self.state.wheel.overflow) + len(self.due)

    def memory_bytes(self) -> int:
        """What the timer holds in memory: the wheel, the current second, the sets."""
        if self.state is None:
            return 0
        s = self.state
        return s.wheel.memory_bytes() + 80 * len(self.due) + 64 * (len(s.cancelled) + len(s.delivered))

    @property
    def saved(self) -> TimerCheckpoint:
        """The last checkpoint on disk (a follower's: its leader's, adopted)."""
        return self.checkpoints.saved

    def retention_floor(self) -> int | None:
        """The commit-log offset retention must keep (called by the store's housekeeping
        thread): the oldest scheduled message not yet delivered, to within a page of
        the wheel's links; from the last checkpoint's ``pending_from`` while the timer is
        not running (on a follower: its leader's checkpoint).
        A scheduled message is never lost to retention, however far ahead it is due."""
        store = self.store
        if store is None or not store.queue_exists(TIMER_TOPIC, SCHEDULED_QUEUE):
            return None
        with self.due.lock:
            state = self.state
            # Not running (a follower, a leader starting or failed): what the last
            # checkpoint (a follower's: its leader's) says may be pending.
            q = self.saved.pending_from if state is None else _lowest_pending(state, self.due.held_low())
        return first_record_from(store, q)

    def is_cancelled(self, commitlog_offset: int) -> bool:
        return self.state is not None and commitlog_offset in self.state.cancelled

    async def tick_loop(self) -> None:
        if self.store is None:
            return  # partition-per-file mode: SEND_MESSAGE to %TIMER% is refused there
        while True:
            await trio.sleep(self.config.timer_tick_ms / 1000)
            try:
                self.ctx.replica.check_writable()
            except RequestError:
                self._stand_down()
                continue
            if self.state is None and self.ctx.store.dispatch_lag_bytes > 0:
                continue  # the %TIMER% queue must show the whole log before the wheel is built from it
            try:
                if self.state is None:
                    await self._start()
                await self._tick()
                self.failure = ""
            except (OSError, StoreError) as e:
                await self._failed(e)

    async def _failed(self, error: BaseException) -> None:
        """A disk or store error: said (log, BROKER_INFO's ``timer_failure``), and tried
        again after ``FAILURE_RETRY_S`` from the last checkpoint: the rebuild finds what
        was delivered since in the log, so nothing is delivered twice."""
        text = f"{type(error).__name__}: {error}"
        if text != self.failure:
            log.error("timer: %s; retrying every %.0f s from the last checkpoint", text, FAILURE_RETRY_S)
        self.failure = text
        self.state = None
        self.due.clear()
        await trio.sleep(FAILURE_RETRY_S)

    def _stand_down(self) -> None:
        if self.state is not None:
            log.info("timer: not the leader: delivery stops (the new leader's timer goes on)")
        self.state = None
        self.due.clear()

    async def _start(self) -> None:
        store = self.store
        assert store is not None
        cp = await trio.to_thread.run_sync(load_checkpoint, store)
        self.state = await trio.to_thread.run_sync(rebuild, store, cp, self.window_s, wall_ms() // 1000)
        self.due.clear()
        self.due.inflight = []
        self.checkpoints.restart(cp)
        self._max_due, self._batches, self._start_mark = cp.done_ms, [], cp.mark_offset

    async def _tick(self) -> None:
        while True:  # new entries and cancels are read before every batch: a backlog never hides them
            await trio.to_thread.run_sync(self._enqueue)
            batch = await trio.to_thread.run_sync(self._due, wall_ms())
            delivered = bool(batch) and await self._deliver(batch)
            await self.checkpoints.save_when_due()
            if not delivered:
                break

    # ------------------------------------------------------------- enqueue
    def _enqueue(self) -> None:
        """Read the entries written since the last look (in a thread)."""
        state, store = self.state, self.store
        assert state is not None and store is not None
        wheel = state.wheel
        while True:
            first, entries = read_entries(store, SCHEDULED_QUEUE, state.enqueued)
            if not len(entries):
                break
            offsets_all = np.arange(first, first + len(entries))
            # Entries the checkpoint counts as delivered (read here when the queue lagged
            # the log at the start: a promotion before dispatch caught up) are not again.
            keep = pending_mask(entries, offsets_all, state.skip_below, state.skip_done_ms)
            offsets, kept = offsets_all[keep], entries[keep]
            seconds = (kept["tag"] // 1000).astype(np.int64)
            late = seconds < wheel.next_second  # due in the second being delivered, or before: into the heap
            for q, off, size, due in zip(
                offsets[late].tolist(),
                kept["offset"][late].tolist(),
                kept["size"][late].tolist(),
                kept["tag"][late].tolist(),
            ):
                self.due.push((due, q, off, size))
            wheel.add_many(offsets[~late], seconds[~late])
            state.enqueued = first + len(entries)
        cancelled, state.cancels_read = read_cancels(store, state.cancels_read, self.checkpoints.snapshot.done_ms)
        state.cancelled |= cancelled

    # ------------------------------------------------------------- due
    def _due(self, now: int) -> list[Due]:
        """Up to ``timer_deliver_batch_messages`` messages due at ``now``, in due order
        (in a thread); first a snapshot of how far delivery is done."""
        state = self.state
        assert state is not None
        self._fill(now)
        head = self.due.head_ms()
        done = (head if head is not None else state.wheel.next_second * 1000) - 1
        if done > self.checkpoints.snapshot.done_ms:
            assert self.store is not None
            # Every delivery of a message due after ``done`` must lie past the mark: the
            # batches that delivered one, and (while any is pending) what the start found
            # delivered after the loaded checkpoint's mark.
            self._batches = [b for b in self._batches if b[1] > done]
            marks = [start for start, _ in self._batches] + ([self._start_mark] if state.delivered else [])
            mark = min([self.store.log.write_offset, *marks])
            pending_from = _lowest_pending(state, self.due.low)
            self.checkpoints.snapshot = TimerCheckpoint(done, mark, state.enqueued, pending_from)
        return self.due.take(now, self.config.timer_deliver_batch_messages)

    def _fill(self, now: int) -> None:
        """Move the wheel's seconds that have begun into the due heap."""
        state, store = self.state, self.store
        assert state is not None and store is not None
        wheel, now_s = state.wheel, now // 1000
        while wheel.next_second <= now_s:
            with self.due.lock:
                wheel.skip_empty(now_s)
                offsets = wheel.take()
                for due in _entries_at(store, offsets):
                    self.due.push(due)

    # ------------------------------------------------------------- deliver
    async def _deliver(self, batch: list[Due]) -> bool:
        """Append the batch's messages to their real queues; False (and the batch back in
        the due heap) if the store refused: tried again next tick."""
        state = self.state
        assert state is not None
        todo = [d for d in batch if d[2] not in state.delivered and d[2] not in state.cancelled]
        assert self.store is not None
        start = self.store.log.write_offset  # the batch's deliveries lie past it
        # (``due.inflight`` is the batch until it is stored or back in the heap; after an
        # error the timer stops, and its floor comes from the checkpoint.)
        messages = await trio.to_thread.run_sync(self.delivery.messages, todo)
        dropped = self.stats.undeliverable
        problem = await self.delivery.append(messages) if messages else None
        dropped = self.stats.undeliverable - dropped  # refused by the store as they are
        if problem is not None:
            log.warning("timer: delivery of %d messages waits (%s); retrying", len(messages), problem)
            self.due.put_back(batch)
            return False
        self.due.inflight = []
        self._max_due = max(self._max_due, batch[-1][0])
        if messages:
            self._batches.append((start, batch[-1][0]))
        self.stats.cancelled += sum(1 for d in batch if d[2] in state.cancelled)
        self.stats.delivered += len(messages) - dropped
        for d in batch:
            state.delivered.discard(d[2])
            state.cancelled.discard(d[2])
        return True

    # ------------------------------------------------------------- checkpoint
    def checkpoint_json(self) -> dict[str, Any] | None:
        """The last checkpoint saved (a leader's followers adopt it)."""
        return self.saved.to_json() if self.state is not None else None

    def adopt_checkpoint(self, value: dict[str, Any]) -> None:
        """A follower takes its leader's checkpoint (see :meth:`Checkpoints.adopt`)."""
        if self.store is not None and self.state is None:
            self.checkpoints.adopt(value)

    def after_truncation(self) -> None:
        """A follower's log was cut (see :meth:`Checkpoints.after_truncation`)."""
        if self.store is not None and self.state is None:
            self.checkpoints.after_truncation()

    @property
    def running(self) -> bool:
        return self.state is not None

    def handled_ms(self) -> int:
        """A due time up to which the timer may have delivered something: a cancel of a
        message due at or before it (plus a margin) is too late."""
        state = self.state
        if state is None:
            return max(self.checkpoints.snapshot.done_ms, self._max_due)
        return max(self._max_due, min([state.wheel.next_second * 1000, *self.due.heads_ms()]) - 1)

    def was_delivered(self, commitlog_offset: int) -> bool:
        return self.state is not None and commitlog_offset in self.state.delivered


def _lowest_pending(state: Rebuilt, current_low: int | None) -> int:
    """A queue-0 offset at or below every message not yet delivered: in the wheel, in
    the due heap (this second's: at or above ``current_low``), or not read yet."""
    lows = [state.enqueued, current_low, state.wheel.lowest_pending()]
    return min(low for low in lows if low is not None)


def _entries_at(store: Store, offsets: list[int]) -> list[Due]:
    """The entries of queue 0 at ``offsets`` (ascending runs read together)."""
    out: list[Due] = []
    i = 0
    offsets = sorted(offsets)
    while i < len(offsets):
        j = i + 1
        while j < len(offsets) and offsets[j] - offsets[i] < 4096:
            j += 1
        first, entries = read_entries(store, SCHEDULED_QUEUE, offsets[i], offsets[j - 1] - offsets[i] + 1)
        for q in offsets[i:j]:
            off, size, due = entries[q - first].tolist() if 0 <= q - first < len(entries) else (0, 0, 0)
            if size:
                out.append((due, q, off, size))
        i = j
    return out

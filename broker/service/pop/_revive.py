"""The leader's POP task (:meth:`PopKeeper.revive_loop`): every
``pop_revive_interval_ms`` it starts the state if need be (the checkpoint, then
``%POP%`` replayed), wakes the long polls of groups with deliveries visible again,
dead-letters the deliveries past their limit, and saves the checkpoint every
``pop_checkpoint_interval_ms`` after a log flush. A follower stands down and copies
its leader's checkpoint (``checkpoint_json``, ``adopt_checkpoint``)."""

from __future__ import annotations

import logging
import time
from typing import Any

import trio

from clmq.broker.store import Store
from clmq.common import Record, StoreError, dlq_topic
from clmq.protocol.transport import RequestError

from .._sendback import dead_letter
from .._system_put import ensure_topic
from ._base import Judged, PopBase
from ._inflight import PopState
from ._reads import entry_of
from ._records import Handle, parse_handle
from ._state import PopCheckpoint, load_checkpoint, log_offset_at, replay, save_checkpoint

log = logging.getLogger("clmq.pop")

FAILURE_RETRY_S = 1.0  # after a disk or store error, the state is rebuilt this much later
CHECKPOINT_DISPATCH_WAIT_S = 1.0  # a checkpoint waits this long for the queues to show the log, else waits a round
DISPATCH_POLL_S = 0.002  # how often a start looks whether the queues show the whole log
START_WAIT_S = 30.0  # a start waits this long for the writes in flight and the dispatcher, else reports and retries


class StartStalled(StoreError):
    """A start could not see the whole log in time (reported in ``pop_failure``)."""


class PopKeeper(PopBase):
    """The task, the start and stand-down, the checkpoint."""

    _last_save = 0.0
    save_failure = ""  # why the last checkpoint could not be saved ("": it was)

    async def revive_loop(self) -> None:
        """The task (module docstring); runs for the broker's lifetime."""
        if self.store is None:
            return  # partition-per-file mode: POP is refused there
        while True:
            await trio.sleep(self.config.pop_revive_interval_ms / 1000)
            try:
                self.ctx.replica.check_writable()
            except RequestError:
                self.stand_down()
                continue
            try:
                if self.state is None:
                    await self.start()
                self.revive()
                await self.dead_letter_due()
                self.failure = ""
            except (OSError, StoreError) as e:
                await self._failed(e)
                continue
            await self._save_reporting()

    async def _save_reporting(self) -> None:
        """:meth:`save_when_due`; a failure is reported (logged once, BROKER_INFO, the
        metric) and the state runs on: every change is in ``%POP%`` already, a start
        replays more of it, retention keeps more of the log."""
        try:
            await self.save_when_due()
        except (OSError, StoreError) as e:
            text = f"checkpoint not saved: {type(e).__name__}: {e}"
            if text != self.save_failure:
                log.error("pop: %s; retried every pop_checkpoint_interval_ms", text)
            self.save_failure = text
            return
        self.save_failure = ""

    async def _failed(self, error: BaseException) -> None:
        text = f"{type(error).__name__}: {error}"
        if text != self.failure:
            log.error("pop: %s; rebuilding every %.0f s from the last checkpoint", text, FAILURE_RETRY_S)
        self.failure, self.state = text, None
        self.dead.clear()  # (noted against the state given up: the rebuilt one notes its own)
        self.wake_all()
        await trio.sleep(FAILURE_RETRY_S)

    def stand_down(self) -> None:
        """Not the leader (any more): the state goes (the new leader rebuilds it)."""
        if self.state is not None:
            log.info("pop: not the leader: the in-flight state stops here")
        self.state = None
        self.dead.clear()
        self.wake_all()

    async def start(self) -> None:
        """Build the state: the checkpoint, then ``%POP%`` from its ``applied_to``."""
        store = self.store
        assert store is not None
        with trio.move_on_after(START_WAIT_S) as waited:
            while self.writes:  # a given-up state's writes land first (answered ok: the rebuild must see them)
                self.drained = trio.Event()
                await self.drained.wait()
            await _dispatched_to(store, store.log.write_offset)  # the queues show the whole log
        if waited.cancelled_caught:
            raise StartStalled(
                f"{len(self.writes)} %POP% writes in flight or the dispatcher behind the log after {START_WAIT_S} s"
            )
        cp = await trio.to_thread.run_sync(load_checkpoint, store)
        state, _end = await trio.to_thread.run_sync(replay, store, cp)
        state.drop_topics(lambda t: store.topics.queue_count(t) is None)  # (deleted since: its records stay)
        for g in state.groups.values():
            g.last_pop_ms = self.now()
        self.saved, self._last_save = cp, 0.0
        self.state = state

    def revive(self) -> None:
        """Wake the groups with deliveries visible again; note those past their limit."""
        state = self.state
        assert state is not None
        now = self.now()
        quiet = now - self.config.pop_member_timeout_ms
        for name, g in state.groups.items():
            if any(t < quiet for t in g.members.values()):  # members that stopped popping: forgotten
                g.members = {c: t for c, t in g.members.items() if t >= quiet}
            woken = False
            for (topic, qid), q in g.queues.items():
                if q.visible(now):
                    _take, dead = q.due(now, 0)
                    self.dead += [(name, topic, qid, off) for off in dead]
                    woken = woken or q.visible(now)
            if woken:
                self.wake(name)

    async def dead_letter_due(self) -> None:
        """Copy the deliveries past their limit to their group's ``%DLQ%`` and settle them."""
        dead, self.dead = self.dead, []
        by_group: dict[str, list[str]] = {}
        state = self.state
        assert state is not None
        now = self.now()
        for group, topic, qid, off in dead:
            g = state.groups.get(group)  # (an entry noted against an older state: judged again, no group made)
            q = g.queues.get((topic, qid)) if g is not None else None
            f = q.flights.get(off) if q is not None else None
            if f is not None and not f.settling and f.attempt > f.max_reconsume_times and f.deadline_ms <= now:
                h = Handle(self.config.broker_name, topic, qid, off, f.ck, f.deadline_ms + 1)
                by_group.setdefault(group, []).append(h.encode())
        for group, handles in by_group.items():
            try:
                await self.dead_letter(group, handles, due=True)
            except RequestError as e:
                log.warning("pop: dead letters of group %s wait: %s", group, e.text)
                self.dead += [(group, *_where(h)) for h in handles]

    async def dead_letter(self, group: str, handles: list[str], due: bool = False) -> list[str]:
        """Copy these deliveries to ``%DLQ%group`` and settle them (REJECT; ``due``:
        deliveries past their limit, whose deadline passed)."""
        now = self.now()
        judged = self.judge(group, handles, now if not due else 0, count=not due)
        if not judged.ok:
            return judged.results
        store = self.store
        assert store is not None
        try:
            records = await trio.to_thread.run_sync(_records_of, store, judged)
            await ensure_topic(self.ctx, dlq_topic(group), 1)
        except BaseException:
            self.restore(judged.ok)
            raise
        letters = [dead_letter(self.ctx, group, r, f.attempt) for r, (_i, _q, _h, f) in zip(records, judged.ok) if r]
        await self.settle(group, judged, letters)
        g = self.group_state(group)
        if g is not None:
            g.stats.dead_lettered += len(judged.ok)
        return judged.results

    async def save_when_due(self) -> None:
        """Save the checkpoint every ``pop_checkpoint_interval_ms``: the state as it is
        and ``applied_to`` low enough (``_state``), after a log flush."""
        if time.monotonic() - self._last_save < self.config.pop_checkpoint_interval_ms / 1000 and not self.save_soon:
            return
        store, state = self.store, self.state
        assert store is not None and state is not None
        if self.forget_idle(state):  # its committed offsets on disk first, then a checkpoint without it
            await trio.to_thread.run_sync(self.ctx.offsets.flush)
            self.save_soon = True
        applied_to = min(self.writes.values(), default=self.pop_end())
        if applied_to == self.saved.applied_to and not self.writes and not self.save_soon:
            return  # nothing recorded since
        self.save_soon = False
        snapshot, write_offset = state.to_json(), store.log.write_offset
        self._last_save = time.monotonic()
        await trio.to_thread.run_sync(store.flush)  # nothing the checkpoint claims may be lost
        with trio.move_on_after(CHECKPOINT_DISPATCH_WAIT_S) as waited:  # the record at applied_to is in the queue
            await _dispatched_to(store, write_offset)
        if waited.cancelled_caught:
            self.save_soon = True
            return  # (replication holds the dispatcher back): the next round saves it
        log_from = await trio.to_thread.run_sync(log_offset_at, store, applied_to, write_offset)
        cp = PopCheckpoint(applied_to, log_from, snapshot)
        await trio.to_thread.run_sync(save_checkpoint, store, cp)
        self.saved = cp
        self.ctx.metadata.bump()  # followers copy it

    def forget_idle(self, state: PopState) -> bool:
        """Forget the groups with nothing in flight that have not popped for
        ``pop_group_idle_forget_ms``, their settled offsets first committed as their
        ordinary committed offsets (never lowered): a later pop, or a queue-based consumer
        of the group, goes on from there. Whether a group was forgotten."""
        offsets, idle_from = self.ctx.offsets, self.now() - self.config.pop_group_idle_forget_ms
        forget = [
            name
            for name, g in state.groups.items()
            if g.last_pop_ms < idle_from and not g.inflight() and name not in self.waiters
        ]
        for name in forget:
            for (topic, qid), q in state.groups[name].queues.items():
                if q.settled_offset() > offsets.query(name, topic, qid):
                    offsets.commit(name, topic, qid, q.settled_offset())
            del state.groups[name]
            log.info("pop: group %s forgotten (idle, nothing in flight; its offsets are committed)", name)
        return bool(forget)

    def checkpoint_json(self) -> dict[str, Any] | None:
        """The last checkpoint saved (a leader's followers adopt it)."""
        return self.saved.to_json() if self.state is not None else None

    def adopt_checkpoint(self, value: dict[str, Any]) -> None:
        """A follower takes its leader's checkpoint (in a worker thread) once its own
        log holds the records it stands on."""
        store = self.store
        if store is None or self.state is not None:
            return
        try:
            cp = PopCheckpoint.from_json(value)
        except (KeyError, TypeError, ValueError) as e:
            log.warning("pop: the leader's checkpoint is unusable (%s); keeping ours", e)
            return
        if cp.log_from <= store.log.write_offset and cp != self.saved:
            try:
                save_checkpoint(store, cp)
            except OSError as e:
                log.warning("pop: cannot save the leader's checkpoint: %s", e)
                return
            self.saved = cp

    def after_truncation(self) -> None:
        """A follower's log was cut: a checkpoint standing on records past the new end is
        replaced by one that replays ``%POP%`` whole at the next start."""
        store = self.store
        if store is None or self.state is not None or self.saved.log_from <= store.log.write_offset:
            return
        self.saved = PopCheckpoint(0, store.log.min_offset)
        try:
            save_checkpoint(store, self.saved)
        except OSError as e:
            log.warning("pop: cannot reset the checkpoint after a truncation: %s", e)


async def _dispatched_to(store: Store, offset: int) -> None:
    """Return once the dispatcher has put every record below ``offset`` in its queue."""
    interval = DISPATCH_POLL_S
    while store.dispatcher.dispatched_offset < offset:
        await trio.sleep(interval)
        interval = min(2 * interval, 0.05)


def _where(text: str) -> tuple[str, int, int]:
    h = parse_handle(text)
    assert h is not None
    return h.topic, h.queue_id, h.offset


def _records_of(store: Store, judged: Judged) -> list[Record | None]:
    """The records of the judged deliveries (None: gone by retention)."""
    out = []
    for _i, _q, h, _f in judged.ok:
        at = entry_of(store, h.topic, h.queue_id, h.offset)
        out.append(None if at is None else store.log.read_record(at[0], at[1]))
    return out

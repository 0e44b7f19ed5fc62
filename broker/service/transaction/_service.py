"""The broker's transactions: the pending half messages of this leader, the checker,
the checkpoint and what followers copy of it. See ``_state`` for what is durable and
why a crash or a fail-over commits nothing twice and loses nothing.

One task (:meth:`Transactions.check_loop`), on the leader only: every
``transaction_check_interval_ms`` it reads the half messages stored since its last
look, wakes the producers of each group polling CHECK_TRANSACTIONS that has a half
older than ``transaction_timeout_ms`` not asked about within it (a group with no
producer polling: the look counts as a check, ``_polls``), ends (rollback) or
keeps those asked ``transaction_check_max`` times (``transaction_unresolved``), and
saves the checkpoint every ``transaction_checkpoint_interval_ms`` after a log flush.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import trio

from clmq.broker.store import Store
from clmq.common import TRANS_HALF_TOPIC, TRANS_OP_COMMIT, TRANS_OP_ROLLBACK, StoreError
from clmq.protocol import ErrorCode
from clmq.protocol.transport import RequestError

from .._context import BrokerContext
from ._ending import op_record, store_together
from ._pending import COMMITTED, ROLLED_BACK, Ended, Half, PendingSet
from ._polls import Polls, count_unasked, log_unresolved, wall_ms
from ._state import (
    HALF_QUEUE,
    OpMarks,
    TransactionCheckpoint,
    half_from_record,
    load_checkpoint,
    op_ends,
    read_entries,
    real,
    rebuild,
    save_checkpoint,
)
from ._traces import read_half, trace_end

log = logging.getLogger("clmq.transactions")

FAILURE_RETRY_S = 1.0  # after a disk or store error, the service starts again this much later


class Transactions:
    """Use :meth:`check_loop` as a task of the broker's nursery; ``halves`` is None
    while this broker is not a running leader (a follower, starting, failed)."""

    def __init__(self, ctx: BrokerContext) -> None:
        self.ctx, self.config = ctx, ctx.config
        self.store: Store | None = ctx.store if isinstance(ctx.store, Store) else None
        self.halves: PendingSet | None = None
        self.ending: dict[int, trio.Event] = {}  # half offsets being ended now
        self.waiters: dict[str, list[trio.Event]] = {}  # CHECK_TRANSACTIONS polls by group
        self.polls = Polls(ctx.config, self.waiters)  # which groups have a producer polling
        self.failure = ""
        self.saved = load_checkpoint(self.store) if self.store is not None else TransactionCheckpoint()
        self._last_save = 0.0
        self._reading = trio.Lock()  # one refresh at a time (the task's and requests')
        self.marks = OpMarks(self.saved)  # where the op queues stood as the log grew (the checkpoint's ops_from)
        if self.store is not None:
            self.store.log.hold_retention(self.retention_floor)

    @property
    def running(self) -> bool:
        """Whether this broker runs the pending set now (a leader, started)."""
        return self.halves is not None

    def fields(self) -> dict[str, int | str]:
        """BROKER_INFO's (and the metrics') view (pending -1: not running here)."""
        h = self.halves
        return {
            "transactions_pending": -1 if h is None else len(h.pending),
            "transactions_committed": 0 if h is None else h.stats.committed,
            "transactions_rolled_back": 0 if h is None else h.stats.rolled_back,
            "transactions_checks": 0 if h is None else h.stats.checks,
            "transactions_failure": self.failure,
        }

    def retention_floor(self) -> int | None:
        """The oldest half message still pending (or not yet read): retention keeps it
        (called by the store's housekeeping thread). While no leader runs here: the last
        checkpoint's (a follower's: its leader's)."""
        store = self.store
        if store is None or not store.queue_exists(TRANS_HALF_TOPIC, HALF_QUEUE):
            return None
        halves = self.halves
        return self.saved.floor_offset if halves is None else halves.floor()

    def running_halves(self) -> PendingSet:
        """The pending set, or the error a request gets while there is none."""
        self.ctx.replica.check_writable()
        if self.halves is None:
            raise RequestError(ErrorCode.SYSTEM_BUSY, "transactions are starting (or recovering): retry")
        return self.halves

    # ------------------------------------------------------------- the task
    async def check_loop(self) -> None:
        """The checker task (see the module docstring); runs for the broker's lifetime."""
        if self.store is None:
            return  # partition-per-file mode: SEND_MESSAGE to %TRANS_HALF% is refused there
        while True:
            await trio.sleep(self.config.transaction_check_interval_ms / 1000)
            try:
                self.ctx.replica.check_writable()
            except RequestError:
                self._stand_down()
                continue
            if self.halves is None and self.ctx.store.dispatch_lag_bytes > 0:
                continue  # the queues must show the whole log before the set is built from them
            try:
                if self.halves is None:
                    await self._start()
                await self.refresh()
                self._mark_ops()
                await self._check()
                await self._save_when_due()
                self.failure = ""
            except (OSError, StoreError) as e:
                await self._failed(e)

    def _mark_ops(self) -> None:
        store = self.store
        assert store is not None
        ends = op_ends(store)  # read before the log's end (OpMarks says why)
        self.marks.add(store.log.write_offset, ends)

    async def _failed(self, error: BaseException) -> None:
        text = f"{type(error).__name__}: {error}"
        if text != self.failure:
            log.error("transactions: %s; retrying every %.0f s from the last checkpoint", text, FAILURE_RETRY_S)
        self.failure, self.halves = text, None
        await trio.sleep(FAILURE_RETRY_S)

    def _stand_down(self) -> None:
        if self.halves is not None:
            log.info("transactions: not the leader: checks stop (the new leader's go on)")
        self.halves = None
        self._wake_all()

    async def _start(self) -> None:
        store = self.store
        assert store is not None
        await self._ends_settled(store)
        cp = await trio.to_thread.run_sync(load_checkpoint, store)
        rebuilt = await trio.to_thread.run_sync(rebuild, store, cp)
        if rebuilt.orphans:  # committed, op record lost: written now, never a second message
            try:
                await store_together(self.ctx, [op_record(TRANS_OP_COMMIT, off) for off in rebuilt.orphans])
            except RequestError as e:
                raise StoreError(f"cannot write the op records of committed half messages: {e.text}") from None
            for off in rebuilt.orphans:
                rebuilt.halves.end(off, Ended(COMMITTED))
            log.warning("transactions: wrote the lost op records of %d committed half messages", len(rebuilt.orphans))
        self.saved, self._last_save = cp, 0.0
        self.marks = OpMarks(cp)
        self.halves = rebuilt.halves
        self.polls.restart(wall_ms())
        rebuilt.halves.stats.committed = rebuilt.halves.stats.rolled_back = 0  # counts since start

    async def _ends_settled(self, store: Store) -> None:
        """Wait for the ENDs in flight and their records in the queues (landing after the rebuild: commits twice)."""
        while self.ending:
            await next(iter(self.ending.values())).wait()
        await dispatched_to(store, store.log.write_offset)  # (not the lane's idling: under load it may never)

    async def refresh(self) -> None:
        """Read the half messages stored since the last look into the pending set (read
        in a thread, applied here: an END on the event loop never races the reader)."""
        async with self._reading:
            halves = self.halves
            if halves is None:
                return
            found, queue_read, read_to = await trio.to_thread.run_sync(self._read_new, halves)
            for half in found:
                halves.add(half)  # not if an END found it meanwhile (it is pending or ended then)
            halves.queue_read, halves.read_to = queue_read, max(halves.read_to, read_to)

    def _read_new(self, halves: PendingSet) -> tuple[list[Half], int, int]:
        """The halves of ``%TRANS_HALF%`` from the queue offset read to; the next offset
        to read; a commit-log offset every half below which is read. A half an END
        already found (pending or ended: membership is read, never changed, here) is
        not read again."""
        start = halves.queue_read
        store = self.store
        assert store is not None
        visible = store.dispatcher.dispatched_offset  # every half below it is in the queue now
        found: list[Half] = []
        read_to, at = 0, start
        while True:
            first, entries = read_entries(store, TRANS_HALF_TOPIC, HALF_QUEUE, at)
            if not len(entries):
                break
            keep = real(entries)
            for i, (off, size) in enumerate(zip(entries["offset"].tolist(), entries["size"].tolist())):
                known = off in halves.pending or off in halves.ended
                record = store.log.read_record(off, size) if keep[i] and not known else None
                half = None if record is None else half_from_record(record, first + i)
                if half is not None:
                    found.append(half)
            read_to = int(entries["offset"][-1]) + int(entries["size"][-1])
            at = first + len(entries)
        return found, at, max(read_to, visible)

    # ------------------------------------------------------------- checks
    async def _check(self) -> None:
        """Wake the pollers of groups with halves due; count the looks at the halves of
        groups no producer polls as checks (RocketMQ's checker counts every look);
        decide the unresolved ones."""
        halves = self.halves
        assert halves is not None
        now = wall_ms()
        orphans: list[Half] = []
        for half in halves.take_due(now, self.config.transaction_timeout_ms):
            if half.checks < self.config.transaction_check_max:
                if self.polls.polling(half.group, now):
                    halves.make_ready(half, now)
                else:
                    orphans.append(half)
            elif self.config.transaction_unresolved == "keep":
                half.given_up = True
                log_unresolved(self.msg_id(half.offset), half, self.polls.why(half.group, now), "kept pending")
            else:
                await self._roll_back_unresolved(half, self.polls.why(half.group, now))
        for group in [g for g, ready in halves.ready.items() if ready and not self.polls.polling(g, now)]:
            orphans += [h for h in halves.ready_of(group) if h.offset not in self.ending]  # its producers left
        orphans += self.polls.unclaimed(halves, now, self.ending)  # polled only by polls that may not take them
        if orphans:
            await count_unasked(self.ctx, halves, orphans, now)
        self.polls.forget_quiet(now)
        for group in [g for g, ready in halves.ready.items() if ready]:
            self._wake(group)

    async def _roll_back_unresolved(self, half: Half, why: str = "") -> None:
        try:
            ended = await self.end(
                half.offset, lambda: store_together(self.ctx, [op_record(TRANS_OP_ROLLBACK, half.offset)])
            )
        except RequestError as e:
            log.warning("transactions: rollback of unresolved half %s waits: %s", self.msg_id(half.offset), e.text)
            if self.halves is not None and half.offset in self.halves.pending:
                self.halves.again(half)  # tried again at the next look
            return
        log_unresolved(self.msg_id(half.offset), half, why, "rolled back")
        if self.ctx.tracer.enabled and ended.state == ROLLED_BACK and self.store is not None:
            record = await trio.to_thread.run_sync(read_half, self.store, half)
            trace_end(self.ctx, half, record, ended, f"unresolved after {half.checks} checks{why}")

    async def end(self, offset: int, append: Any, commit_qid: int | None = None) -> Ended:
        """End the pending half at ``offset`` by ``append()`` (a coroutine storing the
        records: a PutResult; a commit into queue ``commit_qid``); one end at a time per
        half (a second waits, then finds it ended). Raises RequestError (the half stays
        pending) if nothing was stored."""
        while offset in self.ending:
            await self.ending[offset].wait()
        halves = self.running_halves()
        if offset not in halves.pending:
            ended = halves.ended.get(offset)
            if ended is None:
                raise RequestError(
                    ErrorCode.NOT_FOUND,
                    f"no pending half message at CommitLog offset {offset} (nor one ended recently)",
                )
            return Ended("already_" + ended.state, ended.queue_id, ended.queue_offset, ended.commitlog_offset)
        done = self.ending[offset] = trio.Event()
        # Shielded: once the records are handed to the lane they are stored whatever
        # happens to this request, and the set must say so (else a later END commits again).
        with trio.CancelScope(shield=True):
            try:
                result = await append()
            finally:
                del self.ending[offset]
                done.set()
            if commit_qid is not None:
                outcome = Ended(COMMITTED, commit_qid, result.queue_offsets[0], result.commitlog_offsets[0])
            else:
                outcome = Ended(ROLLED_BACK)
            halves.end(offset, outcome)
        return outcome

    def _wake(self, group: str) -> None:
        for event in self.waiters.pop(group, []):
            event.set()

    def _wake_all(self) -> None:
        for group in list(self.waiters):
            self._wake(group)

    def msg_id(self, offset: int) -> str:
        """The message id of the record at ``offset`` on this broker (``addr@OFFSET``)."""
        return f"{self.ctx.addr()}@{offset:016X}"

    # ------------------------------------------------------------- checkpoint
    async def _save_when_due(self) -> None:
        if time.monotonic() - self._last_save < self.config.transaction_checkpoint_interval_ms / 1000:
            return
        store, halves = self.store, self.halves
        assert store is not None and halves is not None
        mark = store.log.write_offset  # every commit below it is whole (appends are)
        floor = min(halves.floor(), mark)
        cp = TransactionCheckpoint(mark, halves.lowest_queue_offset(), floor, self.marks.ops_from(floor))
        self._last_save = time.monotonic()
        if cp == self.saved:
            return
        await trio.to_thread.run_sync(store.flush)  # nothing the checkpoint claims may be lost
        await trio.to_thread.run_sync(save_checkpoint, store, cp)
        self.saved = cp
        self.ctx.metadata.bump()  # followers copy it

    def checkpoint_json(self) -> dict[str, Any] | None:
        """The last checkpoint saved (a leader's followers adopt it)."""
        return self.saved.to_json() if self.halves is not None else None

    def adopt_checkpoint(self, value: dict[str, Any]) -> None:
        """A follower takes its leader's checkpoint (in a worker thread) once its own
        log holds everything up to the checkpoint's mark."""
        store = self.store
        if store is None or self.halves is not None:
            return
        try:
            cp = TransactionCheckpoint.from_json(value)
        except (KeyError, TypeError, ValueError) as e:
            log.warning("transactions: the leader's checkpoint is unusable (%s); keeping ours", e)
            return
        if cp.mark_offset <= store.log.write_offset and cp != self.saved:
            try:
                save_checkpoint(store, cp)
            except OSError as e:
                log.warning("transactions: cannot save the leader's checkpoint: %s", e)
                return
            self.saved = cp

    def after_truncation(self) -> None:
        """A follower's log was cut: a checkpoint whose mark is past the new end is
        replaced by one that reads the whole log at the next start."""
        store = self.store
        if store is None or self.halves is not None or self.saved.mark_offset <= store.log.write_offset:
            return
        self.saved = TransactionCheckpoint(store.log.min_offset, 0, store.log.min_offset)
        try:
            save_checkpoint(store, self.saved)
        except OSError as e:
            log.warning("transactions: cannot reset the checkpoint after a truncation: %s", e)


async def dispatched_to(store: Store, offset: int) -> None:
    """Return once the dispatcher has put every record below ``offset`` in its queue."""
    interval = 0.002
    while store.dispatcher.dispatched_offset < offset:
        await trio.sleep(interval)
        interval = min(2 * interval, 0.05)

"""The shared part of the POP service (:class:`PopBase`): the state, the checks of
handles, and the recorded writes (every change is in ``%POP%`` before its answer)."""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Sequence

import trio

from clmq.broker.store import PutResult, Store
from clmq.common import POP_TOPIC, Message, is_system_topic
from clmq.protocol import ErrorCode
from clmq.protocol.transport import RequestError

from .._context import BrokerContext
from .._read_threads import ReadThreads
from .._system_put import UnconfirmedError, append_acknowledged, confirm_acknowledged, ensure_topic
from ..timer import wall_ms
from ._batch import RecordBatcher
from ._inflight import Flight, GroupFlights, PopState, QueueFlights
from ._records import POP_QUEUE, Acks, Handle, ack_message, parse_handle
from ._state import PopCheckpoint, load_checkpoint

log = logging.getLogger("clmq.pop")


@dataclass(frozen=True)
class Delivery:
    """One message handed to a member by a pop."""

    topic: str
    queue_id: int
    queue_offset: int
    commitlog_offset: int  # -1 when not known (delivery_of)
    size: int
    attempt: int  # 1: the first delivery
    handle: str
    deadline_ms: int


@dataclass
class Judged:
    """Handles judged against the state: each one's status, and the accepted ones."""

    results: list[str]
    ok: list[tuple[int, QueueFlights, Handle, Flight]]  # (index, queue, handle, its flight)
    state: PopState | None = None  # the state judged against


class PopBase:
    """The state, its checks and the recorded writes (the service's shared part)."""

    def __init__(self, ctx: BrokerContext) -> None:
        self.ctx, self.config = ctx, ctx.config
        self.store: Store | None = ctx.store if isinstance(ctx.store, Store) else None
        self.state: PopState | None = None
        self.failure = ""
        self.saved = load_checkpoint(self.store) if self.store is not None else PopCheckpoint()
        self.waiters: dict[str, list[trio.Event]] = {}  # long polls by group
        self.writes: dict[int, int] = {}  # appends in progress: id -> %POP%'s end when submitted
        self.drained: trio.Event | None = None  # set when no append is in progress (a start waits)
        self._ids = itertools.count()
        self.dead: list[tuple[str, str, int, int]] = []  # (group, topic, queue, offset) to dead-letter
        self.save_soon = False  # the state holds what no record says (a failed pop's offsets): checkpoint it now
        # Reads of queue entries and records: a job costs a queue put, not a trio.to_thread hop.
        self.readers = ReadThreads(ctx.config.pull_read_threads, name="pop_read_threads")
        self.batcher = RecordBatcher(
            lambda messages, also: append_acknowledged(ctx, messages, also),
            lambda result, topics: confirm_acknowledged(ctx, result, topics),
        )
        if self.store is not None:
            self.store.log.hold_retention(self.retention_floor)

    @property
    def running(self) -> bool:
        """Whether this broker runs the POP state now (a leader, started)."""
        return self.state is not None

    def retention_floor(self) -> int | None:
        """``%POP%`` records a start would replay stay (the last checkpoint's floor);
        none once the checkpoint covers every record (called by the store's
        housekeeping thread)."""
        store = self.store
        if store is None or not store.queue_exists(POP_TOPIC, POP_QUEUE):
            return None
        saved = self.saved
        return saved.log_from if self.pop_end() > saved.applied_to else None

    def running_state(self) -> PopState:
        """The state, or the error a request gets while there is none."""
        if self.store is None:
            raise RequestError(
                ErrorCode.REQUEST_NOT_SUPPORTED,
                f"POP state lives in the CommitLog: this broker runs {self.config.storage_mode}",
            )
        self.ctx.replica.check_writable()
        if self.state is None:
            raise RequestError(ErrorCode.SYSTEM_BUSY, "POP consumption is starting (or recovering): retry")
        return self.state

    def pop_end(self) -> int:
        """``%POP%`` queue 0's dispatched end (every record below it was appended)."""
        store = self.store
        if store is None or not store.queue_exists(POP_TOPIC, POP_QUEUE):
            return 0
        return store.max_offset(POP_TOPIC, POP_QUEUE)

    async def record(
        self, messages: Sequence[Message], also: Sequence[str] = (), state: PopState | None = None
    ) -> PutResult:
        """Append ``messages`` (``%POP%`` records, dead letters) durably before an answer;
        RequestError if not. Handed over at once (in the next append of the group
        commit, ``_batch``), so ``%POP%`` holds records in the order the state changed.
        ``state``: the state the records change (SYSTEM_BUSY if it was given up meanwhile:
        a rebuild that began may not see them)."""
        if state is not None and state is not self.state:
            raise RequestError(ErrorCode.SYSTEM_BUSY, "POP state rebuilt meanwhile: retry")
        token = next(self._ids)
        self.writes[token] = self.pop_end()
        try:
            with trio.CancelScope(shield=True):  # once handed to the lane, the state must follow it
                result = await self.batcher.record(messages, also)
        finally:
            del self.writes[token]
            if not self.writes and self.drained is not None:
                self.drained.set()
        return result

    async def ensure_pop_topic(self) -> None:
        """Create ``%POP%`` the first time."""
        await ensure_topic(self.ctx, POP_TOPIC, 1)

    def wake(self, group: str) -> None:
        """Wake the group's long polls."""
        for event in self.waiters.pop(group, []):
            event.set()

    def wake_all(self) -> None:
        """Wake every long poll (this broker stops being the leader)."""
        for group in list(self.waiters):
            self.wake(group)

    def judge(self, group: str, handles: Sequence[str], now: int, count: bool = True) -> Judged:
        """Each handle's status; ok ones marked settling (not visible meanwhile);
        ``count``: expired ones counted (a client's acknowledgement, not the broker's own)."""
        state = self.running_state()
        g = state.groups.get(group)
        results: list[str] = []
        ok: list[tuple[int, QueueFlights, Handle, Flight]] = []
        seen: set[tuple[str, int, int]] = set()
        for i, text in enumerate(handles):
            h = parse_handle(text)
            if h is None or h.broker != self.config.broker_name:
                results.append("invalid")
                continue
            key = (h.topic, h.queue_id, h.offset)
            q = g.queues.get((h.topic, h.queue_id)) if g is not None else None
            f = q.flights.get(h.offset) if q is not None else None
            if q is None or f is None or key in seen or f.settling:
                results.append("gone")  # (settling: another acknowledgement of it is being written)
            elif f.ck != h.ck or f.deadline_ms <= now:
                results.append("expired")
                if count and g is not None:
                    g.stats.ack_expired += 1
            else:
                seen.add(key)
                results.append("ok")
                ok.append((i, q, h, Flight(f.ck, f.deadline_ms, f.attempt, f.owner, f.max_reconsume_times)))
                f.settling = True  # not visible meanwhile; its real deadline stays (a checkpoint saves it)
        return Judged(results, ok, state)

    def restore(self, ok: list[tuple[int, QueueFlights, Handle, Flight]]) -> None:
        """A write failed: the judged deliveries are as they were."""
        for _i, q, h, before in ok:
            if h.offset in q.flights:
                q.put(h.offset, before)

    async def settle(self, group: str, judged: Judged, extra: Sequence[Message] = ()) -> None:
        """Record the ok deliveries as settled (an ACK record after ``extra``), then settle them."""
        rows = [(h.topic, h.queue_id, h.offset, h.ck) for _i, _q, h, _f in judged.ok]
        try:
            await self.record([*extra, ack_message(Acks(group, rows))], sorted({r[0] for r in rows}), judged.state)
        except UnconfirmedError:  # in the log (a replay settles them): so does the state, and the error is answered
            self.settled(group, judged)
            raise
        except BaseException:
            self.restore(judged.ok)
            raise
        self.settled(group, judged)

    def settled(self, group: str, judged: Judged) -> None:
        """The ok deliveries' ACK is in ``%POP%``: settle them (and wake what it frees)."""
        cap = self.config.pop_max_inflight_per_queue
        freed = False
        for _i, q, h, _f in judged.ok:
            low = q.settled_offset()
            if q.settle(h.offset, h.ck):
                # Woken only by what may give a waiting pop more: a full in-flight window
                # that moved, or an orderly queue with nothing in flight left.
                freed = freed or (q.next_offset - low >= cap and q.settled_offset() > low) or not q.flights
        if freed and group in self.waiters:
            self.wake(group)

    def check_group(self, group: str) -> None:
        """A consumer group's name (MALFORMED_REQUEST if it is none)."""
        if not group or is_system_topic(group):
            raise RequestError(ErrorCode.MALFORMED_REQUEST, f"field 'group' must name a consumer group, got {group!r}")

    def group_state(self, group: str) -> GroupFlights | None:
        """The group's state here (None: none, or not running)."""
        return None if self.state is None else self.state.groups.get(group)

    @staticmethod
    def now() -> int:
        """Wall-clock epoch ms (deadlines outlive a restart and a fail-over)."""
        return wall_ms()

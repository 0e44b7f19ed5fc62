"""A pop's work on the state (:class:`Taking`): deliveries visible again reserved at
once, new offsets read in a worker thread and reserved when it returns (less what
another pop took meanwhile), the CK records appended, then the deliveries. The
selection itself is ``_take``'s."""

from __future__ import annotations

import logging
from typing import Sequence

import trio

from clmq.broker.store import Store
from clmq.common import POP_TOPIC
from clmq.protocol import ErrorCode
from clmq.protocol.transport import RequestError

from .._system_put import UnconfirmedError
from ._base import Delivery, PopBase
from ._inflight import Flight, GroupFlights, PopState, QueueFlights
from ._reads import Fresh, entry_of, read_fresh, tag_codes
from ._records import Checkpoint, ck_message, encode_handles
from ._take import Ask, Taken, allocate, fresh_after, next_after, rotated, share, within_bytes

log = logging.getLogger("clmq.pop")


class Taking(PopBase):
    """What a pop does to the state (see the module docstring)."""

    def queues_of(self, topic: str, queue_ids: Sequence[int] | None) -> list[int]:
        """The queues a pop of ``topic`` looks at (TOPIC_NOT_FOUND, INVALID_QUEUE_ID)."""
        count = self.ctx.store.topics.queue_count(topic)
        if count is None or topic == POP_TOPIC:
            raise RequestError(
                ErrorCode.TOPIC_NOT_FOUND, f"topic {topic!r} does not exist on {self.config.broker_name}"
            )
        if queue_ids is None:
            return list(range(count))
        bad = [q for q in queue_ids if not 0 <= q < count]
        if bad:
            raise RequestError(
                ErrorCode.INVALID_QUEUE_ID, f"queue id {bad[0]} not in 0..{count - 1} of topic {topic!r}"
            )
        return sorted(set(queue_ids))

    def watch(self, ask: Ask) -> trio.Event:
        """An event set on arrivals in the pop's queues, or a delivery visible again."""
        event = trio.Event()
        for qid in ask.queue_ids:
            self.ctx.waiters.add((ask.topic, qid), event)
        self.waiters.setdefault(ask.group, []).append(event)
        return event

    def unwatch(self, ask: Ask, event: trio.Event) -> None:
        """Forget ``event`` (:meth:`watch`'s)."""
        for qid in ask.queue_ids:
            self.ctx.waiters.unregister((ask.topic, qid), event)
        events = self.waiters.get(ask.group)
        if events and event in events:
            events.remove(event)
            if not events:
                del self.waiters[ask.group]

    def queue_state(self, g: GroupFlights, ask: Ask, qid: int) -> QueueFlights:
        """The group's state of a queue; one new to the group starts at its committed
        offset, else at the queue's start (or end: ``start_from="latest"``)."""
        key = (ask.topic, qid)
        q = g.queues.get(key)
        if q is None:
            committed = self.ctx.offsets.query(ask.group, ask.topic, qid)
            if committed >= 0:
                start = committed
            elif ask.start_from == "latest":
                start = self.ctx.store.max_offset(ask.topic, qid)
            else:
                start = self.ctx.store.min_offset(ask.topic, qid)
            q = g.queues[key] = QueueFlights(start)
        return q

    async def take(self, ask: Ask) -> list[Delivery]:
        """One attempt of a pop: what is there now (maybe nothing)."""
        state = self.running_state()
        g = state.group(ask.group)
        now = self.now()
        g.members[ask.client_id] = g.last_pop_ms = now
        g.invisible_time_ms_last = ask.invisible_time_ms
        order = rotated(ask.queue_ids, g.turn)
        g.turn += 1
        deadline = now + ask.invisible_time_ms
        parts = self._take_due(g, ask, order, now, deadline)
        try:
            await self._take_fresh(g, ask, order, parts, deadline)
            parts = {qid: p for qid, p in parts.items() if p.offsets}
            cks = [ck_message(_checkpoint(ask, qid, p, deadline)) for qid, p in parts.items()]
            result = await self.record(cks, state=state) if cks else None
        except UnconfirmedError:  # the CKs are in the log: in flight, visible again after their deadline
            raise
        except BaseException:
            kept = _undo(parts, ask)
            self.wake(ask.group)  # (deliveries visible again: a long poll may take them)
            if kept:
                await self._give_back(ask, parts, kept, state)
            raise
        out: list[Delivery] = []
        for n, (qid, p) in enumerate(parts.items()):
            assert result is not None
            out += self._delivered(ask, qid, p, result.queue_offsets[n], deadline)
            g.stats.redelivered += sum(1 for b in p.before if b is not None)
        g.stats.popped += len(out)
        return out

    async def _give_back(self, ask: Ask, parts: dict[int, Taken], kept: dict[int, list[int]], state: PopState) -> None:
        """Record the new offsets a failed pop kept below a next offset another pop's CK
        moved: a CK record of them at attempt 0, visible now (a replay must know them).
        If that fails too, a checkpoint is asked for at once, and their next pop's CK
        records them (giving the state up would lose them: the log says nothing of them)."""
        now = self.now()
        cks = [
            ck_message(
                Checkpoint(
                    ask.group,
                    ask.client_id,
                    ask.topic,
                    qid,
                    offs,
                    [0] * len(offs),
                    now,
                    ask.max_reconsume_times,
                    parts[qid].queue.next_offset,
                )
            )
            for qid, offs in kept.items()
        ]
        try:
            with trio.CancelScope(shield=True):
                await self.record(cks, state=state)
        except UnconfirmedError:
            return  # in the log
        except Exception as e:  # (any failure: only memory holds them)
            if state is self.state:
                log.error("pop: offsets given back not recorded (%s: %s); checkpointing at once", type(e).__name__, e)
                self.save_soon = True

    def _delivered(self, ask: Ask, qid: int, p: Taken, ck: int, deadline: int) -> list[Delivery]:
        """A queue's part of a pop once its CK record (``ck``) is stored."""
        out = []
        flights = p.queue.flights
        handles = encode_handles(self.config.broker_name, ask.topic, qid, p.offsets, ck, deadline)
        for off, attempt, (where, size), placed, h in zip(p.offsets, p.attempts, p.where, p.placed, handles):
            if flights.get(off) is placed:  # (not one a later pop put meanwhile)
                placed.ck = ck
            out.append(Delivery(ask.topic, qid, off, where, size, attempt, h, deadline))
        return out

    def _take_due(self, g: GroupFlights, ask: Ask, order: list[int], now: int, deadline: int) -> dict[int, Taken]:
        """Reserve the deliveries visible again, each queue up to its share."""
        parts: dict[int, Taken] = {}
        each = share(ask.limit, len(order))
        budget = ask.limit
        for qid in order:
            q = self.queue_state(g, ask, qid)
            p = parts[qid] = Taken(qid, q)
            if budget <= 0 or not q.visible(now):
                continue
            if ask.orderly and q.busy(now):
                continue
            take, dead = q.due(now, min(each, budget), ask.orderly)
            self.dead += [(ask.group, ask.topic, qid, off) for off in dead]
            for off in take:
                before = q.flights[off]
                flight = Flight(-1, deadline, before.attempt + 1, ask.client_id, ask.max_reconsume_times)
                p.reserve(off, flight, before, before.attempt + 1)
            budget -= len(take)
        return parts

    async def _take_fresh(
        self, g: GroupFlights, ask: Ask, order: list[int], parts: dict[int, Taken], deadline: int
    ) -> None:
        """Read where the due deliveries are and the queues' new entries; reserve new offsets."""
        store = self.store
        assert store is not None
        budget = ask.limit - sum(len(p.offsets) for p in parts.values())
        cap = self.config.pop_max_inflight_per_queue
        asks = []
        for qid in order:
            q = parts[qid].queue
            blocked = ask.orderly and len(q.flights) > len(parts[qid].offsets)
            room = min(budget, q.settled_offset() + cap - q.next_offset)  # the in-flight window
            if room > 0 and not blocked and _has_new(store, ask.topic, qid, q.next_offset):
                asks.append((qid, q.next_offset, room))
        due = {qid: p.offsets for qid, p in parts.items() if p.offsets}
        if not asks and not due:  # nothing to read (every window full, or orderly queues busy): no thread hop
            return
        fresh, where = await self.readers.in_thread(_read, store, ask, asks, due)
        for qid, places in where.items():
            parts[qid].where = places
        for qid in [q for q, p in parts.items() if any(w[1] < 0 for w in p.where)]:
            _drop_gone(parts[qid])
        # (a failed pop gave offsets below this read back meanwhile: the next pop reads them)
        fresh = {qid: f for qid, f in fresh.items() if f.start <= parts[qid].queue.next_offset}
        fresh = {qid: fresh_after(f, parts[qid].queue.next_offset) for qid, f in fresh.items()}
        if ask.orderly:  # another pop may have taken from a queue while its entries were read: it waits
            fresh = {qid: f for qid, f in fresh.items() if len(parts[qid].queue.flights) <= len(parts[qid].offsets)}
        budget = ask.limit - sum(len(p.offsets) for p in parts.values())
        ends = {qid: _window_start(parts[qid].queue, f) + cap for qid, f in fresh.items()}  # past it: not yet
        avail = {qid: sum(1 for o in f.offsets if o < ends[qid]) for qid, f in fresh.items()}
        alloc = allocate(avail, order, budget)
        if ask.max_bytes is not None:
            used = sum(s for p in parts.values() for _w, s in p.where)
            within_bytes(fresh, alloc, order, ask.max_bytes, used)
        for qid, f in fresh.items():
            p, n = parts[qid], alloc.get(qid, 0)
            for i in range(n):
                p.where.append((f.commitlog[i], f.sizes[i]))
                p.reserve(f.offsets[i], Flight(-1, deadline, 1, ask.client_id, ask.max_reconsume_times), None, 1)
            before_next = p.queue.next_offset
            p.queue.next_offset = max(before_next, next_after(f, n))
            p.advanced = (before_next, p.queue.next_offset)


def _has_new(store: Store, topic: str, qid: int, next_offset: int) -> bool:
    """Whether the queue holds entries from ``next_offset`` on (in memory: a queue read
    to its end costs a long poll no thread hop)."""
    return store.queue_exists(topic, qid) and store.max_offset(topic, qid) > next_offset


def _read(
    store: Store, ask: Ask, asks: list[tuple[int, int, int]], due: dict[int, list[int]]
) -> tuple[dict[int, Fresh], dict[int, list[tuple[int, int]]]]:
    """In a worker thread: the new entries, and where the due deliveries' records are."""
    fresh = read_fresh(store, ask.topic, asks, tag_codes(ask.tags))
    where = {}
    for qid, offsets in due.items():
        where[qid] = [entry_of(store, ask.topic, qid, off) or (-1, -1) for off in offsets]
    return {a[0]: f for a, f in zip(asks, fresh)}, where


def _window_start(q: QueueFlights, fresh: Fresh) -> int:
    """The lowest offset not settled once the entries a pop skips (tags) are settled."""
    if q.flights:
        return q.settled_offset()
    return fresh.offsets[0] if fresh.offsets else fresh.end


def _drop_gone(p: Taken) -> None:
    """Deliveries whose record is gone (retention): settled, not delivered."""
    keep = [i for i, w in enumerate(p.where) if w[1] >= 0]
    for i in range(len(p.where)):
        if p.where[i][1] < 0:
            p.queue.flights.pop(p.offsets[i], None)
    p.offsets = [p.offsets[i] for i in keep]
    p.attempts = [p.attempts[i] for i in keep]
    p.before = [p.before[i] for i in keep]
    p.placed = [p.placed[i] for i in keep]
    p.where = [p.where[i] for i in keep]


def _checkpoint(ask: Ask, qid: int, p: Taken, deadline: int) -> Checkpoint:
    """The CK record of a queue's part of a pop."""
    return Checkpoint(
        ask.group,
        ask.client_id,
        ask.topic,
        qid,
        p.offsets,
        p.attempts,
        deadline,
        ask.max_reconsume_times,
        p.queue.next_offset,
    )


def _undo(parts: dict[int, Taken], ask: Ask) -> dict[int, list[int]]:
    """Nothing was recorded: the reserved deliveries are visible again, as they were
    (unless another pop took them meanwhile); the next offset goes back where it was
    unless another pop moved it since (no CK record may carry it past offsets none holds).
    The new offsets kept below a next offset another pop moved, by queue (no record holds them)."""
    kept: dict[int, list[int]] = {}
    for qid, p in parts.items():
        back = p.advanced is not None and p.queue.next_offset == p.advanced[1]
        if back and p.advanced is not None:
            p.queue.next_offset = p.advanced[0]
        for off, before, placed in zip(p.offsets, p.before, p.placed):
            if p.queue.flights.get(off) is not placed:
                continue
            if before is not None:
                p.queue.put(off, before)
            elif back:  # a new offset again: popped from the next offset
                del p.queue.flights[off]
            else:  # a new offset: delivered next with attempt 1
                p.queue.put(off, Flight(-1, 0, 0, ask.client_id, ask.max_reconsume_times))
                kept.setdefault(qid, []).append(off)
    return kept

"""The broker's POP service (:class:`PopService`): pop, ack, change the invisible
time, reject, and what DESCRIBE_GROUP, BROKER_INFO and the metrics show. Used by the
native requests (``_requests``) and by the Kafka listener's share groups. Every change
is recorded in ``%POP%`` before its answer (``_base``); the task is ``_revive``'s."""

from __future__ import annotations

from typing import Any, Sequence

import trio

from clmq.common import Message
from clmq.protocol import ErrorCode
from clmq.protocol.transport import RequestError

from .._system_put import UnconfirmedError
from ._base import Delivery, Judged
from ._inflight import Flight, GroupFlights, QueueFlights
from ._records import Acks, Checkpoint, Handle, ack_message, ck_message, parse_handle
from ._revive import PopKeeper
from ._take import Ask
from ._taking import Taking


class PopService(PopKeeper, Taking):
    """POP on this broker (see the module docstring)."""

    async def pop(
        self,
        group: str,
        client_id: str,
        topic: str,
        *,
        max_messages: int,
        invisible_time_ms: int,
        queue_ids: Sequence[int] | None = None,
        tags: Sequence[str] | None = None,
        orderly: bool = False,
        max_wait_ms: int = 0,
        max_bytes: int | None = None,
        start_from: str = "earliest",
        max_reconsume_times: int | None = None,
    ) -> list[Delivery]:
        """Up to ``max_messages`` deliveries, invisible to the group for
        ``invisible_time_ms``; waits up to ``max_wait_ms`` while there are none.
        RequestError: NOT_LEADER, TOPIC_NOT_FOUND, INVALID_QUEUE_ID, SYSTEM_BUSY while
        starting, MALFORMED_REQUEST for a limit out of range."""
        self.check_group(group)
        self.running_state()
        cap = self.config.pop_invisible_time_max_ms
        if not 1 <= invisible_time_ms <= cap:
            raise RequestError(
                ErrorCode.MALFORMED_REQUEST, f"invisible_time_ms must be in 1..{cap} (pop_invisible_time_max_ms)"
            )
        limit = self.config.max_reconsume_times if max_reconsume_times is None else max_reconsume_times
        ask = Ask(
            group,
            client_id,
            topic,
            self.queues_of(topic, queue_ids),
            max(1, min(max_messages, self.config.pop_max_messages)),
            invisible_time_ms,
            None if tags is None else list(tags),
            orderly,
            max_bytes,
            start_from,
            limit,
        )
        await self.ensure_pop_topic()
        return await self._wait_for_some(ask, min(max(0, max_wait_ms), self.config.pop_max_wait_ms) / 1000)

    async def _wait_for_some(self, ask: Ask, wait_s: float) -> list[Delivery]:
        """A pop's deliveries; while there are none, long polled up to ``wait_s``."""
        deadline = trio.current_time() + wait_s
        got = await self.take(ask)  # the usual case under load: no wait, nothing to register
        while not got and trio.current_time() < deadline:
            event = self.watch(ask)  # before the look: an arrival meanwhile is not missed
            try:
                got = await self.take(ask)
                if not got:
                    with trio.move_on_at(deadline):
                        await event.wait()
            finally:
                self.unwatch(ask, event)
        return got

    async def ack(self, group: str, handles: Sequence[str]) -> list[str]:
        """Settle deliveries: "ok" | "expired" | "gone" | "invalid" for each handle."""
        judged = self.judge(group, handles, self.now())
        if judged.ok:
            await self.settle(group, judged)
            g = self.group_state(group)
            if g is not None:
                g.stats.acked += len(judged.ok)
        return judged.results

    async def change_invisible_time(
        self, group: str, handles: Sequence[str], invisible_time_ms: int
    ) -> list[tuple[str, str]]:
        """Give deliveries a new deadline ``invisible_time_ms`` from now (0: visible at
        once): (status, the new handle or "") for each handle."""
        cap = self.config.pop_invisible_time_max_ms
        if not 0 <= invisible_time_ms <= cap:
            raise RequestError(
                ErrorCode.MALFORMED_REQUEST, f"invisible_time_ms must be in 0..{cap} (pop_invisible_time_max_ms)"
            )
        now = self.now()
        judged = self.judge(group, handles, now)
        if not judged.ok:
            return [(r, "") for r in judged.results]
        deadline = now + invisible_time_ms
        parts, cks, placed = _place_changes(group, judged, deadline)
        # The ACK of the old deliveries first, then their new CKs (``settle`` puts ``extra`` first: not here).
        try:
            rows_ack = [(h.topic, h.queue_id, h.offset, h.ck) for _i, _q, h, _f in judged.ok]
            result = await self.record(
                [ack_message(Acks(group, rows_ack)), *cks], sorted({k[0] for k in parts}), judged.state
            )
        except UnconfirmedError:  # in the log: changed as it says (ck -1: no handle of it is out), the error answered
            raise
        except BaseException:  # as they were (unless a pop took a nacked one meanwhile)
            for _i, q, h, before in judged.ok:
                if q.flights.get(h.offset) is placed[h.topic, h.queue_id, h.offset]:
                    q.put(h.offset, before)
            raise
        out = [(r, "") for r in judged.results]
        for n, rows in enumerate(parts.values()):
            ck = result.queue_offsets[1 + n]
            for i, q, h, _f in rows:
                now_flight = q.flights.get(h.offset)
                if now_flight is not None and now_flight is placed[h.topic, h.queue_id, h.offset]:
                    now_flight.ck = ck
                new = Handle(h.broker, h.topic, h.queue_id, h.offset, ck, deadline)
                out[i] = ("ok", new.encode())
        if invisible_time_ms == 0:
            self.wake(group)
        return out

    async def reject(self, group: str, handles: Sequence[str]) -> list[str]:
        """Dead-letter deliveries now (Kafka's REJECT): statuses as :meth:`ack`'s."""
        return await self.dead_letter(group, list(handles))

    def delivery_of(self, group: str, topic: str, queue_id: int, queue_offset: int) -> Delivery | None:
        """The in-flight delivery of an offset (for acks by offset); its
        commit-log offset is -1 and size 0 (not kept in memory)."""
        g = self.group_state(group)
        q = g.queues.get((topic, queue_id)) if g is not None else None
        f = q.flights.get(queue_offset) if q is not None else None
        if f is None or f.ck < 0:
            return None
        h = Handle(self.config.broker_name, topic, queue_id, queue_offset, f.ck, f.deadline_ms)
        return Delivery(topic, queue_id, queue_offset, -1, 0, f.attempt, h.encode(), f.deadline_ms)

    def owner_of(self, group: str, handle: str) -> str | None:
        """The client id that popped the delivery ``handle`` names (None: not in flight)."""
        h = parse_handle(handle)
        g = self.group_state(group)
        if h is None or g is None:
            return None
        q = g.queues.get((h.topic, h.queue_id))
        f = q.flights.get(h.offset) if q is not None else None
        return f.owner if f is not None and f.ck == h.ck else None

    def drop_topic(self, topic: str) -> None:
        """A deleted topic's POP state goes (its deliveries, next offsets, dead letters due)."""
        if self.state is not None:
            self.state.drop_topics(lambda t: t == topic)
            self.save_soon = True  # (its CK records stay in %POP%: a rebuild must not replay them into a new topic)
        self.dead = [d for d in self.dead if d[1] != topic]

    def groups(self) -> list[str]:
        """The groups with POP state here."""
        return sorted(self.state.groups) if self.state is not None else []

    def describe(self, group: str) -> dict[str, Any] | None:
        """DESCRIBE_GROUP's "pop" part (None: no POP state for the group here)."""
        g = self.group_state(group)
        if g is None:
            return None
        now = self.now()
        rows = []
        for (topic, qid), q in sorted(g.queues.items()):
            hi = self.ctx.store.max_offset(topic, qid) if self.ctx.store.queue_exists(topic, qid) else q.next_offset
            settled = q.settled_offset()
            rows.append(
                {
                    "topic": topic,
                    "queue_id": qid,
                    "next_offset": q.next_offset,
                    "settled_offset": settled,
                    "max_offset": hi,
                    "lag": max(0, hi - settled),
                    "inflight": len(q.flights),
                    "redelivering": sum(1 for f in q.flights.values() if f.deadline_ms <= now and not f.settling),
                }
            )
        timeout = self.config.pop_member_timeout_ms
        s = g.stats
        return {
            "queues": rows,
            "members": sorted(c for c, t in g.members.items() if now - t <= timeout),
            "popped": s.popped,
            "acked": s.acked,
            "ack_expired": s.ack_expired,
            "redelivered": s.redelivered,
            "dead_lettered": s.dead_lettered,
            "invisible_time_ms_last": g.invisible_time_ms_last,
        }

    def fields(self) -> dict[str, int | str]:
        """BROKER_INFO's (and the metrics') view: totals over groups (groups -1: not running here)."""
        state = self.state
        gs: list[GroupFlights] = list(state.groups.values()) if state is not None else []
        return {
            "pop_groups": -1 if state is None else len(gs),
            "pop_inflight": sum(g.inflight() for g in gs),
            "pop_popped": sum(g.stats.popped for g in gs),
            "pop_acked": sum(g.stats.acked for g in gs),
            "pop_ack_expired": sum(g.stats.ack_expired for g in gs),
            "pop_redelivered": sum(g.stats.redelivered for g in gs),
            "pop_dead_lettered": sum(g.stats.dead_lettered for g in gs),
            "pop_failure": self.failure or self.save_failure,
            "pop_record_appends": self.batcher.appends,  # appends of POP records since the broker started
            "pop_record_requests": self.batcher.requests,  # requests whose records they carried (group commit)
        }


Row = tuple[int, QueueFlights, Handle, Flight]  # a judged handle: (index, queue, handle, its delivery)


def _place_changes(
    group: str, judged: Judged, deadline: int
) -> tuple[dict[tuple[str, int, str, int], list[Row]], list[Message], dict[tuple[str, int, int], Flight]]:
    """The changed deliveries put in the state (ck -1 until their CK is stored), their
    CK records (one per queue, owner and dead-letter limit: a replay keeps each one's),
    and the flights put (identity: a nack, visible at once, may be popped again while
    its CK is written; that pop's flight must not get this change's ck, its acks would
    be "expired")."""
    parts: dict[tuple[str, int, str, int], list[Row]] = {}
    for row in judged.ok:
        h, f = row[2], row[3]
        parts.setdefault((h.topic, h.queue_id, f.owner, f.max_reconsume_times), []).append(row)
    cks: list[Message] = []
    placed: dict[tuple[str, int, int], Flight] = {}
    for (topic, qid, _owner, _limit), rows in parts.items():
        q, f = rows[0][1], rows[0][3]
        offsets, attempts = [r[2].offset for r in rows], [r[3].attempt for r in rows]
        ck = Checkpoint(group, f.owner, topic, qid, offsets, attempts, deadline, f.max_reconsume_times, q.next_offset)
        cks.append(ck_message(ck))
        for _i, _q, h, before in rows:
            flight = Flight(-1, deadline, before.attempt, before.owner, before.max_reconsume_times)
            placed[h.topic, h.queue_id, h.offset] = flight
            q.put(h.offset, flight)
    return parts, cks, placed

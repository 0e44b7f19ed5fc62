"""Queue locks for orderly consumers (LOCK_QUEUES, UNLOCK_QUEUES; RocketMQ's
``RebalanceLockManager``).

A member of a group processes a queue in order only while it holds the queue's lock
on the group's leader: a lease of ``lock_lease_ms`` from the request that granted or
renewed it. Another member asking for a held queue is refused (it asks again later);
an expired lock is free.

Locks live in memory on the leader only: followers refuse both requests
(``NOT_LEADER``, like every write). A broker that has just become the leader does not
know what its predecessor granted, so for ``lock_lease_ms`` after it was seen to
become the leader it grants nothing (``locked: []``; clients ask again): every lock
granted before has expired by then, by the holder's own clock too (a client measures
its lease from when it *sent* its request). The same grace applies at a start over a
store that already held topics (a restart: its locks of the last run are gone); a
fresh store's first start has no predecessor and grants at once. The switch is seen on
requests (the replica's role and epoch compared with the last request's), which is
early enough: no lock was granted in between.

Memory: one entry per locked queue. Expired entries are dropped lazily, by a sweep of
the whole table at most once per lease (amortised over the requests of that lease).
"""

from __future__ import annotations

import logging

from clmq.protocol import Frame
from clmq.protocol.transport import Peer, Reply, need

from ._context import BrokerContext, now_ms

log = logging.getLogger("clmq.broker")

QueueKey = tuple[str, str, int]  # (group, topic, queue id)


class LockTable:
    """(group, topic, queue id) -> (client id, expiry in monotonic ms). Plain data."""

    def __init__(self, lease_ms: int) -> None:
        self.lease_ms = lease_ms
        self._locks: dict[QueueKey, tuple[str, float]] = {}
        self._next_sweep_ms = 0.0

    def __len__(self) -> int:
        return len(self._locks)

    def lock(self, group: str, client_id: str, queues: list[tuple[str, int]], now: float) -> list[tuple[str, int]]:
        """Lock each queue that is free, expired or already ``client_id``'s (a renewal)
        for ``lease_ms`` from ``now``; the queues ``client_id`` holds now, in order."""
        self._sweep(now)
        expires = now + self.lease_ms
        locked: list[tuple[str, int]] = []
        for topic, qid in queues:
            key = (group, topic, qid)
            held = self._locks.get(key)
            if held is None or held[0] == client_id or held[1] <= now:
                self._locks[key] = (client_id, expires)
                locked.append((topic, qid))
        return locked

    def unlock(self, group: str, client_id: str, queues: list[tuple[str, int]], now: float) -> int:
        """Release those of ``queues`` that ``client_id`` holds; how many it held."""
        self._sweep(now)
        released = 0
        for topic, qid in queues:
            key = (group, topic, qid)
            held = self._locks.get(key)
            if held is not None and held[0] == client_id:
                del self._locks[key]
                released += 1
        return released

    def release_client(self, client_id: str) -> int:
        """Drop every lock of ``client_id`` (it left); how many it held."""
        gone = [key for key, (holder, _) in self._locks.items() if holder == client_id]
        for key in gone:
            del self._locks[key]
        return len(gone)

    def holder(self, group: str, topic: str, queue_id: int, now: float) -> str | None:
        """Who holds the queue's lock now (None: nobody, or it expired)."""
        held = self._locks.get((group, topic, queue_id))
        return held[0] if held is not None and held[1] > now else None

    def clear(self) -> None:
        self._locks.clear()

    def _sweep(self, now: float) -> None:
        """Drop expired entries, at most once per lease: the table holds at most the
        queues locked within the last two leases."""
        if now < self._next_sweep_ms:
            return
        self._next_sweep_ms = now + self.lease_ms
        for key in [k for k, (_, expires) in self._locks.items() if expires <= now]:
            del self._locks[key]


class LockRequests:
    """LOCK_QUEUES and UNLOCK_QUEUES on a broker, and the release of a client's locks
    when it unregisters."""

    def __init__(self, ctx: BrokerContext) -> None:
        self.ctx = ctx
        self.lease_ms = ctx.config.lock_lease_ms
        self.table = LockTable(self.lease_ms)
        self._term = self._current_term()
        # A restart over a store that held topics: its last run may have granted locks.
        restarted = bool(ctx.store.topics.all()) and self._term[0] == "leader"
        self._grace_until_ms = now_ms() + self.lease_ms if restarted else 0.0

    def _current_term(self) -> tuple[str, int]:
        return self.ctx.replica.role, self.ctx.replica.epoch

    def _check_term(self, now: float) -> None:
        """Forget every lock when the role or the epoch changed since the last request,
        and grant none for a lease after becoming the leader (see the module)."""
        term = self._current_term()
        if term == self._term:
            return
        self._term = term
        dropped = len(self.table)
        self.table.clear()
        if term[0] == "leader":
            self._grace_until_ms = now + self.lease_ms
            log.info(
                "broker %s leads (epoch %d): granting no queue lock for %d ms (locks granted before are unknown; "
                "%d dropped)",
                self.ctx.config.broker_name,
                term[1],
                self.lease_ms,
                dropped,
            )

    def in_grace(self, now: float) -> bool:
        """Whether locks are refused now (just after becoming the leader)."""
        return now < self._grace_until_ms

    async def lock(self, frame: Frame, peer: Peer) -> Reply:
        group, client_id = need(frame.fields, "group", str), need(frame.fields, "client_id", str)
        rows = need(frame.fields, "queues", list)  # [[topic, queue_id], ...], checked by check_request
        self.ctx.replica.check_writable()  # NOT_LEADER on a follower
        now = now_ms()
        self._check_term(now)
        locked: list[tuple[str, int]] = []
        if not self.in_grace(now):
            store = self.ctx.store
            existing = [(t, q) for t, q in rows if store.queue_exists(t, q)]  # no entries for queues that do not exist
            locked = self.table.lock(group, client_id, existing, now)
        return Reply({"locked": [[t, q] for t, q in locked], "lease_ms": self.lease_ms})

    async def unlock(self, frame: Frame, peer: Peer) -> Reply:
        group, client_id = need(frame.fields, "group", str), need(frame.fields, "client_id", str)
        rows = need(frame.fields, "queues", list)
        self.ctx.replica.check_writable()
        now = now_ms()
        self._check_term(now)
        self.table.unlock(group, client_id, [(t, q) for t, q in rows], now)
        return Reply()

    def release_client(self, client_id: str) -> None:
        """Drop every lock ``client_id`` holds (it left)."""
        self.table.release_client(client_id)

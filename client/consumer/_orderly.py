"""An orderly consumer's queue locks (RocketMQ's ``ConsumeMessageOrderlyService``
locking): a queue the rebalance gives this member is fetched only once the group's
leader granted this member the queue's lock (LOCK_QUEUES), and handed out only while
the lock's lease holds by this member's clock.

- Wanted (assigned by the rebalance) but not held: asked for every ``lock_retry_ms``
  (another member still holds it, or the broker has just become the leader and grants
  nothing for a lease).
- Held: renewed every ``lock_renew_interval_ms`` (or a third of the broker's lease,
  if that is shorter). The lease of a grant is measured from
  when its request was *sent*, so it ends here before it ends on the broker. A queue
  whose lease ended (renewals failed) or whose renewal was refused (another member got
  it) is dropped at once, not committed, its prefetched and pending batches not
  acknowledged; it is asked for again while it is wanted.
- Released (the rebalance moved it, or it was granted after it stopped being wanted):
  the consumer waits until its batch being processed is acknowledged (however long:
  the lease is renewed meanwhile), commits, then unlocks (:meth:`QueueLocks.unlock`).
  Lock and unlock requests never overlap (one lock): a renewal sent before an unlock
  could otherwise reach the broker after it and take the queue again.
"""

from __future__ import annotations

import logging
from typing import Callable

import trio

from clmq.protocol import RequestCode

from .._routes import MessageQueue
from ._commits import Commits
from ._requests import NET_ERRORS, Requests
from ._state import ConsumerState

log = logging.getLogger("clmq.consumer")

DEFAULT_LEASE_MS = 30_000  # assumed until a broker says (BrokerConfig.lock_lease_ms's default)


QueueAction = Callable[[MessageQueue], None]


class QueueLocks:
    """Which queues the consumer wants (its share), which it holds and until when
    (trio clock, seconds). What a lock means for the queues read is the consumer's,
    passed in: ``take`` (granted: start reading the queue), ``stop`` (neither fetched
    nor handed out from now on), ``drop`` (stop at once, commit nothing, acknowledge
    nothing)."""

    def __init__(
        self,
        state: ConsumerState,
        requests: Requests,
        commits: Commits,
        *,
        take: QueueAction,
        stop: QueueAction,
        drop: QueueAction,
    ) -> None:
        self.state = state
        self.requests = requests
        self.commits = commits
        self.take, self.stop, self.drop = take, stop, drop
        self.retry_s = state.options.lock_retry_ms / 1000
        self.renew_max_s = state.options.lock_renew_interval_ms / 1000
        self.renew_s = min(self.renew_max_s, DEFAULT_LEASE_MS / 1000 / 3)
        self.lease_s = DEFAULT_LEASE_MS / 1000  # the last broker's answer
        self.wanted: set[MessageQueue] = set()
        self.held: dict[MessageQueue, float] = {}  # queue -> end of its lease
        self.releasing: set[MessageQueue] = set()
        self._sent: dict[MessageQueue, float] = {}  # queue -> when the request of its last grant was sent
        self._requests = trio.Lock()
        self._wakeup = trio.Event()
        self._warned_lease = False
        self._nursery: trio.Nursery | None = None  # releases run here

    def holds(self, mq: MessageQueue, now: float) -> bool:
        """Whether the lease of ``mq`` holds at ``now`` (trio clock)."""
        return self.held.get(mq, 0.0) > now

    def rebalance(self, wanted: set[MessageQueue]) -> None:
        """The rebalance's share: lock the new queues now (the lock loop); release the
        held ones no longer in it, each in a task of its own (it waits for its batch
        being processed). A queue that moved to its group's new leader is released and
        locked there anew."""
        new = wanted - self.wanted
        self.wanted = set(wanted)
        if new:
            self._wakeup.set()
        assert self._nursery is not None, "start() first"
        for mq in [mq for mq in self.held if mq not in wanted and mq not in self.releasing]:
            self.releasing.add(mq)
            self._nursery.start_soon(self.release, mq)

    async def release(self, mq: MessageQueue) -> None:
        """Stop handing ``mq`` out, wait (renewing meanwhile) until its batch being
        processed is acknowledged, commit, then unlock it for its next owner."""
        pending = self.state.pending
        try:
            self.stop(mq)
            # However long the batch takes: the lock loop renews the lease meanwhile, so
            # the next owner cannot lock the queue while this member still processes it
            # (a lapse, renewals failing, ends the wait and the queue is dropped).
            while pending.of(mq) and self.holds(mq, trio.current_time()):
                with trio.move_on_after(max(self.renew_s, 0.05)):
                    await pending.wait_changed()
            if self.holds(mq, trio.current_time()):  # else it lapsed: another member may own it, commit nothing
                await self.commits.commit_queue(mq)
                self.drop(mq)
                await self.unlock([mq])
            else:
                self.drop(mq)
        finally:
            self.releasing.discard(mq)
        log.info("consumer %s: released %s/%s/%d", self.state.client_id, mq.broker_name, mq.topic, mq.queue_id)

    def start(self, nursery: trio.Nursery) -> None:
        """Run the lock loop, and releases, in ``nursery``."""
        self._nursery = nursery
        nursery.start_soon(self.lock_loop)

    async def lock_loop(self) -> None:
        """Ask for wanted queues and renew held ones, every ``lock_retry_ms``."""
        while True:
            await self.tick()
            with trio.move_on_after(self.retry_s):
                await self._wakeup.wait()
            self._wakeup = trio.Event()

    async def tick(self) -> None:
        now = trio.current_time()
        for mq in [mq for mq, end in self.held.items() if end <= now]:
            self.lapse(mq, "its lease ended before a renewal was granted")
        async with self._requests:  # what to ask is decided under the lock: an unlock may have just run
            asks: dict[str, list[MessageQueue]] = {}
            # A queue that moved to its group's new leader is locked there only once this
            # member released it at the old address (its batch being processed is done).
            moving = {(mq.topic, mq.broker_name, mq.queue_id) for mq in self.releasing}
            for mq in sorted(self.wanted | set(self.held)):
                if mq in self.held:
                    due = now - self._sent.get(mq, 0.0) >= self.renew_s
                else:
                    due = (
                        mq in self.wanted
                        and mq not in self.releasing
                        and (mq.topic, mq.broker_name, mq.queue_id) not in moving
                    )
                if due:
                    asks.setdefault(mq.addr, []).append(mq)
            async with trio.open_nursery() as nursery:
                for addr, mqs in asks.items():
                    nursery.start_soon(self._lock, addr, mqs)

    async def _lock(self, addr: str, mqs: list[MessageQueue]) -> None:
        s = self.state
        fields = {"group": s.group, "client_id": s.client_id, "queues": [[mq.topic, mq.queue_id] for mq in mqs]}
        sent = trio.current_time()
        try:
            reply = await self.requests.request(addr, RequestCode.LOCK_QUEUES, fields)
        except NET_ERRORS as e:
            log.debug("consumer %s: locking %d queues at %s failed: %s", s.client_id, len(mqs), addr, e)
            return
        self._learn_lease(int(reply.fields.get("lease_ms", DEFAULT_LEASE_MS)))
        got = {(t, q) for t, q in reply.fields.get("locked") or ()}
        unwanted = []
        for mq in mqs:
            if (mq.topic, mq.queue_id) not in got:
                if mq in self.held:  # another member holds it now: our lease lapsed on the broker
                    self.lapse(mq, "the broker gave its lock to another member")
                continue
            new = mq not in self.held
            self.held[mq], self._sent[mq] = sent + self.lease_s, sent
            if new and mq in self.wanted and mq not in self.releasing:
                log.info("consumer %s: locked %s/%s/%d", s.client_id, mq.broker_name, mq.topic, mq.queue_id)
                self.take(mq)
            elif new:
                unwanted.append(mq)  # the rebalance took it away meanwhile
        if unwanted:
            await self._unlock(addr, unwanted)

    def _learn_lease(self, lease_ms: int) -> None:
        """The broker's lease: renewals come at least three times per lease (a lease
        shorter than ``lock_renew_interval_ms`` would lapse between them)."""
        self.lease_s = lease_ms / 1000
        self.renew_s = min(self.renew_max_s, self.lease_s / 3)
        if self.renew_s < self.renew_max_s and not self._warned_lease:
            self._warned_lease = True
            log.info(
                "consumer %s: the broker's lock lease is %d ms: renewing every %d ms (lock_renew_interval_ms %d)",
                self.state.client_id,
                lease_ms,
                self.renew_s * 1000,
                self.renew_max_s * 1000,
            )

    def lapse(self, mq: MessageQueue, why: str) -> None:
        """Stop processing ``mq`` at once: its lease may have ended."""
        if self.held.pop(mq, None) is None:
            return
        self._sent.pop(mq, None)
        log.warning(
            "consumer %s: lost the lock of %s/%s/%d (%s): stopped reading it",
            self.state.client_id,
            mq.broker_name,
            mq.topic,
            mq.queue_id,
            why,
        )
        self.drop(mq)

    async def unlock(self, mqs: list[MessageQueue]) -> None:
        """Release ``mqs`` on their brokers (after the consumer committed them)."""
        by_addr: dict[str, list[MessageQueue]] = {}
        for mq in mqs:
            by_addr.setdefault(mq.addr, []).append(mq)
        async with self._requests:
            for addr, some in by_addr.items():
                await self._unlock(addr, some)

    async def _unlock(self, addr: str, mqs: list[MessageQueue]) -> None:
        """UNLOCK_QUEUES (holding ``_requests``); the queues are not held from now on,
        whatever the answer (a lost unlock ends with the lease)."""
        for mq in mqs:
            self.held.pop(mq, None)
            self._sent.pop(mq, None)
        s = self.state
        fields = {"group": s.group, "client_id": s.client_id, "queues": [[mq.topic, mq.queue_id] for mq in mqs]}
        try:
            await self.requests.request(addr, RequestCode.UNLOCK_QUEUES, fields)
        except NET_ERRORS as e:
            log.debug("consumer %s: unlocking %d queues at %s failed (they expire): %s", s.client_id, len(mqs), addr, e)

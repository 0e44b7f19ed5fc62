"""Where a batch goes and what happens after a failed try: the queue choice (round
robin, a sharding key, a selector; unhealthy and recently faulty brokers skipped), the
retry rules (which errors, same queue or elsewhere, dedup after an unknown outcome, the
leader a NOT_LEADER names) and a batch's tries (count, budget, backoff)."""

from __future__ import annotations

import re
import time
from typing import Callable, Sequence

import crc32c
import trio

from clmq.common import Message
from clmq.protocol import PROTOCOL_VERSION, ErrorCode
from clmq.protocol.transport import AuthenticationFailed, ConnectionFailed, RpcError

from .._routes import MessageQueue, NoRouteError, Routes
from ._future import SendError

# Worth another try (elsewhere): the broker is busy, stopping, failing, or the route is stale.
# STORE_FAILED: that broker's store failed (it reports itself unhealthy, and routes mark
# it so: producers skip it); the message was not stored durably there, so another broker may.
RETRIABLE = {
    ErrorCode.SYSTEM_BUSY,
    ErrorCode.SHUTTING_DOWN,
    ErrorCode.SYSTEM_ERROR,
    ErrorCode.IO_ERROR,
    ErrorCode.DISK_FULL,
    ErrorCode.TOPIC_NOT_FOUND,
    ErrorCode.INVALID_QUEUE_ID,
    ErrorCode.TIMEOUT,
    ErrorCode.STORE_FAILED,
    ErrorCode.NOT_LEADER,
    ErrorCode.NOT_ENOUGH_REPLICAS,
    ErrorCode.REPLICATION_TIMEOUT,
}
# Replication (sync acks): the group's replicas are behind, not its broker. Retried on
# the same queue (same group and queue id), so that the batch keeps its place in the
# queue's order. NOT_LEADER (the group's leader moved) is retried on the same queue
# too, at the leader it names or after fresh routes.
SAME_QUEUE = {ErrorCode.NOT_ENOUGH_REPLICAS, ErrorCode.REPLICATION_TIMEOUT}
# Answers after which the batch may be stored all the same: REPLICATION_TIMEOUT (stored
# on the leader, not yet held by enough replicas), NOT_LEADER (the leader stepped down
# after writing it). Their retries are marked dedup (as are those after a broken
# connection or a timeout).
AMBIGUOUS = {ErrorCode.REPLICATION_TIMEOUT, ErrorCode.NOT_LEADER}
MAX_ERRORS_REPORTED = 6  # a SendError names this many of the failures (the last ones)
_LEADER_IN_TEXT = re.compile(r"the leader is (\S+:\d+)")

QueueSelector = Callable[[Sequence[MessageQueue], Message], MessageQueue]


class NotLeader(RpcError):
    """NOT_LEADER, with the leader the broker named (``leader_addr``, "" if none)."""

    def __init__(self, addr: str, code: int, text: str, leader_addr: str) -> None:
        super().__init__(addr, code, text)
        self.leader_addr = leader_addr


def _leader_in(text: str) -> str:
    """The leader's address a NOT_LEADER text names ("... the leader is host:port")."""
    found = _LEADER_IN_TEXT.search(text)
    return found.group(1) if found else ""


def shard(key: str, count: int) -> int:
    """The queue index for a sharding key: stable across processes and machines."""
    return crc32c.crc32c(key.encode()) % count


class RetryPolicy:
    """A producer's retry settings (see :class:`client.Producer`)."""

    def __init__(
        self,
        retries: int,
        retry_budget_ms: int,
        retry_backoff_ms: int,
        retry_backoff_max_ms: int,
        fault_backoff_ms: int,
        replication_retry_backoff_ms: int,
    ) -> None:
        self.retries = retries
        self.retry_budget_ms = retry_budget_ms
        self.retry_backoff_ms = retry_backoff_ms
        self.retry_backoff_max_ms = retry_backoff_max_ms
        self.fault_backoff_ms = fault_backoff_ms
        self.replication_retry_backoff_ms = replication_retry_backoff_ms


class Tries:
    """One batch's tries: how many, until when, the next wait, and where the next goes."""

    def __init__(self, policy: RetryPolicy, started: float) -> None:
        self.minimum = policy.retries + 1
        self.deadline = started + policy.retry_budget_ms / 1000
        self.backoff_s = policy.retry_backoff_ms / 1000
        self.backoff_max_s = policy.retry_backoff_max_ms / 1000
        self.attempts = 0
        self.errors: list[str] = []
        self.last_code: int | None = None
        self.pinned: MessageQueue | None = None  # every retry goes to this queue (its group's leader now)
        self.hint: MessageQueue | None = None  # the next try goes here at once (NOT_LEADER named the leader)
        self.replicas_behind = False  # the last answer said so: wait for the group even if not routed
        self.dedup = False  # an earlier try may have been stored: ask the broker to check
        self.wait_s = 0.0  # at least this long before the next try
        self._hinted = False  # the last try went to a named leader without a pause

    def note(self, error: str, code: int | None) -> None:
        self.errors.append(error)
        if code is not None:
            self.last_code = code

    def more(self) -> bool:
        """Another try: fewer than the minimum so far, or time left in the budget."""
        return self.attempts < self.minimum or time.monotonic() < self.deadline

    def delay(self) -> float:
        """The wait before the next try (s), within the budget once the minimum is done.
        A leader named by NOT_LEADER is tried at once, but not twice in a row: during a
        hand-over the old leader names the new one, which names the old one until it
        leads, and a ping-pong without pauses spent the tries in milliseconds."""
        if self.hint is not None and not self._hinted:
            self._hinted = True
            return 0.0
        self._hinted = False
        delay = max(self.backoff_s, self.wait_s)
        self.backoff_s, self.wait_s = min(self.backoff_s * 2, self.backoff_max_s), 0.0
        if self.attempts >= self.minimum:
            delay = min(delay, max(0.0, self.deadline - time.monotonic()))
        return delay

    def error(self, topic: str) -> SendError:
        """The error of a send whose tries are spent."""
        shown = self.errors[-MAX_ERRORS_REPORTED:]
        more = f"({len(self.errors) - len(shown)} earlier failures not shown) " if len(self.errors) > len(shown) else ""
        return SendError(
            f"send to topic {topic!r} failed {self.attempts} times: {more}{'; '.join(shown)}", self.last_code
        )


class Targets:
    """The queue each try goes to, and the lessons of failed tries (faulty brokers,
    forgotten routes, pins and hints)."""

    def __init__(self, routes: Routes, policy: RetryPolicy) -> None:
        self.routes = routes
        self.policy = policy
        self._rr = 0  # the round robin's next index
        self._faulty: dict[str, float] = {}  # broker address -> avoid until (monotonic s)
        self._filtered: dict[tuple[str, str], tuple[list[MessageQueue], frozenset[str], list[MessageQueue]]] = {}
        self._routed: dict[str, tuple[float, list[MessageQueue]]] = {}  # topic -> (fresh until, its queues)
        self._looking_up: dict[str, trio.Lock] = {}
        self._indexed: dict[str, tuple[list[MessageQueue], dict[tuple[str, int], MessageQueue]]] = {}

    async def target(
        self,
        topic: str,
        first: Message,
        sharding_key: str | None,
        selector: QueueSelector | None,
        tries: Tries,
        refresh: bool | None = None,
        last: MessageQueue | None = None,
    ) -> MessageQueue | None:
        """The queue of the next try; None if there is none now (the failure is noted).
        ``refresh``: ask for fresh routes (default: on a retry). ``last``: the queue of
        the try that failed; a batch placed round robin moves only to another group's
        queue, else it keeps ``last`` (and its place in that queue's order: moved to
        another queue of the same broker it would go behind later batches, for nothing)."""
        tries.attempts += 1
        if refresh is None:
            refresh = tries.attempts > 1
        if tries.hint is not None:
            mq, tries.hint = tries.hint, None
            return mq
        if tries.pinned is not None:
            return await self._pinned(tries.pinned, tries, refresh)
        try:
            mq = await self.pick(topic, first, sharding_key, selector, refresh=refresh)
            if last is None or selector is not None or sharding_key is not None or mq.broker_name != last.broker_name:
                return mq
            return self._by_queue(topic, self._routed[topic][1]).get((last.broker_name, last.queue_id), mq)
        except NoRouteError as e:
            if not e.unreachable:
                raise
            tries.note(str(e), None)
        except SendError as e:  # no healthy broker: leaderless groups, failed stores
            if e.code not in RETRIABLE:
                raise
            tries.note(str(e), e.code)
        return None

    async def _pinned(self, pinned: MessageQueue, tries: Tries, refresh: bool) -> MessageQueue | None:
        """The pinned queue as fresh routes have it; None while its group has no leader.
        A group the routes no longer have unpins the batch (unless the replicas were
        behind: then the group is waited for)."""
        mq = await self._same_queue(pinned, refresh)
        if mq is None:
            tries.note(f"{pinned.broker_name} queue {pinned.queue_id}: not routed", None)
            if not tries.replicas_behind:
                tries.pinned = None
            return None
        if mq.addr in self.routes.leaderless:
            tries.note(f"{pinned.broker_name}: no leader (waiting for one)", ErrorCode.NOT_LEADER)
            return None
        return mq

    def failed(self, mq: MessageQueue, e: Exception, tries: Tries) -> bool:
        """Note a failed try and decide where the next goes; raises :class:`SendError`
        for an error not worth another try. True if the try may have been stored (its
        outcome is unknown: the next is marked dedup)."""
        maybe_stored = False
        if isinstance(e, RpcError):
            self._check_retriable(mq, e)
            tries.note(str(e), e.code)
            tries.replicas_behind = e.code in SAME_QUEUE
            if e.code in AMBIGUOUS:
                tries.dedup = maybe_stored = True
            if e.code in SAME_QUEUE or e.code == ErrorCode.NOT_LEADER:
                tries.pinned, tries.wait_s = mq, self.policy.replication_retry_backoff_ms / 1000
                if e.code == ErrorCode.NOT_LEADER:
                    self._follow_hint(mq, e, tries)
                if e.code in SAME_QUEUE:
                    return maybe_stored  # its broker is fine: the replicas are behind
            elif e.code == ErrorCode.STORE_FAILED:
                tries.pinned = None  # that broker takes no produce until restarted: another may
        else:
            # Nothing was sent on a connection that never opened, failed its TLS handshake or its login.
            never_sent = isinstance(e, AuthenticationFailed) or str(e).startswith(("cannot connect", "TLS handshake"))
            maybe_stored = not (isinstance(e, ConnectionFailed) and never_sent)
            tries.note(f"{mq.addr}: {e or 'timed out'}", None)
            tries.dedup |= maybe_stored
            if maybe_stored or self.routes.followers(mq.broker_name):  # a replicated group gets a new leader
                tries.pinned = mq
        self._faulty[mq.addr] = time.monotonic() + self.policy.fault_backoff_ms / 1000
        self.forget(mq.topic)
        return maybe_stored

    def _follow_hint(self, mq: MessageQueue, e: RpcError, tries: Tries) -> None:
        """NOT_LEADER naming the leader: the next try goes there at once (with name
        servers, or when a direct connection lists that address)."""
        leader = (e.leader_addr if isinstance(e, NotLeader) else "") or _leader_in(e.text)
        if leader and leader != mq.addr and (self.routes.namesrv_addrs or leader in self.routes.broker_addrs):
            tries.hint = mq._replace(addr=leader)

    @staticmethod
    def _check_retriable(mq: MessageQueue, e: RpcError) -> None:
        """Raise :class:`SendError` for an error answer not worth another try."""
        if e.code == ErrorCode.UNSUPPORTED_VERSION:
            raise SendError(
                f"broker {mq.addr} does not speak this client's protocol version {PROTOCOL_VERSION}: {e.text}", e.code
            ) from None
        if e.code not in RETRIABLE:
            raise SendError(str(e), e.code) from None

    async def _same_queue(self, mq: MessageQueue, refresh: bool) -> MessageQueue | None:
        """``mq`` (same group and queue id) as fresh routes have it: its group's leader
        may have changed. None if the routes no longer have it."""
        if refresh:
            self.forget(mq.topic)
        try:
            mqs = await self.routes.queues(mq.topic, refresh=refresh)
        except NoRouteError:
            return None
        self._routed[mq.topic] = (time.monotonic() + self.routes.refresh_interval_ms / 1000, mqs)
        return self._by_queue(mq.topic, mqs).get((mq.broker_name, mq.queue_id))

    def _by_queue(self, topic: str, mqs: list[MessageQueue]) -> dict[tuple[str, int], MessageQueue]:
        """``mqs`` by group and queue id, kept until the routes change: a retry of each of
        a failed request's batches looked its queue up among 65,536 one by one."""
        cached = self._indexed.get(topic)
        if cached is not None and cached[0] is mqs:
            return cached[1]
        index = {(m.broker_name, m.queue_id): m for m in mqs}
        self._indexed[topic] = (mqs, index)
        return index

    async def pick(
        self, topic: str, first: Message, sharding_key: str | None, selector: QueueSelector | None, refresh: bool
    ) -> MessageQueue:
        if not refresh:  # one look-up for many concurrent sends of a topic not routed yet, not one each
            async with self._looking_up.setdefault(topic, trio.Lock()):
                chosen = self.pick_now(topic, first, sharding_key, selector)
                if chosen is not None:
                    return chosen
                mqs = await self.routes.queues(topic)
        else:
            mqs = await self.routes.queues(topic, refresh=True)
        self._routed[topic] = (time.monotonic() + self.routes.refresh_interval_ms / 1000, mqs)
        return self._choose(topic, mqs, first, sharding_key, selector)

    async def first(
        self, topic: str, first: Message, sharding_key: str | None, selector: QueueSelector | None
    ) -> tuple[MessageQueue | None, Tries | None]:
        """The queue of a batch's first try; None and its first failure if none now."""
        try:
            return await self.pick(topic, first, sharding_key, selector, refresh=False), None
        except NoRouteError as e:
            if not e.unreachable:
                raise
            text, code = str(e), None
        except SendError as e:  # no healthy broker: leaderless groups, failed stores
            if e.code not in RETRIABLE:
                raise
            text, code = str(e), e.code
        tries = Tries(self.policy, time.monotonic())
        tries.attempts = 1
        tries.note(text, code)
        return None, tries

    def pick_now(
        self, topic: str, first: Message, sharding_key: str | None, selector: QueueSelector | None
    ) -> MessageQueue | None:
        """:meth:`pick` from the routes this producer fetched last, if still fresh (no
        await: a submit's common case); None if they must be fetched."""
        routed = self._routed.get(topic)
        if routed is None or routed[0] < time.monotonic():
            return None
        return self._choose(topic, routed[1], first, sharding_key, selector)

    def forget(self, topic: str) -> None:
        """Routes known stale: the next pick fetches them."""
        self._routed.pop(topic, None)
        self.routes.forget(topic)

    def _choose(
        self,
        topic: str,
        mqs: list[MessageQueue],
        first: Message,
        sharding_key: str | None,
        selector: QueueSelector | None,
    ) -> MessageQueue:
        mqs = self._healthy(topic, mqs)
        if selector is not None:
            return selector(mqs, first)
        if sharding_key is not None:
            return mqs[shard(sharding_key, len(mqs))]
        mqs = self._not_faulty(topic, mqs)
        rr = self._rr
        self._rr = rr + 1
        return mqs[rr % len(mqs)]

    def _healthy(self, topic: str, mqs: list[MessageQueue]) -> list[MessageQueue]:
        """``mqs`` without unhealthy brokers' queues; SendError if none is left."""
        if not mqs:
            raise NoRouteError(f"topic {topic!r} has no queues")
        failures = self.routes.failures
        if failures:  # unhealthy brokers take no produce (consumers still read them)
            routed, mqs = mqs, self._without(topic, mqs, frozenset(failures), "routed")
            if not mqs:
                down = sorted({failures[m.addr] for m in routed})
                # Every group leaderless: NOT_LEADER (a promotion is due), else a failed store.
                code = (
                    ErrorCode.NOT_LEADER
                    if {m.addr for m in routed} <= self.routes.leaderless
                    else ErrorCode.STORE_FAILED
                )
                raise SendError(f"topic {topic!r}: no healthy broker to send to ({code.name}): {'; '.join(down)}", code)
        return mqs

    def _not_faulty(self, topic: str, mqs: list[MessageQueue]) -> list[MessageQueue]:
        """``mqs`` without recently faulty brokers' queues (all of them if every one is)."""
        if self._faulty:
            now = time.monotonic()
            faulty = frozenset(addr for addr, until in self._faulty.items() if until > now)
            if faulty:
                return self._without(topic, mqs, faulty, "faulty") or mqs
            self._faulty.clear()  # all expired: the next picks skip this
        return mqs

    def round_robin_now(self, topic: str, count: int) -> tuple[list[MessageQueue], int] | None:
        """For ``count`` messages sent round robin (``submit_many``): the queues they may
        go to and the index of the first (message ``i`` to ``mqs[(start + i) % len]``),
        the counter advanced past them; None if the routes must be fetched first.
        Raises SendError when no broker is healthy."""
        routed = self._routed.get(topic)
        if routed is None or routed[0] < time.monotonic():
            return None
        mqs = self._not_faulty(topic, self._healthy(topic, routed[1]))
        start = self._rr
        self._rr = start + count
        return mqs, start

    def _without(self, topic: str, mqs: list[MessageQueue], addrs: frozenset[str], why: str) -> list[MessageQueue]:
        """``mqs`` without the queues of brokers ``addrs``, kept until either changes: a
        topic of 10,000 queues cost ~5 ms per send to filter anew."""
        key = (topic, why)
        cached = self._filtered.get(key)
        if cached is not None and cached[0] is mqs and cached[1] == addrs:
            return cached[2]
        kept = [m for m in mqs if m.addr not in addrs]
        self._filtered[key] = (mqs, addrs, kept)
        return kept

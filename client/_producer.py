"""The producer: sends messages to the queues of a topic, chosen round robin, by a
sharding key (one key, one queue, in order) or by a function; retries elsewhere, or on
the same queue when a replicated group's followers are behind (sync acks)."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import re
import secrets
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Mapping, NoReturn, Sequence

import crc32c
import trio

from commitlog import ClientError, Message
from protocol import PROTOCOL_VERSION, ErrorCode, RequestCode, encode_batch
from protocol.transport import ConnectionFailed, RpcClient, RpcError, background_nursery

from ._routes import MessageQueue, NoRouteError, Routes

log = logging.getLogger("clmq.producer")

# Worth another try (elsewhere): the broker is busy, stopping, failing, or the route is stale.
# STORE_FAILED: that broker's store failed (it reports itself unhealthy, and routes mark
# it so: producers skip it); the message was not stored durably there, so another broker may.
RETRIABLE = {ErrorCode.SYSTEM_BUSY, ErrorCode.SHUTTING_DOWN, ErrorCode.SYSTEM_ERROR, ErrorCode.IO_ERROR,
             ErrorCode.DISK_FULL, ErrorCode.TOPIC_NOT_FOUND, ErrorCode.INVALID_QUEUE_ID, ErrorCode.TIMEOUT,
             ErrorCode.STORE_FAILED, ErrorCode.NOT_LEADER, ErrorCode.NOT_ENOUGH_REPLICAS,
             ErrorCode.REPLICATION_TIMEOUT}  # fmt: skip
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
UNIQ_KEY = "UNIQ_KEY"  # the message property naming a message uniquely (RocketMQ's name)
DEFAULT_RETRIES = 2
DEFAULT_RETRY_BUDGET_MS = 15_000
MAX_ERRORS_REPORTED = 6  # a SendError names this many of the failures (the last ones)
_LEADER_IN_TEXT = re.compile(r"the leader is (\S+:\d+)")

QueueSelector = Callable[[Sequence[MessageQueue], Message], MessageQueue]


class SendError(ClientError):
    """A send that failed for good (after retries, or not retriable)."""

    def __init__(self, text: str, code: int | None = None) -> None:
        super().__init__(text)
        self.code = code


@dataclass(frozen=True)
class SendResult:
    queue: MessageQueue
    queue_offsets: list[int]
    commitlog_offsets: list[int]
    durable: bool  # fsynced before the answer (always, with sync flush, unless flush_timeout)
    flush_timeout: bool = False  # stored, but the broker's fsync did not finish in time
    duplicate: bool = False  # a retry the broker found stored already (by UNIQ_KEY): these are the first try's offsets
    uniq_keys: tuple[str, ...] = ()  # the messages' UNIQ_KEY properties, in order (empty without unique_ids)

    @property
    def queue_offset(self) -> int:
        return self.queue_offsets[0]

    @property
    def msg_ids(self) -> list[str]:
        """Broker address and commit-log offset: where the message can be found."""
        return [f"{self.queue.addr}@{o:016X}" for o in self.commitlog_offsets]


class _NotLeader(RpcError):
    """NOT_LEADER, with the leader the broker named (``leader_addr``, "" if none)."""

    def __init__(self, addr: str, code: int, text: str, leader_addr: str) -> None:
        super().__init__(addr, code, text)
        self.leader_addr = leader_addr


def _leader_in(text: str) -> str:
    """The leader's address a NOT_LEADER text names ("... the leader is host:port")."""
    found = _LEADER_IN_TEXT.search(text)
    return found.group(1) if found else ""


class _Tries:
    """One send's tries: how many, until when, the next wait, and where the next goes."""

    def __init__(self, producer: Producer, started: float) -> None:
        self.minimum = producer.retries + 1
        self.deadline = started + producer.retry_budget_ms / 1000
        self.backoff_s = producer.retry_backoff_ms / 1000
        self.backoff_max_s = producer.retry_backoff_max_ms / 1000
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

    async def pause(self) -> None:
        """The wait before the next try, within the budget once the minimum is done. A
        leader named by NOT_LEADER is tried at once, but not twice in a row: during a
        hand-over the old leader names the new one, which names the old one until it
        leads, and a ping-pong without pauses spent the tries in milliseconds."""
        if self.hint is not None and not self._hinted:
            self._hinted = True
            return
        self._hinted = False
        delay = max(self.backoff_s, self.wait_s)
        self.backoff_s, self.wait_s = min(self.backoff_s * 2, self.backoff_max_s), 0.0
        if self.attempts >= self.minimum:
            delay = min(delay, max(0.0, self.deadline - time.monotonic()))
        await trio.sleep(delay)

    def give_up(self, topic: str) -> NoReturn:
        shown = self.errors[-MAX_ERRORS_REPORTED:]
        more = f"({len(self.errors) - len(shown)} earlier failures not shown) " if len(self.errors) > len(shown) else ""
        raise SendError(f"send to topic {topic!r} failed {self.attempts} times: {more}{'; '.join(shown)}",
                        self.last_code)  # fmt: skip


def _encoded(msgs: list[Message], queue_id: int, cache: dict[int, bytes]) -> bytes:
    """The batch encoded for ``queue_id`` (the messages' ``queue_id`` set to it), once."""
    for m in msgs:
        m.queue_id = queue_id
    if queue_id not in cache:
        cache[queue_id] = encode_batch(msgs)
    return cache[queue_id]


def shard(key: str, count: int) -> int:
    """The queue index for a sharding key: stable across processes and machines."""
    return crc32c.crc32c(key.encode()) % count


class Producer:
    """Use :func:`open_producer` (trio) or :class:`client.BlockingProducer`.

    Retries: a send is tried at least ``1 + retries`` times and, beyond that, until
    ``retry_budget_ms`` has passed since it started (Kafka's ``delivery.timeout.ms``),
    waiting ``retry_backoff_ms`` before a retry, doubled each time up to
    ``retry_backoff_max_ms``. Default: ``retries`` 2 and a budget of 15 s; giving
    ``retries`` without ``retry_budget_ms`` keeps the count-only behaviour of earlier
    versions (budget 0). Only retriable failures are retried (see :meth:`send_batch`).
    ``unique_ids`` (default on) gives messages their ``UNIQ_KEY``: off, retries after
    an unknown outcome may store a batch twice.
    """

    def __init__(self, rpc: RpcClient, routes: Routes, *, send_timeout_ms: int = 3000, retries: int | None = None,
                 fault_backoff_ms: int = 3000, replication_retry_backoff_ms: int = 200,
                 retry_budget_ms: int | None = None, retry_backoff_ms: int = 50,
                 retry_backoff_max_ms: int = 500, unique_ids: bool = True) -> None:  # fmt: skip
        self.rpc = rpc
        self.replication_retry_backoff_ms = replication_retry_backoff_ms
        self.routes = routes
        self.send_timeout_ms = send_timeout_ms
        self.retries = DEFAULT_RETRIES if retries is None else retries
        if retry_budget_ms is None:
            retry_budget_ms = DEFAULT_RETRY_BUDGET_MS if retries is None else 0
        self.retry_budget_ms = retry_budget_ms
        self.retry_backoff_ms = retry_backoff_ms
        self.retry_backoff_max_ms = retry_backoff_max_ms
        self.fault_backoff_ms = fault_backoff_ms
        # UNIQ_KEY per message (about 1.5 us and 45 bytes per message): without it a
        # retry after an unknown outcome cannot be recognised (at least once).
        self.unique_ids = unique_ids
        self.producer_id = secrets.token_hex(8)  # the first half of every UNIQ_KEY this producer makes
        self._uniq = itertools.count()
        self._rr = itertools.count()
        self._faulty: dict[str, float] = {}  # broker address -> avoid until (monotonic s)
        self._filtered: dict[tuple[str, str], tuple[list[MessageQueue], frozenset[str], list[MessageQueue]]] = {}

    async def send(self, topic: str, body: bytes, *, tags: str = "", keys: str = "",
                   properties: Mapping[str, str] | None = None, sharding_key: str | None = None,
                   selector: QueueSelector | None = None) -> SendResult:  # fmt: skip
        """Send one message; returns where it was stored."""
        msg = Message(topic, 0, body, tags, keys, dict(properties or {}), born_timestamp_ms=int(time.time() * 1000))
        return await self.send_batch(topic, [msg], sharding_key=sharding_key, selector=selector)

    async def send_batch(self, topic: str, messages: Sequence[Message | bytes], *, sharding_key: str | None = None,
                         selector: QueueSelector | None = None) -> SendResult:  # fmt: skip
        """Send messages as one request to one queue (in order). The producer sets the
        messages' ``queue_id`` to the queue it picks, and gives each message without
        one a unique id, the property ``UNIQ_KEY``.

        Retries (see the class): a busy, failing or unreachable broker, or a stale
        route, elsewhere (fresh routes). After a failure whose outcome is unknown (the
        connection broke after sending, no answer in ``send_timeout_ms``,
        REPLICATION_TIMEOUT, NOT_LEADER), and after NOT_ENOUGH_REPLICAS, to *the same
        queue* (same group and queue id, its leader's address looked up again) while the
        routes still have that group: the batch keeps its place in the queue's order,
        and the retry is marked ``dedup`` so that the broker answers with the offsets of
        a first try that was in fact stored instead of storing it twice (within the
        broker's ``dedup_window_ms``). NOT_LEADER naming the new leader is retried there
        at once. A send that fails for good raises :class:`SendError` whose ``code`` is
        the last broker's error code (e.g. NOT_ENOUGH_REPLICAS)."""
        msgs = [m if isinstance(m, Message) else Message(topic, 0, m) for m in messages]
        if not msgs:
            raise ValueError("send_batch needs at least one message")
        if self.unique_ids:
            self._identify(msgs)
        encoded: dict[int, bytes] = {}  # queue id -> the batch encoded for it
        tries = _Tries(self, time.monotonic())
        while True:
            mq = await self._target(topic, msgs[0], sharding_key, selector, tries)
            if mq is not None:
                try:
                    result = await self.send_to(mq, _encoded(msgs, mq.queue_id, encoded), len(msgs), dedup=tries.dedup)
                    if not self.unique_ids:
                        return result
                    return dataclasses.replace(result, uniq_keys=tuple(m.properties[UNIQ_KEY] for m in msgs))
                except (ConnectionFailed, trio.TooSlowError, RpcError) as e:
                    self._failed(mq, e, tries)
            if not tries.more():
                tries.give_up(topic)
            await tries.pause()

    def _identify(self, msgs: list[Message]) -> None:
        """Give every message without a ``UNIQ_KEY`` one: this producer's id and a count."""
        for m in msgs:
            if UNIQ_KEY not in m.properties:
                key = f"{self.producer_id}{next(self._uniq):016X}"
                if isinstance(m.properties, dict):
                    m.properties[UNIQ_KEY] = key
                else:
                    m.properties = {**m.properties, UNIQ_KEY: key}

    async def _target(self, topic: str, first: Message, sharding_key: str | None, selector: QueueSelector | None,
                      tries: _Tries) -> MessageQueue | None:  # fmt: skip
        """The queue of the next try; None if there is none now (the failure is noted)."""
        tries.attempts += 1
        if tries.hint is not None:
            mq, tries.hint = tries.hint, None
            return mq
        if tries.pinned is not None:
            return await self._pinned(tries.pinned, tries)
        try:
            return await self._pick(topic, first, sharding_key, selector, refresh=tries.attempts > 1)
        except NoRouteError as e:
            if not e.unreachable:
                raise
            tries.note(str(e), None)
        except SendError as e:  # no healthy broker: leaderless groups, failed stores
            if e.code not in RETRIABLE:
                raise
            tries.note(str(e), e.code)
        return None

    async def _pinned(self, pinned: MessageQueue, tries: _Tries) -> MessageQueue | None:
        """The pinned queue as fresh routes have it; None while its group has no leader.
        A group the routes no longer have unpins the batch (unless the replicas were
        behind: then the group is waited for)."""
        mq = await self._same_queue(pinned)
        if mq is None:
            tries.note(f"{pinned.broker_name} queue {pinned.queue_id}: not routed", None)
            if not tries.replicas_behind:
                tries.pinned = None
            return None
        if mq.addr in self.routes.leaderless:
            tries.note(f"{pinned.broker_name}: no leader (waiting for one)", ErrorCode.NOT_LEADER)
            return None
        return mq

    def _failed(self, mq: MessageQueue, e: Exception, tries: _Tries) -> None:
        """Note a failed try and decide where the next goes; raises :class:`SendError`
        for an error not worth another try."""
        if isinstance(e, RpcError):
            self._check_retriable(mq, e)
            tries.note(str(e), e.code)
            tries.replicas_behind = e.code in SAME_QUEUE
            if e.code in AMBIGUOUS:
                tries.dedup = True
            if e.code in SAME_QUEUE or e.code == ErrorCode.NOT_LEADER:
                tries.pinned, tries.wait_s = mq, self.replication_retry_backoff_ms / 1000
                if e.code == ErrorCode.NOT_LEADER:
                    self._follow_hint(mq, e, tries)
                if e.code in SAME_QUEUE:
                    return  # its broker is fine: the replicas are behind
            elif e.code == ErrorCode.STORE_FAILED:
                tries.pinned = None  # that broker takes no produce until restarted: another may
        else:
            sent = not (isinstance(e, ConnectionFailed) and str(e).startswith("cannot connect"))
            tries.note(f"{mq.addr}: {e or 'timed out'}", None)
            tries.dedup |= sent  # it may have been stored
            if sent or self.routes.followers(mq.broker_name):  # a replicated group gets a new leader
                tries.pinned = mq
        self._faulty[mq.addr] = time.monotonic() + self.fault_backoff_ms / 1000
        self.routes.forget(mq.topic)

    def _follow_hint(self, mq: MessageQueue, e: RpcError, tries: _Tries) -> None:
        """NOT_LEADER naming the leader: the next try goes there at once (with name
        servers, or when a direct connection lists that address)."""
        leader = (e.leader_addr if isinstance(e, _NotLeader) else "") or _leader_in(e.text)
        if leader and leader != mq.addr and (self.routes.namesrv_addrs or leader in self.routes.broker_addrs):
            tries.hint = mq._replace(addr=leader)

    @staticmethod
    def _check_retriable(mq: MessageQueue, e: RpcError) -> None:
        """Raise :class:`SendError` for an error answer not worth another try."""
        if e.code == ErrorCode.UNSUPPORTED_VERSION:
            raise SendError(f"broker {mq.addr} does not speak this client's protocol version "
                            f"{PROTOCOL_VERSION}: {e.text}", e.code) from None  # fmt: skip
        if e.code not in RETRIABLE:
            raise SendError(str(e), e.code) from None

    async def _same_queue(self, mq: MessageQueue) -> MessageQueue | None:
        """``mq`` (same group and queue id) as fresh routes have it: its group's leader
        may have changed. None if the routes no longer have it."""
        self.routes.forget(mq.topic)
        try:
            mqs = await self.routes.queues(mq.topic, refresh=True)
        except NoRouteError:
            return None
        return next((m for m in mqs if m.broker_name == mq.broker_name and m.queue_id == mq.queue_id), None)

    async def send_to(self, mq: MessageQueue, body: bytes, count: int, *, dedup: bool = False) -> SendResult:
        """Send an encoded batch (``encode_batch`` of messages whose ``queue_id`` is
        ``mq.queue_id``) to one queue; no retries. ``dedup``: the broker answers with
        the offsets of the same batch (by ``UNIQ_KEY``) if it has stored it already."""
        fields: dict[str, object] = {"topic": mq.topic, "dedup": True} if dedup else {"topic": mq.topic}
        reply = await self.rpc.request(mq.addr, RequestCode.SEND_MESSAGE, fields, body,
                                       timeout_ms=self.send_timeout_ms, check=False)  # fmt: skip
        flush_timeout = reply.error_code == ErrorCode.FLUSH_DISK_TIMEOUT
        if reply.error_code and not flush_timeout:
            if reply.error_code == ErrorCode.NOT_LEADER:
                leader = reply.fields.get("leader_addr")
                raise _NotLeader(mq.addr, reply.error_code, reply.error_text, leader if isinstance(leader, str) else "")
            raise RpcError(mq.addr, reply.error_code, reply.error_text)
        f = reply.fields
        return SendResult(mq, f["queue_offsets"], f["commitlog_offsets"], bool(f["durable"]), flush_timeout,
                          bool(f.get("duplicate", False)))  # fmt: skip

    async def send_oneway(self, topic: str, body: bytes, *, tags: str = "", keys: str = "",
                          sharding_key: str | None = None) -> None:  # fmt: skip
        """Send without waiting for (or getting) an answer: fastest, no guarantee."""
        mq = await self._pick(topic, Message(topic, 0, body, tags, keys), sharding_key, None, refresh=False)
        msg = Message(topic, mq.queue_id, body, tags, keys, born_timestamp_ms=int(time.time() * 1000))
        await self.rpc.oneway(mq.addr, RequestCode.SEND_MESSAGE, {"topic": topic}, encode_batch([msg]))

    async def _pick(self, topic: str, first: Message, sharding_key: str | None, selector: QueueSelector | None,
                    refresh: bool) -> MessageQueue:  # fmt: skip
        mqs = await self.routes.queues(topic, refresh=refresh)
        if not mqs:
            raise NoRouteError(f"topic {topic!r} has no queues")
        failures = self.routes.failures
        if failures:  # unhealthy brokers take no produce (consumers still read them)
            routed, mqs = mqs, self._without(topic, mqs, frozenset(failures), "routed")
            if not mqs:
                down = sorted({failures[m.addr] for m in routed})
                # Every group leaderless: NOT_LEADER (a promotion is due), else a failed store.
                code = ErrorCode.NOT_LEADER if {m.addr for m in routed} <= self.routes.leaderless else ErrorCode.STORE_FAILED
                raise SendError(f"topic {topic!r}: no healthy broker to send to ({code.name}): {'; '.join(down)}",
                                code)  # fmt: skip
        if selector is not None:
            return selector(mqs, first)
        if sharding_key is not None:
            return mqs[shard(sharding_key, len(mqs))]
        now = time.monotonic()
        faulty = frozenset(addr for addr, until in self._faulty.items() if until > now)
        healthy = (self._without(topic, mqs, faulty, "faulty") or mqs) if faulty else mqs
        return healthy[next(self._rr) % len(healthy)]

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


@asynccontextmanager
async def open_producer(namesrv_addrs: list[str] | None = None, *, broker_addrs: list[str] | None = None,
                        **options: Any) -> AsyncIterator[Producer]:  # fmt: skip
    """A producer for trio code: ``async with open_producer(["127.0.0.1:9876"]) as p:``."""
    async with background_nursery() as nursery:
        rpc = RpcClient(nursery)
        try:
            yield Producer(rpc, Routes(rpc, namesrv_addrs or [], broker_addrs=broker_addrs), **options)
        finally:
            await rpc.aclose()
            nursery.cancel_scope.cancel()

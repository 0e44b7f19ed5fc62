"""The producer: sends messages to the queues of a topic, chosen round robin, by a
sharding key (one key, one queue, in order) or by a function; retries elsewhere, or on
the same queue when a replicated group's followers are behind (sync acks)."""

from __future__ import annotations

import itertools
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Mapping, Sequence

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
# queue's order; REPLICATION_TIMEOUT means stored on the leader, so the retry may store
# it twice (at least once). NOT_LEADER (the group's leader moved) is retried after
# fresh routes, like a stale route.
SAME_QUEUE = {ErrorCode.NOT_ENOUGH_REPLICAS, ErrorCode.REPLICATION_TIMEOUT}

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

    @property
    def queue_offset(self) -> int:
        return self.queue_offsets[0]

    @property
    def msg_ids(self) -> list[str]:
        """Broker address and commit-log offset: where the message can be found."""
        return [f"{self.queue.addr}@{o:016X}" for o in self.commitlog_offsets]


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
    """Use :func:`open_producer` (trio) or :class:`client.BlockingProducer`."""

    def __init__(self, rpc: RpcClient, routes: Routes, *, send_timeout_ms: int = 3000, retries: int = 2,
                 fault_backoff_ms: int = 3000, replication_retry_backoff_ms: int = 200) -> None:  # fmt: skip
        self.rpc = rpc
        self.replication_retry_backoff_ms = replication_retry_backoff_ms
        self.routes = routes
        self.send_timeout_ms = send_timeout_ms
        self.retries = retries
        self.fault_backoff_ms = fault_backoff_ms
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
        messages' ``queue_id`` to the queue it picks.

        Retries (``retries``): a busy, failing or unreachable broker, or a stale route,
        elsewhere (fresh routes); NOT_LEADER (the group's leader moved) after fresh
        routes. NOT_ENOUGH_REPLICAS and REPLICATION_TIMEOUT (sync acks) to *the same
        queue* (same group and queue id, its leader's address looked up again), after
        ``replication_retry_backoff_ms`` (NOT_LEADER waits as long: a promotion takes a
        moment to reach the name servers): the batch keeps its place in the queue's order.
        At least once: a batch answered REPLICATION_TIMEOUT is stored on the leader (only
        not yet held by enough replicas), so its retry may store it twice (Kafka without
        idempotence). A send that fails for good raises :class:`SendError` whose ``code``
        is the last broker's error code (e.g. NOT_ENOUGH_REPLICAS)."""
        msgs = [m if isinstance(m, Message) else Message(topic, 0, m) for m in messages]
        if not msgs:
            raise ValueError("send_batch needs at least one message")
        encoded: dict[int, bytes] = {}  # queue id -> the batch encoded for it
        errors: list[str] = []
        last_code: int | None = None  # the last broker's error code, for the caller (e.g. STORE_FAILED)
        pinned: MessageQueue | None = None  # set by a replication error: every retry goes to this queue
        wait = False  # before the next attempt: the replicas, or the new leader, need time
        for attempt in range(self.retries + 1):
            if wait:
                await trio.sleep(self.replication_retry_backoff_ms / 1000)
            target: MessageQueue | None
            if pinned is None:
                target = await self._pick(topic, msgs[0], sharding_key, selector, refresh=attempt > 0)
            elif (target := await self._same_queue(pinned)) is None:
                errors.append(f"{pinned.broker_name} queue {pinned.queue_id}: not routed")
                continue  # wait stays set
            mq, wait = target, False
            try:
                return await self.send_to(mq, _encoded(msgs, mq.queue_id, encoded), len(msgs))
            except (ConnectionFailed, trio.TooSlowError) as e:
                errors.append(f"{mq.addr}: {e or 'timed out'}")
            except RpcError as e:
                self._check_retriable(mq, e)
                errors.append(str(e))
                last_code = e.code
                wait = e.code in SAME_QUEUE or e.code == ErrorCode.NOT_LEADER
                if e.code in SAME_QUEUE:
                    pinned = mq
                    continue  # its broker is fine: the replicas are behind
            self._faulty[mq.addr] = time.monotonic() + self.fault_backoff_ms / 1000
            self.routes.forget(topic)
        raise SendError(f"send to topic {topic!r} failed {self.retries + 1} times: {'; '.join(errors)}",
                        last_code)  # fmt: skip

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

    async def send_to(self, mq: MessageQueue, body: bytes, count: int) -> SendResult:
        """Send an encoded batch (``encode_batch`` of messages whose ``queue_id`` is
        ``mq.queue_id``) to one queue; no retries."""
        reply = await self.rpc.request(mq.addr, RequestCode.SEND_MESSAGE, {"topic": mq.topic}, body,
                                       timeout_ms=self.send_timeout_ms, check=False)  # fmt: skip
        flush_timeout = reply.error_code == ErrorCode.FLUSH_DISK_TIMEOUT
        if reply.error_code and not flush_timeout:
            raise RpcError(mq.addr, reply.error_code, reply.error_text)
        f = reply.fields
        return SendResult(mq, f["queue_offsets"], f["commitlog_offsets"], bool(f["durable"]), flush_timeout)

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
                        **options: int) -> AsyncIterator[Producer]:  # fmt: skip
    """A producer for trio code: ``async with open_producer(["127.0.0.1:9876"]) as p:``."""
    async with background_nursery() as nursery:
        rpc = RpcClient(nursery)
        try:
            yield Producer(rpc, Routes(rpc, namesrv_addrs or [], broker_addrs=broker_addrs), **options)
        finally:
            await rpc.aclose()
            nursery.cancel_scope.cancel()

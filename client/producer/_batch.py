"""The accumulator's parts shared by its modules: a batch, a queue's buffer, a request,
and what the sender and the retries need of the accumulator (protocols:
the modules import this one, not each other)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol, Sequence

import trio

from clmq.common import Message, set_queue_id
from clmq.protocol.transport import RpcClient

from .._routes import MessageQueue
from ._future import UNIQ_KEY, SendError, SendFuture
from ._options import ProducerOptions
from ._tries import QueueSelector, RetryPolicy, Targets, Tries

QueueKey = tuple[str, str, int]  # topic, broker name, queue id


class Batch:
    """Messages to one queue sent together, with the futures of the calls they came
    from: one ``submit_batch`` (one future), or single ``submit`` calls merged (a future
    per message, ``per_message``). Only the first message is kept as an object (a
    retry's selector needs one); the rest is encoded bytes and UNIQ_KEYs: fewer objects
    for the cyclic collector to scan while a buffer of 64 MiB waits (slots: no dict
    each, at 10,000 queues a batch per message)."""

    __slots__ = (
        "_body",
        "_born_ms",
        "_first",
        "alone",
        "chunks",
        "count",
        "created",
        "done",
        "encoded_for",
        "futures",
        "gen",
        "history",
        "keys",
        "lane",
        "mq",
        "next_mq",
        "open",
        "per_message",
        "selector",
        "sharding_key",
        "size",
        "span",
        "starts",
        "topic",
        "tries",
        "waiting",
    )

    def __init__(
        self,
        topic: str,
        first: Message,
        count: int,
        keys: Sequence[str],
        chunk: bytes,
        fut: SendFuture,
        mq: MessageQueue,
        gen: int,
        sharding_key: str | None,
        selector: QueueSelector | None,
        per_message: bool,
        plain: bool = False,
    ) -> None:
        self.topic = topic
        # A plain message (no tags, keys or properties but its UNIQ_KEY, ``keys[0]``) is
        # made again if a retry's selector wants it: three objects fewer to keep.
        self._first: Message | None = None if plain else first
        self._body, self._born_ms = first.body, first.born_timestamp_ms
        self.count = count
        # Tuples until a message joins (a tuple of strings or bytes is not tracked by the
        # collector once it has seen it: two objects fewer per batch to scan again).
        self.keys: list[str] | tuple[str, ...] = keys if isinstance(keys, tuple) else list(keys)  # UNIQ_KEYs, in order
        self.chunks: list[bytes] | tuple[bytes, ...] = (
            chunk,
        )  # encoded for queue ``encoded_for``; a request joins them
        self.size = len(chunk)
        self.futures = [fut]
        self.per_message = per_message  # futures[i] is message i's (else futures[0] is the whole batch's)
        self.mq = mq  # the queue of its last (or next) try
        self.created = time.monotonic()  # its retry budget and linger count from here
        self.gen = gen  # flush generation
        self.sharding_key = sharding_key
        self.selector = selector
        self.open = per_message  # single submits may still join it
        self.encoded_for = first.queue_id
        self._no_tries_yet()

    def _no_tries_yet(self) -> None:
        """The state of its tries, its retries' grouping and its span: none yet."""
        self.tries: Tries | None = None  # made at its first failure
        self.history: tuple[int, ...] = ()  # the requests whose outcome was unknown: dedup, sent only with its like
        self.alone = False  # sent in a request of its own (another batch's bad message failed a shared one)
        self.done = False
        self.next_mq: MessageQueue | None = None  # a retry's target, until the batch is queued again
        # submit_many's runs merged (not per_message): futures[i] is messages starts[i]..starts[i + 1]
        self.starts: list[int] | None = None
        # A span (``_span``): the queues it holds a place in, how many of them do not
        # have it at their head (unmuted) yet, and the sender it goes to. None: a batch of one queue.
        self.span: list[QueueBuffer] | None = None
        self.waiting = 0
        self.lane: SenderLike | None = None

    @classmethod
    def plain_run(
        cls,
        topic: str,
        mq: MessageQueue,
        born_ms: int,
        first_body: bytes,
        keys: list[str],
        chunk: bytes,
        fut: SendFuture,
        sharding_key: str | None,
    ) -> Batch:
        """A run of plain messages to queue ``mq`` (``submit_many``: no tags, keys or
        properties but their UNIQ_KEYs ``keys``, encoded together as ``chunk``), with
        one future for them all; later runs to the queue may join it (``starts``), single
        submits do not. No Message is made (see :attr:`first`)."""
        b = cls.__new__(cls)
        b.topic, b._first, b._body, b._born_ms = topic, None, first_body, born_ms
        b.count, b.keys, b.chunks, b.size = len(keys), keys, (chunk,), len(chunk)
        b.futures, b.per_message, b.mq, b.created, b.gen = [fut], False, mq, time.monotonic(), 0
        b.sharding_key, b.selector, b.open, b.encoded_for = sharding_key, None, True, mq.queue_id
        b.starts = [0]
        b.tries, b.history, b.alone, b.done, b.next_mq = None, (), False, False, None
        b.span, b.waiting, b.lane = None, 0, None
        return b

    @classmethod
    def spanning(
        cls,
        topic: str,
        mq: MessageQueue,
        born_ms: int,
        first_body: bytes,
        keys: list[str],
        chunk: bytes,
        fut: SendFuture,
        queues: list[QueueBuffer],
        lane: SenderLike,
    ) -> Batch:
        """A span (``_span``): plain messages of one ``submit_many`` call to the queues
        ``queues`` of one broker, each encoded with its own queue id in ``chunk`` (``mq``:
        its first message's queue), one future for them all. It holds a place in each of
        its queues and is sent once it is at the head of all of them (``lane``)."""
        b = cls.plain_run(topic, mq, born_ms, first_body, keys, chunk, fut, None)
        b.open = False
        b.span, b.lane = queues, lane
        return b

    def append(self, chunk: bytes, keys: Sequence[str], count: int, fut: SendFuture) -> None:
        """``count`` more messages at the back (not sent yet): encoded for
        :attr:`encoded_for` as ``chunk``, their UNIQ_KEYs ``keys`` (none without unique
        ids), the future that answers them ``fut``."""
        self.futures.append(fut)
        chunks, have = self.chunks, self.keys
        if isinstance(chunks, tuple):  # its first join: lists from now on
            self.chunks = chunks = list(chunks)
        if isinstance(have, tuple):
            self.keys = have = list(have)
        chunks.append(chunk)
        have.extend(keys)
        self.size += len(chunk)
        self.count += count

    def join_run(
        self,
        keys: Sequence[str],
        chunk: bytes,
        fut: SendFuture,
        gen: int,
        sharding_key: str | None,
        queue_id: int,
        batch_max_bytes: int,
    ) -> bool:
        """Append a ``submit_many`` run (see :meth:`plain_run`) if this batch is one that
        it may join: not sent yet, of flush generation ``gen``, the same sharding key,
        encoded for ``queue_id``, within ``batch_max_bytes``. Whether it joined."""
        starts = self.starts
        if (
            starts is None
            or self.span is not None
            or not self.open
            or self.gen != gen
            or self.sharding_key != sharding_key
            or self.encoded_for != queue_id
            or self.size + len(chunk) > batch_max_bytes
        ):
            return False
        starts.append(self.count)
        self.append(chunk, keys, len(keys), fut)
        return True

    @property
    def first(self) -> Message:
        """The batch's first message (a retry's selector is given it)."""
        if self._first is None:
            props = {UNIQ_KEY: self.keys[0]}
            self._first = Message(self.topic, self.encoded_for, self._body, "", "", props, 0, self._born_ms)
        return self._first

    def encode_for(self, queue_id: int) -> None:
        """Encode for another queue (a retry elsewhere): each message's queue id changes."""
        if queue_id != self.encoded_for:
            self.chunks = (set_queue_id(b"".join(self.chunks), queue_id, self.count),)
            self.encoded_for = queue_id
            if self._first is not None:
                self._first.queue_id = queue_id


class QueueBuffer:
    """One queue's batches waiting to be sent, in order, and the broker they go to."""

    __slots__ = ("batches", "bytes", "key", "mq", "muted", "parked", "sender")

    def __init__(self, key: QueueKey, mq: MessageQueue, sender: SenderLike) -> None:
        self.key = key
        self.mq = mq  # the queue at its current address (the group's leader)
        self.sender = sender
        self.batches: deque[Batch] = deque()
        self.bytes = 0
        self.muted = False  # a batch of it is in flight or being retried
        self.parked = False  # its head is a span that counted it (``Batch.waiting``)


@dataclass
class Request:
    """Batches of one topic sent together (to one broker)."""

    id: int
    topic: str
    batches: list[Batch]
    queues: list[QueueBuffer]  # muted until the answer
    dedup: bool


class SenderLike(Protocol):
    """One broker's sender, as the accumulator sees it (``_send_sender.Sender``)."""

    ready: dict[QueueKey, QueueBuffer]
    pending: int
    in_flight: int

    def wake(self) -> None: ...
    def make_ready(self, qb: QueueBuffer) -> None: ...
    def span_ready(self, span: Batch) -> bool: ...
    def forget(self, qb: QueueBuffer) -> None: ...


class Buffers(Protocol):
    """The accumulator, as its sender and its retries see it (``_accumulator.Accumulator``)."""

    rpc: RpcClient
    targets: Targets
    policy: RetryPolicy
    settings: ProducerOptions
    nursery: trio.Nursery
    queues: dict[QueueKey, QueueBuffer]
    unrouted: dict[str, list[Batch]]
    linger_s: float
    batch_max_bytes: int
    send_timeout_ms: int
    unique_ids: bool

    @property
    def urgent(self) -> bool: ...
    def next_request_id(self) -> int: ...
    def failed(self, req: Request, error: Exception) -> None: ...
    def fail(self, batch: Batch, error: SendError) -> None: ...
    def finished(self, batch: Batch) -> None: ...
    def unmute(self, qb: QueueBuffer) -> None: ...
    def requeue(self, old: QueueKey | None, batches: list[Batch]) -> None: ...

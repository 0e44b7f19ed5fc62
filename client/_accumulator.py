"""The producer's accumulator (Kafka's RecordAccumulator, RocketMQ's batching): sends
wait in per-queue buffers, and one sender task per broker (``_send_sender``) sends
every ready queue's batches for a topic as one request.

A batch is one ``submit_batch`` (kept whole, in order) or a run of single-message
``submit`` calls to one queue merged together (its *open* batch: not sent yet). Per
queue (topic, broker name, queue id: the group's leader may move, the queue stays)
batches are sent in order; a queue with a batch in flight is *muted* (no further
batch of it is sent until the answer), so a retried batch goes back to the front of
its queue and never overtakes a later one. Back-pressure: ``buffer_max_bytes`` of
encoded messages accepted and not yet answered; ``flush`` and closing make every
buffered batch ready at once.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from commitlog import Message
from protocol import encode_batch
from protocol.transport import RpcClient

from ._routes import MessageQueue
from ._send_future import BatchTooLargeError, BufferFullError, SendError, SendFuture
from ._send_tries import QueueSelector, RetryPolicy, Targets, Tries

if TYPE_CHECKING:
    from ._send_sender import Sender

QueueKey = tuple[str, str, int]  # topic, broker name, queue id
BUFFER_FULL_MODES = ("block", "raise")
FRAME_HEADROOM_BYTES = 64 << 10  # a request's fields and framing, besides its messages
YIELD_EVERY_SUBMITS = 64  # a submit that found nothing to wait for yields this often (lets the senders run)


@dataclass(frozen=True)
class AccumulatorSettings:
    """The producer's batching settings (see :class:`client.Producer`)."""

    linger_ms: int = 5
    batch_max_bytes: int = 1 << 20
    max_in_flight: int = 5
    buffer_max_bytes: int = 64 << 20
    buffer_full: str = "block"
    buffer_block_max_ms: int = 60_000

    def __post_init__(self) -> None:
        for name in ("batch_max_bytes", "max_in_flight", "buffer_max_bytes"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"{name}={value!r}: must be a positive integer")
        for name in ("linger_ms", "buffer_block_max_ms"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ValueError(f"{name}={value!r}: must be an integer >= 0")
        if self.buffer_full not in BUFFER_FULL_MODES:
            raise ValueError(f"buffer_full={self.buffer_full!r}: must be one of {', '.join(BUFFER_FULL_MODES)}")


class Batch:
    """Messages to one queue sent together, with the futures of the calls they came from."""

    __slots__ = (
        "alone",
        "chunks",
        "created",
        "done",
        "encoded_for",
        "futures",
        "gen",
        "history",
        "mq",
        "msgs",
        "next_mq",
        "open",
        "selector",
        "sharding_key",
        "size",
        "topic",
        "tries",
    )  # fmt: skip

    def __init__(self, topic: str, msgs: list[Message], chunk: bytes, fut: SendFuture, mq: MessageQueue, gen: int,
                 sharding_key: str | None, selector: QueueSelector | None, open_: bool) -> None:  # fmt: skip
        self.topic = topic
        self.msgs = msgs
        self.chunks = [chunk]  # encoded for queue ``encoded_for``; the request joins them
        self.size = len(chunk)
        self.futures: list[tuple[SendFuture, int, int]] = [(fut, 0, len(msgs))]  # future, first message, count
        self.mq = mq  # the queue of its last (or next) try
        self.created = time.monotonic()  # its retry budget and linger count from here
        self.gen = gen  # flush generation
        self.tries: Tries | None = None  # made at its first failure
        self.history: tuple[int, ...] = ()  # the requests whose outcome was unknown: dedup, sent only with its like
        self.alone = False  # sent in a request of its own (another batch's bad message failed a shared one)
        self.sharding_key = sharding_key
        self.selector = selector
        self.open = open_  # single submits may still join it
        self.encoded_for = mq.queue_id
        self.done = False
        self.next_mq: MessageQueue | None = None  # a retry's target, until the batch is queued again

    def encode_for(self, queue_id: int) -> None:
        """Encode for another queue (a retry elsewhere): each message's queue id changes."""
        if queue_id != self.encoded_for:
            for m in self.msgs:
                m.queue_id = queue_id
            self.chunks = [encode_batch(self.msgs)]
            self.encoded_for = queue_id


class QueueBuffer:
    """One queue's batches waiting to be sent, in order, and the broker they go to."""

    __slots__ = ("batches", "bytes", "key", "mq", "muted", "sender")

    def __init__(self, key: QueueKey, mq: MessageQueue, sender: Sender) -> None:
        self.key = key
        self.mq = mq  # the queue at its current address (the group's leader)
        self.sender = sender
        self.batches: deque[Batch] = deque()
        self.bytes = 0
        self.muted = False  # a batch of it is in flight or being retried


class Accumulator:
    """Per-queue buffers and per-broker senders of one producer (see the module)."""

    def __init__(self, rpc: RpcClient, targets: Targets, policy: RetryPolicy, settings: AccumulatorSettings,
                 send_timeout_ms: int, unique_ids: bool, nursery: trio.Nursery) -> None:  # fmt: skip
        self.rpc = rpc
        self.targets = targets
        self.policy = policy
        self.settings = settings
        self.linger_s = settings.linger_ms / 1000
        self.batch_max_bytes = settings.batch_max_bytes
        self.send_timeout_ms = send_timeout_ms
        self.unique_ids = unique_ids
        self.nursery = nursery
        self.max_request_bytes = rpc.max_frame_bytes - FRAME_HEADROOM_BYTES
        self.queues: dict[QueueKey, QueueBuffer] = {}
        self.senders: dict[str, Sender] = {}
        self.live: set[Batch] = set()  # not done: failed with "producer closed" if still here at the end
        self.buffered_bytes = 0
        self._room: trio.Event | None = None  # set when bytes are released (blocked submits wait on it)
        self.gen = 0
        self._pending_by_gen: dict[int, int] = {}
        self._gen_done: trio.Event | None = None
        self.flushing = 0
        self.closing = False
        self.closed = False
        self._since_yield = 0
        self._request_ids = 0

    def next_request_id(self) -> int:
        self._request_ids += 1
        return self._request_ids

    @property
    def urgent(self) -> bool:
        """Linger is over for everyone (a flush, or closing)."""
        return self.flushing > 0 or self.closing

    # ------------------------------------------------------------------ accepting
    def check_size(self, size: int) -> None:
        """Refuse a batch that could never be sent."""
        if size > self.settings.buffer_max_bytes:
            raise BatchTooLargeError(f"a batch of {size:,} encoded bytes exceeds the producer's "
                                     f"buffer_max_bytes={self.settings.buffer_max_bytes:,}")  # fmt: skip
        if size > self.max_request_bytes:
            raise BatchTooLargeError(f"a batch of {size:,} encoded bytes exceeds the largest request "
                                     f"({self.max_request_bytes:,}: the client's max_frame_bytes less headroom)")  # fmt: skip

    async def reserve(self, size: int) -> None:
        """Room for ``size`` bytes in the buffer: wait (``block``) or BufferFullError."""
        if self.closing:
            raise SendError("producer closed")
        limit = self.settings.buffer_max_bytes
        if self.buffered_bytes + size <= limit:
            self.buffered_bytes += size
            return
        if self.settings.buffer_full == "block":
            with trio.move_on_after(self.settings.buffer_block_max_ms / 1000):
                while self.buffered_bytes + size > limit:
                    if self._room is None:
                        self._room = trio.Event()
                    await self._room.wait()
                    if self.closing:
                        raise SendError("producer closed")
                self.buffered_bytes += size
                return
            raise BufferFullError(f"the producer's buffer is full: {self.buffered_bytes:,} bytes accepted and not "
                                  f"answered, buffer_max_bytes={limit:,}; waited buffer_block_max_ms="
                                  f"{self.settings.buffer_block_max_ms:,}")  # fmt: skip
        raise BufferFullError(f"the producer's buffer is full: {self.buffered_bytes:,} bytes accepted and not "
                              f"answered, buffer_max_bytes={limit:,} (buffer_full='raise')")  # fmt: skip

    def add(self, topic: str, msgs: list[Message], chunk: bytes, fut: SendFuture, mq: MessageQueue,
            sharding_key: str | None, selector: QueueSelector | None, single: bool) -> bool:  # fmt: skip
        """Buffer a submit's messages (bytes reserved). True if the caller should yield:
        a sender has a request to make."""
        key = (topic, mq.broker_name, mq.queue_id)
        qb = self.queues.get(key)
        if qb is None:
            qb = self.queues[key] = QueueBuffer(key, mq, self.sender_for(mq.addr))
        elif not qb.batches and not qb.muted and qb.mq != mq:
            self.home(qb, mq)  # idle: follow the routes (a new leader)
        size = len(chunk)
        last = qb.batches[-1] if qb.batches else None
        if (single and last is not None and last.open and last.gen == self.gen and last.selector is selector
                and last.sharding_key == sharding_key and last.size + size <= self.batch_max_bytes):  # fmt: skip
            last.futures.append((fut, len(last.msgs), 1))
            last.msgs.append(msgs[0])
            last.chunks.append(chunk)
            last.size += size
        else:
            batch = Batch(topic, msgs, chunk, fut, mq, self.gen, sharding_key, selector, single)
            self._track(batch)
            qb.batches.append(batch)
        self._grew(qb, size)
        sender = qb.sender
        self._since_yield += 1
        if sender.pending >= self.batch_max_bytes and sender.in_flight < self.settings.max_in_flight:
            sender.wake()
            self._since_yield = 0
            return True
        if self._since_yield >= YIELD_EVERY_SUBMITS:
            self._since_yield = 0
            return True
        return False

    @staticmethod
    def _grew(qb: QueueBuffer, size: int) -> None:
        """``size`` bytes more at the back of ``qb``: counted by its sender if ready."""
        qb.bytes += size
        if not qb.muted:
            sender = qb.sender
            if qb.key in sender.ready:
                sender.pending += size
            else:
                sender.make_ready(qb)

    def _track(self, batch: Batch) -> None:
        self.live.add(batch)
        self._pending_by_gen[batch.gen] = self._pending_by_gen.get(batch.gen, 0) + 1

    def add_retry(self, batch: Batch) -> None:
        """A batch whose first try found no queue (no route now): tracked until its retry."""
        self._track(batch)

    def sender_for(self, addr: str) -> Sender:
        sender = self.senders.get(addr)
        if sender is None:
            from ._send_sender import Sender

            sender = self.senders[addr] = Sender(self, addr)
            self.nursery.start_soon(sender.run)
        return sender

    def home(self, qb: QueueBuffer, mq: MessageQueue) -> None:
        """The queue's batches go to ``mq.addr`` from now on (its group's leader)."""
        if mq.addr != qb.mq.addr:
            qb.sender.forget(qb)
            qb.sender = self.sender_for(mq.addr)
            if not qb.muted and qb.batches:
                qb.sender.make_ready(qb)
        qb.mq = mq

    def unmute(self, qb: QueueBuffer) -> None:
        qb.muted = False
        if qb.batches:
            qb.sender.make_ready(qb)

    def requeue(self, old: QueueKey | None, batches: list[Batch]) -> None:
        """Batches retried (each with its ``next_mq``): back to the front of their queue
        in order, or to the back of another queue's; then the old queue goes on."""
        front: list[Batch] = []
        for b in batches:
            mq, b.next_mq = b.next_mq, None
            assert mq is not None
            b.mq = mq
            key = (mq.topic, mq.broker_name, mq.queue_id)
            if key == old:
                front.append(b)
                continue
            qb = self.queues.get(key)
            if qb is None:
                qb = self.queues[key] = QueueBuffer(key, mq, self.sender_for(mq.addr))
            elif not qb.batches and not qb.muted:
                self.home(qb, mq)
            qb.batches.append(b)
            self._grew(qb, b.size)
        if old is None:
            return
        qb = self.queues[old]
        if front:
            qb.batches.extendleft(reversed(front))
            qb.bytes += sum(b.size for b in front)
            self.home(qb, front[0].mq)
        self.unmute(qb)

    # ------------------------------------------------------------------ outcomes
    def finished(self, batch: Batch) -> None:
        """Answered or failed: its bytes and its flush generation are released."""
        batch.done = True
        self.live.discard(batch)
        self.buffered_bytes -= batch.size
        if self._room is not None:
            self._room.set()
            self._room = None
        left = self._pending_by_gen[batch.gen] - 1
        if left:
            self._pending_by_gen[batch.gen] = left
        else:
            del self._pending_by_gen[batch.gen]
            if self._gen_done is not None:
                self._gen_done.set()
                self._gen_done = None

    def fail(self, batch: Batch, error: SendError) -> None:
        if batch.done:
            return
        self.finished(batch)
        for fut, _start, _count in batch.futures:
            fut._fail(error)

    # ------------------------------------------------------------------ flush, close
    async def flush(self) -> None:
        """Until every batch submitted before the call is answered or failed for good."""
        gen = self.gen
        self.gen += 1
        self.flushing += 1
        self._wake_all()
        try:
            while any(g <= gen for g in self._pending_by_gen):
                if self._gen_done is None:
                    self._gen_done = trio.Event()
                await self._gen_done.wait()
        finally:
            self.flushing -= 1

    async def aclose(self, flush_timeout_s: float) -> None:
        """Flush (for at most ``flush_timeout_s``), then fail whatever is left."""
        if self.closed:
            return
        self.closing = True
        self._wake_all()
        if self._room is not None:
            self._room.set()  # blocked submits: refused
        try:
            with trio.move_on_after(flush_timeout_s):
                await self.flush()
        finally:
            self.closed = True
            closed = SendError("producer closed")
            for batch in list(self.live):
                self.fail(batch, closed)

    def _wake_all(self) -> None:
        for sender in self.senders.values():
            sender.wake()

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

import trio

from clmq.common import Message
from clmq.protocol.transport import RpcClient

from .._routes import MessageQueue
from ._batch import Batch, QueueBuffer, QueueKey, Request
from ._future import SendError, SendFuture
from ._options import ProducerOptions
from ._retry import failed, retry
from ._sender import Sender
from ._span import SpanQueues, split_spans
from ._tries import QueueSelector, RetryPolicy, Targets

FRAME_HEADROOM_BYTES = 64 << 10  # a request's fields and framing, besides its messages
YIELD_EVERY_SUBMITS = 64  # a submit that found nothing to wait for yields this often (lets the senders run)


class Accumulator:
    """Per-queue buffers and per-broker senders of one producer (see the module)."""

    def __init__(
        self, rpc: RpcClient, targets: Targets, policy: RetryPolicy, options: ProducerOptions, nursery: trio.Nursery
    ) -> None:
        self.rpc = rpc
        self.targets = targets
        self.policy = policy
        self.settings = options
        self.linger_s = options.linger_ms / 1000
        self.batch_max_bytes = options.batch_max_bytes
        self.buffer_max_bytes = options.buffer_max_bytes
        self.send_timeout_ms = options.send_timeout_ms
        self.unique_ids = options.unique_ids
        self.nursery = nursery
        self.max_request_bytes = rpc.max_frame_bytes - FRAME_HEADROOM_BYTES
        self.size_max_bytes = min(self.buffer_max_bytes, self.max_request_bytes)  # a larger batch: check_size refuses
        self.queues: dict[QueueKey, QueueBuffer] = {}
        self.senders: dict[str, Sender] = {}
        self.live: set[Batch] = set()  # not done: failed with "producer closed" if still here at the end
        self.buffered_bytes = 0
        self.room: trio.Event | None = None  # set when bytes are released (blocked submits wait on it: _room)
        self.gen = 0
        self._pending_by_gen: dict[int, int] = {}  # older generations' batches not done (a flush waits on them)
        self._pending_now = 0  # the current generation's (no flush waits on them: a counter is enough)
        self._gen_done: trio.Event | None = None
        self.flushing = 0
        self.closing = False
        self.closed = False
        self._since_yield = 0
        self._request_ids = 0
        # Per topic: batches that found no queue yet (no route), in submission order. A
        # later submit of the topic queues behind them (not straight into a queue):
        # else a batch retried once the routes are back would land after later ones.
        self.unrouted: dict[str, list[Batch]] = {}
        self.span_queues: dict[str, SpanQueues] = {}  # per topic: its queue buffers by route position (``_span``)

    def next_request_id(self) -> int:
        self._request_ids += 1
        return self._request_ids

    @property
    def urgent(self) -> bool:
        """Linger is over for everyone (a flush, or closing)."""
        return self.flushing > 0 or self.closing

    # ------------------------------------------------------------------ accepting
    def reserve_now(self, size: int) -> bool:
        """Room for ``size`` bytes taken at once if there is some (no await)."""
        if self.buffered_bytes + size <= self.settings.buffer_max_bytes and not self.closing:
            self.buffered_bytes += size
            return True
        return False

    def add(self, mq: MessageQueue, batch: Batch) -> bool:
        """Buffer a submitted batch (its bytes reserved). True if the caller should
        yield: a sender has a request to make (or it has not yielded for a while)."""
        qb = self.queue_buffer(batch.topic, mq)
        batch.gen = self.gen
        self.track(batch)
        qb.batches.append(batch)
        return self.grew(qb, batch.size)

    def add_one(
        self,
        mq: MessageQueue,
        msg: Message,
        uniq: tuple[str, ...],
        chunk: bytes,
        fut: SendFuture,
        sharding_key: str | None,
        selector: QueueSelector | None,
        plain: bool,
    ) -> bool:
        """:meth:`add` for one message: merged into the queue's open batch if it has one
        (no new batch: the common case under load costs an append or two). ``uniq``:
        its UNIQ_KEY, or none without unique ids; ``plain``: see :class:`Batch`."""
        qb = self.queue_buffer(msg.topic, mq)
        size = len(chunk)
        last = qb.batches[-1] if qb.batches else None
        if (
            last is not None
            and last.open
            and last.per_message
            and last.gen == self.gen
            and last.selector is selector
            and last.sharding_key == sharding_key
            and last.size + size <= self.batch_max_bytes
        ):
            last.append(chunk, uniq, 1, fut)
        else:
            batch = Batch(msg.topic, msg, 1, uniq, chunk, fut, mq, self.gen, sharding_key, selector, True, plain)
            self.track(batch)
            qb.batches.append(batch)
        return self.grew(qb, size)

    def queue_buffer(self, topic: str, mq: MessageQueue) -> QueueBuffer:
        key = (topic, mq.broker_name, mq.queue_id)
        qb = self.queues.get(key)
        if qb is None:
            qb = self.queues[key] = QueueBuffer(key, mq, self.sender_for(mq.addr))
        elif not qb.batches and not qb.muted and qb.mq != mq:
            self.home(qb, mq)  # idle: follow the routes (a new leader)
        return qb

    def grew(self, qb: QueueBuffer, size: int) -> bool:
        """``size`` bytes more at the back of ``qb``: counted by its sender if ready.
        True if the submitting task should yield (see :meth:`add`)."""
        qb.bytes += size
        if qb.muted:
            return False
        sender = qb.sender
        if qb.key in sender.ready:
            sender.pending += size
        else:
            sender.make_ready(qb)
        self._since_yield += 1
        if sender.pending >= self.batch_max_bytes and sender.in_flight < self.settings.max_in_flight:
            sender.wake()
            self._since_yield = 0
            return True
        if self._since_yield >= YIELD_EVERY_SUBMITS:
            self._since_yield = 0
            return True
        return False

    def track(self, batch: Batch) -> None:
        self.live.add(batch)
        if batch.gen == self.gen:
            self._pending_now += 1
        else:
            self._pending_by_gen[batch.gen] = self._pending_by_gen.get(batch.gen, 0) + 1

    def add_retry(self, batch: Batch) -> None:
        """A batch whose first try found no queue (no route now), or submitted behind
        such batches of its topic: retried from the start, after them."""
        self.track(batch)
        waiting = self.unrouted.get(batch.topic)
        if waiting is not None:
            waiting.append(batch)  # the topic's retry task takes it in order
            return
        self.unrouted[batch.topic] = waiting = [batch]
        groups: dict[QueueKey | None, list[Batch]] = {None: waiting}
        self.nursery.start_soon(retry, self, batch.topic, groups)

    def failed(self, req: Request, error: Exception) -> None:
        """A request failed as a whole: its batches are retried or failed (``_retry``;
        a span split into one batch per queue first)."""
        failed(self, split_spans(self, req), error)

    def replace(self, old: Batch, new: list[Batch]) -> None:
        """``old`` (a span) is now the batches ``new``: the same bytes, its generation."""
        extra = len(new) - 1
        if old.gen == self.gen:
            self._pending_now += extra
        else:
            self._pending_by_gen[old.gen] += extra
        old.done = True
        self.live.discard(old)
        self.live.update(new)

    def sender_for(self, addr: str) -> Sender:
        sender = self.senders.get(addr)
        if sender is None:
            sender = self.senders[addr] = Sender(self, addr)
            self.nursery.start_soon(sender.send_loop)
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
            self.grew(qb, b.size)  # no yield: a retry task has none to give
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
        if self.room is not None:
            self.room.set()
            self.room = None
        if batch.gen == self.gen:
            self._pending_now -= 1
            return
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
        for fut in batch.futures:
            fut._fail(error)

    # ------------------------------------------------------------------ flush, close
    async def flush(self) -> None:
        """Until every batch submitted before the call is answered or failed for good."""
        gen = self.gen
        if self._pending_now:
            self._pending_by_gen[gen] = self._pending_now
            self._pending_now = 0
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
        if self.room is not None:
            self.room.set()  # blocked submits: refused
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

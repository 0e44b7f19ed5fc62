"""What the consumer's parts share (aiokafka's ``SubscriptionState``): who the consumer
is in its group, what it subscribes to, the queues it reads and where each stands,
what it fetched and what it handed out. The fetcher, membership, commits, queue locks
and redelivery each get this one object (and the few collaborators they need), never
a reference to the consumer.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import trio

from clmq.common import ClientError, Record

from .._routes import MessageQueue
from .._trace import ConsumeTracer
from ._options import ConsumerOptions, TagFilter


@dataclass(slots=True)
class QueueState:
    """A queue assigned to this consumer; given up, it is no longer ``assigned[mq]``
    (every step that awaits checks that before using the answer)."""

    generation: int
    offset: int | None = None  # next offset to read; None until looked up
    idle: bool = False  # nothing more to read at the look-up or the last answer: watched, not fetched
    paused: bool = False  # its next record is damaged: asked again only after damaged_queue_retry_ms
    # Neither fetched nor handed out by receive() until Fetcher.resume (orderly: being
    # released, or waiting to redeliver a failed message in place).
    stopped: bool = False

    def known_offset(self) -> int:
        """The next offset, for a queue that is fetched (only once it is known)."""
        assert self.offset is not None, "a queue is fetched only after its start offset is looked up"
        return self.offset


class DamagedQueueError(ClientError):
    """A queue whose record at ``offset`` is damaged on its broker (the text is the
    broker's: file, log offset, which check failed). The consumer does not read past
    it; it asks again every ``damaged_queue_retry_ms``."""

    def __init__(self, queue: MessageQueue, offset: int, text: str) -> None:
        super().__init__(
            f"{queue.topic}/{queue.queue_id} on {queue.broker_name} ({queue.addr}), offset {offset}: {text}"
        )
        self.queue = queue
        self.offset = offset
        self.text = text


@dataclass(slots=True)
class Batch:
    mq: MessageQueue
    generation: int
    records: list[Record]
    next_offset: int
    nbytes: int = 0  # the records' size on the wire (what the prefetch bound counts)


class PrefetchBuffer:
    """Fetched batches not yet returned by ``receive()``, and the byte budget of the
    fetches: a request reserves the bytes its answer may bring (its ``max_bytes``)
    before it is sent, and gives the reservation back once its batches are buffered.
    Buffered and reserved bytes together stay within ``max_bytes``; when nothing is
    held, one request may reserve its whole cap, so that a message larger than the
    bound is still read (alone)."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"prefetch_max_bytes={max_bytes}: at least 1")
        self.max_bytes = max_bytes
        self.batches: deque[Batch] = deque()
        self.buffered_bytes = 0
        self.reserved_bytes = 0
        self._arrived = trio.Event()
        self._room = trio.Event()
        self._room_waiters = 0  # fetches waiting in reserve(): a pop wakes them only then

    def _grant(self, cap: int) -> int:
        held = self.buffered_bytes + self.reserved_bytes
        if self.max_bytes - held >= cap:
            return cap
        return min(cap, self.max_bytes) if held == 0 else 0

    async def reserve(self, cap: int) -> int:
        """Reserve up to ``cap`` bytes (waits for room); the bytes reserved."""
        while not (granted := self._grant(cap)):
            self._room_waiters += 1
            try:
                await self._room.wait()
            finally:
                self._room_waiters -= 1
        self.reserved_bytes += granted
        return granted

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more (an answer that reserved nothing) keep within the bound."""
        held = self.buffered_bytes + self.reserved_bytes
        return held == 0 or held + nbytes <= self.max_bytes

    def release(self, reserved: int) -> None:
        self.reserved_bytes -= reserved
        self._wake_room()

    def put(self, batch: Batch) -> None:
        self.batches.append(batch)
        self.buffered_bytes += batch.nbytes
        if not self._arrived.is_set():
            self._arrived.set()

    def pop(self) -> Batch:
        batch = self.batches.popleft()
        self.buffered_bytes -= batch.nbytes
        self._wake_room()
        return batch

    async def arrival(self) -> None:
        """Wait until some batch is buffered."""
        if not self.batches:
            if self._arrived.is_set():
                self._arrived = trio.Event()
            await self._arrived.wait()

    def _wake_room(self) -> None:
        # A new event per pop (a batch per queue: 65,536 of them) only when a fetch waits.
        if self._room_waiters:
            room, self._room = self._room, trio.Event()  # waiters wait on the current one: none is left behind
            room.set()


class PendingBatches(list[Batch]):
    """The batches ``receive()`` returned that are not acknowledged yet, in order, and
    a wake-up for whoever waits for them to change (an orderly consumer releasing a
    queue waits until its batch being processed is acknowledged)."""

    def __init__(self) -> None:
        super().__init__()
        self._changed: trio.Event | None = None

    def take(self) -> list[Batch]:
        """All of them, leaving none pending (acknowledged)."""
        taken = list(self)
        self.clear()
        self.changed()
        return taken

    def changed(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def wait_changed(self) -> None:
        if self._changed is None:
            self._changed = trio.Event()
        await self._changed.wait()

    def of(self, mq: MessageQueue) -> bool:
        """Whether a batch of ``mq`` is pending."""
        return any(b.mq == mq for b in self)

    def drop(self, mq: MessageQueue) -> None:
        """Forget ``mq``'s batches: never acknowledged."""
        if self.of(mq):
            self[:] = [b for b in self if b.mq != mq]
            self.changed()

    def where(self, records: Sequence[Record], *, strict: bool = True) -> dict[int, MessageQueue]:
        """``id(record)`` -> its queue, for pending records. ``strict``: a record not
        pending is a ``ValueError``; else it is left out."""
        where = {id(r): batch.mq for batch in self for r in batch.records}
        if strict:
            for r in records:
                if id(r) not in where:
                    raise ValueError(
                        f"{r.topic}/{r.queue_id} offset {r.queue_offset} is not among the messages the "
                        "last receive() returned (or they were acknowledged since)"
                    )
        return {id(r): where[id(r)] for r in records if id(r) in where}


class Processed(dict[MessageQueue, int]):
    """Next offset to commit per queue, and the queues whose offset was set since the
    last commit (``changed``): a commit looks at those only."""

    def __init__(self) -> None:
        super().__init__()
        self.changed: set[MessageQueue] = set()

    def __setitem__(self, mq: MessageQueue, offset: int) -> None:
        super().__setitem__(mq, offset)
        self.changed.add(mq)

    def setdefault(self, mq: MessageQueue, offset: int) -> int:
        self.changed.add(mq)
        return super().setdefault(mq, offset)


@dataclass(eq=False)
class ConsumerState:
    """A consumer's shared state. ``assigned``: a queue given up is no longer in it
    (every step that awaits checks that before using an answer)."""

    group: str
    client_id: str
    options: ConsumerOptions
    filters: dict[str, TagFilter]  # the subscribed topics (the group's retry topic among them)
    retry_topic: str | None  # clustering, not orderly: where this group's failed messages come back
    assigned: dict[MessageQueue, QueueState] = field(default_factory=dict)
    processed: Processed = field(default_factory=Processed)  # next offset to commit per queue
    # Assigned queues stopped at a damaged record (an entry goes once the queue reads again).
    errors: dict[MessageQueue, DamagedQueueError] = field(default_factory=dict)
    pending: PendingBatches = field(default_factory=PendingBatches)  # handed out, not acknowledged
    prefetch: PrefetchBuffer = field(init=False)  # fetched, not handed out yet; the fetches' byte budget
    # Set to rebalance now, not at the next interval (a group's leader may have moved).
    rebalance_wanted: trio.Event = field(default_factory=trio.Event)
    tracer: ConsumeTracer | None = None  # trace=True: delivered, acked, sent-back events (docs/traces.md)

    def __post_init__(self) -> None:
        self.prefetch = PrefetchBuffer(self.options.prefetch_max_bytes)

    def rebalance_soon(self) -> None:
        self.rebalance_wanted.set()

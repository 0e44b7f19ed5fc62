"""Client-side message traces (docs/traces.md): a producer or consumer opened with
``trace=True`` records events of the messages it sends and receives, and a
:class:`TraceDispatcher` writes them to ``%TRACE%`` in batches, in the background.

Recording never blocks and never fails a send or a receive: an event goes into a
bounded buffer (``trace_buffer_max_events``) and is dropped, counted in ``dropped``,
when the buffer is full; a batch that cannot be written is counted in ``failed``. The
dispatcher's task writes what is buffered every ``trace_flush_interval_ms`` or as soon
as a batch's worth is waiting, one batch in flight at a time, and writes what is left
when the client closes (within :data:`TRACE_CLOSE_TIMEOUT_MS`)."""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any, Awaitable, Callable, Iterable, Sequence

import trio

from clmq.common import (
    PROP_ORIGIN_MSG_ID,
    TIMER_TOPIC,
    TRACE_EVENT_MAX_KEYS,
    TRACE_TOPIC,
    ClmqError,
    CorruptRecordError,
    Message,
    Record,
    TraceEvent,
    TraceKind,
    trace_event,
    trace_messages,
)

from ._msg_id import format_msg_id

log = logging.getLogger("clmq.trace")

UNIQ_KEY = "UNIQ_KEY"  # the producer's property (client.producer's name; that family imports this module)
TRACE_BATCH_MAX_EVENTS = 1024  # events per write (one send_batch to %TRACE%, records of 64 events)
NACKED_REMEMBERED_RECORDS = 65536  # a consumer's nacked records kept so that the ack after a nack skips them
TRACE_WRITE_RETRY_BUDGET_MS = 2000  # a trace write is retried this long at most (then counted failed)
# The producer that writes a client's trace records: not traced itself, no UNIQ_KEY (a
# trace record retried after an unknown outcome may be stored twice; lookups show it once).
TRACE_WRITER_OPTIONS: dict[str, Any] = {
    "trace": False,
    "unique_ids": False,
    "retries": 1,
    "retry_budget_ms": TRACE_WRITE_RETRY_BUDGET_MS,
}
TRACE_CLOSE_TIMEOUT_MS = 3000  # closing: what is buffered is written within this, the rest counted dropped

SendTraceBatch = Callable[[list[Message]], Awaitable[object]]


SENT = TraceKind.SENT.value
TIMER_SCHEDULED_QUEUE = 0  # the %TIMER% queue of scheduled messages


def _keys(keys: str) -> str:
    """A message's keys as its events keep them (at most TRACE_EVENT_MAX_KEYS)."""
    return keys if keys.count(" ") < TRACE_EVENT_MAX_KEYS else " ".join(keys.split()[:TRACE_EVENT_MAX_KEYS])


def wall_ms() -> int:
    return int(time.time() * 1000)


class TraceDispatcher:
    """The buffer of trace events and the task that writes them (:meth:`run`).
    ``send(messages)`` writes one batch of ``%TRACE%`` records (a producer's
    ``send_batch``); its failures are counted, never raised to the client."""

    def __init__(
        self,
        send: SendTraceBatch,
        *,
        buffer_max_events: int,
        flush_interval_ms: int,
        batch_max_events: int = TRACE_BATCH_MAX_EVENTS,
    ) -> None:
        if buffer_max_events < 1 or flush_interval_ms < 1 or batch_max_events < 1:
            raise ValueError("trace buffer, batch and flush interval must be at least 1")
        self._send = send
        self.buffer_max_events = buffer_max_events
        self.flush_interval_ms = flush_interval_ms
        self.batch_max_events = batch_max_events
        self._buffer: list[TraceEvent] = []
        self._wake = trio.Event()
        self._idle = trio.Event()
        self._idle.set()
        self.recorded = 0  # events accepted into the buffer
        self.dropped = 0  # events refused: the buffer was full (or the client closed with them)
        self.written = 0  # events written to %TRACE%
        self.failed = 0  # events of batches whose write failed
        self._failing = False  # the last write failed (the next failure is not logged again)

    def record(self, event: TraceEvent) -> None:
        """Buffer one event (never blocks, never raises): dropped and counted when full."""
        if len(self._buffer) >= self.buffer_max_events:
            self.dropped += 1
            return
        self._buffer.append(event)
        self.recorded += 1
        if len(self._buffer) >= self.batch_max_events:
            self._wake.set()

    def room(self, wanted: int) -> int:
        """How many of ``wanted`` events the buffer takes now; the rest are counted
        dropped at once (so that a full buffer costs its client no events to make)."""
        room = min(wanted, self.buffer_max_events - len(self._buffer))
        if room < wanted:
            self.dropped += wanted - max(0, room)
        return max(0, room)

    def record_all(self, events: Iterable[TraceEvent]) -> None:
        for event in events:
            self.record(event)

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def counts(self) -> dict[str, int]:
        """recorded, dropped, written, failed and buffered events."""
        return {
            "recorded": self.recorded,
            "dropped": self.dropped,
            "written": self.written,
            "failed": self.failed,
            "buffered": self.buffered,
        }

    async def run(self) -> None:
        """Write buffered events until cancelled: every ``flush_interval_ms``, or at
        once when a batch's worth is waiting."""
        while True:
            with trio.move_on_after(self.flush_interval_ms / 1000):
                await self._wake.wait()
            self._wake = trio.Event()
            await self.flush()

    async def flush(self) -> None:
        """Write everything buffered now (one batch at a time); returns once no write is
        in flight (the background task's included: the writer may be closed next)."""
        while True:
            if not self._idle.is_set():  # another flush is writing: wait for it, then look again
                await self._idle.wait()
                continue
            if not self._buffer:
                return
            batch = self._buffer[: self.batch_max_events]
            del self._buffer[: len(batch)]
            self._idle = trio.Event()
            try:
                await self._write(batch)
            finally:
                self._idle.set()

    async def _write(self, batch: list[TraceEvent]) -> None:
        try:
            await self._send(trace_messages(batch))
        except (ClmqError, OSError, trio.TooSlowError) as e:  # a trace never fails its client
            self.failed += len(batch)
            # Said once per run of failures (a broker without %TRACE% fails every write).
            (log.debug if self._failing else log.warning)("%d trace events not written: %s", len(batch), e)
            self._failing = True
        else:
            self.written += len(batch)
            self._failing = False

    async def aclose(self, timeout_ms: int = TRACE_CLOSE_TIMEOUT_MS) -> None:
        """Write what is buffered, within ``timeout_ms``; what is left is counted dropped."""
        with trio.move_on_after(timeout_ms / 1000):
            await self.flush()
        if self._buffer:
            self.dropped += len(self._buffer)
            self._buffer.clear()


class Tracing:
    """What a traced client holds: its dispatcher, and the close of the producer that
    writes its records (:func:`tracing_parts`)."""

    def __init__(self, dispatcher: TraceDispatcher, close: Callable[[], Awaitable[None]], client_id: str) -> None:
        self.dispatcher = dispatcher
        self._close = close
        self.client_id = client_id

    async def aclose(self) -> None:
        """Write what is buffered (bounded), then close the writing producer."""
        try:
            await self.dispatcher.aclose()
        finally:
            await self._close()


class SendTracer(Tracing):
    """A producer's side: a ``sent`` event per message once its send is answered."""

    group = ""

    def watch(self, future: Any, messages: Sequence[Message], scheduled_at_ms: int = 0) -> None:
        """Record ``sent`` for ``messages`` when ``future`` (a SendFuture) succeeds;
        ``scheduled_at_ms``: a scheduled send, stored in %TIMER% until then."""
        started = time.monotonic()

        def done(fut: Any) -> None:
            if fut.exception() is None:
                self.sent(messages, fut.result(), int((time.monotonic() - started) * 1000), scheduled_at_ms)

        future.add_done_callback(done)

    def sent(self, messages: Sequence[Message], result: Any, latency_ms: int, scheduled_at_ms: int = 0) -> None:
        now = wall_ms()
        queue = result.queue
        addr, topic, qid, broker = queue.addr, queue.topic, queue.queue_id, queue.broker_name
        uniq, offsets, positions = result.uniq_keys, result.queue_offsets, result.commitlog_offsets
        detail = "duplicate: stored before" if result.duplicate else ""
        if scheduled_at_ms:  # the offsets are the %TIMER% copy's; the queue is where it will be delivered
            detail = f"scheduled for {topic}[{qid}] at {scheduled_at_ms}" + (f"; {detail}" if detail else "")
            topic, qid = TIMER_TOPIC, TIMER_SCHEDULED_QUEUE
        record, group, client = self.dispatcher.record, self.group, self.client_id
        for i, m in enumerate(
            messages[: self.dispatcher.room(len(messages))]
        ):  # positional: one event per message sent, the cheapest way to make it
            record(
                TraceEvent(
                    SENT,
                    now,
                    format_msg_id(addr, positions[i]),
                    topic,
                    qid,
                    offsets[i],
                    _keys(m.keys),
                    uniq[i] if i < len(uniq) else "",
                    group,
                    client,
                    latency_ms,
                    broker,
                    0,
                    "",
                    detail,
                )
            )


class ConsumeTracer(Tracing):
    """A consumer's side: ``delivered`` when receive() returns a message, ``acked``
    when it is acknowledged, ``sent_back`` when it is nacked."""

    group = ""

    def __init__(self, dispatcher: TraceDispatcher, close: Callable[[], Awaitable[None]], client_id: str) -> None:
        super().__init__(dispatcher, close, client_id)
        self._nacked: dict[tuple[str, int, int], None] = {}  # records sent back, not to be traced as acked

    def delivered(self, mq: Any, records: Sequence[Record]) -> None:
        now = wall_ms()
        for r in records[: self.dispatcher.room(len(records))]:
            self.dispatcher.record(self._event(TraceKind.DELIVERED, mq, r, now, now - r.store_timestamp_ms))

    def acked(self, mq: Any, records: Sequence[Record]) -> None:
        now = wall_ms()
        for r in records:
            self.dispatcher.record(self._event(TraceKind.ACKED, mq, r, now))

    def acked_batches(self, batches: Iterable[Any], upto: dict[tuple[str, int], int] | None) -> None:
        """The records of pending ``batches`` an ack covers (``upto``: the last offset
        acknowledged per queue; None: all), minus those sent back (a nack is not an ack)."""
        now = wall_ms()
        nacked = self._nacked
        for batch in batches:
            last = None if upto is None else upto.get((batch.mq.topic, batch.mq.queue_id))
            if upto is not None and last is None:
                continue
            records = batch.records if last is not None else batch.records[: self.dispatcher.room(len(batch.records))]
            for r in records:
                if last is not None and r.queue_offset > last:
                    break
                if nacked and nacked.pop((r.topic, r.queue_id, r.queue_offset), 0) is None:
                    continue
                self.dispatcher.record(self._event(TraceKind.ACKED, batch.mq, r, now))

    def sent_back(self, mqs: Sequence[Any], records: Sequence[Record], outcomes: Sequence[str]) -> None:
        now = wall_ms()
        for mq, r, outcome in zip(mqs, records, outcomes):
            self._nacked[(r.topic, r.queue_id, r.queue_offset)] = None
            self.dispatcher.record(self._event(TraceKind.SENT_BACK, mq, r, now, detail=outcome))
        while len(self._nacked) > NACKED_REMEMBERED_RECORDS:  # records never acked afterwards (a rewind)
            del self._nacked[next(iter(self._nacked))]

    def _event(
        self, kind: TraceKind, mq: Any, r: Record, now: int, latency_ms: int = -1, detail: str = ""
    ) -> TraceEvent:
        try:
            props = r.properties
        except CorruptRecordError:  # a faulty writer's: traced without them, the record still delivered
            props = {}
        return TraceEvent(
            kind.value,
            now,
            format_msg_id(mq.addr, r.commitlog_offset),
            r.topic,
            r.queue_id,
            r.queue_offset,
            _keys(r.keys),
            props.get(UNIQ_KEY, ""),
            self.group,
            self.client_id,
            latency_ms if latency_ms >= 0 else -1,
            mq.broker_name,
            r.reconsume_times,
            props.get(PROP_ORIGIN_MSG_ID, ""),
            detail,
        )


def tracing_parts(
    writer: Any, nursery: trio.Nursery, buffer_max_events: int, flush_interval_ms: int
) -> tuple[TraceDispatcher, Callable[[], Awaitable[None]]]:
    """A dispatcher writing through ``writer`` (a Producer of its own, not traced), its
    task started in ``nursery``; and the writer's close."""

    async def send(messages: list[Message]) -> None:
        await writer.send_batch(TRACE_TOPIC, messages)

    async def close() -> None:
        try:
            await writer.aclose()
        finally:
            await writer.rpc.aclose()

    dispatcher = TraceDispatcher(send, buffer_max_events=buffer_max_events, flush_interval_ms=flush_interval_ms)
    nursery.start_soon(dispatcher.run)
    return dispatcher, close


def send_tracer(writer: Any, nursery: trio.Nursery, options: Any, client_id: str) -> SendTracer:
    """A producer's tracer (``options``: its ProducerOptions)."""
    dispatcher, close = tracing_parts(writer, nursery, options.trace_buffer_max_events, options.trace_flush_interval_ms)
    return SendTracer(dispatcher, close, client_id)


def consume_tracer(writer: Any, nursery: trio.Nursery, options: Any, group: str, client_id: str) -> ConsumeTracer:
    """A consumer's tracer (``options``: its ConsumerOptions)."""
    dispatcher, close = tracing_parts(writer, nursery, options.trace_buffer_max_events, options.trace_flush_interval_ms)
    tracer = ConsumeTracer(dispatcher, close, client_id)
    tracer.group = group
    return tracer


def client_name(client: object) -> str:
    """A traced client's id when it has none of its own: host, process and object."""
    return f"{socket.gethostname()}@{os.getpid()}@{id(client):x}"


def sent_back_detail(result: Any) -> str:
    """A nack's outcome as an event's detail (``result``: a SendBackResult)."""
    if result.destination == "retry":
        return f"retry {result.reconsume_times}, due at {result.deliver_at_ms}"
    return "to the dead-letter queue" if result.destination == "dlq" else str(result.destination)


def resent_event(dead_letter_id: str, letter: Record, result: Any, client_id: str) -> TraceEvent:
    """A dead letter (``letter``, id ``dead_letter_id``) sent again by ``client_id``: the event names
    the new copy (``result``: its SendResult) and carries the first message's id and
    the letter's UNIQ_KEY, so that a trace by either finds the copy."""
    props = letter.properties
    queue = result.queue
    return trace_event(
        TraceKind.RESENT,
        result.msg_ids[0],
        wall_ms(),
        topic=queue.topic,
        queue_id=queue.queue_id,
        queue_offset=result.queue_offsets[0],
        keys=letter.keys,
        uniq_key=props.get(UNIQ_KEY, ""),
        group=props.get("DLQ_GROUP", ""),
        client_id=client_id,
        broker=queue.broker_name,
        origin_msg_id=props.get(PROP_ORIGIN_MSG_ID, "") or dead_letter_id,
        detail=f"from dead letter {dead_letter_id}",
    )

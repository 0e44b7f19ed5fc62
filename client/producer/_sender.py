"""One broker's sender (Kafka's Sender): drains the ready queues of one topic into one
SEND_MESSAGE request, once ``batch_max_bytes`` is waiting, the oldest batch has waited
``linger_ms``, or a flush asks; at most ``max_in_flight`` requests at a time. The
answer's offsets are per message in request order: each batch gets its slice."""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import trio

from clmq.protocol import ErrorCode, Frame, RequestCode
from clmq.protocol.transport import ConnectionFailed, RpcClient, RpcError

from .._routes import MessageQueue
from ._batch import Batch, Buffers, QueueBuffer, QueueKey, Request
from ._future import Answer, SendError, SendResult, resolve_each, resolve_runs
from ._span import SPAN_PART_OF_BATCH
from ._tries import NotLeader

log = logging.getLogger("clmq.producer")


def reply_error(addr: str, reply: Frame) -> RpcError | None:
    """The error a SEND_MESSAGE answer carries (None: stored; FLUSH_DISK_TIMEOUT is
    stored too, not fsynced in time)."""
    if not reply.error_code or reply.error_code == ErrorCode.FLUSH_DISK_TIMEOUT:
        return None
    if reply.error_code == ErrorCode.NOT_LEADER:
        leader = reply.fields.get("leader_addr")
        return NotLeader(addr, reply.error_code, reply.error_text, leader if isinstance(leader, str) else "")
    return RpcError(addr, reply.error_code, reply.error_text)


async def send_to(rpc: RpcClient, mq: MessageQueue, body: bytes, timeout_ms: int, dedup: bool) -> SendResult:
    """:meth:`Producer.send_to`: one encoded batch to one queue, at once."""
    fields: dict[str, object] = {"topic": mq.topic, "dedup": True} if dedup else {"topic": mq.topic}
    reply = await rpc.request(mq.addr, RequestCode.SEND_MESSAGE, fields, body, timeout_ms=timeout_ms, check=False)
    error = reply_error(mq.addr, reply)
    if error is not None:
        raise error
    f = reply.fields
    return SendResult(
        mq,
        f["queue_offsets"],
        f["commitlog_offsets"],
        bool(f["durable"]),
        bool(reply.error_code),
        bool(f.get("duplicate", False)),
    )


def unmute_all(queues: list[QueueBuffer]) -> None:
    """``Accumulator.unmute`` of each, inline (a span's answer unmutes its 1,000 queues):
    a queue whose head is a span counts down the span's ``waiting`` (see ``make_ready``)."""
    for qb in queues:
        qb.muted = False
        batches = qb.batches
        if not batches:
            continue
        head = batches[0]
        if head.span is None:
            qb.sender.make_ready(qb)
        else:
            park_at_span(qb, head)


def park_at_span(qb: QueueBuffer, head: Batch) -> None:
    """``qb``'s head is the span ``head``: count ``qb`` as free for it (once); the span
    is ready when all its queues are."""
    if qb.parked:
        return
    qb.parked = True
    head.waiting -= 1
    if not head.waiting:
        assert head.lane is not None
        head.lane.span_ready(head)


class Sender:
    def __init__(self, acc: Buffers, addr: str) -> None:
        self.acc = acc
        self.addr = addr
        self.ready: dict[QueueKey, QueueBuffer] = {}  # unmuted queues with batches, oldest first (roughly)
        self.pending = 0  # bytes in the ready queues
        self.in_flight = 0
        self.due = math.inf  # when the oldest ready batch has lingered enough (monotonic s)
        self.spans: dict[Batch, None] = {}  # spans at the head of all their queues (``_span``), oldest first
        self._spans_turn = True  # ready spans and ready queues take turns
        self._wake = trio.Event()

    def wake(self) -> None:
        self._wake.set()

    def make_ready(self, qb: QueueBuffer) -> None:
        """``qb`` (unmuted, with batches) may be sent; if its head is a span, it is
        counted at the span's head (sent once all its queues are)."""
        if qb.key in self.ready:
            return
        head = qb.batches[0]
        if head.span is not None:
            park_at_span(qb, head)
            return
        self.ready[qb.key] = qb
        self.pending += qb.bytes
        due = qb.batches[0].created + self.acc.linger_s
        if due < self.due:
            self.due = due
            self._wake.set()

    def span_ready(self, span: Batch) -> bool:
        """``span`` is at the head of all its queues: it may be sent. True if the
        submitting task should yield (a request is worth making now)."""
        self.spans[span] = None
        self.pending += span.size
        due = span.created + self.acc.linger_s
        if due < self.due:
            self.due = due
            self._wake.set()
        if self.pending >= self.acc.batch_max_bytes and self.in_flight < self.acc.settings.max_in_flight:
            self._wake.set()
            return True
        return False

    def forget(self, qb: QueueBuffer) -> None:
        if self.ready.pop(qb.key, None) is not None:
            self.pending -= qb.bytes

    async def send_loop(self) -> None:
        """Forever: wait until a request is due and a slot is free, make it, send it."""
        acc = self.acc
        while True:
            if self.in_flight >= acc.settings.max_in_flight or not (self.ready or self.spans):
                await self._sleep(math.inf)
                continue
            if self.pending < acc.batch_max_bytes and not acc.urgent:
                left = self.due - time.monotonic()
                if left > 0:
                    await self._sleep(left)
                    continue
            request = self.drain()
            if self.ready:
                self.due = next(iter(self.ready.values())).batches[0].created + acc.linger_s
            elif self.spans:
                self.due = next(iter(self.spans)).created + acc.linger_s
            else:
                self.due = math.inf
            if request is not None:
                self.in_flight += 1
                acc.nursery.start_soon(self.send, request)

    async def _sleep(self, seconds: float) -> None:
        with trio.move_on_after(seconds):
            await self._wake.wait()
        self._wake = trio.Event()

    def drain(self) -> Request | None:
        """Take the ready queues' batches of one topic, oldest queue first, up to
        ``batch_max_bytes`` (a larger batch goes alone). A batch whose tries had unknown
        outcomes goes only with batches of the same history (the broker's dedup answers
        a request all found or none found); one marked ``alone`` goes alone.
        Ready spans and ready queues take turns (:meth:`_drain_spans`)."""
        if self.spans and (self._spans_turn or not self.ready):
            self._spans_turn = False
            return self._drain_spans()
        self._spans_turn = True
        topic: str | None = None
        history: tuple[int, ...] = ()
        taken: list[Batch] = []
        took: list[tuple[QueueBuffer, int, int]] = []  # queue, batches taken, their bytes
        size = 0
        for qb in self.ready.values():
            first = qb.batches[0]
            if topic is None:
                topic, history = qb.key[0], first.history
            elif qb.key[0] != topic or first.history != history or first.alone:
                continue
            count, nbytes, full = self._take(qb, taken, size, history)
            size += nbytes
            if count:
                took.append((qb, count, nbytes))
            if full:
                break
        for qb, count, nbytes in took:
            self.forget(qb)
            for _ in range(count):
                qb.batches.popleft()
            qb.bytes -= nbytes
            qb.muted = True
        if topic is None:
            return None
        return Request(self.acc.next_request_id(), topic, taken, [qb for qb, _c, _n in took], bool(history))

    def _take(self, qb: QueueBuffer, taken: list[Batch], size: int, history: tuple[int, ...]) -> tuple[int, int, bool]:
        """Append ``qb``'s leading batches to ``taken`` (``size`` bytes so far) while they
        fit ``batch_max_bytes`` and share ``history``, up to a span's place. Returns how
        many, their bytes, and whether the request is full."""
        limit = self.acc.batch_max_bytes
        mq, count, nbytes = qb.mq, 0, 0
        for b in qb.batches:
            if b.span is not None:  # its place: the span goes when all its queues are free
                break
            if taken and (b.alone or b.history != history or size + nbytes + b.size > limit):
                return count, nbytes, size + nbytes + b.size > limit
            b.open = False
            b.mq = mq
            if b.encoded_for != mq.queue_id:
                b.encode_for(mq.queue_id)
            taken.append(b)
            count += 1
            nbytes += b.size
            if b.alone:
                return count, nbytes, True
        return count, nbytes, False

    def _drain_spans(self) -> Request:
        """Ready spans of one topic, oldest first, up to a ``SPAN_PART_OF_BATCH`` share
        of ``batch_max_bytes`` (the first however large), as one request; their queues
        muted until the answer. Two ready spans never share a queue (each is at the head
        of all of its queues). Requests of a share, not of a whole ``batch_max_bytes``:
        when every call touches every queue, a call's spans wait for the previous
        call's, and requests of a call each would be one in flight at a time."""
        limit = self.acc.batch_max_bytes // SPAN_PART_OF_BATCH
        topic = next(iter(self.spans)).topic
        taken: list[Batch] = []
        size = 0
        for span in self.spans:
            if span.topic == topic and (not taken or size + span.size <= limit):
                taken.append(span)
                size += span.size
        queues: list[QueueBuffer] = []
        for span in taken:
            del self.spans[span]
            self.pending -= span.size
            assert span.span is not None
            for qb in span.span:
                qb.batches.popleft()  # the span: at the head of each of its queues
                qb.parked = False
                qb.muted = True
            queues += span.span
        return Request(self.acc.next_request_id(), topic, taken, queues, False)

    async def send(self, req: Request) -> None:
        """One request: its answer resolves the batches, a failure retries them."""
        acc = self.acc
        try:
            body = b"".join([c for b in req.batches for c in b.chunks])
            fields: dict[str, object] = {"topic": req.topic, "dedup": True} if req.dedup else {"topic": req.topic}
            try:
                reply = await acc.rpc.request(
                    self.addr, RequestCode.SEND_MESSAGE, fields, body, timeout_ms=acc.send_timeout_ms, check=False
                )
            except (ConnectionFailed, trio.TooSlowError) as e:
                acc.failed(req, e)
                return
            error = reply_error(self.addr, reply)
            if error is not None:
                acc.failed(req, error)
            else:
                self._answered(req, reply.fields, reply.error_code == ErrorCode.FLUSH_DISK_TIMEOUT)
        except Exception as e:  # a bug must not lose batches silently: they fail, the producer goes on
            log.exception("sending a request to %s failed", self.addr)
            for b in req.batches:
                acc.fail(b, SendError(f"send to {self.addr} failed: {e!r}"))
            for qb in req.queues:
                acc.unmute(qb)
        finally:
            self.in_flight -= 1
            self._wake.set()

    def _answered(self, req: Request, fields: dict[str, Any], flush_timeout: bool) -> None:
        acc = self.acc
        qoffs, coffs = fields["queue_offsets"], fields["commitlog_offsets"]
        total = sum(b.count for b in req.batches)
        # No commit-log offsets from a partition-per-file broker (it has no commit log).
        if len(qoffs) != total or len(coffs) not in (0, total):
            error = SendError(
                f"{self.addr} answered {len(qoffs)} queue offsets and {len(coffs)} commit-log offsets "
                f"for {total} messages"
            )
            for b in req.batches:
                acc.fail(b, error)
        else:
            durable, duplicate = bool(fields["durable"]), bool(fields.get("duplicate", False))
            i = 0
            for b in req.batches:
                n = b.count
                answer = Answer(b.mq, qoffs, coffs, durable, flush_timeout, duplicate, i)
                i += n
                if b.done:
                    continue
                acc.finished(b)
                keys = b.keys
                if b.per_message:
                    resolve_each(b.futures, answer, keys)
                elif b.starts is None:
                    b.futures[0]._resolve(answer, keys, 0, n)
                else:
                    resolve_runs(b.futures, b.starts, answer, keys, n)
        unmute_all(req.queues)

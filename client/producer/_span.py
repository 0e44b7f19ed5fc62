"""Spans: the plain messages of one ``submit_many`` call to many queues of one broker
as ONE batch (one encoded buffer, each message with its own queue id; one future), not
a batch per queue: at 1,000 queues a call of 1,000 messages touches each queue about
once, and a batch, a future and the sender's bookkeeping per message cost five times
what the messages' encoding does.

Order per queue is kept as for any batch: a span holds a place in each of its queues
(it is appended to each one's buffer) and is sent only once it is at the head of all of
them and none is muted (``Sender.make_ready`` counts down its ``waiting``); sending it mutes
them all until the answer. A failed span is split into one ordinary batch per queue
(its messages in order, each with its own future, :func:`split_spans`), retried by the
rules of any batch (same queue or elsewhere, dedup history, isolation of a bad one):
the slow path, the common one pays nothing for it.
"""

from __future__ import annotations

import functools
from typing import Protocol

from .._routes import MessageQueue
from ._batch import Batch, QueueBuffer, Request
from ._encode import _ITEM, _UNIQ_PREFIX, _UNIQ_PROPS_BYTES, PLAIN_CHECKED
from ._future import SendError, SendFuture, SendOutcome, SendResult, _copy


class Accumulator(Protocol):
    """What spans need of the accumulator (``_accumulator.Accumulator``)."""

    gen: int
    span_queues: dict[str, SpanQueues]

    def track(self, batch: Batch) -> None: ...
    def replace(self, old: Batch, new: list[Batch]) -> None: ...
    def queue_buffer(self, topic: str, mq: MessageQueue) -> QueueBuffer: ...


class SpanFuture(SendFuture):
    """The future of a span's share of a ``submit_many`` call: ``count`` consecutive
    messages of the call, message ``k`` to queue ``mqs[(first + k) % len(mqs)]``. Until
    a failure it is answered as one (one answer, sliced per message when asked); a
    failed span's messages get a future each (:meth:`split`), and it is done when they
    all are."""

    _pieces: list[SendFuture] | None = None
    _left = 0

    def __init__(self, mqs: list[MessageQueue], first: int, count: int) -> None:
        self._mqs = mqs
        self._first = first
        self.messages = count

    def queue_of(self, k: int) -> MessageQueue:
        return self._mqs[(self._first + k) % len(self._mqs)]

    def done(self) -> bool:
        if self._pieces is not None:
            return self._left == 0 or self._error is not None
        return self._answer is not None or self._error is not None

    def result(self) -> SendResult:
        """The first message's result (a span has no one queue: ``SendFutures`` asks
        per message, :meth:`_outcome`)."""
        outcome = self._outcome(0)
        if isinstance(outcome, SendError):
            raise outcome
        return outcome

    def _outcome(self, k: int) -> SendOutcome:
        if self._error is not None:
            return self._error
        if self._pieces is not None:
            return self._pieces[k]._outcome(0)
        answer = self._answer
        if answer is None:
            raise RuntimeError("the send is not done yet: await wait() or add a done callback")
        i = self._start + k
        at = answer.base + i
        return SendResult(
            self.queue_of(k),
            answer.queue_offsets[at : at + 1],
            answer.commitlog_offsets[at : at + 1],
            answer.durable,
            answer.flush_timeout,
            answer.duplicate,
            tuple(self._keys[i : i + 1]),
        )

    def _message(self, k: int) -> SendFuture:
        if self._pieces is not None and self._error is None:
            return self._pieces[k]
        view = SendFuture()
        if self.done():
            self._copy_into(view, k)
        else:
            self.add_done_callback(functools.partial(SpanFuture._copy_into, view=view, k=k))
        return view

    def _copy_into(self, view: SendFuture, k: int) -> None:
        if self._pieces is not None and self._error is None:
            _copy(self._pieces[k], view, 0)
            return
        outcome = self._outcome(k)
        if isinstance(outcome, SendError):
            view._fail(outcome)
            return
        answer = self._answer
        assert answer is not None
        view._resolve(answer._replace(queue=outcome.queue), self._keys, self._start + k, 1)

    def _failed_count(self, count: int) -> int:
        if self._error is not None:
            return count
        if self._pieces is not None:
            return sum(p._error is not None for p in self._pieces)
        return 0

    def split(self) -> list[SendFuture]:
        """A future per message from now on (its span failed and is retried per queue)."""
        pieces = [SendFuture() for _ in range(self.messages)]
        for p in pieces:
            p.add_done_callback(self._piece_done)
        self._pieces, self._left = pieces, len(pieces)
        return pieces

    def _piece_done(self, _piece: SendFuture) -> None:
        self._left -= 1
        if self._left == 0:
            self._finish()


_PROPS = _UNIQ_PROPS_BYTES


def encode_span(qids: list[int], first: int, born_ms: int, keys: list[str], bodies: list[bytes]) -> bytes:
    """Plain messages (see ``encode_plain``) ``bodies[i]`` with UNIQ_KEY ``keys[i]`` to
    queue ``qids[(first + i) % len(qids)]``, as one buffer."""
    pack = _ITEM.pack
    prefix = _UNIQ_PREFIX
    n = len(qids)
    j = first % n
    parts: list[bytes] = []
    add = parts.extend
    for key, body in zip(keys, bodies, strict=True):
        add((pack(qids[j], 0, born_ms, 0, 0, _PROPS, len(body)), prefix, key.encode(), body))
        j += 1
        if j == n:
            j = 0
    return b"".join(parts)


# A span holds at most this share of ``batch_max_bytes`` (a request of spans, too): when
# every call touches every queue (round robin over 1,000 queues, calls of 1,000), the
# spans of a call wait for the previous call's; four spans a call keep four requests in
# flight (``max_in_flight`` is 5 by default) where one span a call kept one.
SPAN_PART_OF_BATCH = 4
SPANS_CHECKED = PLAIN_CHECKED  # the layout encode_plain was checked to share (else no spans)


class SpanQueues:
    """A topic's queue buffers in the order of a routes list (``mqs``), their queue ids,
    and whether they are all at one broker: built once per routes list, so that a span
    finds its queues by position (no key, no look-up per message)."""

    __slots__ = ("addrs", "mqs", "one_broker", "qbs", "qids")

    def __init__(self, acc: Accumulator, topic: str, mqs: list[MessageQueue]) -> None:
        self.mqs = mqs
        self.qbs: list[QueueBuffer] = [acc.queue_buffer(topic, mq) for mq in mqs]
        self.qids = [mq.queue_id for mq in mqs]
        self.addrs = [mq.addr for mq in mqs]
        self.one_broker = len(set(self.addrs)) == 1

    def touched(self, first: int, count: int) -> list[QueueBuffer]:
        """The buffers of queues ``first % n`` .. (``count`` messages round robin)."""
        qbs, n = self.qbs, len(self.qbs)
        if count >= n:
            return list(qbs)
        j = first % n
        end = j + count
        return qbs[j:end] if end <= n else qbs[j:] + qbs[: end - n]


def span_queues(acc: Accumulator, topic: str, mqs: list[MessageQueue]) -> SpanQueues:
    cached = acc.span_queues.get(topic)
    if cached is None or cached.mqs is not mqs:
        cached = acc.span_queues[topic] = SpanQueues(acc, topic, mqs)
    return cached


def add_span(acc: Accumulator, span: Batch) -> bool:
    """Buffer a span (its bytes reserved): a place at the back of each of its queues.
    True if the submitting task should yield (it is ready and a request is due)."""
    queues = span.span
    assert queues is not None and span.lane is not None
    span.gen = acc.gen
    acc.track(span)
    waiting = len(queues)
    for qb in queues:
        batches = qb.batches
        if not batches and not qb.muted:
            qb.parked = True
            waiting -= 1
        batches.append(span)
    span.waiting = waiting
    if not waiting:
        return span.lane.span_ready(span)
    return False


def split_spans(acc: Accumulator, req: Request) -> Request:
    """A failed request with its spans split into one batch per queue (in the span's
    order per queue, each message with its own future): retried as any batch is."""
    if all(b.span is None for b in req.batches):
        return req
    batches: list[Batch] = []
    for b in req.batches:
        if b.span is None or b.done:
            batches.append(b)
            continue
        pieces = _split(b)
        acc.replace(b, pieces)
        batches += pieces
    return Request(req.id, req.topic, batches, req.queues, req.dedup)


def _split(span: Batch) -> list[Batch]:
    assert span.span is not None
    data = b"".join(span.chunks)
    futures = [p for f in span.futures for p in _pieces_of(f)]
    by_qid: dict[int, tuple[list[bytes], list[str], list[SendFuture], list[bytes]]] = {}
    pos, keys = 0, span.keys
    for k in range(span.count):
        qid, _flags, _born, tl, kl, pl, bl = _ITEM.unpack_from(data, pos)
        end = pos + _ITEM.size + tl + kl + pl + bl
        chunks, ks, futs, first = by_qid.setdefault(qid, ([], [], [], []))
        if not first:
            first.append(data[end - bl : end])
        chunks.append(data[pos:end])
        ks.append(keys[k])
        futs.append(futures[k])
        pos = end
    qbs = {qb.key[2]: qb for qb in span.span}
    out: list[Batch] = []
    for qid, (chunks, ks, futs, first) in by_qid.items():
        b = Batch.plain_run(span.topic, qbs[qid].mq, span._born_ms, first[0], ks, b"".join(chunks), futs[0], None)
        b.futures, b.per_message, b.starts, b.open = futs, True, None, False
        b.created, b.history, b.gen, b.count = span.created, span.history, span.gen, len(ks)
        out.append(b)
    return out


def _pieces_of(f: SendFuture) -> list[SendFuture]:
    assert isinstance(f, SpanFuture)
    return f.split()

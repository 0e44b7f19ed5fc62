"""Group commit of ``%POP%`` records (as RocketMQ's ``PopBufferMergeService`` merges
CK and ACK records): the records of requests that arrive while an append of them is
in flight go together in the next append, one lane submit and one durability wait for
all of them, and the ACK records of plain acknowledgements merged per group (at most
``ACK_MAX_ROWS`` deliveries a record). Records keep the order in which they were handed
over (the order the state changed; merged ACKs go last in their batch); a batch is a
run of requests that wait for the same topics (their own besides ``%POP%`` and the ones
they name: one topic's refusal is never another request's error), closed at
``BATCH_MAX_RECORDS`` / ``BATCH_MAX_BYTES``. Only the append is serialized: a batch
waits for its fsync and replicas while the next one is appended."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Sequence

import trio

from clmq.broker.store import PutResult
from clmq.common import POP_TOPIC, Message

from ._records import ACK_TAG, Acks, ack_message, decode_pop_record

BATCH_MAX_RECORDS = 512  # a batch closes at this many records (its requests' own, before ACKs are merged)
BATCH_MAX_BYTES = 1024 * 1024  # ... or at this many bytes of record bodies (well under max_message_bytes)
ACK_MAX_ROWS = 2048  # a merged ACK record holds at most this many deliveries (more: further records)

Append = Callable[[list[Message], Sequence[str]], Awaitable[PutResult]]
Confirm = Callable[[PutResult, list[str]], Awaitable[None]]


@dataclass(eq=False)
class _Waiting:
    """One request's records, waiting for an append."""

    messages: list[Message]
    also: tuple[str, ...]  # the topics whose ack mode it waits for besides %POP% (its batch key)
    wake: trio.Event = field(default_factory=trio.Event)  # its batch is done, or it may lead the next
    appended: bool = False  # in a batch appended: waits for that batch's confirmation
    result: PutResult | None = None
    group_ack: str | None = None  # its one ACK record merged into this group's (set while appended)
    error: BaseException | None = None

    @property
    def finished(self) -> bool:
        return self.result is not None or self.error is not None


class RecordBatcher:
    """Appends records through ``append`` then waits for ``confirm`` (durability and
    replicas: ``append_acknowledged`` and ``confirm_acknowledged``), batching the requests
    that wait meanwhile. The first request finding no append in flight leads at once
    (no added wait when alone); a request waiting while another leads is appended in
    the next batch, led by the oldest waiting request. The lead is held for the append
    only (the log order is fixed there): a batch waits for its confirmation while the
    next one is appended."""

    def __init__(self, append: Append, confirm: Confirm) -> None:
        self._append = append
        self._confirm = confirm
        self._waiting: deque[_Waiting] = deque()
        self._busy = False
        self.appends = 0  # appends made (each one batch)
        self.requests = 0  # requests appended

    async def record(self, messages: Sequence[Message], also: Sequence[str] = ()) -> PutResult:
        """Append ``messages`` (in order, after every earlier call's); this call's part of
        the batch's result (its own queue offsets), or the batch's error raised."""
        own = {m.topic for m in messages if m.topic != POP_TOPIC}
        me = _Waiting(list(messages), tuple(sorted(set(also) | own)))
        self._waiting.append(me)
        while not me.finished:
            if self._busy or me.appended:
                await me.wake.wait()
                me.wake = trio.Event()
                continue
            self._busy = True
            try:
                appended = await self._append_next()
            finally:
                self._busy = False
                if self._waiting:
                    self._waiting[0].wake.set()  # the oldest waiting leads the next batch
            if appended is not None:
                await self._confirmed(*appended)
        if me.error is not None:
            raise me.error
        assert me.result is not None
        return me.result

    async def _append_next(self) -> tuple[list[_Waiting], PutResult, list[str], dict[str, slice]] | None:
        """Append the oldest waiting requests that wait for the same topics; the batch,
        its result, the topics it waits for and where the merged ACKs are (None: failed,
        each request's error set)."""
        batch = [self._waiting.popleft()]
        records, size = len(batch[0].messages), _size(batch[0])
        while self._waiting and self._waiting[0].also == batch[0].also:
            records, size = records + len(self._waiting[0].messages), size + _size(self._waiting[0])
            if records > BATCH_MAX_RECORDS or size > BATCH_MAX_BYTES:
                break  # (a pile-up goes in several appends: none grows past what a record may hold)
            batch.append(self._waiting.popleft())
        for w in batch:
            w.appended = True
        messages, plain = _merged(batch)
        self.appends += 1
        self.requests += len(batch)
        try:
            result = await self._append(messages, batch[0].also)
        except BaseException as e:  # each request of the batch raises it (the leader may not be one)
            _fail(batch, e)
            if not isinstance(e, Exception):
                raise
            return None
        topics = sorted({m.topic for m in messages} | set(batch[0].also))
        return batch, result, topics, plain

    async def _confirmed(
        self, batch: list[_Waiting], result: PutResult, topics: list[str], plain: dict[str, slice]
    ) -> None:
        """Wait for the batch's durability and replicas, then answer each request."""
        try:
            await self._confirm(result, topics)
        except BaseException as e:
            _fail(batch, e)
            if not isinstance(e, Exception):
                raise
            return
        at = 0
        for w in batch:
            n = len(w.messages)
            where = slice(at, at + n)
            if w.group_ack is not None:  # its rows are in its group's merged ACK record
                where = plain[w.group_ack]
            else:
                at += n
            w.result = PutResult(
                result.status,
                result.error,
                result.queue_offsets[where],
                result.commitlog_offsets[where],
                result.end_offset,
                result.store_timestamp_ms,
                [n],
            )
            w.wake.set()


def _fail(batch: list[_Waiting], error: BaseException) -> None:
    """Each request of the batch gets the error (its own copy: tracebacks do not mix)."""
    for w in batch:
        w.error = _own(error)
        w.wake.set()


def _own(error: BaseException) -> BaseException:
    """A twin of ``error`` for one request, caused by it (one exception object raised in
    many tasks would mix their tracebacks); the error itself if it is no Exception."""
    if not isinstance(error, Exception):
        return error
    try:
        twin = type(error).__new__(type(error), *error.args)
        twin.__dict__.update(error.__dict__)
        twin.args = error.args
    except Exception:
        return error
    twin.__cause__ = error
    return twin


def _merged(batch: list[_Waiting]) -> tuple[list[Message], dict[str, slice]]:
    """The batch's records: each request's in order, except that requests whose one
    record is an ACK give their rows to one ACK record per group, after the others (an
    offset being acknowledged is taken by no pop or change meanwhile, so a later ACK
    settles the same), each at most ``ACK_MAX_ROWS`` rows; and where each group's merged
    ACK records are."""
    messages: list[Message] = []
    rows: dict[str, list[tuple[str, int, int, int]]] = {}
    for w in batch:
        acks = _plain_ack(w.messages)
        if acks is None:
            messages += w.messages
            continue
        w.group_ack = acks.group
        rows.setdefault(acks.group, []).extend(acks.rows)
    where: dict[str, slice] = {}
    for group, r in rows.items():
        at = len(messages)
        messages += [ack_message(Acks(group, r[i : i + ACK_MAX_ROWS])) for i in range(0, len(r), ACK_MAX_ROWS)]
        where[group] = slice(at, len(messages))
    return messages, where


def _size(w: _Waiting) -> int:
    """A request's record bytes (bodies)."""
    return sum(len(m.body) for m in w.messages)


def _plain_ack(messages: list[Message]) -> Acks | None:
    """The ACK record a request appends alone (None: it appends anything else)."""
    if len(messages) != 1 or messages[0].tags != ACK_TAG or messages[0].topic != POP_TOPIC:
        return None
    try:
        record = decode_pop_record(ACK_TAG, messages[0].body)
    except (ValueError, KeyError, TypeError):
        return None
    return record if isinstance(record, Acks) else None

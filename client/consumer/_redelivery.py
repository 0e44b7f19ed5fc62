"""What a consumer does with messages its application failed on (RocketMQ's
"reconsume later"), and the callback loop that decides it per message.

- :class:`ConsumeStatus`: a handler's verdict on one message.
- :class:`SendBackResult`, :class:`SendBackError`: the outcome of
  :meth:`Consumer.nack` (CONSUMER_SEND_BACK to the brokers).
- :func:`send_back_rows`: the delay asked for each message (the consumer's own
  back-off, or the broker's).
- :class:`Round`: one ``receive()`` result being handled by ``run()``: which records
  are still to be handled (orderly: a queue stops at its first failure), which failed,
  which were left for later (``max_messages`` reached).

- :class:`Redelivery`: the consumer's ``nack`` and ``run``, and the attempt counts of
  an orderly consumer's in-place retries.

The trio consumer, the blocking facade (handlers run in the application's thread) and
the asyncio facade (handlers run on the asyncio loop) run the same rounds.
"""

from __future__ import annotations

import enum
import inspect
import logging
import time
from typing import Any, Awaitable, Callable, Iterator, NamedTuple, Sequence

import trio

from clmq.common import ClientError, Record
from clmq.protocol import DEFAULT_MAX_RECONSUME_TIMES, Frame, ProtocolError, RequestCode

from .._routes import MessageQueue
from .._trace import sent_back_detail
from ._orderly import QueueLocks
from ._requests import NET_ERRORS, Requests
from ._state import Batch, ConsumerState

log = logging.getLogger("clmq.consumer")

BROKER_DECIDES = -1  # a send-back row's delay: the broker's back-off for that attempt


class ConsumeStatus(enum.Enum):
    """A handler's verdict on one message (``None`` counts as SUCCESS, an exception as
    RECONSUME_LATER)."""

    SUCCESS = "success"
    RECONSUME_LATER = "reconsume_later"


Handler = Callable[[Record], ConsumeStatus | Awaitable[ConsumeStatus | None] | None]


class SendBackResult(NamedTuple):
    """Where a failed message went.

    ``destination``: "retry" (``%RETRY%<group>``, due at ``deliver_at_ms``, epoch ms),
    "dlq" (``%DLQ%<group>``: it failed too often; ``deliver_at_ms`` 0) or, for an
    orderly consumer, "in_place" (its queue delivers it again after
    ``orderly_retry_delay_ms``; ``deliver_at_ms`` is that time by this machine's clock).
    ``reconsume_times``: the attempt count of its next delivery (of the dead letter).
    """

    record: Record
    destination: str
    reconsume_times: int
    deliver_at_ms: int


class SendBackError(ClientError):
    """Failed messages could not be handed back to their broker within the consumer's
    ``retry_budget_ms`` (or the broker refused them). ``records``: those not sent back:
    they are not marked processed; the consumer reads their queues again from the
    first of them. ``results``: those that were sent back (other brokers)."""

    def __init__(self, text: str, records: Sequence[Record], results: Sequence[SendBackResult] = ()) -> None:
        super().__init__(text)
        self.records = list(records)
        self.results = list(results)


def send_back_rows(
    records: Sequence[Record], delay_ms: int | None, retry_delays_ms: tuple[int, ...] | None
) -> list[list[int]]:
    """CONSUMER_SEND_BACK rows ``[commitlog_offset, delay_ms]``: ``delay_ms`` if given,
    else the consumer's back-off for the record's next attempt, else the broker's (-1)."""
    rows = []
    for r in records:
        if delay_ms is not None:
            delay = delay_ms
        elif retry_delays_ms:
            delay = retry_delays_ms[min(r.reconsume_times, len(retry_delays_ms) - 1)]
        else:
            delay = BROKER_DECIDES
        rows.append([r.commitlog_offset, delay])
    return rows


def check_delay(delay_ms: int | None) -> None:
    if delay_ms is not None and (type(delay_ms) is not int or delay_ms < 0):
        raise ValueError(f"delay_ms must be milliseconds >= 0 (or None), got {delay_ms!r}")


async def judge(handler: Handler, record: Record) -> bool:
    """Run ``handler`` (sync or async) on ``record``: True if it succeeded. An exception
    is a failure, logged with its traceback (the message is retried, not lost)."""
    try:
        verdict = handler(record)
        if inspect.isawaitable(verdict):
            verdict = await verdict
    except Exception:
        log.exception(
            "handler failed on %s/%d offset %d (delivered again later)",
            record.topic,
            record.queue_id,
            record.queue_offset,
        )
        return False
    return succeeded(verdict, record)


def judge_sync(handler: Callable[[Record], Any], record: Record) -> bool:
    """:func:`judge` for a plain function (the blocking consumer's thread)."""
    try:
        verdict = handler(record)
    except Exception:
        log.exception(
            "handler failed on %s/%d offset %d (delivered again later)",
            record.topic,
            record.queue_id,
            record.queue_offset,
        )
        return False
    return succeeded(verdict, record)


def succeeded(verdict: object, record: Record) -> bool:
    if verdict is None or verdict is ConsumeStatus.SUCCESS:
        return True
    if verdict is ConsumeStatus.RECONSUME_LATER:
        return False
    raise TypeError(
        f"a handler returns ConsumeStatus.SUCCESS, ConsumeStatus.RECONSUME_LATER or None, "
        f"got {verdict!r:.80} for {record.topic}/{record.queue_id} offset {record.queue_offset}"
    )


class Round:
    """One ``receive()`` result handled record by record (``run()``).

    ``keys`` maps each record (by identity) to its queue; orderly rounds stop a queue at
    its first failure (the later records of that queue are delivered again after it,
    in order). ``limit``: records to handle at most (the rest are left, and delivered
    again)."""

    def __init__(
        self,
        records: list[Record],
        keys: dict[int, Any],
        *,
        orderly: bool,
        limit: int | None,
        still_held: Callable[[Any], bool] | None = None,
    ) -> None:
        self.records = records
        self.keys = keys
        self.orderly = orderly
        self.limit = limit
        self.still_held = still_held  # orderly: whether this member still holds a queue's lock
        self.handled = 0
        self.failed: list[Record] = []
        self._done: set[int] = set()
        self._stopped: set[Any] = set()
        self._lost: set[Any] = set()  # queues whose lock lapsed during the round: their new owner reads them

    def todo(self) -> Iterator[Record]:
        """The records to hand to the handler, in order (call :meth:`done` for each)."""
        for r in self.records:
            if self.limit is not None and self.handled >= self.limit:
                return
            key = self.keys.get(id(r))
            if self.orderly and key in self._stopped:
                continue  # after a failure in its queue: delivered again after the failed one
            if self.still_held is not None and key is not None and (key in self._lost or not self.still_held(key)):
                self._lost.add(key)  # checked before every record: another member may own the queue now
                continue
            yield r

    def done(self, record: Record, ok: bool) -> None:
        self.handled += 1
        self._done.add(id(record))
        if not ok:
            self.failed.append(record)
            if self.orderly:
                self._stopped.add(self.keys.get(id(record)))

    def left(self) -> list[Record]:
        """Records not handled (the limit was reached, the round was interrupted, or the
        queue's lock lapsed: never acknowledged past them), but for those of queues
        stopped at a failure (the failure rewinds them)."""
        stopped = self._stopped
        return [r for r in self.records if id(r) not in self._done and self.keys.get(id(r)) not in stopped]


class Redelivery:
    """A consumer's ``nack`` and ``run`` (see :class:`Consumer`), and the attempt
    counts of messages retried in place.

    Orderly consumers retry in place: the queue of each failed record is read again
    from its first failed record (later records of that queue are delivered again too,
    after it) once ``orderly_retry_delay_ms`` passed, with ``record.reconsume_times``
    counting the attempts (from the record's own count). A record failing with
    ``reconsume_times >= max_reconsume_times`` (default 16) goes to ``%DLQ%<group>``
    (CONSUMER_SEND_BACK with ``to_dlq``) and its queue goes on after it; if that
    request fails, the record is delivered again in place and tried again.

    The consumer's own operations are passed in: ``receive`` and ``ack`` (what
    :meth:`handle_rounds` calls), ``rewind`` (read a queue again from an offset)."""

    def __init__(
        self,
        state: ConsumerState,
        requests: Requests,
        locks: QueueLocks | None,
        receive: Callable[[], Awaitable[list[Record]]],
        ack: Callable[[], None],
        rewind: Callable[[MessageQueue, int, float], None],
    ) -> None:
        self.state = state
        self.requests = requests
        self.locks = locks
        self.receive, self.ack, self.rewind = receive, ack, rewind
        # Orderly: per queue, the offset of the message retried in place and the
        # attempt count its next delivery carries (one per queue: the queue waits on it).
        self._attempts: dict[MessageQueue, tuple[int, int]] = {}

    def mark_attempt(self, batch: Batch) -> None:
        """Orderly: a batch about to be handed out that starts with a message retried
        in place carries its attempt count (``reconsume_times``)."""
        attempt = self._attempts.get(batch.mq)
        if attempt is not None and batch.records and batch.records[0].queue_offset == attempt[0]:
            batch.records[0].reconsume_times = attempt[1]

    def forget(self, mq: MessageQueue) -> None:
        self._attempts.pop(mq, None)

    def _errors(self) -> tuple[type[BaseException], ...]:
        """Failures of a send-back: the network's, and an answer that is not the protocol's."""
        return (*NET_ERRORS, ProtocolError)

    async def nack(self, records: Sequence[Record], delay_ms: int | None) -> list[SendBackResult]:
        if self.state.options.mode != "clustering":
            raise ValueError("nack needs mode='clustering': a broadcasting consumer's messages are not redelivered")
        check_delay(delay_ms)
        records = list(records)
        if not records:
            return []
        where = self.state.pending.where(records)
        if self.locks is not None:
            return await self._in_place(records, where)
        results = await self._send_back(records, where, delay_ms)
        if self.state.tracer is not None:
            self.state.tracer.sent_back(
                [where[id(r)] for r in records], records, [sent_back_detail(x) for x in results]
            )
        return results

    async def _send_back(
        self, records: list[Record], where: dict[int, MessageQueue], delay_ms: int | None
    ) -> list[SendBackResult]:
        """One CONSUMER_SEND_BACK per group leader; see :meth:`Consumer.nack`."""
        options = self.state.options
        by_addr: dict[str, list[Record]] = {}
        for r in records:
            by_addr.setdefault(where[id(r)].addr, []).append(r)
        done: dict[int, SendBackResult] = {}
        failed: list[Record] = []
        why: list[str] = []
        for addr, some in by_addr.items():
            fields: dict[str, Any] = {
                "group": self.state.group,
                "messages": send_back_rows(some, delay_ms, options.retry_delays_ms),
            }
            if options.max_reconsume_times is not None:
                fields["max_reconsume_times"] = options.max_reconsume_times
            try:
                reply = await self.requests.to_leader(where[id(some[0])], addr, RequestCode.CONSUMER_SEND_BACK, fields)
                rows = _result_rows(reply, len(some))
            except self._errors() as e:
                failed += some
                why.append(f"{addr}: {e}")
                continue
            for r, row in zip(some, rows):
                done[id(r)] = SendBackResult(r, *row)
        if failed:
            self._rewind_to_first(failed, where)
            raise SendBackError(
                f"{len(failed)} of {len(records)} failed messages not sent back ({'; '.join(why)}): "
                "their queues are read again from the first of them",
                failed,
                list(done.values()),
            )
        return [done[id(r)] for r in records]

    async def _in_place(self, records: list[Record], where: dict[int, MessageQueue]) -> list[SendBackResult]:
        """Orderly: each queue is read again from its first failed record, after
        ``orderly_retry_delay_ms``, or on after it once it went to the dead letters."""
        first: dict[MessageQueue, Record] = {}
        for r in records:
            mq = where[id(r)]
            if mq not in first or r.queue_offset < first[mq].queue_offset:
                first[mq] = r
        outcome = {mq: await self._retry_one(mq, r) for mq, r in first.items()}
        out = []
        for r in records:
            res = outcome[where[id(r)]]
            out.append(res if res.record is r else SendBackResult(r, "in_place", r.reconsume_times, res.deliver_at_ms))
        return out

    async def _retry_one(self, mq: MessageQueue, r: Record) -> SendBackResult:
        options = self.state.options
        limit = DEFAULT_MAX_RECONSUME_TIMES if options.max_reconsume_times is None else options.max_reconsume_times
        if r.reconsume_times >= limit:
            dead = await self._dead_letter(mq, r)
            if dead is not None:
                self._attempts.pop(mq, None)
                self.rewind(mq, r.queue_offset + 1, 0.0)  # the queue goes on after it
                return dead
            self._attempts[mq] = (r.queue_offset, r.reconsume_times)  # the dead letter is tried again next time
        else:
            self._attempts[mq] = (r.queue_offset, r.reconsume_times + 1)
        self.rewind(mq, r.queue_offset, options.orderly_retry_delay_ms / 1000)
        due = int(time.time() * 1000) + options.orderly_retry_delay_ms
        return SendBackResult(r, "in_place", self._attempts[mq][1], due)

    async def _dead_letter(self, mq: MessageQueue, r: Record) -> SendBackResult | None:
        """Orderly: move a message that failed too often to ``%DLQ%<group>`` (None: it
        could not be, within ``retry_budget_ms``)."""
        fields = {"group": self.state.group, "messages": [[r.commitlog_offset, BROKER_DECIDES]], "to_dlq": True}
        try:
            reply = await self.requests.to_leader(mq, mq.addr, RequestCode.CONSUMER_SEND_BACK, fields)
            row = _result_rows(reply, 1)[0]
        except self._errors() as e:
            log.warning(
                "consumer %s: %s/%d offset %d failed %d times; not moved to the dead letters (%s): "
                "delivered again in place",
                self.state.client_id,
                mq.topic,
                mq.queue_id,
                r.queue_offset,
                r.reconsume_times + 1,
                e,
            )
            return None
        log.warning(
            "consumer %s: %s/%d offset %d failed %d times: moved to %%DLQ%%%s",
            self.state.client_id,
            mq.topic,
            mq.queue_id,
            r.queue_offset,
            r.reconsume_times + 1,
            self.state.group,
        )
        return SendBackResult(r, *row)

    def _rewind_to_first(self, records: Sequence[Record], where: dict[int, MessageQueue]) -> None:
        """Read the queues of ``records`` again from the first of them in each."""
        first: dict[MessageQueue, int] = {}
        for r in records:
            mq = where.get(id(r))
            if mq is not None:
                first[mq] = min(first.get(mq, r.queue_offset), r.queue_offset)
        for mq, offset in first.items():
            self.rewind(mq, offset, 0.0)

    # ------------------------------------------------------------------- run()
    def round(self, records: list[Record], limit: int | None) -> Round:
        """A round over what ``receive()`` just returned."""
        locks, assigned = self.locks, self.state.assigned
        # Held now, and its batch still the one handed out: a lapse drops the queue, a
        # lock won back meanwhile reads it anew (another generation). The clock, not
        # trio.current_time(): a blocking consumer's handler thread asks too.
        clock = trio.lowlevel.current_clock()
        generations = {b.mq: b.generation for b in self.state.pending}

        def held(mq: Any) -> bool:
            assert locks is not None
            st = assigned.get(mq)
            return st is not None and st.generation == generations.get(mq) and locks.holds(mq, clock.current_time())

        return Round(
            records,
            self.state.pending.where(records, strict=False),
            orderly=locks is not None,
            limit=limit,
            still_held=None if locks is None else held,
        )

    async def handle_rounds(self, handler: Handler, max_messages: int | None) -> int:
        """``Consumer.run``: receive, hand each message to ``handler``, settle each round."""
        check_limit(max_messages)
        handled = 0
        while max_messages is None or handled < max_messages:
            records = await self.receive()
            rnd = self.round(records, None if max_messages is None else max_messages - handled)
            try:
                for r in rnd.todo():
                    rnd.done(r, await judge(handler, r))
            except BaseException:
                self.abandon(rnd)
                raise
            handled += rnd.handled
            await self.settle(rnd)
        return handled

    async def settle(self, rnd: Round) -> None:
        """After a round: nack its failures, read what it left again, acknowledge the rest."""
        if rnd.failed and self.state.options.mode != "clustering":
            log.warning(
                "consumer %s: %d messages failed (broadcasting mode: not delivered again)",
                self.state.client_id,
                len(rnd.failed),
            )
        elif rnd.failed:
            still = self.state.pending.where(rnd.failed, strict=False)  # a queue lost meanwhile: its new owner reads it
            try:
                await self.nack([r for r in rnd.failed if id(r) in still], None)
            except SendBackError as e:
                log.warning("consumer %s: %s", self.state.client_id, e)
        self.abandon(rnd, failed=False)

    def abandon(self, rnd: Round, *, failed: bool = True) -> None:
        """A round interrupted (cancelled, an error): what it did not handle, and
        (``failed``) what failed, is read again; the rest is acknowledged. No request."""
        undone = rnd.left() + (rnd.failed if failed else [])
        if undone:
            self._rewind_to_first(undone, self.state.pending.where(undone, strict=False))
        self.ack()


def check_limit(max_messages: int | None) -> None:
    if max_messages is not None and (type(max_messages) is not int or max_messages < 0):
        raise ValueError(f"max_messages must be a count >= 0 (or None: run until cancelled), got {max_messages!r}")


def _result_rows(reply: Frame, n: int) -> list[tuple[str, int, int]]:
    """The rows of a CONSUMER_SEND_BACK answer: one per message sent."""
    rows = reply.fields.get("results")
    if not isinstance(rows, list) or len(rows) != n:
        raise ProtocolError(f"CONSUMER_SEND_BACK: {n} messages sent, the answer has no row for each: {rows!r:.80}")
    out = []
    for row in rows:
        if not (
            isinstance(row, list)
            and len(row) == 3
            and isinstance(row[0], str)
            and type(row[1]) is int
            and type(row[2]) is int
        ):
            raise ProtocolError(
                f"CONSUMER_SEND_BACK: a result row must be [destination, reconsume_times, "
                f"deliver_at_ms], got {row!r:.80}"
            )
        out.append((row[0], row[1], row[2]))
    return out

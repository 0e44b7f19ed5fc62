"""Half messages sent together: concurrent ``send_in_transaction`` calls whose half
messages go to the same broker share one SEND_MESSAGE, as plain sends share the
accumulator's requests (a single-message request costs the broker several times a
batched message). One request per broker is in flight: the call that finds none sends
every half message waiting, including those that arrive meanwhile in the next round;
each waiting call gets its own offset from the answer. A failed request fails each of
its calls, which then retry alone (their own tries, with ``dedup`` after an unknown
outcome); a refusal of a request of several halves sends each alone once more, so that
one bad half message never fails the others."""

from __future__ import annotations

import weakref
from collections import deque
from typing import Any, Awaitable, Callable

import trio

from clmq.protocol.transport import ConnectionFailed, RpcError

from .._routes import MessageQueue
from ._future import SendResult
from ._tries import RETRIABLE

SendTo = Callable[..., Awaitable[SendResult]]  # Producer.send_to(mq, body, count, dedup=...)


class SendAlone(Exception):
    """A request of several half messages was refused: each is sent again alone."""


class _Half:
    __slots__ = ("body", "done", "error", "lead", "offset")

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.done = trio.Event()
        self.offset = -1
        self.error: BaseException | None = None
        self.lead = False  # woken to send the next round, not answered


class _Broker:
    """One broker's waiting half messages and whether a request is in flight."""

    def __init__(self) -> None:
        self.waiting: deque[_Half] = deque()
        self.busy = False


class HalfBatches:
    """The half-message batching of one producer (see the module)."""

    def __init__(self, send_to: SendTo) -> None:
        self.send_to = send_to
        self.brokers: dict[str, _Broker] = {}

    async def send(self, half: MessageQueue, body: bytes) -> int:
        """Store the encoded half message ``body`` at ``half`` (the broker's
        ``%TRANS_HALF%`` queue) with others waiting; its commit-log offset. Raises what
        the request raised, or :class:`SendAlone`."""
        b = self.brokers.setdefault(half.addr, _Broker())
        item = _Half(body)
        b.waiting.append(item)
        if b.busy:
            try:
                await item.done.wait()
            except BaseException:
                self._abandon(b, item)
                raise
            if not item.lead:
                return _outcome(item)
        b.busy = True
        await self._lead(b, half, item)
        return _outcome(item)

    async def _lead(self, b: _Broker, half: MessageQueue, mine: _Half) -> None:
        """Send rounds until ``mine`` is answered; then hand the next round to the first
        half message waiting (or leave the broker idle)."""
        try:
            while not mine.done.is_set() or mine.lead:
                mine.lead = False
                batch = list(b.waiting)
                b.waiting.clear()
                await self._round(half, batch)
        finally:
            if b.waiting:
                nxt = b.waiting[0]
                nxt.lead = True
                nxt.done.set()
            else:
                b.busy = False

    async def _round(self, half: MessageQueue, batch: list[_Half]) -> None:
        try:
            got = await self.send_to(half, b"".join(h.body for h in batch), len(batch))
        except (RpcError, ConnectionFailed, trio.TooSlowError) as e:
            alone = len(batch) > 1 and isinstance(e, RpcError) and e.code not in RETRIABLE
            _answer(batch, error=SendAlone(str(e)) if alone else e)
        except BaseException:  # cancelled: the halves' outcome is unknown, each retries alone
            _answer(batch, error=ConnectionFailed("the request carrying it was cancelled"))
            raise
        else:
            for h, offset in zip(batch, got.commitlog_offsets, strict=True):
                h.offset = offset
            _answer(batch)

    def _abandon(self, b: _Broker, item: _Half) -> None:
        """A waiting call cancelled: out of the queue; if it was to lead, the next leads."""
        if item in b.waiting:
            b.waiting.remove(item)
        if item.lead:
            if b.waiting:
                b.waiting[0].lead = True
                b.waiting[0].done.set()
            else:
                b.busy = False


def _answer(batch: list[_Half], error: BaseException | None = None) -> None:
    for h in batch:
        h.error = error
        h.done.set()


def _outcome(item: _Half) -> int:
    if item.error is not None:
        raise item.error
    return item.offset


_BATCHES: weakref.WeakKeyDictionary[Any, HalfBatches] = weakref.WeakKeyDictionary()


def half_batches(producer: Any) -> HalfBatches:
    """The producer's :class:`HalfBatches` (made on first use, gone with the producer)."""
    batches = _BATCHES.get(producer)
    if batches is None:
        batches = _BATCHES[producer] = HalfBatches(producer.send_to)
    return batches

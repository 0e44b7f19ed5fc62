"""``run(handler)`` of the POP consumer: handlers run concurrently (up to
``handler_concurrency``), each message acknowledged as its handler finishes (acks
gathered into one ACK_MESSAGE per broker while others are on their way), a failed one
nacked. Orderly: a *lane* is one queue's batch, handled in order by one task, which
stops at a failed message and nacks it and the rest of the batch (delivered again
after the delay, in order); otherwise a lane is one message.

:func:`handle_lane` only awaits what it is given, so the asyncio facade runs the same
lanes on its own loop."""

from __future__ import annotations

import logging
import math
from typing import Awaitable, Callable, Sequence

import trio

from clmq.common import Record

from ..consumer import Handler, judge

log = logging.getLogger("clmq.pop")

Judge = Callable[[Record], Awaitable[bool]]
Settle = Callable[[Sequence[Record]], Awaitable[object]]
Nack = Callable[[Sequence[Record], int | None], Awaitable[object]]
ACK_BATCH_MAX = 1024  # acks gathered into one call at most
# When run() is cancelled (or its consumer closes): the wait for the acks of handlers that
# finished (queued, or on their way) before returning; past it they come back after their
# invisible time.
ACK_AT_CANCEL_TIMEOUT_S = 5.0


def failed_part(lane: list[Record], i: int, orderly: bool) -> list[Record]:
    """What a failure at ``lane[i]`` hands back: orderly, the rest of the lane with it."""
    return lane[i:] if orderly else [lane[i]]


async def handle_lane(
    lane: list[Record], judge_one: Judge, ack: Settle, nack: Nack, *, orderly: bool, delay_of: Callable[[Record], int]
) -> int:
    """Handle ``lane`` in order; the number of messages handled (a failed one counts)."""
    for i, record in enumerate(lane):
        if await judge_one(record):
            await ack([record])
            continue
        await nack(failed_part(lane, i, orderly), delay_of(record) if orderly else None)
        return i + 1
    return len(lane)


class Budget:
    """How many more messages ``run(max_messages=...)`` may hand to handlers: the limit
    minus those handled and those in lanes being handled. An orderly lane that stops at
    a failure hands the rest of it back unhandled: that room comes back."""

    def __init__(self, most: int | None) -> None:
        self.most, self.handled, self.busy = most, 0, 0

    def finished(self) -> bool:
        return self.most is not None and self.handled >= self.most

    def full(self) -> bool:
        """No room now (lanes being handled may give some back)."""
        return self.most is not None and self.handled + self.busy >= self.most

    def take(self, lane: list[Record]) -> tuple[list[Record], list[Record]]:
        """The part of ``lane`` to handle (it is then busy) and the part beyond the limit."""
        cut = len(lane) if self.most is None else max(0, self.most - self.handled - self.busy)
        self.busy += min(cut, len(lane))
        return lane[:cut], lane[cut:]

    def done(self, taken: int, handled: int) -> None:
        self.busy -= taken
        self.handled += handled


class Runner:
    """One ``run()``: takes lanes as handlers become free, acks in batches."""

    def __init__(
        self,
        take_lane: Callable[[], Awaitable[list[Record]]],
        ack: Settle,
        nack: Nack,
        release: Settle,
        *,
        concurrency: int,
        orderly: bool,
        delay_of: Callable[[Record], int],
    ) -> None:
        self.take_lane, self.ack, self.nack, self.release = take_lane, ack, nack, release
        self.concurrency, self.orderly, self.delay_of = concurrency, orderly, delay_of
        self.budget = Budget(None)
        self._lane_done = trio.Event()

    async def run(self, handler: Handler, max_messages: int | None) -> int:
        send, recv = trio.open_memory_channel[Record](math.inf)
        slots = trio.Semaphore(self.concurrency)
        budget = self.budget = Budget(max_messages)
        async with trio.open_nursery() as outer:
            outer.start_soon(self._acker, recv)
            async with send, trio.open_nursery() as workers:
                while not budget.finished():
                    await slots.acquire()
                    while budget.full() and not budget.finished():
                        await self._lane_done.wait()
                    if budget.finished():
                        break
                    lane, extra = budget.take(await self.take_lane())
                    if extra:
                        await self.release(extra)
                    workers.start_soon(self._work, handler, lane, send, slots)
        return budget.handled

    async def _work(
        self, handler: Handler, lane: list[Record], send: trio.MemorySendChannel[Record], slots: trio.Semaphore
    ) -> None:
        async def ack(records: Sequence[Record]) -> None:
            for r in records:
                try:
                    send.send_nowait(r)
                except (trio.BrokenResourceError, trio.ClosedResourceError):  # the acker ended (cancelled)
                    return  # not acknowledged: it comes back after its invisible time

        async def judge_one(record: Record) -> bool:
            return await judge(handler, record)

        n = 0
        try:
            n = await handle_lane(lane, judge_one, ack, self.nack, orderly=self.orderly, delay_of=self.delay_of)
        finally:
            self.budget.done(len(lane), n)
            slots.release()
            self._lane_done.set()
            self._lane_done = trio.Event()

    async def _acker(self, recv: trio.MemoryReceiveChannel[Record]) -> None:
        """Acknowledge what handlers finished: what queued up meanwhile in one call. When
        cancelled, what was queued or on its way is still acknowledged (shielded, for
        ``ACK_AT_CANCEL_TIMEOUT_S`` at most)."""
        batch: list[Record] = []
        try:
            while True:
                try:
                    batch = [await recv.receive()]
                except trio.EndOfChannel:
                    return
                batch += _queued(recv, ACK_BATCH_MAX - 1)
                await self._ack_batch(batch)
                batch = []
        finally:
            rest = batch + _queued(recv, None)
            recv.close()
            if rest:
                with trio.CancelScope(shield=True), trio.move_on_after(ACK_AT_CANCEL_TIMEOUT_S):
                    await self._ack_batch(rest)

    async def _ack_batch(self, batch: list[Record]) -> None:
        """One ack call; a failure is logged (run() never ends because of an ack)."""
        try:
            await self.ack(batch)
        except Exception:
            log.exception("pop: an ack of %d messages failed (they come back after their invisible time)", len(batch))


def _queued(recv: trio.MemoryReceiveChannel[Record], most: int | None) -> list[Record]:
    """What ``recv`` holds now, up to ``most`` (None: all), without waiting."""
    out: list[Record] = []
    while most is None or len(out) < most:
        try:
            out.append(recv.receive_nowait())
        except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
            break
    return out

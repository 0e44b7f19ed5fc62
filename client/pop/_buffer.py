"""The POP consumer's prefetch buffer: records popped and not yet handed out, bounded
by ``prefetch_max_messages`` counting what the POPs in flight may still bring (a
loop reserves room before it asks), so that no message waits out its invisible time
here while other members could take it."""

from __future__ import annotations

import collections

import trio

from clmq.common import Record


class PopBuffer:
    """Shared by the POP loops (which fill it) and the consumer (which takes from it)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        # (broker name, record): a queue is (broker name, topic, queue id)
        self.records: collections.deque[tuple[str, Record]] = collections.deque()
        self.reserved = 0  # room promised to POPs in flight
        self.failure: BaseException | None = None  # a POP refused for good: receive() raises it
        self._changed = trio.Event()
        self._turn = trio.Lock()  # fair: waiters are served first come, first served

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def reserve(self, want: int) -> int:
        """Wait for room, then promise up to ``want`` of it (at least 1). Loops waiting
        for room get it in turn (a FIFO lock): a loop whose POP just came back cannot
        take the room again before the loops of other brokers waiting for it."""
        async with self._turn:
            while self.limit - len(self.records) - self.reserved <= 0:
                await self._changed.wait()
            n = min(want, self.limit - len(self.records) - self.reserved)
            self.reserved += n
        return n

    def fill(self, reserved: int, broker_name: str, records: list[Record]) -> None:
        """A POP asked with ``reserved`` of room came back with ``records`` (or failed: [])."""
        self.reserved -= reserved
        self.records.extend((broker_name, r) for r in records)
        self._notify()

    def fail(self, error: BaseException) -> None:
        self.failure = error
        self._notify()

    def drain(self) -> list[tuple[str, Record]]:
        """Everything buffered, taken out (at close)."""
        out, self.records = list(self.records), collections.deque()
        return out

    def take(self, most: int, *, whole_queues: bool) -> list[Record]:
        """Up to ``most`` buffered records, oldest first. ``whole_queues`` (orderly): all
        buffered records of the first one's queue, in order, then of the next queues
        while they fit (a queue's batch is never split)."""
        buffer = self.records
        if not whole_queues:
            out = [buffer.popleft()[1] for _ in range(min(most, len(buffer)))]
        else:
            out = []
            while buffer and len(out) < most:
                name, first = buffer[0]
                key = (name, first.topic, first.queue_id)
                same = [r for n, r in buffer if (n, r.topic, r.queue_id) == key]
                if out and len(out) + len(same) > most:
                    break
                self.records = buffer = collections.deque(e for e in buffer if (e[0], e[1].topic, e[1].queue_id) != key)
                out += same
        if out:
            self._notify()
        return out

    async def arrival(self) -> None:
        """Wait until something changes (records arrive, room is freed, a failure)."""
        await self._changed.wait()

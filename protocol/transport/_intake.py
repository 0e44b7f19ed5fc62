"""Reading one connection's requests within the server's limits: how many bytes it may
read next, what it holds in the server's :class:`ByteBudget`, and the deadlines (a
frame must arrive within ``frame_timeout_ms``; a connection with nothing in flight is
closed after ``idle_timeout_ms``)."""

from __future__ import annotations

import trio

from clmq.protocol import Frame, FrameDecoder, FrameRejected

from ._limits import ByteBudget, Framing

READ_CHUNK_BYTES = 1 << 18  # the most read at a time between frames


class Intake:
    """One connection's share of the budget. ``charged`` is what it holds: ``held``
    (frames being handled) plus the frame being read (all of it once reserved, else
    the bytes buffered)."""

    def __init__(
        self,
        budget: ByteBudget,
        decoder: FrameDecoder,
        max_frame_bytes: int,
        connection_cap: int,
        frame_timeout_s: float,
    ) -> None:
        self.budget = budget
        self.decoder = decoder
        self.framing = Framing(max_frame_bytes)
        self.connection_cap = connection_cap
        self.frame_timeout_s = frame_timeout_s
        self.frame_left_s = frame_timeout_s
        self.charged = 0
        self.held = 0
        self.reserved = False  # the current frame is reserved whole
        self._handled = trio.Event()

    @property
    def mid_frame(self) -> bool:
        return self.framing.started

    async def admit_read(self) -> int:
        """Wait until this connection may read, and return how many bytes."""
        f = self.framing
        if f.acceptable and not self.reserved:  # reserve the rest of the frame before reading its body
            await self._charge(self.held + f.total - self.charged, large=f.total > self.budget.large_frame_bytes)
            self.reserved = True
        if self.reserved:
            return min(READ_CHUNK_BYTES, f.total - f.seen)  # up to its end: nothing beyond is charged
        await self._charge(READ_CHUNK_BYTES)  # between frames: charged until the bytes are decoded
        return READ_CHUNK_BYTES

    async def _charge(self, n: int, large: bool = False) -> None:
        while self.charged + n > self.connection_cap:  # pipelined requests: wait for their handlers
            self._handled = trio.Event()
            await self._handled.wait()
        await self.budget.take(n, large)
        self.charged += n

    def receive(self, data: bytes) -> None:
        """Feed what was read to the framing and the decoder."""
        before = self.framing.completed
        self.framing.feed(data)
        self.decoder.receive_data(data)
        if self.framing.completed != before:
            self.reserved = False
            self.frame_left_s = self.frame_timeout_s  # the next frame's clock starts

    def claim(self, event: Frame | FrameRejected) -> int:
        """The bytes of a frame the decoder emitted (0 for a rejected one): the handler
        holds them until :meth:`release`, unless it is dropped at once (``settle``)."""
        if isinstance(event, FrameRejected) or not self.framing.done:
            return 0
        size = self.framing.done.popleft()
        self.held += size
        return size

    def settle(self) -> None:
        """Give back what was charged beyond what the connection now holds."""
        target = self.held + (self.framing.total if self.reserved else self.decoder.buffered_bytes)
        if target < self.charged:
            self.budget.give(self.charged - target)
            self.charged = target

    def release(self, size: int) -> None:
        """A handler is done with a frame of ``size`` bytes."""
        if size:
            self.held -= size
            self.charged -= size
            self.budget.give(size)
            self._handled.set()

    def close(self) -> None:
        """The connection is gone: give back the frame being read and the buffer (frames
        still being handled give theirs back when done)."""
        self.budget.give(self.charged - self.held)
        self.charged = self.held

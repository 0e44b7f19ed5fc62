"""Limits at the door of an :class:`RpcServer`: how many connections, how many request
bytes held (per connection and in all), how long a frame may take to arrive.

Why reserve whole frames: a server that counts only the bytes it has buffered, and
stops reading at a cap, can fill the cap with the first halves of several large frames
and then never read the second halves (every frame waits for the others to finish).
So once a frame's length is known, the whole of it is reserved before its body is
read (Kafka's memory pool works the same way): a frame that is being read can always
complete. Large frames may only reserve up to three quarters of the cap, so that a few
half-sent large frames cannot stop small requests (pulls, heartbeats, small produces)
of other clients until ``frame_timeout_ms`` cuts them off.
"""

from __future__ import annotations

import logging
import resource
import struct
from collections import deque
from dataclasses import dataclass

import trio

from clmq.common import MiB

_PREFIX = struct.Struct("<II")
MAX_HEADER_BYTES = 1 << 20  # as protocol's FrameDecoder: the most a rejected frame's header buffers
LARGE_FRAME_SHARE = 64  # frames above cap/64 are "large" ...
LARGE_FRAMES_MAY_USE = 0.75  # ... and may only reserve up to this share of the cap


@dataclass(frozen=True)
class ServerLimits:
    """The limits of one server; see the broker's settings of the same names."""

    max_connections: int = 10_000
    reserved_file_descriptors: int = 128
    max_connection_buffer_bytes: int = 64 * MiB
    max_buffered_request_bytes: int = 256 * MiB
    frame_timeout_ms: int = 60_000
    # Reply bytes (file spans counted) one connection may have waiting to be written;
    # beyond it the server stops reading that connection's requests until its client
    # reads (a client that never reads cannot make the server buffer without bound).
    max_connection_send_buffer_bytes: int = 32 * MiB

    def check(self, max_frame_bytes: int) -> None:
        """Raise ValueError naming the settings if these limits cannot work together."""
        floor = max(max_frame_bytes, 2 * MAX_HEADER_BYTES)
        if self.max_connection_buffer_bytes < floor:
            raise ValueError(
                f"max_connection_buffer_bytes={self.max_connection_buffer_bytes} must be at least "
                f"max_frame_bytes={max_frame_bytes} and at least {2 * MAX_HEADER_BYTES}"
            )
        if self.max_buffered_request_bytes < self.max_connection_buffer_bytes:
            raise ValueError(
                f"max_buffered_request_bytes={self.max_buffered_request_bytes} must be at least "
                f"max_connection_buffer_bytes={self.max_connection_buffer_bytes}"
            )
        if self.max_connection_send_buffer_bytes < 1:
            raise ValueError(
                f"max_connection_send_buffer_bytes must be positive, got {self.max_connection_send_buffer_bytes}"
            )
        if self.max_connections < 1 or self.frame_timeout_ms <= 0 or self.reserved_file_descriptors < 0:
            raise ValueError("max_connections and frame_timeout_ms must be positive, reserved_file_descriptors >= 0")

    def connection_cap(self) -> int:
        """``max_connections``, lowered so that connections leave
        ``reserved_file_descriptors`` of the process's descriptor limit to the rest of
        the server (its store's files, outgoing connections)."""
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            return self.max_connections
        return max(1, min(self.max_connections, soft - self.reserved_file_descriptors))


class ByteBudget:
    """Request bytes a server holds, at most ``limit`` (``max_buffered_request_bytes``):
    bytes read and not yet handled, and frames reserved whole while they arrive."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.large_frame_bytes = limit // LARGE_FRAME_SHARE
        self.large_ceiling = int(limit * LARGE_FRAMES_MAY_USE)
        self.used = 0
        self.peak = 0
        self._freed = trio.Event()

    def try_take(self, n: int, large: bool = False) -> bool:
        ceiling = self.large_ceiling if large and self.used else self.limit
        if self.used + n > ceiling:
            return False
        self.used += n
        self.peak = max(self.peak, self.used)
        return True

    async def take(self, n: int, large: bool = False) -> None:
        """Wait until ``n`` bytes fit, then take them (back-pressure: the caller does
        not read from its socket meanwhile)."""
        while not self.try_take(n, large):
            await self._freed.wait()

    def give(self, n: int) -> None:
        if n:
            self.used -= n
            self._freed.set()
            self._freed = trio.Event()


class Framing:
    """Where a byte stream is relative to frame boundaries, from the frames' prefixes
    (the decoder keeps its buffer to itself): the length of the frame being read, how
    much of it has arrived, and the lengths of frames completed since last asked."""

    def __init__(self, max_frame_bytes: int) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._prefix = b""
        self.total = 0  # the current frame's length with its prefix, once known
        self.seen = 0  # bytes of the current frame received
        self.completed = 0  # frames completed so far
        self.done: deque[int] = deque()  # lengths of completed frames the decoder will emit

    @property
    def started(self) -> bool:
        return self.seen > 0

    @property
    def acceptable(self) -> bool:
        """The current frame's length is known and within ``max_frame_bytes``."""
        return 8 <= self.total <= self.max_frame_bytes

    def feed(self, data: bytes) -> None:
        pos, n = 0, len(data)
        while pos < n:
            if not self.total and not self._prefix and n - pos >= _PREFIX.size:  # a whole prefix here: no copy
                total = max(_PREFIX.size, 4 + _PREFIX.unpack_from(data, pos)[0])
                if total <= n - pos:  # and the whole frame (pipelined small requests)
                    if 8 <= total <= self.max_frame_bytes:
                        self.done.append(total)
                    pos += total
                    self.completed += 1
                    continue
            if not self.total:
                take = min(_PREFIX.size - len(self._prefix), len(data) - pos)
                self._prefix += data[pos : pos + take]
                pos += take
                self.seen += take
                if len(self._prefix) < _PREFIX.size:
                    return
                self.total = max(_PREFIX.size, 4 + _PREFIX.unpack(self._prefix)[0])  # a bad one kills the decoder
            step = min(self.total - self.seen, len(data) - pos)
            pos += step
            self.seen += step
            if self.seen == self.total:
                if self.acceptable:
                    self.done.append(self.total)
                self._prefix, self.total, self.seen = b"", 0, 0
                self.completed += 1


class Burst:
    """One warning when a run of refusals begins (not one per connection), and one
    line with the count when it ends."""

    def __init__(self, log: logging.Logger, what: str) -> None:
        self.log, self.what = log, what
        self.count = 0
        self.last_s = 0.0

    def hit(self, message: str) -> None:
        if not self.count:
            self.log.warning("%s (further ones are counted, not logged, until it ends)", message)
        self.count += 1
        self.last_s = trio.current_time()

    def end(self) -> None:
        if self.count:
            self.log.info("%s: %d in this burst", self.what, self.count)
            self.count = 0

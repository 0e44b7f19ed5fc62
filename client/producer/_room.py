"""Room in the producer's buffer (``buffer_max_bytes`` of encoded messages accepted and
not yet answered): refusing a batch that could never fit, and waiting for room
(``buffer_full="block"``) or refusing at once (``"raise"``). The state is the
accumulator's (``buffered_bytes``, its ``room`` event, set as answers free bytes)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from ._future import BatchTooLargeError, BufferFullError, SendError

if TYPE_CHECKING:
    from ._accumulator import Accumulator


def check_size(acc: Accumulator, size: int) -> None:
    """Refuse a batch that could never be sent."""
    if size > acc.settings.buffer_max_bytes:
        raise BatchTooLargeError(
            f"a batch of {size:,} encoded bytes exceeds the producer's "
            f"buffer_max_bytes={acc.settings.buffer_max_bytes:,}"
        )
    if size > acc.max_request_bytes:
        raise BatchTooLargeError(
            f"a batch of {size:,} encoded bytes exceeds the largest request "
            f"({acc.max_request_bytes:,}: the client's max_frame_bytes less headroom)"
        )


async def reserve(acc: Accumulator, size: int) -> None:
    """Room for ``size`` bytes in the buffer: wait (``block``) or BufferFullError."""
    if acc.closing:
        raise SendError("producer closed")
    limit = acc.settings.buffer_max_bytes
    if acc.buffered_bytes + size <= limit:
        acc.buffered_bytes += size
        return
    if acc.settings.buffer_full == "block":
        with trio.move_on_after(acc.settings.buffer_block_max_ms / 1000):
            while acc.buffered_bytes + size > limit:
                if acc.room is None:
                    acc.room = trio.Event()
                await acc.room.wait()
                if acc.closing:
                    raise SendError("producer closed")
            acc.buffered_bytes += size
            return
        raise BufferFullError(
            f"the producer's buffer is full: {acc.buffered_bytes:,} bytes accepted and not "
            f"answered, buffer_max_bytes={limit:,}; waited buffer_block_max_ms="
            f"{acc.settings.buffer_block_max_ms:,}"
        )
    raise BufferFullError(
        f"the producer's buffer is full: {acc.buffered_bytes:,} bytes accepted and not "
        f"answered, buffer_max_bytes={limit:,} (buffer_full='raise')"
    )

"""The producer (:class:`Producer`, :func:`open_producer`) and the parts it is made of.

- ``_producer``: the public API (``send``, ``send_batch``, ``submit``/``flush``), options.
- ``_accumulator``: per-queue buffers, ``linger_ms``/``batch_max_bytes``, the buffer limit.
- ``_batch``, ``_encode``: batches and requests, encoded once per attempt.
- ``_sender``, ``_retry``, ``_tries``: requests in flight per broker, retries within the
  budget (same queue after an unknown outcome, with dedup), ``max_in_flight``.
- ``_future``, ``_scheduled``: the results of ``submit``; scheduled sends (``delay_ms``).
"""

from ._producer import (
    BatchTooLargeError,
    BufferFullError,
    Producer,
    SendError,
    SendFuture,
    SendResult,
    open_producer,
    shard,
)

__all__ = [
    "BatchTooLargeError",
    "BufferFullError",
    "Producer",
    "SendError",
    "SendFuture",
    "SendResult",
    "open_producer",
    "shard",
]

"""The producer (:class:`Producer`, :func:`open_producer`) and the parts it is made of.

- ``_producer``: the public API (``send``, ``send_batch``, ``submit``/``flush``).
- ``_options``: :class:`ProducerOptions`, checked when made.
- ``_accumulator``: per-queue buffers, ``linger_ms``/``batch_max_bytes``, the buffer limit.
- ``_batch``, ``_encode``, ``_room``: batches and requests, encoded once per attempt;
  message ids; room in the buffer.
- ``_sender``, ``_retry``, ``_tries``: requests in flight per broker, retries within the
  budget (same queue after an unknown outcome, with dedup), ``max_in_flight``.
- ``_future``, ``_scheduled``: the results of ``submit``; scheduled sends (``delay_ms``).
- ``_many``: ``submit_many`` (many messages per call, a batch per queue touched).
- ``_transaction``, ``_checkback``, ``_transaction_hosts``: transactional sends
  (``send_in_transaction``), the check-back task, where listeners run (asyncio, threads).
"""

from ._many import check_input as check_many_input
from ._producer import (
    BatchTooLargeError,
    BufferFullError,
    Producer,
    ProducerOptions,
    SendError,
    SendFuture,
    SendFutures,
    SendResult,
    open_producer,
    producer_context,
    shard,
)
from ._transaction import LocalTransactionState, TransactionListener, TransactionResult
from ._transaction_hosts import in_threads, on_asyncio, transact_in_thread, transact_on_loop, user_listener

__all__ = [
    "BatchTooLargeError",
    "BufferFullError",
    "LocalTransactionState",
    "Producer",
    "ProducerOptions",
    "SendError",
    "SendFuture",
    "SendFutures",
    "SendResult",
    "TransactionListener",
    "TransactionResult",
    "check_many_input",
    "in_threads",
    "on_asyncio",
    "open_producer",
    "producer_context",
    "shard",
    "transact_in_thread",
    "transact_on_loop",
    "user_listener",
]

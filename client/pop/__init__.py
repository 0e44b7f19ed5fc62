"""The POP consumer (:class:`PopConsumer`, :func:`open_pop_consumer`) and its parts.

- ``_consumer``: the public API (``receive``, ``ack``, ``nack``, ``extend``, ``run``).
- ``_options``: :class:`PopConsumerOptions`.
- ``_loops``: ``pops_in_flight`` long-polling POP loops per (topic, broker group), following routes.
- ``_buffer``: the bounded prefetch buffer the loops fill.
- ``_receipts``: each popped record's receipt handle; :class:`PopStats`.
- ``_settle``: ACK_MESSAGE and CHANGE_INVISIBLE_TIME, per broker, following its leader.
- ``_run``: ``run(handler)``: concurrent handlers, batched acks, orderly lanes.
"""

from ._consumer import PopConsumer, open_pop_consumer, pop_consumer_context
from ._options import DEFAULT_RETRY_DELAYS_MS, PopConsumerOptions
from ._receipts import PopStats, Receipt
from ._run import Budget, failed_part, handle_lane

__all__ = [
    "DEFAULT_RETRY_DELAYS_MS",
    "Budget",
    "PopConsumer",
    "PopConsumerOptions",
    "PopStats",
    "Receipt",
    "failed_part",
    "handle_lane",
    "open_pop_consumer",
    "pop_consumer_context",
]

"""The consumer (:class:`Consumer`, :func:`open_consumer`) and the parts it is made of.

- ``_consumer``: the public API (``receive``, ``commit``, ``nack``, ``run``).
- ``_options``: :class:`ConsumerOptions`, :class:`TagFilter`.
- ``_state``: :class:`ConsumerState`, what the parts below share (subscriptions,
  assigned queues and their positions, prefetched and pending batches); no part holds
  a reference to the consumer.
- ``_requests``: requests to brokers, following a group's moved leader.
- ``_fetcher``, ``_ready``: prefetching pulls across the assigned queues; which are ready to ask.
- ``_membership``, ``_allocate``: heartbeats, rebalancing.
- ``_commits``, ``_start_offset``: committed offsets and where a new queue starts.
- ``_redelivery``, ``_orderly``: retries and dead letters; orderly consumption's locks.
"""

from ._allocate import allocate_averagely
from ._consumer import Consumer, consumer_context, open_consumer
from ._options import ConsumerOptions, TagFilter
from ._redelivery import ConsumeStatus, Handler, Round, SendBackError, SendBackResult, check_limit, judge, judge_sync
from ._state import DamagedQueueError

__all__ = [
    "ConsumeStatus",
    "Consumer",
    "ConsumerOptions",
    "DamagedQueueError",
    "Handler",
    "Round",
    "SendBackError",
    "SendBackResult",
    "TagFilter",
    "allocate_averagely",
    "check_limit",
    "consumer_context",
    "judge",
    "judge_sync",
    "open_consumer",
]

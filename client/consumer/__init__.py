"""The consumer (:class:`Consumer`, :func:`open_consumer`) and the parts it is made of.

- ``_consumer``: the public API (``receive``, ``commit``, ``nack``, ``run``).
- ``_options``: :class:`ConsumerOptions`, :class:`TagFilter`.
- ``_fetcher``: prefetching pulls across the assigned queues.
- ``_membership``, ``_allocate``: heartbeats, rebalancing, following a moved leader.
- ``_commits``, ``_start_offset``: committed offsets and where a new queue starts.
- ``_redelivery``, ``_orderly``: retries and dead letters; orderly consumption's locks.
"""

from ._allocate import allocate_averagely
from ._consumer import Consumer, consumer_context, open_consumer
from ._fetcher import DamagedQueueError
from ._options import ConsumerOptions, TagFilter
from ._redelivery import ConsumeStatus, Handler, Round, SendBackError, SendBackResult, check_limit, judge, judge_sync

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

"""Where a consumer starts reading a queue it was given: the group's committed offset
(clustering), else ``start_from``: ``earliest``, ``latest`` or a timestamp in ms, which
the queue's broker searches (SEARCH_OFFSET)."""

from __future__ import annotations

import logging
from typing import Any, Awaitable, Callable, Protocol, TypeVar

import trio

from clmq.protocol import Frame, RequestCode

from .._routes import MessageQueue
from ._options import ConsumerOptions

log = logging.getLogger("clmq.consumer")

T = TypeVar("T")
RETRY_FIRST_S, RETRY_MAX_S = 0.05, 2.0  # back-off of a look-up that failed


class StartHost(Protocol):
    """What a start-offset search needs of its consumer."""

    options: ConsumerOptions
    client_id: str
    net_errors: tuple[type[BaseException], ...]

    async def request(self, addr: str, code: int, fields: dict[str, Any], timeout_ms: float | None = None) -> Frame: ...


async def retrying(host: StartHost, fn: Callable[[], Awaitable[T]]) -> T:
    """``fn()``, again after each network failure (growing back-off) until it answers."""
    delay = RETRY_FIRST_S
    while True:
        try:
            return await fn()
        except host.net_errors as e:
            log.debug("consumer %s: %s; retrying in %.2f s", host.client_id, e, delay)
            await trio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_S)


def start_offset_now(options: ConsumerOptions, committed: int, lo: int, hi: int) -> int | None:
    """:func:`start_offset` when it needs no request (all but timestamps), else None: a
    consumer of 10,000 queues calls it for each, and an await apiece adds up.
    ``committed``: the group's offset (-1: none); ``lo``/``hi``: the queue's min/max."""
    if options.mode == "clustering" and committed >= 0:
        return committed
    start = options.start_from
    if isinstance(start, int) or (isinstance(start, str) and start.isdigit()):
        return None
    return hi if start == "latest" else lo


async def start_offset(host: StartHost, mq: MessageQueue, committed: int, lo: int, hi: int) -> int:
    """Where to start reading ``mq``: :func:`start_offset_now`, else the offset of the
    first message stored at or after the ``start_from`` timestamp."""
    now = start_offset_now(host.options, committed, lo, hi)
    if now is not None:
        return now
    q = {"topic": mq.topic, "queue_id": mq.queue_id, "timestamp_ms": int(host.options.start_from)}
    reply = await retrying(host, lambda: host.request(mq.addr, RequestCode.SEARCH_OFFSET, q))
    offset: int = reply.fields["offset"]
    return offset

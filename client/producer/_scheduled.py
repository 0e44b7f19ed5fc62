"""Scheduled (delayed) sends: a message due later is sent to its broker's ``%TIMER%``
topic, with its real topic, queue and tags as properties and its due time as tags
(the wire contract: SEND_MESSAGE in ``protocol/_codes.py``); the broker's timer
delivers it once, at its time, into the queue chosen here. Its message id names the
scheduled copy: :meth:`client.Admin.cancel_message` cancels it until shortly before
it is due."""

from __future__ import annotations

import datetime as dt
import time
from typing import Awaitable, Callable, Sequence

import trio

from clmq.common import (
    MAX_TAGS_BYTES,
    PROP_DELIVER_AT,
    PROP_REAL_QID,
    PROP_REAL_TAGS,
    PROP_REAL_TOPIC,
    TIMER_TOPIC,
    ClmqError,
    Message,
    PackError,
    encode_properties,
    pack_parts,
    timer_tag,
)
from clmq.protocol.transport import ConnectionFailed, RpcError

from .._routes import MessageQueue
from ._future import Answer, DoneCallback, SendError, SendFuture, SendResult
from ._tries import QueueSelector, RetryPolicy, Targets, Tries

SendTo = Callable[..., Awaitable[SendResult]]  # Producer.send_to(mq, body, count, dedup=...)


def due_ms(delay_ms: int | float | None, deliver_at: int | dt.datetime | None) -> int | None:
    """The due time in epoch ms of a send given ``delay_ms`` or ``deliver_at`` (epoch ms
    or an aware datetime); None for neither. Both is a ValueError."""
    if delay_ms is not None and deliver_at is not None:
        raise ValueError("give delay_ms or deliver_at, not both")
    if delay_ms is not None:
        if isinstance(delay_ms, bool) or not isinstance(delay_ms, (int, float)) or delay_ms < 0:
            raise ValueError(f"delay_ms must be a number of milliseconds >= 0, got {delay_ms!r}")
        return int(time.time() * 1000 + delay_ms)
    if isinstance(deliver_at, dt.datetime):
        if deliver_at.tzinfo is None:
            raise ValueError("deliver_at must be an aware datetime (with tzinfo) or epoch milliseconds")
        return int(deliver_at.timestamp() * 1000)
    if deliver_at is not None and (isinstance(deliver_at, bool) or not isinstance(deliver_at, int) or deliver_at < 0):
        raise ValueError(f"deliver_at must be epoch milliseconds or a datetime, got {deliver_at!r}")
    return deliver_at


_RESERVED = frozenset({PROP_DELIVER_AT, PROP_REAL_TOPIC, PROP_REAL_QID, PROP_REAL_TAGS})


def encode_scheduled(msgs: Sequence[Message], real: MessageQueue, due: int) -> bytes:
    """The SEND_MESSAGE body of ``msgs`` as scheduled messages for queue ``real`` at
    ``due``. Their properties start with the ones every message of the batch shares
    (due time, real topic and queue: encoded once), then REAL_TAGS, then the message's
    own (a user property of a reserved name is left out): the broker checks the shared
    part of a batch once."""
    lead = encode_properties(
        {PROP_DELIVER_AT: str(due), PROP_REAL_TOPIC: real.topic, PROP_REAL_QID: str(real.queue_id)}
    )
    tags = timer_tag(due).encode()
    parts: list[bytes] = []
    for m in msgs:
        own = m.properties
        if own and not _RESERVED.isdisjoint(own):
            own = {k: v for k, v in own.items() if k not in _RESERVED}
        real_tags = m.tags.encode()
        if len(real_tags) > MAX_TAGS_BYTES:  # they are a message's tags again when it is delivered
            raise PackError(f"tags of {len(real_tags)} bytes: at most {MAX_TAGS_BYTES}")
        props = lead + encode_properties({PROP_REAL_TAGS: m.tags}) + (encode_properties(own) if own else b"")
        parts += pack_parts(0, m.flags, m.born_timestamp_ms, tags, m.keys.encode(), props, m.body)
    return b"".join(parts)


async def send_scheduled(
    send_to: SendTo,
    targets: Targets,
    policy: RetryPolicy,
    topic: str,
    msgs: Sequence[Message],
    due: int,
    sharding_key: str | None,
    selector: QueueSelector | None,
) -> SendResult:
    """Send ``msgs`` as one batch due at ``due``: to the queue picked as for a plain send,
    retried as a plain send is (:class:`Tries`: ``retries`` and ``retry_budget_ms``, the
    same queue after an unknown outcome, with ``dedup``, a leader NOT_LEADER names). The
    result's queue is the real one; its offsets and message ids are the scheduled copies'."""
    born = int(time.time() * 1000)
    for m in msgs:
        m.born_timestamp_ms = m.born_timestamp_ms or born
    tries = Tries(policy, time.monotonic())
    while tries.more():
        real = await targets.target(topic, msgs[0], sharding_key, selector, tries)
        if real is not None:
            timer = MessageQueue(TIMER_TOPIC, real.broker_name, 0, real.addr)
            try:
                got = await send_to(timer, encode_scheduled(msgs, real, due), len(msgs), dedup=tries.dedup)
                return SendResult(
                    real, got.queue_offsets, got.commitlog_offsets, got.durable, got.flush_timeout, got.duplicate
                )
            except (RpcError, ConnectionFailed, trio.TooSlowError) as e:
                targets.failed(real, e, tries)  # raises SendError for an error not worth another try
        await trio.sleep(tries.delay())
    raise tries.error(topic)


def start_scheduled(
    nursery: trio.Nursery,
    inflight: set[SendFuture],
    keys: Sequence[str],
    send: Callable[[], Awaitable[SendResult]],
    callback: DoneCallback | None,
) -> SendFuture:
    """A :class:`SendFuture` for a scheduled send run as a task of the producer's
    nursery (``submit(..., delay_ms=...)``); ``inflight`` holds it until it is done,
    for the producer's ``flush``."""
    fut = SendFuture()
    if callback is not None:
        fut.add_done_callback(callback)
    inflight.add(fut)

    async def send_when_due() -> None:
        try:
            r = await send()
            answer = Answer(r.queue, r.queue_offsets, r.commitlog_offsets, r.durable, r.flush_timeout, r.duplicate)
            fut._resolve(answer, keys, 0, len(r.queue_offsets))
        except SendError as e:
            fut._fail(e)
        except ClmqError as e:  # no route for the topic, say
            fut._fail(SendError(f"scheduled send failed: {e}", getattr(e, "code", None)))
        finally:
            inflight.discard(fut)

    nursery.start_soon(send_when_due)
    return fut

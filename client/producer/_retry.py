"""A failed request's batches: each is retried by the producer's rules (``Tries``,
``Targets``) or failed for good. A retried batch keeps its queue muted until it is
queued again: at the front of the same queue, or at the back of another one (not
pinned, retried elsewhere). The batches of one failed request are retried together:
one pause, one route refresh, not one per batch (a request may carry 1,000 queues)."""

from __future__ import annotations

import logging

import trio

from clmq.protocol.transport import RpcError

from .._routes import NoRouteError
from ._batch import Batch, Buffers, QueueKey, Request
from ._future import SendError
from ._tries import RETRIABLE, Targets, Tries

log = logging.getLogger("clmq.producer")


def failed(acc: Buffers, req: Request, error: Exception) -> None:
    """The request failed as a whole (no answer, or an error answer)."""
    if isinstance(error, RpcError) and error.code not in RETRIABLE and len(req.batches) > 1:
        _isolate(acc, req)
        return
    groups: dict[QueueKey | None, list[Batch]] = {}
    for b in req.batches:
        if b.done:
            continue
        tries = b.tries
        if tries is None:
            tries = b.tries = Tries(acc.policy, b.created)
            tries.attempts = 1
        try:
            maybe_stored = acc.targets.failed(b.mq, error, tries)
        except SendError as e:
            acc.fail(b, e)
            continue
        if maybe_stored:
            b.history += (req.id,)
        if not tries.more():
            acc.fail(b, tries.error(req.topic))
            continue
        groups.setdefault((b.mq.topic, b.mq.broker_name, b.mq.queue_id), []).append(b)
    for qb in req.queues:
        if qb.key not in groups:
            acc.unmute(qb)
    if groups:
        acc.nursery.start_soon(retry, acc, req.topic, groups)


def _isolate(acc: Buffers, req: Request) -> None:
    """An error answer not worth a retry for a request of several batches: it may be one
    batch's fault (a message too large, a bad one). Each batch is sent again in a
    request of its own (not counted as a try): only the culprit fails."""
    for qb in req.queues:
        own = [b for b in req.batches if not b.done and (b.mq.topic, b.mq.broker_name, b.mq.queue_id) == qb.key]
        for b in own:
            b.alone, b.next_mq = True, b.mq
        acc.requeue(qb.key, own)


async def retry(acc: Buffers, topic: str, groups: dict[QueueKey | None, list[Batch]]) -> None:
    """Retry ``groups`` (per old queue, in order) until each batch has a queue or is
    failed; a queue's batches are queued again together, once all have their target.
    Group ``None`` is the topic's unrouted batches (``acc.unrouted[topic]``): submits
    append to it meanwhile, and it is let go in the same step as it is queued."""
    try:
        while groups:
            waiting = [b for bs in groups.values() for b in bs if b.next_mq is None and not b.done]
            unreachable = None
            if waiting:
                await trio.sleep(max(_tries(b).delay() for b in waiting))
                if any(_tries(b).hint is None for b in waiting):
                    unreachable = await _refresh(acc.targets, topic)
            for key, bs in list(groups.items()):
                if await _retarget(acc, topic, bs, unreachable):
                    del groups[key]
                    if key is None:  # the topic's unrouted batches, all placed now (no await since)
                        acc.unrouted.pop(topic, None)
                    acc.requeue(key, [b for b in bs if not b.done])
    except Exception as e:  # a bug must not lose batches silently, nor keep their queues muted
        log.exception("retrying batches of topic %r failed", topic)
        if None in groups:
            acc.unrouted.pop(topic, None)
        for key, bs in groups.items():
            for b in bs:
                acc.fail(b, SendError(f"send to topic {topic!r} failed: {e!r}"))
            if key is not None and key in acc.queues:
                acc.unmute(acc.queues[key])


def _tries(b: Batch) -> Tries:
    assert b.tries is not None
    return b.tries


async def _refresh(targets: Targets, topic: str) -> str | None:
    """Fresh routes for the whole group; the error text if no name server answered."""
    targets.forget(topic)
    try:
        await targets.routes.queues(topic, refresh=True)
    except NoRouteError as e:
        return str(e) if e.unreachable else None
    return None


async def _retarget(acc: Buffers, topic: str, batches: list[Batch], unreachable: str | None) -> bool:
    """Find the next queue of each batch in order; False at the first that has none yet
    (it and those after it wait for the next round: their order is kept)."""
    for b in batches:
        if b.done or b.next_mq is not None:
            continue
        tries = _tries(b)
        mq = None
        if unreachable is not None and tries.hint is None:
            tries.attempts += 1
            tries.note(unreachable, None)
        else:
            try:
                mq = await acc.targets.target(
                    topic, b.first, b.sharding_key, b.selector, tries, refresh=False, last=b.mq
                )
            except (SendError, NoRouteError) as e:
                acc.fail(b, e if isinstance(e, SendError) else SendError(str(e)))
                continue
        if mq is None:
            if not tries.more():
                acc.fail(b, tries.error(topic))
                continue
            return False
        b.next_mq = mq
    return True

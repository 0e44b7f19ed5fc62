"""``Producer.submit_many``: many messages of one topic in one call, each with its own
future and its own outcome. The common case (no tags, keys or properties, unique ids
on, no selector, fresh routes) pays per call what ``submit`` pays per message: one
clock read, one route look-up, one round-robin step, one reservation of buffer room;
per queue it touches, one encoded buffer and one batch; per message, a UNIQ_KEY and a
header.
Anything else goes through ``submit`` once per message, with the same outcomes.

Outcomes are results: a message larger than a request can carry fails alone with
:class:`BatchTooLargeError`; any other refusal (the buffer full, the producer closed, no
healthy broker) fails that message and every later one of the call, none of them
buffered, and no earlier one refused: resending ``bodies[first_failed:]`` sends each
message once, and a queue's stored messages keep their order without gaps. (Room is
reserved for the whole call before any of it is buffered, or, for a call larger than
``buffer_max_bytes / CALL_PART_OF_BUFFER``, for each such part in turn.) Raised at
once, with nothing buffered: bad input (TypeError), an unknown topic (NoRouteError),
a producer opened without a nursery (RuntimeError)."""

from __future__ import annotations

import gc
import time
from bisect import bisect_right
from contextlib import contextmanager
from itertools import accumulate
from typing import TYPE_CHECKING, Iterator, Mapping, Protocol, Sequence

import trio

from clmq.common import ClientError, Message

from .._routes import MessageQueue
from ._batch import Batch
from ._encode import PLAIN_CHECKED, PLAIN_OVERHEAD_BYTES, encode_plain, encode_plain_run
from ._future import BatchTooLargeError, SendError, SendFuture, SendFutures
from ._room import check_size, reserve
from ._span import SPAN_PART_OF_BATCH, SPANS_CHECKED, SpanFuture, add_span, encode_span, span_queues

if TYPE_CHECKING:
    from ._accumulator import Accumulator
    from ._encode import MessageIds
    from ._tries import QueueSelector, Targets


class Producer(Protocol):
    """What ``submit_many`` needs of the producer (``_producer.Producer``)."""

    ids: MessageIds
    targets: Targets

    @property
    def tracer(self) -> object | None: ...

    def _accumulator(self) -> Accumulator: ...

    async def submit(
        self,
        topic: str,
        body: bytes,
        *,
        tags: str = "",
        keys: str = "",
        properties: Mapping[str, str] | None = None,
        sharding_key: str | None = None,
        selector: QueueSelector | None = None,
    ) -> SendFuture: ...


# Python's cyclic collector passes every 700 new objects (its default); a call makes a
# few objects per message, so a call of fewer messages than this triggers a pass or
# two at most: not worth pausing the collector of the whole process for.
COLLECTOR_PAUSE_MIN_MESSAGES = 256
# A call reserves buffer room in parts of at most this share of ``buffer_max_bytes``
# (a whole call at once if it is smaller): with ``buffer_full="block"`` a part waits for
# that much room only, not for an empty buffer.
CALL_PART_OF_BUFFER = 4

# A call's part goes as spans (batches of many queues, ``_span``) when it has fewer than
# this many messages per queue of the plan; with more, each queue's run is a batch of its
# own (as before spans): a few queues then keep a request each in flight, where spans
# over all of them would go one at a time.
SPAN_BELOW_PER_QUEUE = 8

Plan = tuple[list[MessageQueue], int]  # message i goes to queue ``mqs[(start + i) % len(mqs)]``
Group = tuple[MessageQueue, range]  # a queue and the indices of the call's messages that go to it
Part = tuple[range, int]  # consecutive messages of a call, and the buffer room they take


def check_input(topic: object, bodies: object) -> list[bytes]:
    """The bodies as a list of bytes; TypeError naming the first bad one."""
    if not isinstance(topic, str):
        raise TypeError(f"submit_many: topic must be a str, not {type(topic).__name__}")
    if isinstance(bodies, (str, bytes, bytearray, memoryview)) or not isinstance(bodies, Sequence):
        raise TypeError(f"submit_many: bodies must be a sequence of bytes (a list), not {type(bodies).__name__}")
    out = list(bodies)
    for i, b in enumerate(out):
        if type(b) is not bytes:
            if not isinstance(b, (bytes, bytearray)):
                raise TypeError(f"submit_many: bodies[{i}] is a {type(b).__name__}, not bytes")
            out[i] = bytes(b)
    return out


async def submit_many(
    p: Producer,
    topic: str,
    bodies: Sequence[bytes],
    tags: str,
    keys: str,
    properties: Mapping[str, str] | None,
    sharding_key: str | None,
    selector: QueueSelector | None,
) -> SendFutures:
    """See the module and :meth:`Producer.submit_many`."""
    items = check_input(topic, bodies)
    acc = p._accumulator()  # raises why
    if not items:
        return SendFutures()
    plain = (
        PLAIN_CHECKED
        and p.ids.unique_ids
        and not (tags or keys or properties)
        and selector is None
        and p.tracer is None
        and topic not in acc.unrouted
    )
    if plain:
        try:
            plan = _plan(p, topic, len(items), sharding_key)
            if plan is None:  # routes to fetch (an unknown topic raises NoRouteError here)
                mq, _tries = await p.targets.first(topic, Message(topic, 0, items[0]), sharding_key, None)
                plan = _plan(p, topic, len(items), sharding_key) if mq is not None else None
        except SendError:  # no healthy broker now: per message, where it becomes each one's result
            plan = None
        if plan is not None:
            return await _buffer_plain(p, acc, topic, items, plan, sharding_key)
    return await _one_by_one(p, topic, items, tags, keys, properties, sharding_key, selector)


def _plan(p: Producer, topic: str, count: int, sharding_key: str | None) -> Plan | None:
    """Which queue each message goes to: all to the sharding key's, or round robin
    (message ``i`` to the queue after message ``i - 1``'s); None if the routes are not fresh."""
    if sharding_key is not None:
        mq = p.targets.pick_now(topic, Message(topic, 0, b""), sharding_key, None)
        return None if mq is None else ([mq], 0)
    return p.targets.round_robin_now(topic, count)  # the counter advanced past the call


def _groups(plan: Plan, part: range) -> list[Group]:
    """A part's messages by queue (see :data:`Plan`)."""
    mqs, start = plan
    n, stop = len(mqs), part.stop
    return [(mqs[(start + j) % n], range(j, stop, n)) for j in range(part.start, min(stop, part.start + n))]


def parts(items: list[bytes], most: int, size_max: int) -> list[Part]:
    """The call cut into consecutive parts of at most ``most`` bytes encoded (or one
    message), each reserved whole before any of it is buffered: the messages a full
    buffer refuses are always the first refused and every later one. A message over
    ``size_max`` could never be sent and takes no room (``_runs`` refuses it alone)."""
    total = sum(map(len, items)) + PLAIN_OVERHEAD_BYTES * len(items)
    if total <= min(most, size_max):  # most calls: one part, no message too large
        return [(range(len(items)), total)]
    parts: list[Part] = []
    start = size = 0
    for i, body in enumerate(items):
        n = PLAIN_OVERHEAD_BYTES + len(body)
        if n > size_max:
            continue
        if size and size + n > most:
            parts.append((range(start, i), size))
            start, size = i, 0
        size += n
    parts.append((range(start, len(items)), size))
    return parts


class CollectorPaused:
    """Python's cyclic collector paused while a call of at least
    ``COLLECTOR_PAUSE_MIN_MESSAGES`` encodes and buffers its messages (as the consumer's
    ``collector_paused`` does while it decodes), and on again while the call waits for
    buffer room (other tasks run then). A call allocates a few objects per message, none
    in a cycle; at the collector's default (a pass every 700 new objects) those passes
    kept scanning every future and batch still buffered, about 40 % of the call's CPU at
    1,000 queues. The objects are counted all the same: the collector runs after.

    The collector is one per process: the application's other threads run without it
    meanwhile. It is paused only if it was on at entry, and switched on again at the end
    only if it is still off as the pause left it: a collector the application disabled
    before, or while the call waited, stays disabled. (One disabled by another thread
    while the call encodes cannot be told from the pause: it is on again after.)"""

    def __init__(self, count: int) -> None:
        self.paused = False
        self.count = count

    def __enter__(self) -> CollectorPaused:
        if self.count >= COLLECTOR_PAUSE_MIN_MESSAGES and gc.isenabled():
            gc.disable()
            self.paused = True
        return self

    def __exit__(self, *_exc: object) -> None:
        if self.paused:
            self.paused = False
            gc.enable()

    @contextmanager
    def resumed(self) -> Iterator[None]:
        """The collector as it was while the body runs (an await: others run)."""
        if not self.paused:
            yield
            return
        gc.enable()
        try:
            yield
        finally:
            self.paused = gc.isenabled()  # else the application disabled it meanwhile: its own now
            if self.paused:
                gc.disable()


async def _buffer_plain(
    p: Producer, acc: Accumulator, topic: str, items: list[bytes], plan: Plan, sharding_key: str | None
) -> SendFutures:
    born_ms = int(time.time() * 1000)
    uniq = p.ids.many_keys(len(items))
    futs = SendFutures(len(items))
    wake = False  # a sender has a request to make: yield at the end
    with CollectorPaused(len(items)) as paused:
        most = acc.settings.buffer_max_bytes // CALL_PART_OF_BUFFER
        for part, size in parts(items, most, acc.size_max_bytes):
            if size and not acc.reserve_now(size):
                with paused.resumed():
                    error = await _reserve(acc, size)
                if error is not None:
                    futs.refuse(range(part.start, len(items)), error)
                    break
            if SPANS_CHECKED and len(plan[0]) > 1 and len(part) < SPAN_BELOW_PER_QUEUE * len(plan[0]):
                wake = _add_spans(acc, topic, items, uniq, plan, part, born_ms, futs) or wake
                continue
            for mq, indices in _groups(plan, part):
                for run in _runs(acc, items, indices, futs):
                    if len(run) == 1:  # a call spread thin over many queues: most runs
                        i = run.start
                        keys = [uniq[i]]
                        chunk = encode_plain(mq.queue_id, born_ms, uniq[i], items[i])
                    else:
                        keys = uniq[run.start : run.stop : run.step]
                        chunk = encode_plain_run(mq.queue_id, born_ms, keys, items[run.start : run.stop : run.step])
                    fut = SendFuture()
                    wake = _add(acc, topic, mq, born_ms, items[run.start], keys, chunk, fut, sharding_key) or wake
                    futs.parts.append((run, fut))
    if wake:
        await trio.lowlevel.checkpoint()
    return futs


def _add_spans(
    acc: Accumulator,
    topic: str,
    items: list[bytes],
    uniq: list[str],
    plan: Plan,
    part: range,
    born_ms: int,
    futs: SendFutures,
) -> bool:
    """A part of a call over several queues, as spans (``_span``): one batch each,
    not one per queue. Whether a sender has a request to make."""
    mqs, start = plan
    sq = span_queues(acc, topic, mqs)
    wake = False
    for a, b in _span_cuts(acc, items, sq.addrs, sq.one_broker, start, part, futs):
        first, keys = start + a, uniq[a:b]
        chunk = encode_span(sq.qids, first, born_ms, keys, items[a:b])
        fut = SpanFuture(mqs, first, b - a)
        mq = mqs[first % len(mqs)]
        lane = acc.sender_for(mq.addr)
        span = Batch.spanning(topic, mq, born_ms, items[a], keys, chunk, fut, sq.touched(first, b - a), lane)
        wake = add_span(acc, span) or wake
        futs.parts.append((range(a, b), fut))
    return wake


def _span_cuts(
    acc: Accumulator, items: list[bytes], addrs: list[str], one_broker: bool, start: int, part: range, futs: SendFutures
) -> list[tuple[int, int]]:
    """``part`` cut into consecutive spans ``(a, b)``: each within a ``SPAN_PART_OF_BATCH``
    share of ``batch_max_bytes`` encoded, to one broker; a message that could never be
    sent is left out, refused (BatchTooLargeError)."""
    limit, size_max, n = (
        min(acc.batch_max_bytes // SPAN_PART_OF_BATCH, acc.size_max_bytes),
        acc.size_max_bytes,
        len(addrs),
    )
    if one_broker:
        sizes = list(map(PLAIN_OVERHEAD_BYTES.__add__, map(len, items[part.start : part.stop])))
        if max(sizes) <= size_max:  # the common case: cut by the running total alone
            return _cut_by_size(sizes, part.start, limit)
    cuts: list[tuple[int, int]] = []
    a, size = part.start, 0
    for i in range(part.start, part.stop):
        m = PLAIN_OVERHEAD_BYTES + len(items[i])
        if m > size_max:
            try:
                check_size(acc, m)
            except BatchTooLargeError as e:
                futs.refuse((i,), e)
            if i > a:
                cuts.append((a, i))
            a, size = i + 1, 0
            continue
        if i > a and (size + m > limit or (not one_broker and addrs[(start + i) % n] != addrs[(start + a) % n])):
            cuts.append((a, i))
            a, size = i, 0
        size += m
    if a < part.stop:
        cuts.append((a, part.stop))
    return cuts


def _cut_by_size(sizes: list[int], first: int, limit: int) -> list[tuple[int, int]]:
    """Messages ``first``.. of encoded ``sizes`` cut into consecutive spans of at most
    ``limit`` bytes (a larger message alone)."""
    total = list(accumulate(sizes, initial=0))
    cuts: list[tuple[int, int]] = []
    a, count = 0, len(sizes)
    while a < count:
        b = max(bisect_right(total, total[a] + limit) - 1, a + 1)
        cuts.append((first + a, first + b))
        a = b
    return cuts


async def _reserve(acc: Accumulator, size: int) -> SendError | None:
    """Wait for room (``buffer_full="block"``); the refusal, if any."""
    try:
        await reserve(acc, size)
    except SendError as e:
        return e
    return None


def _runs(acc: Accumulator, items: list[bytes], indices: range, futs: SendFutures) -> list[range]:
    """``indices`` cut into runs of at most ``batch_max_bytes`` encoded (and never more
    than the buffer holds); a message that could never be sent is left out, refused
    (BatchTooLargeError)."""
    if len(indices) == 1 and PLAIN_OVERHEAD_BYTES + len(items[indices.start]) <= acc.size_max_bytes:
        return [indices]
    limit, step = min(acc.batch_max_bytes, acc.size_max_bytes), indices.step
    runs: list[range] = []
    start, size = indices.start, 0
    for i in indices:
        n = PLAIN_OVERHEAD_BYTES + len(items[i])
        if n > acc.size_max_bytes:
            try:
                check_size(acc, n)
            except BatchTooLargeError as e:
                futs.refuse((i,), e)
            if i > start:
                runs.append(range(start, i, step))
            start, size = i + step, 0
            continue
        if size + n > limit and i > start:
            runs.append(range(start, i, step))
            start, size = i, 0
        size += n
    if start < indices.stop:
        runs.append(range(start, indices.stop, step))
    return runs


def _add(
    acc: Accumulator,
    topic: str,
    mq: MessageQueue,
    born_ms: int,
    first_body: bytes,
    keys: list[str],
    chunk: bytes,
    fut: SendFuture,
    sharding_key: str | None,
) -> bool:
    """Queue a run (its bytes reserved): joined to the queue's last batch if that is a
    ``submit_many`` batch still waiting with room (:meth:`Batch.join_run`), else as a
    batch of its own: fewer batches when calls spread thin over many queues. Whether
    a sender has a request to make (``Accumulator.add``'s answer)."""
    qb = acc.queues.get((topic, mq.broker_name, mq.queue_id))
    limit = acc.batch_max_bytes
    if (
        qb is not None
        and qb.batches
        and qb.batches[-1].join_run(keys, chunk, fut, acc.gen, sharding_key, mq.queue_id, limit)
    ):
        return acc.grew(qb, len(chunk))
    batch = Batch.plain_run(topic, mq, born_ms, first_body, keys, chunk, fut, sharding_key)
    return acc.add(mq, batch)


async def _one_by_one(
    p: Producer,
    topic: str,
    items: list[bytes],
    tags: str,
    keys: str,
    properties: Mapping[str, str] | None,
    sharding_key: str | None,
    selector: QueueSelector | None,
) -> SendFutures:
    """``submit`` per message (what the common case does not cover), errors as results."""
    futs = SendFutures(len(items))
    for i, body in enumerate(items):
        try:
            fut = await p.submit(
                topic, body, tags=tags, keys=keys, properties=properties, sharding_key=sharding_key, selector=selector
            )
        except BatchTooLargeError as e:
            futs.refuse((i,), e)
            continue
        except SendError as e:
            futs.refuse(range(i, len(items)), e)
            break
        except ClientError as e:  # NoRouteError: raised if nothing was buffered yet
            if i == 0:
                raise
            futs.refuse(range(i, len(items)), SendError(f"topic {topic!r}: {e}"))
            break
        futs.parts.append((range(i, i + 1), fut))
    return futs

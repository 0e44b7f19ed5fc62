"""Deduplication of a producer's retried batch (exactly once across retries).

A producer gives every message a unique id, the property ``UNIQ_KEY`` (RocketMQ's
name). When it retries a batch whose first try had an unknown outcome (the connection
broke after sending, the answer timed out, REPLICATION_TIMEOUT, NOT_LEADER), it sends
the retry with ``dedup: true``. For such a request the broker first waits until
everything already in its log is visible in the queues (the dispatcher has caught up
with the log end, which replication may hold back until the in-sync replicas hold it),
then looks back through the tail of *that* queue for the batch's ids (a request
spanning queues: through each of its queues, for that queue's part). Found whole, the
request is answered with the offsets found, ``duplicate: true``, and nothing is
appended.

A batch can also be found in part: a follower copies whole records, not whole batches,
so one promoted while it caught up may hold only the first messages of a batch
(docs/replication.md, "Producers and replication"); a request spanning queues may then
hold some queues' parts and not others. Each queue's part must then be stored as its
first messages, in order (with other messages between them, if other producers wrote
meanwhile): the messages found keep their offsets, the others are appended, once, as
one append, and the answer says how many were found (``stored_before``). Anything else
(a later message stored without an earlier one, messages out of the batch's order) is
refused (:class:`PartlyStored`: not the request that was sent).

The look-back is bounded: at most ``dedup_window_ms`` back by store timestamp and at
most ``dedup_max_messages`` entries. A retry that comes later than that, or after more
messages than that reached the queue, may store the batch twice (at least once).
Only the broker's public store API is used (``bounds``, ``get``, ``end_offset``,
``dispatch_lag_bytes`` and, in commitlog mode, the log's confirmed offset).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import trio

from clmq.broker.store import GetStatus, StorageEngine, Store
from clmq.common import Record

UNIQ_KEY = "UNIQ_KEY"  # the message property that names a message uniquely (set by the producer)

# Defaults of the broker's dedup settings (BrokerConfig names: dedup_window_ms,
# dedup_max_messages, dedup_catch_up_timeout_ms); a config without them uses these.
DEDUP_WINDOW_MS = 120_000  # how far back (store timestamp) a retried batch is looked for
DEDUP_MAX_MESSAGES = 10_000  # how many of the queue's last entries are looked at, at most
DEDUP_CATCH_UP_TIMEOUT_MS = 5_000  # how long to wait for the queues to show the whole log
READ_CHUNK_MESSAGES = 256  # the look-back reads the queue backwards this many records at a time
_FIRST_POLL_S, _MAX_POLL_S = 0.001, 0.02  # waiting for dispatch: nothing notifies a confirmed offset


@dataclass(frozen=True)
class DedupLimits:
    """How far back a retried batch is looked for (see the module's docstring)."""

    window_ms: int = DEDUP_WINDOW_MS
    max_messages: int = DEDUP_MAX_MESSAGES
    catch_up_timeout_ms: int = DEDUP_CATCH_UP_TIMEOUT_MS

    @classmethod
    def of(cls, config: object) -> DedupLimits:
        """The limits a broker config sets (its ``dedup_*`` settings, else the defaults)."""
        return cls(
            int(getattr(config, "dedup_window_ms", DEDUP_WINDOW_MS)),
            int(getattr(config, "dedup_max_messages", DEDUP_MAX_MESSAGES)),
            int(getattr(config, "dedup_catch_up_timeout_ms", DEDUP_CATCH_UP_TIMEOUT_MS)),
        )


@dataclass(frozen=True)
class Stored:
    """A retried batch found in its queue: where it was stored the first time."""

    queue_offsets: list[int]
    commitlog_offsets: list[int]
    store_timestamp_ms: int
    end_offset: int  # the commit-log offset just past its last record (for durability waits)


class PartlyStored(Exception):
    """What a queue holds of a retried batch is not its first messages in its order:
    the retry is not the batch that was sent."""


def visible_end(store: StorageEngine) -> int:
    """How far the queues show the log: everything below it is dispatched."""
    confirmed = store.log.confirmed_offset if isinstance(store, Store) else store.end_offset
    return confirmed if store.dispatch_lag_bytes == 0 else -1


async def wait_visible(store: StorageEngine, timeout_ms: int) -> bool:
    """Wait until every record in the log now is visible in its queue (dispatched, and
    below the confirmed offset); False if not within ``timeout_ms``."""
    target = store.end_offset
    interval = _FIRST_POLL_S
    with trio.move_on_after(timeout_ms / 1000):
        while visible_end(store) < target:
            await trio.sleep(interval)
            interval = min(interval * 2, _MAX_POLL_S)
        return True
    return False


def find_stored(
    store: StorageEngine, topic: str, queue_id: int, keys: list[str], limits: DedupLimits, now_ms: int
) -> Stored | None:
    """What the tail of the queue holds, within ``limits``, of the batch whose messages
    carry ``keys`` (in order): all of it, a first part (``len(queue_offsets) <
    len(keys)``: a batch only partly copied to a follower that was then promoted), or
    None. Raises :class:`PartlyStored` when what is found is not a first part of the
    batch in its order. Blocking (store reads): run it in a worker thread."""
    if not keys or not store.queue_exists(topic, queue_id):
        return None
    found = _look_back(store, topic, queue_id, keys, limits, now_ms)
    if not found:
        return None
    records = [found.get(i) for i in range(len(found))]
    if None in records:
        missing = next(i for i, r in enumerate(records) if r is None)
        raise PartlyStored(
            f"{topic}/{queue_id}: the retried batch's message {max(found)} is stored but its message {missing} "
            "is not: not the batch that was sent"
        )
    part = [r for r in records if r is not None]
    if any(a.queue_offset >= b.queue_offset for a, b in pairwise(part)):
        raise PartlyStored(
            f"{topic}/{queue_id}: the retried batch's messages are stored at offsets "
            f"{[r.queue_offset for r in part]}, not in the batch's order: not the batch that was sent"
        )
    last = max(part, key=lambda r: r.commitlog_offset)
    return Stored(
        [r.queue_offset for r in part],
        [r.commitlog_offset for r in part],
        part[0].store_timestamp_ms,
        last.commitlog_offset + last.size,
    )


def _look_back(
    store: StorageEngine, topic: str, queue_id: int, keys: list[str], limits: DedupLimits, now_ms: int
) -> dict[int, Record]:
    """The records of the queue's tail (newest first, within ``limits``) carrying one of
    ``keys``, by the key's index. Stops early once every key is found (a stored retry);
    else reads the whole window, so that a message stored anywhere in it is never
    appended again."""
    want = {k: i for i, k in enumerate(keys)}
    found: dict[int, Record] = {}
    lo, hi = store.bounds(topic, queue_id)
    floor = max(lo, hi - limits.max_messages)
    oldest_ms = now_ms - limits.window_ms
    end = hi
    while end > floor:
        start = max(floor, end - READ_CHUNK_MESSAGES)
        for r in reversed(_read(store, topic, queue_id, start, end - start)):
            if r.store_timestamp_ms < oldest_ms:
                return found
            i = want.get(r.properties.get(UNIQ_KEY, ""))
            if i is not None:
                found.setdefault(i, r)
                if len(found) == len(keys):
                    return found
        end = start
    return found


def find_stored_queues(
    store: StorageEngine, topic: str, keys_by_queue: dict[int, list[str]], limits: DedupLimits, now_ms: int
) -> dict[int, Stored | None]:
    """:func:`find_stored` for each queue of a multi-queue batch. Blocking: a worker thread."""
    return {qid: find_stored(store, topic, qid, keys, limits, now_ms) for qid, keys in keys_by_queue.items()}


@dataclass(frozen=True)
class Found:
    """What the queues hold of a retried request, per message in request order."""

    places: list[tuple[int, int] | None]  # (queue offset, commit-log offset); None: not stored
    store_timestamp_ms: int  # the earliest of the parts found
    end_offset: int  # the commit-log offset just past the last record found

    @property
    def missing(self) -> list[int]:
        """The messages (indexes in request order) no queue holds: to append."""
        return [i for i, p in enumerate(self.places) if p is None]

    def offsets(self, appended: tuple[list[int], list[int]] = ([], [])) -> tuple[list[int], list[int]]:
        """Queue and commit-log offsets in request order: those found, and for the
        missing messages (in order) those of their append, ``appended``."""
        rest = iter(zip(*appended))
        both = [p if p is not None else next(rest) for p in self.places]
        return [q for q, _c in both], [c for _q, c in both]


def place(queue_ids: list[int], found: dict[int, Stored | None]) -> Found | None:
    """Where each message of a request (``queue_ids``: each message's queue) is stored,
    from what :func:`find_stored_queues` found per queue; None if nothing was found. A
    queue's part found whole, in part (its first messages) or not at all: the messages
    not found are the rest of their queue's part."""
    parts = {qid: s for qid, s in found.items() if s is not None}
    if not parts:
        return None
    at = dict.fromkeys(found, 0)
    places: list[tuple[int, int] | None] = []
    for qid in queue_ids:
        i, s = at[qid], parts.get(qid)
        at[qid] = i + 1
        places.append(
            (s.queue_offsets[i], s.commitlog_offsets[i]) if s is not None and i < len(s.queue_offsets) else None
        )
    stamp = min(s.store_timestamp_ms for s in parts.values())
    return Found(places, stamp, max(s.end_offset for s in parts.values()))


def _read(store: StorageEngine, topic: str, queue_id: int, offset: int, count: int) -> list[Record]:
    res = store.get(topic, queue_id, offset, max(1, count))
    if res.status is not GetStatus.FOUND:
        return []  # retention took it, or only holes: nothing to match
    return [r for r in res.messages if r.queue_offset < offset + count]

"""Deduplication of a producer's retried batch (exactly once across retries).

A producer gives every message a unique id, the property ``UNIQ_KEY`` (RocketMQ's
name). When it retries a batch whose first try had an unknown outcome (the connection
broke after sending, the answer timed out, REPLICATION_TIMEOUT, NOT_LEADER), it sends
the retry with ``dedup: true``. For such a request the broker first waits until
everything already in its log is visible in the queues (the dispatcher has caught up
with the log end, which replication may hold back until the in-sync replicas hold it),
then looks back through the tail of *that* queue for the batch's first id (a request
spanning queues: through each of its queues, for that queue's part). Found, with
the batch's other ids right after it (a batch is one append: all of it is stored or
none), the request is answered with the offsets found and nothing is appended. A
multi-queue request is one append too: every queue's part found, it is answered
``duplicate`` with the offsets in request order; none found, it is appended; some
found and others not, it is refused (:class:`PartlyStored`: not the request that was
sent).

The look-back is bounded: at most ``dedup_window_ms`` back by store timestamp and at
most ``dedup_max_messages`` entries. A retry that comes later than that, or after more
messages than that reached the queue, may store the batch twice (at least once).
Only the broker's public store API is used (``bounds``, ``get``, ``end_offset``,
``dispatch_lag_bytes`` and, in commitlog mode, the log's confirmed offset).
"""

from __future__ import annotations

from dataclasses import dataclass

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
    """The batch's first id is in the queue but the ids after it are not the batch's:
    the retry is not the batch that was sent (a batch is stored whole or not at all)."""


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
    """The batch whose messages carry ``keys`` (in order) if the tail of the queue holds
    it, within ``limits``; None if not. Raises :class:`PartlyStored` for a batch only
    partly there. Blocking (store reads): run it in a worker thread."""
    if not keys or not store.queue_exists(topic, queue_id):
        return None
    lo, hi = store.bounds(topic, queue_id)
    floor = max(lo, hi - limits.max_messages)
    oldest_ms = now_ms - limits.window_ms
    end = hi
    while end > floor:
        start = max(floor, end - READ_CHUNK_MESSAGES)
        records = _read(store, topic, queue_id, start, end - start)
        for r in reversed(records):
            if r.store_timestamp_ms < oldest_ms:
                return None
            if r.properties.get(UNIQ_KEY) == keys[0]:
                return _whole(store, topic, queue_id, r.queue_offset, keys)
        end = start
    return None


def find_stored_queues(
    store: StorageEngine, topic: str, keys_by_queue: dict[int, list[str]], limits: DedupLimits, now_ms: int
) -> dict[int, Stored | None]:
    """:func:`find_stored` for each queue of a multi-queue batch (one request spanning
    queues is one append: all of it is stored or none). Blocking: a worker thread."""
    return {qid: find_stored(store, topic, qid, keys, limits, now_ms) for qid, keys in keys_by_queue.items()}


def merge_stored(queue_ids: list[int], found: dict[int, Stored]) -> Stored:
    """The offsets of a multi-queue batch in request order (``queue_ids``: each
    message's queue), from what was found per queue."""
    at = dict.fromkeys(found, 0)
    qoffs, coffs = [], []
    for qid in queue_ids:
        i = at[qid]
        at[qid] = i + 1
        qoffs.append(found[qid].queue_offsets[i])
        coffs.append(found[qid].commitlog_offsets[i])
    stamp = min(s.store_timestamp_ms for s in found.values())
    return Stored(qoffs, coffs, stamp, max(s.end_offset for s in found.values()))


def _read(store: StorageEngine, topic: str, queue_id: int, offset: int, count: int) -> list[Record]:
    res = store.get(topic, queue_id, offset, max(1, count))
    if res.status is not GetStatus.FOUND:
        return []  # retention took it, or only holes: nothing to match
    return [r for r in res.messages if r.queue_offset < offset + count]


def _whole(store: StorageEngine, topic: str, queue_id: int, at: int, keys: list[str]) -> Stored:
    """The batch stored from queue offset ``at``: every one of ``keys`` in order."""
    records = _read(store, topic, queue_id, at, len(keys))
    if [r.properties.get(UNIQ_KEY) for r in records] != keys:
        raise PartlyStored(
            f"{topic}/{queue_id}: the retried batch's first message is stored at offset {at}, "
            f"but the {len(keys)} messages from there are not the batch"
        )
    last = records[-1]
    return Stored(
        [r.queue_offset for r in records],
        [r.commitlog_offset for r in records],
        records[0].store_timestamp_ms,
        last.commitlog_offset + last.size,
    )

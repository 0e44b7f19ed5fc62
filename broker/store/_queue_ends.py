"""The next offsets of queues whose records are no longer in the log, for replication.

A queue whose every record retention removed keeps its numbering on the broker that
dispatched them: its consume queue keeps its last file (entries pointing below the
log's start) and shows ``(next, next)``, and its next message gets ``next``. A replica
that starts its log empty at its leader's log start (``Store.restart_at``) copies no
record of such a queue and would number it from 0 again, below offsets consumer groups
may have committed. So the leader tells it each such queue's next offset
(:func:`queue_ends_before`) and the replica continues the queues there, durably
(:func:`continue_queues`).

One case stays as the leader itself would have it after a restart: records that
retention removed before the leader's dispatcher reached them (its confirmed offset
lagged) are in no consume queue, so the queue's next offset sent is its consume
queue's, below their numbers (no consumer saw them; the leader's own open rebuilds its
next-offset table from its consume queues too).
"""

from __future__ import annotations

import logging
from typing import Iterable

from clmq.commitlog import QueueKey
from clmq.common import CorruptRecordError

from ._log_parts import LogParts

log = logging.getLogger("clmq.store")

QueueEnd = tuple[str, int, int]  # topic, queue id, next queue offset


def queue_ends_before(parts: LogParts, log_offset: int) -> list[QueueEnd]:
    """``(topic, queue id, next offset)`` of every queue holding no record at or after
    ``log_offset`` and numbered past 0. Loads every queue (the caller is a worker thread).

    A queue whose newest records are not dispatched yet is safe too: its next offset
    here is its consume queue's, at or below the queue offset of those records."""
    ends: list[QueueEnd] = []
    for topic, queue_id in parts.queues.known():
        try:
            first, nxt = parts.queues.queue(topic, queue_id).bounds(log_offset)
        except CorruptRecordError as e:  # marked for rebuild; its records, if any, come with the log
            parts.mark_for_rebuild(topic, queue_id, e)
            continue
        if first == nxt > 0:
            ends.append((topic, queue_id, nxt))
    return ends


def continue_queues(parts: LogParts, ends: Iterable[QueueEnd]) -> int:
    """Make each queue continue at least at its given next offset: its consume queue
    (an empty one begins there; durably) and the log's next-offset table. Returns how
    many queues moved. Callers must not append concurrently (a follower before it fetches)."""
    moved = 0
    raised: dict[QueueKey, int] = {}
    for topic, queue_id, nxt in ends:
        if parts.queues.queue(topic, queue_id).start_at(nxt):
            moved += 1
        raised[(topic, queue_id)] = nxt
    table = parts.log.queue_offset_table()
    for key, nxt in raised.items():
        table[key] = max(table.get(key, 0), nxt)
    parts.log.set_queue_offset_table(table)
    return moved


def next_offsets(parts: LogParts) -> dict[QueueKey, int]:
    """Every queue's next offset from its consume queue: those not loaded yet as the
    checkpoint the open read (they have not changed since), the others as they are."""
    with parts.state.checkpoint_lock:
        table = {key: nxt for key, (_first, nxt) in parts.manifest.items()}
    table.update(parts.queues.next_offsets())
    return table

"""Bringing the consume queues back in line with the commit log at open.

The log is the source of truth; queue files are derived. This module decides, per
queue, whether its files can be trusted, cuts what points past the log's end, and
picks the log offset from which dispatch must run again. Re-dispatch is idempotent,
so starting too early costs time but never duplicates entries.
"""

from __future__ import annotations

import logging
import struct

from commitlog import HEADER_SIZE, RECORD_MAGIC, CommitLog
from consumequeue import ConsumeQueue, ConsumeQueueSet, Entry

from ._checkpoint import Checkpoint

log = logging.getLogger("clmq.recovery")

_CHECK = struct.Struct("<II")
_QOFF_QID = struct.Struct("<QI")


def entry_matches(commitlog: CommitLog, cq: ConsumeQueue, offset: int, entry: Entry) -> bool:
    """Does the entry at queue ``offset`` point at this queue's record ``offset``?"""
    phys, size, _tag = entry
    if size < HEADER_SIZE or phys < commitlog.min_offset or phys + size > commitlog.write_offset:
        return False
    head = commitlog.read_bytes(phys, HEADER_SIZE + len(cq.topic.encode()))
    if head is None:
        return False
    rsize, magic = _CHECK.unpack_from(head, 0)
    qoff, qid = _QOFF_QID.unpack_from(head, 20)
    topic = head[HEADER_SIZE:]
    return rsize == size and magic == RECORD_MAGIC and qoff == offset and qid == cq.queue_id and topic == cq.topic.encode()


def _last_good_end(commitlog: CommitLog, cq: ConsumeQueue) -> int | None:
    """Cut entries that do not match the log (a torn tail); return the log offset
    after the last good entry, or None if the queue has no good entry left."""
    nxt = cq.next_offset
    if nxt > cq.first_offset:
        last = cq.entry(nxt - 1)
        if last is None or not entry_matches(commitlog, cq, nxt - 1, last):
            # Entries form a valid prefix followed by damage: find where it starts.
            cq.truncate(_first_bad(commitlog, cq))
    while cq.next_offset > cq.first_offset:
        entry = cq.entry(cq.next_offset - 1)
        if entry is not None and entry[1]:
            return entry[0] + entry[1]
        cq.truncate(cq.next_offset - 1)  # trailing holes carry no information
    return None


def _first_bad(commitlog: CommitLog, cq: ConsumeQueue) -> int:
    lo, hi = cq.first_offset, cq.next_offset
    while lo < hi:
        mid = (lo + hi) // 2
        entry = cq.entry(mid)
        good = entry is not None and (entry[1] == 0 or entry_matches(commitlog, cq, mid, entry))
        if good:
            lo = mid + 1
        else:
            hi = mid
    return lo


def recover_queues(commitlog: CommitLog, queues: ConsumeQueueSet, checkpoint: Checkpoint | None,
                   unclean: bool) -> int:  # fmt: skip
    """Validate every queue against the log; return the offset to re-dispatch from."""
    start = checkpoint.dispatched if checkpoint is not None else commitlog.min_offset
    start = min(start, commitlog.write_offset)
    expected = checkpoint.queues if checkpoint is not None else {}
    repaired: list[str] = []
    for key in sorted(set(queues.discover()) | set(expected)):
        resume = _recover_queue(commitlog, queues.queue(*key), expected.get(key, (0, 0)), unclean, repaired)
        if resume is not None:
            start = min(start, resume)
    if repaired:  # one line, not one per queue: a store may have 100,000 of them
        log.warning("recovery: %d consume queue(s) repaired from the log, re-dispatching from offset %d: %s%s",
                    len(repaired), start, "; ".join(repaired[:5]), " ..." if len(repaired) > 5 else "")  # fmt: skip
    return max(start, commitlog.min_offset)


def _recover_queue(commitlog: CommitLog, cq: ConsumeQueue, expected: tuple[int, int], unclean: bool,
                   repaired: list[str]) -> int | None:  # fmt: skip
    """Repair one queue; return the log offset it must be re-dispatched from, if any."""
    if not unclean and expected[1] and cq.looks_intact(*expected):
        return None  # clean stop and the files are there: load it lazily, on first use
    first, nxt = cq.first_offset, cq.next_offset  # loads the files, noting damage
    if cq.damage is None and not unclean and first <= expected[0] and nxt >= expected[1]:
        return None
    name = f"{cq.topic}/{cq.queue_id}"
    if first > expected[0] and nxt > first:
        # Files missing at the head: retention and damage look alike, so rebuild it all.
        repaired.append(f"{name} starts at {first}, expected {expected[0]}")
        cq.reset()
        return commitlog.min_offset
    end = _last_good_end(commitlog, cq)
    if cq.damage is not None or cq.next_offset < expected[1]:
        repaired.append(f"{name} {cq.damage or 'holds'} {cq.next_offset} of {expected[1]} entries")
        return end if end is not None else commitlog.min_offset
    if cq.next_offset < nxt:
        repaired.append(f"{name} cut from {nxt} to {cq.next_offset} (log was truncated)")
        return end
    return None

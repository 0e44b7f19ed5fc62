"""Bringing the consume queues back in line with the commit log at open.

The log is the source of truth; queue files are derived. This module decides, per
queue, whether its files can be trusted, cuts what points past the log's end, and
picks the log offset from which dispatch must run again. Re-dispatch is idempotent,
so starting too early costs time but never duplicates entries.

Invariants (at every open, clean or not):
- Every queue the checkpoint lists has its files checked against the checkpointed
  extent from their sizes (one stat per file, no reads): files present, contiguous,
  every one but the last full. A queue that fails is loaded now, cut at its first
  inconsistent file and re-dispatched from the end of its last good entry.
- After an unclean stop, each queue's last entry must point at its own record, and
  zeroed entries in its last two files (a machine crash: sizes written, pages not)
  are cut, both re-dispatched from the log.
- Queues *marked for rebuild* (a read met an entry that does not point at its own
  record, or a zeroed one: :class:`RebuildList`) are dropped whole and re-dispatched
  from the log's first offset, then unmarked once the open's checkpoint is written.
- What was rebuilt is reported by the store in one log line (:class:`Recovery`).
"""

from __future__ import annotations

import logging
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path

from clmq.commitlog import CommitLog, QueueKey, delete_json, read_json, write_json
from clmq.common import HEADER_SIZE, RECORD_MAGIC, CorruptRecordError
from clmq.consumequeue import ConsumeQueue, ConsumeQueueSet, Entry

from ._checkpoint import Checkpoint

log = logging.getLogger("clmq.recovery")

_CHECK = struct.Struct("<II")
_QOFF_QID = struct.Struct("<QI")


@dataclass
class Recovery:
    """What :func:`recover_queues` decided: where dispatch restarts, what it repaired."""

    start: int  # the log offset to re-dispatch from
    rebuilt: list[str] = field(default_factory=list)  # "topic/queue: why", per queue repaired


class RebuildList:
    """Queues marked for rebuild, kept in a small crash-safe file until an open has
    rebuilt them (a read met damage in a running store: rebuilding a queue needs a
    pass over the whole log, which the next open does for all marked queues at once)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        raw = read_json(path)
        rows = raw.get("queues", []) if isinstance(raw, dict) else []
        self.marked: dict[QueueKey, str] = {}
        for row in rows if isinstance(rows, list) else []:
            if isinstance(row, list) and len(row) == 3 and isinstance(row[0], str) and isinstance(row[1], int):
                self.marked[(row[0], row[1])] = str(row[2])

    def add(self, key: QueueKey, reason: str) -> bool:
        """Mark a queue (durably); False if it already was."""
        with self._lock:
            if key in self.marked:
                return False
            self.marked[key] = reason
            self._save()
            return True

    def clear(self, keys: set[QueueKey]) -> None:
        """Unmark queues that were rebuilt."""
        with self._lock:
            if not keys & set(self.marked):
                return
            self.marked = {k: v for k, v in self.marked.items() if k not in keys}
            if self.marked:
                self._save()
            else:  # with its previous generation, which would otherwise come back
                delete_json(self.path)

    def _save(self) -> None:
        write_json(self.path, {"version": 1, "queues": [[t, q, why] for (t, q), why in self.marked.items()]})


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
    return (
        rsize == size and magic == RECORD_MAGIC and qoff == offset and qid == cq.queue_id and topic == cq.topic.encode()
    )


def retained_away(commitlog: CommitLog, entry: Entry) -> bool:
    """Does the entry point at a record that retention removed (below the log's start)?
    It cannot be checked against its record, and it is kept: a queue whose every record
    is gone still numbers its next message after them (consumers may have committed there)."""
    phys, size, _tag = entry
    return size >= HEADER_SIZE and phys + size <= commitlog.min_offset


def _entry(cq: ConsumeQueue, offset: int) -> Entry | None:
    """The entry at ``offset``, or None if it is missing or damaged (zeroed, file short)."""
    try:
        return cq.entry(offset)
    except CorruptRecordError:
        return None


def _last_good_end(commitlog: CommitLog, cq: ConsumeQueue) -> int | None:
    """Cut entries that do not match the log (a torn tail); return the log offset
    after the last good entry, or None if the queue has no good entry left."""
    nxt = cq.next_offset
    if nxt > cq.first_offset:
        last = _entry(cq, nxt - 1)
        if last is None or not (entry_matches(commitlog, cq, nxt - 1, last) or retained_away(commitlog, last)):
            # Entries form a valid prefix followed by damage: find where it starts.
            cq.truncate(_first_bad(commitlog, cq))
    while cq.next_offset > cq.first_offset:
        entry = _entry(cq, cq.next_offset - 1)
        if entry is not None and entry[1]:
            return entry[0] + entry[1]
        cq.truncate(cq.next_offset - 1)  # trailing holes carry no information
    return None


def _first_bad(commitlog: CommitLog, cq: ConsumeQueue) -> int:
    lo, hi = cq.first_offset, cq.next_offset
    while lo < hi:
        mid = (lo + hi) // 2
        entry = _entry(cq, mid)
        good = entry is not None and (
            entry[1] == 0 or entry_matches(commitlog, cq, mid, entry) or retained_away(commitlog, entry)
        )
        if good:
            lo = mid + 1
        else:
            hi = mid
    return lo


def recover_queues(
    commitlog: CommitLog,
    queues: ConsumeQueueSet,
    checkpoint: Checkpoint | None,
    unclean: bool,
    marked: dict[QueueKey, str] | None = None,
) -> Recovery:
    """Validate every queue against the log, drop the ``marked`` ones (rebuilt whole);
    return where to re-dispatch from and what was repaired (the caller logs it)."""
    start = checkpoint.dispatched if checkpoint is not None else commitlog.min_offset
    start = min(start, commitlog.write_offset)
    expected = checkpoint.queues if checkpoint is not None else {}
    marked = marked or {}
    repaired: list[str] = []
    for key in sorted(set(queues.discover()) | set(expected) | set(marked)):
        cq = queues.queue(*key)
        if key in marked:
            repaired.append(f"{key[0]}/{key[1]} marked for rebuild ({marked[key]})")
            cq.reset()
            start = commitlog.min_offset
            continue
        resume = _recover_queue(commitlog, cq, expected.get(key, (0, 0)), unclean, repaired)
        if resume is not None:
            start = min(start, resume)
    return Recovery(max(start, commitlog.min_offset), repaired)


def _recover_queue(
    commitlog: CommitLog, cq: ConsumeQueue, expected: tuple[int, int], unclean: bool, repaired: list[str]
) -> int | None:
    """Repair one queue; return the log offset it must be re-dispatched from, if any."""
    if expected[1]:
        cq.expected_first = expected[0]
    if not unclean and expected[1] and cq.looks_intact(*expected):
        return None  # clean stop and the files are all there: load it lazily, on first use
    first, nxt = cq.first_offset, cq.next_offset  # loads the files, cutting at the first inconsistent one
    if cq.damage is None and not unclean and first <= expected[0] and nxt >= expected[1]:
        return None
    name = f"{cq.topic}/{cq.queue_id}"
    if first > expected[0] and nxt > first:
        # Files missing at the head: retention and damage look alike, so rebuild it all.
        repaired.append(f"{name} starts at {first}, expected {expected[0]}")
        cq.reset()
        return commitlog.min_offset
    zeroed = cq.first_zeroed() if unclean else None
    if zeroed is not None:
        cq.truncate(zeroed)
        repaired.append(f"{name} zeroed from entry {zeroed}")
    end = _last_good_end(commitlog, cq)
    if cq.damage is not None or cq.next_offset < expected[1]:
        repaired.append(f"{name} {cq.damage or 'holds'} {cq.next_offset} of {expected[1]} entries")
        return end if end is not None else commitlog.min_offset
    if cq.next_offset < nxt:
        repaired.append(f"{name} cut from {nxt} to {cq.next_offset} (log was truncated)")
        return end
    if zeroed is not None:
        return end if end is not None else commitlog.min_offset
    return None

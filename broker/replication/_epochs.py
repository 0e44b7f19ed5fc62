"""Leader epochs: which leadership term wrote which part of the log.

Every term has an epoch, higher than every earlier one the broker knew; the file
``leader-epochs`` in the data directory lists ``(epoch, start_offset, leader_id)``
terms, epochs increasing, starts never decreasing: the log from ``start_offset`` to the
next term's start was written by that term's leader. A follower that joins a leader
compares the two lists to find the last offset both logs agree on (:func:`divergence`,
after Kafka's KIP-101) and cuts its log there: a tail written by an old leader that the
new one never had does not survive.

A term is named by its epoch *and* its leader's id: two brokers that both believed
they were leaders (an old leader restarted while a follower was promoted) may have
chosen the same epoch, and their terms must never be mistaken for one.

Invariants (checked when loaded and when changed):
- epochs strictly increase, starts never decrease;
- every start is at or below the log's end (a term starting past the end is dropped
  when the log is cut: :meth:`LeaderEpochs.truncate`).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from clmq.broker.store import MetadataSource, load_json, write_json
from clmq.common import MetadataError

FILE_NAME = "leader-epochs"
Entry = tuple[int, int, int]  # (epoch, start offset, leader's broker id)


def _invalid(value: Any) -> str | None:
    entries = value.get("epochs") if isinstance(value, dict) else None
    if not isinstance(entries, list) or not all(
        isinstance(e, list) and len(e) == 3 and all(type(x) is int and x >= 0 for x in e) for e in entries
    ):
        return "'epochs' must be a list of [epoch, start_offset, leader_id] of non-negative integers"
    return order_problem([(e[0], e[1], e[2]) for e in entries])


def order_problem(entries: list[Entry]) -> str | None:
    """Why a list of terms breaks the invariants, or None."""
    for (e1, s1, _), (e2, s2, _) in itertools.pairwise(entries):
        if e2 <= e1 or s2 < s1:
            return f"epochs out of order: ({e1}, {s1}) then ({e2}, {s2})"
    return None


class LeaderEpochs:
    """The epoch list of one data directory, persisted on every change (rare: once per
    leadership term)."""

    def __init__(self, path: Path, entries: list[Entry]) -> None:
        self.path = path
        self.entries = entries

    @classmethod
    def load(cls, directory: Path) -> LeaderEpochs:
        """Read the list; none yet is an empty list. Both generations damaged refuses
        (MetadataError): without it a follower cannot tell its divergent tail."""
        path = directory / FILE_NAME
        loaded = load_json(path, _invalid)
        if loaded.source is MetadataSource.DAMAGED:
            raise MetadataError(
                f"{path}: no good generation ({'; '.join(loaded.problems)}); delete it (and "
                f"{path.name}.prev) to copy this replica's log again from its leader"
            )
        raw = loaded.value["epochs"] if loaded.value else []
        return cls(path, [(int(e), int(s), int(b)) for e, s, b in raw])

    @property
    def latest(self) -> int:
        """The newest epoch (-1: none)."""
        return self.entries[-1][0] if self.entries else -1

    def start(self, epoch: int, start_offset: int, leader_id: int) -> None:
        """A new term begins at ``start_offset`` (a leader's log end when it takes over)."""
        assert epoch > self.latest, f"epoch {epoch} after {self.latest}"
        assert not self.entries or start_offset >= self.entries[-1][1], (start_offset, self.entries[-1])
        self._save([*self.entries, (epoch, start_offset, leader_id)])

    def adopt(self, leader_entries: list[Entry], log_end: int) -> None:
        """After cutting the log to where it agrees with its leader: take the leader's
        list up to ``log_end`` (terms that start at or past it are added as the log reaches them)."""
        kept = [e for e in leader_entries if e[1] <= log_end] or leader_entries[:1]
        if kept != self.entries:
            self._save(kept)

    def catch_up(self, leader_entries: list[Entry], log_end: int) -> None:
        """Add the leader's terms that the log has now reached (called as bytes arrive)."""
        if len(self.entries) < len(leader_entries) and leader_entries[len(self.entries)][1] <= log_end:
            self.adopt(leader_entries, log_end)

    def truncate(self, log_end: int) -> None:
        """The log was cut to ``log_end``: terms starting past it never wrote a byte here."""
        kept = [e for e in self.entries if e[1] <= log_end]
        if kept != self.entries:
            self._save(kept)

    def _save(self, entries: list[Entry]) -> None:
        problem = order_problem(entries)
        assert problem is None, problem
        write_json(self.path, {"epochs": [list(e) for e in entries]})
        self.entries = list(entries)


def divergence(own: list[Entry], own_end: int, leader: list[Entry], leader_end: int) -> int:
    """The offset up to which a follower's log (``own`` terms, ending at ``own_end``)
    agrees with its leader's: the follower keeps ``[.., result)`` and cuts the rest.

    The newest term in both lists (same epoch, same leader) is the last one both logs
    may share; they agree up to where that term ends in either log (the start of the
    next term in that list, or the log's end). Everything a follower holds after that
    was written in a term the leader never had. A follower that shares no term with its
    leader keeps nothing, nor does one with no terms at all (a directory that never
    replicated): its bytes cannot be told apart from the leader's but by content.
    """
    leader_terms = {(e, b): i for i, (e, _, b) in enumerate(leader)}
    for i in range(len(own) - 1, -1, -1):
        j = leader_terms.get((own[i][0], own[i][2]))
        if j is None:
            continue
        own_term_end = own[i + 1][1] if i + 1 < len(own) else own_end
        leader_term_end = leader[j + 1][1] if j + 1 < len(leader) else leader_end
        return min(own_term_end, leader_term_end, own_end, leader_end)
    return 0

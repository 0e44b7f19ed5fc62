"""The CommitLog mode's key index (``index/``): opened beside the queues, brought in
line with the log at open, and queried with every candidate checked against its record.

Invariants:
- At open the index is cut to the log's end (a torn tail cut at an unclean open, a
  follower's truncation) and re-dispatch starts no later than its ``end_offset``.
- A query returns only records read from the log whose topic is the query's and whose
  keys (split on whitespace) or UNIQ_KEY hold the key, with a store time in range;
  an entry past the log's end, below retention, or naming another record is skipped.
- A query is bounded: at most ``INDEX_MAX_CHAIN_STEPS`` chain entries read and
  ``INDEX_MAX_CANDIDATES`` records checked; stopped by either, it says ``truncated``.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Iterator

from clmq.commitlog import CommitLog
from clmq.common import CorruptRecordError, Record
from clmq.consumequeue import UNIQ_KEY, Candidate, IndexSettings, KeyIndex, WalkBudget

from ._state import StoreState

log = logging.getLogger("clmq.store")

INDEX_DIR = "index"
INDEX_MAX_CANDIDATES = 100_000  # a query stops after checking this many hash matches (collisions, duplicates)
# A query stops after reading this many chain entries (a hot key's chain outside a
# narrow time range: entries that fail the time filter are read but not candidates).
INDEX_MAX_CHAIN_STEPS = 1_000_000


@dataclass
class KeyMatches:
    """What :func:`find_by_key` found: records newest first, and whether more matched
    than ``max_results`` (``truncated``); ``index_lag_bytes``: the log's confirmed bytes
    the index did not hold when the query ran (0 unless index writes fail, or failed
    and left more than ``index_query_catch_up_bytes``: a query first brings the index
    up to the log, so messages stored before it are found)."""

    records: list[Record]
    truncated: bool
    index_lag_bytes: int = 0


def open_key_index(state: StoreState, commitlog: CommitLog) -> KeyIndex | None:
    """The store's key index (None when ``index_enabled`` is off), cut to the log's end."""
    config = state.config
    if not config.index_enabled:
        return None
    settings = IndexSettings(config.index_hash_slots, config.index_max_entries_per_file)
    index = KeyIndex(state.directory / INDEX_DIR, settings, commitlog.min_offset)
    if index.end_offset > commitlog.write_offset:
        log.warning(
            "key index: indexed up to %d, the log ends at %d: entries past it dropped",
            index.end_offset,
            commitlog.write_offset,
        )
        index.truncate(commitlog.write_offset)
    return index


def record_has_key(record: Record, topic: str, key: str) -> bool:
    """The record is the topic's and carries ``key`` (keys split on ASCII whitespace, as indexed)."""
    if record.topic != topic:
        return False
    return record.properties.get(UNIQ_KEY) == key or key.encode() in record.keys.encode().split()


def find_by_key(
    index: KeyIndex,
    commitlog: CommitLog,
    topic: str,
    key: str,
    *,
    since_ms: int | None = None,
    until_ms: int | None = None,
    max_results: int = 1000,
    max_chain_steps: int = INDEX_MAX_CHAIN_STEPS,
) -> KeyMatches:
    """Records of ``topic`` with ``key`` (a key or the UNIQ_KEY) stored in
    ``[since_ms, until_ms]``, newest first, at most ``max_results``; ``truncated`` also
    when a bound (``max_chain_steps``, ``INDEX_MAX_CANDIDATES``) stopped the walk."""
    found: dict[int, Record] = {}
    budget = WalkBudget(max_chain_steps)
    with contextlib.closing(index.candidates(topic, key, since_ms, until_ms, budget)) as walk:
        stopped = _verify(walk, commitlog, topic, key, since_ms, until_ms, max_results, found)
    records = sorted(found.values(), key=lambda r: (r.store_timestamp_ms, r.commitlog_offset), reverse=True)
    truncated = len(records) > max_results or stopped or budget.exhausted
    return KeyMatches(records[:max_results], truncated)


def _verify(
    walk: Iterator[Candidate],
    commitlog: CommitLog,
    topic: str,
    key: str,
    since_ms: int | None,
    until_ms: int | None,
    max_results: int,
    found: dict[int, Record],
) -> bool:
    """Read each candidate's record into ``found`` if it is a match; True when
    ``INDEX_MAX_CANDIDATES`` stopped it."""
    checked = 0
    for cand in walk:
        if cand.offset in found or cand.offset >= commitlog.confirmed_offset:
            continue
        checked += 1
        if checked > INDEX_MAX_CANDIDATES:
            return True
        try:
            record = commitlog.read_record(cand.offset)
        except CorruptRecordError:  # an entry past a truncation into another record's middle
            continue
        if record is None or not record_has_key(record, topic, key):
            continue
        ts = record.store_timestamp_ms
        if (since_ms is None or ts >= since_ms) and (until_ms is None or ts <= until_ms):
            found[cand.offset] = record
            if len(found) > max_results:
                break
    return False

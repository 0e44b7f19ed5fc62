"""The partition-per-file store: Kafka's layout behind the store's API, for comparison.

Each (topic, queue) has its own segmented log (see ``_partition_log``). A batch is
grouped by queue and written with one system call per queue file; the flusher fsyncs
every file written since the last flush (sync mode: group commit over all of them).
Durability is tracked by a *virtual offset*: the count of bytes appended across every
partition, so that "durable up to X" means the same as in the CommitLog mode.

Promises (issue 14), as in the CommitLog mode:
- ``recovery-points`` holds, per partition, the queue offset below which everything was
  fsynced when it was written (each checkpoint). Every open, clean or not, checks each
  partition against it (:class:`~._partition_log.PartitionLoader`): bytes promised and
  gone refuse the open with :class:`~commitlog.LogDamageError`.
- One flush at a time: the durable offset is published only after every fsync covering
  it has returned. An fsync error fails the store (nothing retried, nothing published);
  housekeeping retries only a full disk.

:class:`PartitionStore` is a facade over the mode's parts, which share one
:class:`~._partition_state.PartitionState`: appends (:mod:`._partition_append`),
flushing and recovery points (:mod:`._partition_flush`), reads
(:mod:`._partition_reads`); each partition's log is :mod:`._partition_log`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from clmq.commitlog import MetadataSource, QueueKey, load_json
from clmq.common import LogDamageError, StoreFailedError

from ._base import StoreBase
from ._config import Stopwatch, StoreConfig
from ._partition_append import PartitionWriter
from ._partition_flush import PartitionFlusher, apply_retention, housekeeping_loop
from ._partition_log import LoadReport, PartitionLoader
from ._partition_reads import PartitionReads
from ._partition_state import PartitionState
from ._puts import PutPath
from ._reads import Reads

log = logging.getLogger("clmq.partition")


class PartitionStore(StoreBase):
    """Same API as :class:`~broker.Store`; open with :meth:`open`, then :meth:`start`."""

    def __init__(self, config: StoreConfig) -> None:
        super().__init__(config)
        self._parts = PartitionState(self._state)
        self.files = self._parts.files
        self.partitions = self._parts.partitions
        self._flusher = PartitionFlusher(self._parts)
        self._puts = PutPath(self._state, PartitionWriter(self._parts, self._flusher, self._notify_arrivals))
        self._reads = Reads(self._state, PartitionReads(self._parts))

    @property
    def root(self) -> Path:
        return self._parts.root

    # ---------------------------------------------------------------- lifecycle
    @classmethod
    def open(cls, config: StoreConfig) -> PartitionStore:
        """Load every partition and verify it against its recovery point (see
        :class:`PartitionLoader`); :class:`~commitlog.LogDamageError` if log bytes that
        were promised durable are gone (the directory is released first)."""
        self = cls(config)
        clock = Stopwatch()
        unclean = self._begin_open()
        try:
            unclean = self._load_partitions(unclean)
        except BaseException:
            self._release_files()
            self._life.end_close(clean=False)
            raise
        clock.lap("log_open_s")
        self.open_stats = {"unclean": unclean, **clock.stats}
        try:
            self.checkpoint()
        except OSError as e:  # disk full: the abort marker stays, so the next open validates again
            log.warning("partition store open: could not write recovery points yet: %s", e)
        return self

    def _load_partitions(self, unclean: bool) -> bool:
        """Open every partition directory; returns whether the open is unclean (no
        recovery points count as an unclean stop: everything is validated)."""
        points, from_previous = _load_points(self.directory / "recovery-points")
        unclean = unclean or points is None or from_previous
        promised = points or {}
        self.root.mkdir(exist_ok=True)
        reports: list[LoadReport] = []
        for name in sorted(os.listdir(self.root)):
            topic, _, qid = name.rpartition("-")
            if topic and qid.isdigit():
                key = (topic, int(qid))
                part = self._parts.new_partition(key)
                reports.append(PartitionLoader(part, self.files, promised.get(key, 0), unclean).load())
                self.partitions[key] = part
        for (t, q), point in promised.items():
            if (t, q) not in self.partitions and point > 0:
                raise LogDamageError(
                    str(self.root / f"{t}-{q}"), 0, 0, "the partition's directory is missing", [(t, q, 0, point - 1)]
                )
        _log_open(reports, len(self.partitions), unclean)
        return unclean

    def create_topic(self, topic: str, queue_count: int) -> None:
        """Create the topic and, as Kafka does, every partition's log right away."""
        super().create_topic(topic, queue_count)
        with self._parts.lock:
            for q in range(queue_count):
                self._parts.partition((topic, q))

    def start(self) -> PartitionStore:
        parts, flusher = self._parts, self._flusher
        self._life.start_threads(
            [("clmq-flush", flusher.flush_loop), ("clmq-housekeeping", lambda: housekeeping_loop(parts, flusher))]
        )
        return self

    def _wake_threads(self) -> None:
        self._state.durable.flush_requested.set()

    def _close_files(self) -> bool:
        try:
            self.flush()
        except StoreFailedError:  # fsync failed just now: the next open recovers (abort marker stays)
            self.files.close()
            return False
        for part in self.partitions.values():
            part.write_indexes(part.segments[-1])
        try:
            self.checkpoint()
            clean = True
        except OSError as e:  # the data is fsynced; without recovery points the next open validates
            log.error("partition store close: could not write recovery points (%s)", e)
            clean = False
        self.files.close()
        return clean

    def _release_files(self) -> None:
        self.files.close()

    # -------------------------------------------------------------- durability
    def flush(self) -> int:
        """fsync every file written since the last flush, then publish the durable
        offset; returns it (see :meth:`PartitionFlusher.flush`)."""
        return self._flusher.flush()

    def checkpoint(self) -> None:
        """Record each partition's recovery point: all below it is fsynced."""
        self._flusher.checkpoint()

    def apply_retention(self, now: float | None = None) -> int:
        return apply_retention(self._parts, now)

    # ------------------------------------------------------------------- reads
    @property
    def dispatch_lag_bytes(self) -> int:
        return 0  # readers see messages as soon as they are written: nothing to dispatch

    @property
    def end_offset(self) -> int:
        return self._parts.written

    def catch_up(self) -> None:
        """Nothing to do: partition reads see what was written."""


def _load_points(path: Path) -> tuple[dict[QueueKey, int] | None, bool]:
    """Each partition's recovery point (None if there are none to trust: then the open
    validates every partition from its start), and whether they came from the previous
    generation: older but true points, which a clean open must not trust as the end."""
    loaded = load_json(path, _points_error)
    if not loaded.ok:
        return None, False
    raw = loaded.value
    return {(str(t), int(q)): int(n) for t, q, n in raw["points"]}, loaded.source is MetadataSource.PREVIOUS


def _points_error(raw: Any) -> str | None:
    try:
        [(str(t), int(q), int(n)) for t, q, n in raw["points"]]
    except (TypeError, KeyError, ValueError):
        return "not a list of [topic, queue id, offset] points"
    return None


def _log_open(reports: list[LoadReport], partitions: int, unclean: bool) -> None:
    """One line for the whole open, with counts (and the first few reasons)."""
    rebuilt = [r for rep in reports for r in rep.rebuilt]
    cut = [c for rep in reports for c in rep.cut]
    scanned = sum(rep.scanned for rep in reports)
    if not (rebuilt or cut):
        log.info(
            "partition store open (%s): %d partitions, %d segments read whole",
            "unclean" if unclean else "clean",
            partitions,
            scanned,
        )
        return
    log.warning(
        "partition store open (%s): %d partitions; rebuilt the indexes of %d segment(s) that did not check%s;"
        " cut %d torn tail(s) above the recovery point%s; %d segments read whole",
        "unclean" if unclean else "clean",
        partitions,
        len(rebuilt),
        f" ({'; '.join(rebuilt[:3])})" if rebuilt else "",
        len(cut),
        f" ({'; '.join(cut[:3])})" if cut else "",
        scanned,
    )

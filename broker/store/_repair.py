"""``clmq store repair``: cut a damaged store back to what its log still proves, and say
exactly which messages that drops. Never runs implicitly (the store refuses to open on
damage instead).

What a repair does, under the store's lock:
1. checks the store (:func:`check_unlocked`);
2. cuts each damaged log to its longest valid prefix (:func:`clmq.commitlog.repair_log`:
   truncate, fsync, later segments deleted, directory fsync);
3. removes what the next open rebuilds from the log: the consume queues, damaged
   index files, the checkpoint or recovery points (both generations), and creates the
   ``abort`` marker, so that the next open is a full, validating recovery;
4. rebuilds ``topics.json`` from the records when no generation of it is readable;
5. reads the cut log again to find, per queue, the last message kept: the dropped
   messages are every offset after it up to the highest any file knew of.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from clmq.commitlog import (
    LogLayout,
    QueueKey,
    QueueRange,
    delete_json,
    fsync_dir,
    load_json,
    queue_extents,
    read_json,
    repair_log,
)

from ._check import Progress, StoreReport, Validators, check_unlocked, on_disk_queues, store_lock
from ._config import StoreConfig
from ._topics import TopicTable

log = logging.getLogger("clmq.store")

_REBUILT_METADATA = ("checkpoint", "recovery-points")  # derived: a full recovery needs none


def repair_store(
    config: StoreConfig, progress: Progress | None = None, validators: Validators | None = None
) -> StoreReport:
    """Repair the (closed) store at ``config.data_dir``; the report's ``dropped`` lists
    the messages cut (``repaired`` is False when nothing needed doing). ``validators``:
    as :func:`check_store`."""
    directory = config.data_dir
    with store_lock(directory):
        report = check_unlocked(config, progress, validators)
        if not report.damaged:
            return report
        known = _known_queues(directory, config)
        if config.storage_mode == "partition-per-file":
            kept = _repair_partitions(config, report)
        else:
            kept = _repair_commitlog(config, report)
        report.dropped = _dropped(report.would_drop, kept)
        for name in _REBUILT_METADATA:
            for suffix in ("", ".prev", ".tmp"):
                (directory / (name + suffix)).unlink(missing_ok=True)
        (directory / "abort").touch()  # the next open validates everything
        topics_state = next((m.state for m in report.metadata if m.file.endswith("topics.json")), "ok")
        if topics_state in ("damaged", "incomplete"):
            _rebuild_topics(directory, known, kept)
        elif topics_state == "previous":  # write the good previous generation back as the current one
            table = TopicTable(directory / "topics.json")
            table.replace(table.all())
        fsync_dir(directory)
        report.repaired = True
        log.warning(
            "store repair of %s: dropped %d messages in %d queues",
            directory,
            sum(r.count for r in report.dropped),
            len(report.dropped),
        )
        return report


def _repair_commitlog(config: StoreConfig, report: StoreReport) -> dict[QueueKey, int]:
    """Cut the log, drop the queues and damaged indexes; the last offset kept per queue."""
    directory = config.data_dir
    if report.log_damaged:
        repair_log(directory / "commitlog", config.commitlog, LogLayout.COMMITLOG)
    shutil.rmtree(directory / "consumequeue", ignore_errors=True)
    delete_json(directory / "rebuild-queues")  # every queue is rebuilt at the next open anyway
    for problem in report.index_problems:
        Path(problem.file).unlink(missing_ok=True)
    extents = queue_extents(directory / "commitlog", config.commitlog, LogLayout.COMMITLOG)
    return {(r.topic, r.queue_id): r.last for r in extents}


def _repair_partitions(config: StoreConfig, report: StoreReport) -> dict[QueueKey, int]:
    """Cut each damaged partition; the last offset kept per partition."""
    kept: dict[QueueKey, int] = {}
    for problem in report.index_problems:  # derived: rebuilt at open
        Path(problem.file).unlink(missing_ok=True)
    for log_report in report.logs:
        topic, _, qid = Path(log_report.directory).name.rpartition("-")
        if log_report.damaged:
            log_report = repair_log(Path(log_report.directory), config.commitlog, LogLayout.PARTITION)
        kept[(topic, int(qid))] = log_report.valid_end - 1
    return kept


def _dropped(would_drop: list[QueueRange], kept: dict[QueueKey, int]) -> list[QueueRange]:
    """The offsets past each queue's last kept message, up to the highest known one."""
    out = []
    for r in would_drop:
        first = kept.get((r.topic, r.queue_id), r.first - 1) + 1
        if r.last >= first:
            out.append(QueueRange(r.topic, r.queue_id, first, r.last, r.last - first + 1))
    return out


def _known_queues(directory: Path, config: StoreConfig) -> set[QueueKey]:
    """Queues the store's derived files know of, read before a repair removes them."""
    keys: set[QueueKey] = set(on_disk_queues(directory, config.storage_mode))
    raw = read_json(directory / "recovery-points")
    if isinstance(raw, dict) and isinstance(raw.get("points"), list):
        keys.update((str(p[0]), int(p[1])) for p in raw["points"] if isinstance(p, list) and len(p) == 3)
    loaded = load_json(directory / "topics.json")  # a readable but incomplete table keeps its topics
    topics = loaded.value.get("topics") if loaded.ok else None
    for topic, count in (topics or {}).items() if isinstance(topics, dict) else []:
        if isinstance(count, int):
            keys.update((topic, q) for q in range(count))
    return keys


def _rebuild_topics(directory: Path, known: set[QueueKey], kept: dict[QueueKey, int]) -> None:
    """Write ``topics.json`` anew from the queues the records and derived files name."""
    topics: dict[str, int] = {}
    for topic, qid in known | set(kept):
        topics[topic] = max(topics.get(topic, 0), qid + 1)
    path = directory / "topics.json"
    for suffix in ("", ".prev", ".tmp"):
        path.with_name(path.name + suffix).unlink(missing_ok=True)
    TopicTable(path).replace(topics)
    log.warning(
        "store repair: topics.json rebuilt from the log: %d topics, %d queues", len(topics), sum(topics.values())
    )

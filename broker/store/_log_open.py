"""Opening the CommitLog mode (its ``LogLoader``): the log checked against the
checkpoint, the queues against the log, everything the queues miss re-dispatched, and
only then a store that serves anything. One log line says what the open did."""

from __future__ import annotations

import logging
from typing import Callable

from clmq.commitlog import CommitLog, QueueKey
from clmq.common import LogDamageError
from clmq.consumequeue import Arrivals, ConsumeQueueSet, Dispatcher, EntryReader, KeyIndex, affected_queues

from ._checkpoint import Checkpoint
from ._config import Stopwatch
from ._housekeeping import checkpoint
from ._key_index import open_key_index
from ._log_parts import REBUILD_FILE, LogParts
from ._recovery import RebuildList, Recovery, recover_queues
from ._state import StoreState

log = logging.getLogger("clmq.store")


def open_log_parts(
    state: StoreState, unclean: bool, on_arrivals: Callable[[Arrivals], None]
) -> tuple[LogParts, dict[str, float]]:
    """The mode's parts, recovered (from an unclean stop too, when ``unclean``), with
    ``on_arrivals`` told of every dispatch round; and how long each phase took.

    Raises :class:`LogDamageError` (with the affected queues) when log bytes that were
    promised are gone, having closed whatever it opened."""
    clock = Stopwatch()
    cp = Checkpoint.load(state.directory / "checkpoint")
    # A checkpoint of the previous generation (the current one was damaged) is old:
    # what happened since is unknown, as after a crash.
    unclean = unclean or cp is None or cp.from_previous
    queues = ConsumeQueueSet(
        state.directory / "consumequeue", state.config.cq_entries_per_file, state.config.max_open_files
    )
    commitlog: CommitLog | None = None
    entries: EntryReader | None = None
    try:
        commitlog = _open_log(state, queues, cp, unclean)
        clock.lap("log_open_s")
        state.durable = commitlog.durability  # the log's flusher publishes it
        entries = EntryReader(commitlog)
        parts = _recover(state, commitlog, queues, entries, cp, unclean, on_arrivals, clock)
    except BaseException:
        if entries is not None:
            entries.close()
        queues.files.close()
        if commitlog is not None:
            commitlog.abandon()
        raise
    return parts, {"unclean": unclean, **clock.stats}


def _open_log(state: StoreState, queues: ConsumeQueueSet, cp: Checkpoint | None, unclean: bool) -> CommitLog:
    """Open the log; a clean open expects it to end where the checkpoint says."""
    durable = cp.log_durable if cp is not None else None
    try:
        return CommitLog.open(
            state.directory / "commitlog",
            state.config.commitlog,
            clean=not unclean,
            checkpoint_offset=durable,
            expected_end=None if unclean else durable,
        )
    except LogDamageError as e:  # name what is lost, from the queue files (slow, but only here)
        raise e.with_queues(affected_queues(queues.root, e.start, e.end)) from None


def _recover(
    state: StoreState,
    commitlog: CommitLog,
    queues: ConsumeQueueSet,
    entries: EntryReader,
    cp: Checkpoint | None,
    unclean: bool,
    on_arrivals: Callable[[Arrivals], None],
    clock: Stopwatch,
) -> LogParts:
    """Bring the queues in line with the log, then write them and the checkpoint."""
    rebuild = RebuildList(state.directory / REBUILD_FILE)
    marked = dict(rebuild.marked)
    plan = recover_queues(commitlog, queues, cp, unclean, marked)
    clock.lap("queue_check_s")
    index = open_key_index(state, commitlog)
    start = plan.start if index is None else min(plan.start, max(index.end_offset, commitlog.min_offset))
    dispatcher = _new_dispatcher(state, commitlog, queues, start, index, on_arrivals)
    parts = LogParts(state, commitlog, queues, dispatcher, entries, rebuild)
    appended = queues.appended_entries
    try:
        clock.stats["redispatched_records"] = dispatcher.catch_up()  # serve nothing until queues agree with the log
    except BaseException:
        if index is not None:
            index.close()
        raise
    clock.lap("redispatch_s")
    if index is not None:
        clock.stats["index_files"] = len(index.files)
    # Queues not loaded (clean stop, files intact) keep the checkpoint's extents; the
    # checkpoint carries them forward until they are loaded.
    parts.manifest = dict(cp.queues) if cp is not None and not unclean else {}
    table = {key: nxt for key, (_first, nxt) in parts.manifest.items()}
    table.update(queues.next_offsets())
    commitlog.set_queue_offset_table(table)
    _write_first_checkpoint(parts, set(marked))
    clock.lap("queue_files_s")
    _report_rebuild(plan, dispatcher.dispatched_offset, queues.appended_entries - appended, clock)
    log.info(
        "store opened (%s): %s", "after an unclean stop" if unclean else "clean", {"unclean": unclean, **clock.stats}
    )
    return parts


def _new_dispatcher(
    state: StoreState,
    commitlog: CommitLog,
    queues: ConsumeQueueSet,
    start: int,
    index: KeyIndex | None,
    on_arrivals: Callable[[Arrivals], None],
) -> Dispatcher:
    """The dispatcher from ``start``, feeding ``index`` (if any) as the settings say."""
    config = state.config
    batch = (config.index_batch_interval_ms, config.index_batch_bytes)  # how the key index is fed
    dispatcher = Dispatcher(commitlog, queues, start, config.dispatch_chunk_bytes, *batch)
    if index is not None:
        dispatcher.set_index(index)
    dispatcher.add_listener(on_arrivals)
    return dispatcher


def _write_first_checkpoint(parts: LogParts, rebuilt: set[QueueKey]) -> None:
    """Write the queues and the checkpoint, then unmark the queues rebuilt; a full disk
    only delays it (the entries stay in memory until there is room)."""
    try:
        checkpoint(parts)
        parts.rebuild.clear(rebuilt)  # rebuilt and written: unmark
    except OSError as e:
        log.warning("store open: could not write consume queues yet: %s", e)


def _report_rebuild(plan: Recovery, dispatched: int, entries: int, clock: Stopwatch) -> None:
    """One line for everything the open rebuilt (a store may have 100,000 queues)."""
    clock.stats["queues_rebuilt"] = len(plan.rebuilt)
    if not plan.rebuilt:
        return
    log.warning(
        "store open: %d queue(s) rebuilt from the log, %d entries re-dispatched from %d log bytes "
        "(from offset %d): %s%s",
        len(plan.rebuilt),
        entries,
        dispatched - plan.start,
        plan.start,
        "; ".join(plan.rebuilt[:5]),
        " ..." if len(plan.rebuilt) > 5 else "",
    )

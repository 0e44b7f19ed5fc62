"""What a query selects: topics, queues and per-queue offset ranges, resolved once at planning.

The rules follow Spark's Kafka source where it has one:

- ``topics`` / ``topicPattern`` choose topics; ``queues`` as JSON (``{"orders": [0, 1]}``)
  also chooses topics when neither is given: exactly the topics it names, nothing else.
  A topic or queue that does not exist is an error naming it.
- ``startingOffsets`` / ``endingOffsets`` (JSON per queue, -2 earliest, -1 latest),
  ``startingTimestamp`` / ``endingTimestamp`` (every queue) or
  ``startingOffsetsByTimestamp`` / ``endingOffsetsByTimestamp`` (JSON per queue) bound
  each queue; a queue they do not name runs from earliest to latest. They may only name
  selected topics and queues.
- ``failOnDataLoss`` (default true): an offset no longer retained, or not yet written,
  fails the query naming the queue and the range; false moves it to what is there and
  logs a warning.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Protocol

from clmq.common import is_system_topic

from ._layout import LogLayout
from ._options import EARLIEST, LATEST, OptionError, Positions, ReadOptions

log = logging.getLogger("clmq.spark")


class QueueSource(Protocol):
    """What planning needs of one store (a data directory or one broker)."""

    layout: LogLayout

    def bounds(self, topic: str, qid: int) -> tuple[int, int]: ...  # (min, max) queue offsets
    def offset_for_timestamp(self, topic: str, qid: int, timestamp_ms: int) -> int: ...
    def message_count(self) -> int: ...
    def read(self, seg_base: int, offset: int, n: int) -> bytes: ...
    def close(self) -> None: ...


class DataLossError(OptionError):
    """An offset asked for is no longer retained or not yet written (``failOnDataLoss=true``)."""


@dataclass(frozen=True)
class Selection:
    """What a query selects, shared by every task (filters applied to parsed records)."""

    topics: tuple[str, ...]
    queues: dict[str, tuple[int, ...]]  # topic -> selected queue ids
    ranges: dict[str, tuple[int, int]] = field(default_factory=dict)  # "source|topic/qid" -> [lo, hi)
    all_queues: bool = True  # every queue of every selected topic, no offset bounds


def resolve_topics(opts: ReadOptions, available: dict[str, int], where: str) -> tuple[str, ...]:
    """The selected topics, in the order named (then by name); an unknown one is an error."""
    named = list(opts.topics or ())
    by_queues = list(opts.queues) if isinstance(opts.queues, dict) else []
    if by_queues and not named and not opts.topic_pattern:
        named = by_queues  # queues JSON alone: exactly the topics it names
    missing = [t for t in dict.fromkeys(named + by_queues) if t not in available]
    if missing:
        raise OptionError(
            f"topic(s) {', '.join(missing)} not found in {where}; "
            f"topics there: {', '.join(sorted(available)) or 'none'}"
        )
    names = list(dict.fromkeys(named))
    # The broker's own topics (%TIMER%, %RETRY%g, %DLQ%g) are read only when named.
    user = sorted(t for t in available if not is_system_topic(t))
    if opts.topic_pattern:
        rx = re.compile(opts.topic_pattern)
        names += [t for t in user if rx.fullmatch(t) and t not in names]
    if not opts.topics and not opts.topic_pattern and not by_queues:
        names = user
    outside = [t for t in by_queues if t not in names]
    if outside:
        raise OptionError(f"option queues names topic(s) {', '.join(outside)} that topics/topicPattern do not select")
    return tuple(names)


def _queue_ids(opts: ReadOptions, topic: str, count: int) -> tuple[int, ...]:
    wanted = opts.queues
    if isinstance(wanted, dict):
        ids = wanted.get(topic, tuple(range(count)))
    else:
        ids = wanted if wanted is not None else tuple(range(count))
    bad = [q for q in ids if not 0 <= q < count]
    if bad:
        raise OptionError(f"queue id(s) {bad} not in 0..{count - 1} of topic {topic!r}")
    return tuple(sorted(set(ids)))


def _check_named(opts: ReadOptions, queues: dict[str, tuple[int, ...]]) -> None:
    """Offsets and timestamps may only name selected topics and queues (a typo would
    otherwise read the queue in full)."""
    for name, positions in (
        ("startingOffsets", opts.starting),
        ("endingOffsets", opts.ending),
        ("startingOffsetsByTimestamp", opts.starting_by_timestamp),
        ("endingOffsetsByTimestamp", opts.ending_by_timestamp),
    ):
        for topic, per in (positions or {}).items():
            if topic == "*":
                continue
            if topic not in queues:
                raise OptionError(
                    f"option {name} names topic {topic!r}, which the query does not select "
                    f"(selected: {', '.join(queues) or 'none'})"
                )
            extra = sorted(q for q in per if q not in queues[topic])
            if extra:
                raise OptionError(
                    f"option {name} names queue(s) {extra} of topic {topic!r}, which the query does "
                    f"not select (selected: {list(queues[topic])})"
                )


def _has_bounds(opts: ReadOptions) -> bool:
    return any(
        v is not None
        for v in (
            opts.starting,
            opts.ending,
            opts.starting_timestamp_ms,
            opts.ending_timestamp_ms,
            opts.starting_by_timestamp,
            opts.ending_by_timestamp,
        )
    )


def _named(positions: Positions | None, topic: str, qid: int) -> int | None:
    if positions is None:
        return None
    per = positions.get(topic) or positions.get("*") or {}
    return per.get(qid, per.get(-1))


def _resolve(src: QueueSource, opts: ReadOptions, topic: str, qid: int, end: bool) -> int | None:
    """One side of a queue's range as asked: a queue offset, or None (the queue's edge)."""
    ts = opts.ending_timestamp_ms if end else opts.starting_timestamp_ms
    if ts is None:
        ts = _named(opts.ending_by_timestamp if end else opts.starting_by_timestamp, topic, qid)
    if ts is not None:
        return src.offset_for_timestamp(topic, qid, ts)
    at = _named(opts.ending if end else opts.starting, topic, qid)
    if at == EARLIEST:
        return src.bounds(topic, qid)[0]
    if at == LATEST:
        return src.bounds(topic, qid)[1]
    return at


def _within(opts: ReadOptions, what: str, at: int, qmin: int, qmax: int, where: str) -> int:
    """``at`` if the queue holds it, else (failOnDataLoss=false) the nearest offset it holds."""
    if qmin <= at <= qmax:
        return at
    why = (
        f"offsets [{at}, {qmin}) are no longer retained" if at < qmin else f"offsets [{qmax}, {at}) are not yet written"
    )
    text = f"{where}: {what} {at} is outside the queue's [{qmin}, {qmax}): {why}"
    if opts.fail_on_data_loss:
        raise DataLossError(text + " (option failOnDataLoss=false reads what is there instead)")
    log.warning("%s; reading from %d (failOnDataLoss=false)", text, min(max(at, qmin), qmax))
    return min(max(at, qmin), qmax)


def queue_range(src: QueueSource, opts: ReadOptions, topic: str, qid: int) -> tuple[int, int] | None:
    """``[lo, hi)`` queue offsets of one queue, or None when it is read whole."""
    if not _has_bounds(opts):
        return None
    lo, hi = _resolve(src, opts, topic, qid, False), _resolve(src, opts, topic, qid, True)
    if lo is None and hi is None:
        return None
    qmin, qmax = src.bounds(topic, qid)
    where = f"{src.layout.source} queue {topic}/{qid}"
    lo = qmin if lo is None else _within(opts, "start", lo, qmin, qmax, where)
    hi = qmax if hi is None else _within(opts, "end", hi, qmin, qmax, where)
    settle = getattr(src, "ensure_readable", None)  # a broker: its snapshot may lag its queues' ends
    if settle is not None and hi > lo:
        settle(topic, qid, hi, opts.timeout_ms)
    if hi < lo:
        raise OptionError(f"{where}: the end offset {hi} is before the start offset {lo}")
    return lo, hi


def select(opts: ReadOptions, sources: list[QueueSource]) -> Selection:
    """Resolve topics, queues and per-queue offset ranges (once, at planning)."""
    available: dict[str, int] = {}
    for src in sources:
        for t, n in src.layout.topics.items():
            available[t] = max(n, available.get(t, 0))
    where = ", ".join(s.layout.source for s in sources)
    topics = resolve_topics(opts, available, where)
    queues = {t: _queue_ids(opts, t, available[t]) for t in topics}
    _check_named(opts, queues)
    ranges: dict[str, tuple[int, int]] = {}
    for src in sources:
        for t in topics:
            for q in queues[t]:
                if src.layout.topics.get(t, 0) > q:
                    r = queue_range(src, opts, t, q)
                    if r is not None:
                        ranges[f"{src.layout.source}|{t}/{q}"] = r
    all_queues = not ranges and all(len(queues[t]) == available[t] for t in topics)
    return Selection(topics, queues, ranges, all_queues)

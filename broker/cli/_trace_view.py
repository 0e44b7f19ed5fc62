"""``clmq message trace ID`` and ``clmq message trace --key K [--topic T]``: the life
of a message as a timeline of its trace events (docs/traces.md), one row per event:
when, how long after the first, what happened, who saw it, where the message was,
the attempt, its id and a detail; ``-o json`` prints :meth:`MessageTrace.to_json`."""

from __future__ import annotations

import argparse
from typing import Any

from clmq.client import Admin
from clmq.common import TraceEvent

from ._errors import EXIT_FAILED, EXIT_USAGE, CliError
from ._output import emit, tally
from ._timefmt import FORMS, format_time_ms, parse_time_ms

TRACE_COLUMNS = ["time", "+ms", "event", "by", "where", "attempt", "msg id", "detail"]
DEFAULT_TRACE_MAX_EVENTS = 1000  # events shown at most (--max-events)


def add_trace_parser(msub: Any) -> None:
    """``clmq message trace``."""
    trace = msub.add_parser(
        "trace",
        help="the life of a message as a timeline: sent, delivered, acked, sent back, dead-lettered, resent",
    )
    trace.add_argument("msg_id", nargs="?", help="the message id (host:port@HEXOFFSET) a send printed")
    trace.add_argument("--key", help="instead of an id: the messages carrying this key (one of their keys)")
    trace.add_argument("--topic", help="with --key: only messages sent to this topic")
    trace.add_argument("--since", help=f"only events recorded at or after: {FORMS}")
    trace.add_argument("--until", help="only events recorded at or before (same forms)")
    trace.add_argument(
        "--max-events", type=int, default=DEFAULT_TRACE_MAX_EVENTS, help="show at most this many (default 1000)"
    )


async def show_trace(args: argparse.Namespace, admin: Admin) -> None:
    """Print the trace ``args`` ask for; CliError when nothing was recorded."""
    if (args.msg_id is None) == (args.key is None):
        raise CliError("give a message id or --key (one of them)", EXIT_USAGE)
    if args.topic is not None and args.key is None:
        raise CliError("--topic goes with --key", EXIT_USAGE)
    if args.max_events < 1:
        raise CliError("--max-events must be at least 1", EXIT_USAGE)
    since = parse_time_ms(args.since) if args.since else None
    until = parse_time_ms(args.until) if args.until else None
    try:
        trace = await admin.trace(
            args.msg_id, key=args.key, topic=args.topic, since_ms=since, until_ms=until, max_events=args.max_events
        )
    except ValueError as e:
        raise CliError(str(e), EXIT_USAGE) from None
    what = (
        f"message {args.msg_id}" if args.msg_id else f"key {args.key!r}" + (f" in {args.topic}" if args.topic else "")
    )
    if not trace.events:
        raise CliError(
            f"no trace events for {what}: was it sent or consumed with trace=True, through brokers with "
            "trace_enabled? (events older than trace_retention_ms are not shown)",
            EXIT_FAILED,
        )
    emit(args, f"trace of {what}", TRACE_COLUMNS, trace_rows(trace.events), data=trace.to_json())
    tally(f"[dim]{len(trace.events)} events" + ("" if trace.complete else "; older events may exist (a bound hit)"))


def trace_rows(events: list[TraceEvent]) -> list[list[Any]]:
    """One table row per event (see :data:`TRACE_COLUMNS`)."""
    first = events[0].time_ms if events else 0
    return [
        [
            format_time_ms(e.time_ms),
            e.time_ms - first,
            e.kind,
            who(e),
            where(e),
            e.attempt,
            e.msg_id,
            detail(e),
        ]
        for e in events
    ]


def who(e: TraceEvent) -> str:
    """Who recorded the event: a consumer's group and client id, a producer's client
    id, or the broker."""
    if e.client_id:
        return f"{e.group}/{e.client_id}" if e.group else e.client_id
    return f"broker {e.broker}" if e.broker else e.group


def where(e: TraceEvent) -> str:
    """topic, queue and offset, as far as known."""
    if not e.topic:
        return ""
    if e.queue_id < 0:
        return e.topic
    offset = f"@{e.queue_offset}" if e.queue_offset >= 0 else ""
    return f"{e.topic}[{e.queue_id}]{offset}"


def detail(e: TraceEvent) -> str:
    parts = [e.detail] if e.detail else []
    if e.latency_ms >= 0:
        parts.append(f"{e.latency_ms} ms" + (" after store" if e.kind == "delivered" else ""))
    if e.keys and e.kind == "sent":
        parts.append(f"keys {e.keys}")
    return "; ".join(parts)

"""The broker's own trace events (docs/traces.md), with ``trace_enabled``: what its
handlers saw happen to messages (sent back to a retry topic, dead-lettered), buffered
here off the hot path and written to ``%TRACE%`` in batches by ``_trace_writer``.

A handler's :meth:`TraceRecorder.record` is a list append; a full buffer drops the
event and counts it (``dropped``), it never delays a request."""

from __future__ import annotations

import time
from typing import Any, Sequence

from clmq.common import PROP_ORIGIN_MSG_ID, Record, TraceEvent, TraceKind, dlq_topic, trace_event

UNIQ_KEY = "UNIQ_KEY"  # the producer's unique id of a message (a property)

TRACE_BUFFER_MAX_EVENTS = 65536  # the broker's trace events waiting to be written; more are dropped (counted)
TRACE_FLUSH_INTERVAL_MS = 200  # the broker writes its buffered trace events this often
TRACE_BATCH_MAX_EVENTS = 1024  # trace records per append


class TraceRecorder:
    """The buffer of the broker's trace events; ``enabled`` is the broker's
    ``trace_enabled`` (off: :meth:`record` keeps nothing)."""

    def __init__(self, enabled: bool = False, buffer_max_events: int = TRACE_BUFFER_MAX_EVENTS) -> None:
        self.enabled = enabled
        self.buffer_max_events = buffer_max_events
        self._events: list[TraceEvent] = []
        self.recorded = 0
        self.dropped = 0
        self.written = 0
        self.failed = 0

    def record(self, event: TraceEvent) -> None:
        """Keep ``event`` for the next write (nothing if tracing is off; dropped and
        counted when the buffer is full)."""
        if not self.enabled:
            return
        if len(self._events) >= self.buffer_max_events:
            self.dropped += 1
            return
        self._events.append(event)
        self.recorded += 1

    def take(self, n: int = TRACE_BATCH_MAX_EVENTS) -> list[TraceEvent]:
        """Up to ``n`` buffered events, oldest first, removed from the buffer."""
        out = self._events[:n]
        del self._events[: len(out)]
        return out

    @property
    def buffered(self) -> int:
        return len(self._events)


def send_back_events(
    tracer: TraceRecorder, addr: str, broker: str, group: str, records: Sequence[Record], results: Sequence[list[Any]]
) -> None:
    """CONSUMER_SEND_BACK's events: per record, ``sent_back`` (its retry stored, due at
    a time) or ``dead_lettered`` (moved to ``%DLQ%group``); ``results`` are the answer's rows."""
    now = int(time.time() * 1000)
    for record, (where, times, due) in zip(records, results):
        props = record.properties
        dead = where == "dlq"
        tracer.record(
            trace_event(
                TraceKind.DEAD_LETTERED if dead else TraceKind.SENT_BACK,
                f"{addr}@{record.commitlog_offset:016X}",
                now,
                topic=record.topic,
                queue_id=record.queue_id,
                queue_offset=record.queue_offset,
                keys=record.keys,
                uniq_key=props.get(UNIQ_KEY, ""),
                group=group,
                broker=broker,
                attempt=times,
                origin_msg_id=props.get(PROP_ORIGIN_MSG_ID, ""),
                detail=f"to {dlq_topic(group)}" if dead else f"retry {times} stored, due at {due}",
            )
        )


def trace_fields(config: Any, tracer: TraceRecorder) -> dict[str, Any]:
    """What BROKER_INFO says of traces: the switch, the retention lookups apply, and
    the broker's own events (recorded, dropped, written, failed, buffered)."""
    return {
        "trace_enabled": config.trace_enabled,
        "trace_retention_ms": config.trace_retention_ms,
        "trace_events": {
            "recorded": tracer.recorded,
            "dropped": tracer.dropped,
            "written": tracer.written,
            "failed": tracer.failed,
            "buffered": tracer.buffered,
        },
    }

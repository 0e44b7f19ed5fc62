"""The admin client's message traces (docs/traces.md): the life of a message as a
timeline of the events clients and brokers recorded in ``%TRACE%``.

A trace record's keys are its message's id, ``UNIQ_KEY``, first id (on a retry or a
dead letter) and own keys, so a lookup by any of them finds it. From a message id the
trace follows what the events found say about the same message: its ``UNIQ_KEY``
(kept by retries and dead letters), the first id, the id of a copy resent from the
dead letters, for at most :data:`TRACE_FOLLOW_MAX_ROUNDS` rounds. Records older than
the brokers' ``trace_retention_ms`` are not returned."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterable

from clmq.common import TRACE_TOPIC, Record, TraceEvent, TraceFormatError, concerns, decode_events, timeline
from clmq.protocol import ErrorCode, RequestCode
from clmq.protocol.transport import ConnectionFailed, RpcError

from ._admin_calls import AdminCalls

TRACE_FOLLOW_MAX_ROUNDS = 4  # rounds of following ids found in events (a retry's, a resent copy's)
TRACE_LOOKUP_MAX_KEYS = 64  # keys looked up in all, per trace
TRACE_MAX_EVENTS = 1000  # events returned at most (the newest kept when cut)

# A lookup of one key in %TRACE%: its records (newest first), and whether it read all there was.
FindRecords = Callable[[str, int | None, int | None, int], Awaitable[tuple[list[Record], bool]]]


@dataclass
class MessageTrace:
    """What :meth:`Admin.trace` found: ``events`` in the order they happened; ``keys``
    the ids and keys looked up; ``complete`` false if a lookup hit its bound (older
    events may exist) or the keys to follow ran out of rounds; ``unreadable`` trace
    records that did not decode (a damaged or foreign record, skipped)."""

    events: list[TraceEvent] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    complete: bool = True
    unreadable: int = 0
    since_ms: int | None = None  # the window searched (retention applied)

    def to_json(self) -> dict[str, Any]:
        """The trace as plain data (``-o json``, the dashboard)."""
        return {
            "events": [_event_json(e) for e in self.events],
            "keys": self.keys,
            "complete": self.complete,
            "unreadable": self.unreadable,
            "since_ms": self.since_ms,
        }


def _event_json(event: TraceEvent) -> dict[str, Any]:
    return event._asdict()


async def retention_since(calls: AdminCalls, now_ms: int) -> int | None:
    """The oldest time a trace may show: now minus the shortest ``trace_retention_ms``
    of the leaders that trace (None: no leader said)."""
    shortest = None
    for b in await calls.leaders():
        try:
            info = await calls.call(b["addr"], RequestCode.BROKER_INFO, {})
        except (RpcError, ConnectionFailed):
            continue
        retention = info.get("trace_retention_ms")
        if isinstance(retention, int) and info.get("trace_enabled"):
            shortest = retention if shortest is None else min(shortest, retention)
    return None if shortest is None else now_ms - shortest


async def message_trace(
    find: FindRecords,
    *,
    msg_id: str | None,
    key: str | None,
    topic: str | None,
    since_ms: int | None,
    until_ms: int | None,
    max_events: int = TRACE_MAX_EVENTS,
) -> MessageTrace:
    """The trace of message ``msg_id``, or of the messages of ``topic`` (any topic if
    None) carrying ``key`` (see the module's docstring)."""
    if (msg_id is None) == (key is None):
        raise ValueError("trace needs a message id or a key (one of them)")
    out = MessageTrace(since_ms=since_ms)
    found: dict[TraceEvent, None] = {}
    todo: list[str] = [msg_id or key or ""]
    for round_ in range(TRACE_FOLLOW_MAX_ROUNDS):
        todo = [k for k in dict.fromkeys(todo) if k not in out.keys][: TRACE_LOOKUP_MAX_KEYS - len(out.keys)]
        if not todo:
            break
        new: list[TraceEvent] = []
        for k in todo:
            out.keys.append(k)
            records, complete = await find(k, since_ms, until_ms, max_events)
            out.complete = out.complete and complete
            events, bad = _decode(records)
            out.unreadable += bad
            if round_ == 0 and key is not None:  # a user's key: the messages of that topic carrying it
                events = [e for e in events if key in e.keys.split() and (topic is None or e.topic == topic)]
            else:  # a record holds other messages' events too
                events = [e for e in events if concerns(e, k)]
            new += [e for e in events if e not in found]
        found.update(dict.fromkeys(new))
        todo = list(_ids_of(new))
    else:
        out.complete = out.complete and not [k for k in todo if k not in out.keys]
    events = timeline(found)
    if len(events) > max_events:
        events, out.complete = events[-max_events:], False
    out.events = events
    return out


def _decode(records: Iterable[Record]) -> tuple[list[TraceEvent], int]:
    events, bad = [], 0
    for r in records:
        try:
            events += decode_events(r.body)
        except TraceFormatError:
            bad += 1
    return events, bad


def _ids_of(events: Iterable[TraceEvent]) -> Iterable[str]:
    """The ids an event names for its message (never its own keys: other messages share them)."""
    for e in events:
        yield from (k for k in (e.msg_id, e.uniq_key, e.origin_msg_id) if k)


def now_ms() -> int:
    return int(time.time() * 1000)


def key_scan_finder(scan: Callable[..., Awaitable[Any]]) -> FindRecords:
    """A :data:`FindRecords` over a key lookup of the ``Admin.messages_by_key`` kind
    (``scan(topic, key, max_messages=, since_ms=, until_ms=)`` answering records and
    ``complete``)."""

    async def find(key: str, since_ms: int | None, until_ms: int | None, limit: int) -> tuple[list[Record], bool]:
        try:
            lookup = await scan(TRACE_TOPIC, key, max_messages=limit, since_ms=since_ms, until_ms=until_ms)
        except ValueError:  # no broker has %TRACE%: nothing was traced
            return [], True
        return list(lookup.records), bool(lookup.complete) and len(lookup.records) < limit

    return find


def index_finder(find_by_key: Callable[..., Awaitable[Any]], fallback: FindRecords) -> FindRecords:
    """A :data:`FindRecords` over ``Admin.find_by_key`` (the key index); ``fallback``
    where a broker has no index (REQUEST_NOT_SUPPORTED: partition mode, index off)."""

    async def find(key: str, since_ms: int | None, until_ms: int | None, limit: int) -> tuple[list[Record], bool]:
        try:
            found = await find_by_key(TRACE_TOPIC, key, since_ms=since_ms, until_ms=until_ms, max_results=limit)
        except RpcError as e:
            if e.code != ErrorCode.REQUEST_NOT_SUPPORTED:
                raise
            return await fallback(key, since_ms, until_ms, limit)
        return list(found.records), not found.truncated

    return find


async def trace_lookup(
    admin: Any,
    msg_id: str | None,
    key: str | None,
    topic: str | None,
    since_ms: int | None,
    until_ms: int | None,
    max_events: int,
) -> MessageTrace:
    """:meth:`Admin.trace`: through the key index when the admin client has it, else
    the bounded key scan; the brokers' trace retention applied to ``since_ms``."""
    if max_events < 1:
        raise ValueError(f"max_events must be at least 1, got {max_events}")
    oldest = await retention_since(admin.calls, now_ms())
    if oldest is not None:
        since_ms = oldest if since_ms is None else max(since_ms, oldest)
    find = index_finder(admin.find_by_key, key_scan_finder(admin.messages_by_key))
    return await message_trace(
        find, msg_id=msg_id, key=key, topic=topic, since_ms=since_ms, until_ms=until_ms, max_events=max_events
    )

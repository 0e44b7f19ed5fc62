"""Message traces (docs/traces.md): the events of a message's life and their record
format. Sans-IO: building, encoding and decoding events; clients and brokers write
them as records of topic ``%TRACE%`` (:data:`TRACE_TOPIC`).

A record holds the events of one write, up to :data:`TRACE_RECORD_MAX_EVENTS`
(RocketMQ's trace dispatcher packs its contexts the same way): a record per event
cost a traced producer twice its untraced CPU, most of it per record (the record, its
header, its consume-queue entry), measured by ``clmq bench trace``. Its body is a
compact JSON array: the format version (1), then one array per event holding
:class:`TraceEvent`'s fields in their order (positional, not objects: the whole body
is one call of the C encoder; a newer version only appends fields). Its keys are,
for every event, the traced message's id, its ``UNIQ_KEY``, the first message's id
(on a retry, a dead letter, a resent copy) and the message's own keys, each once,
separated by spaces, so that the key index finds every event of a message by any of
them (:func:`trace_keys`); a lookup keeps the events of the record that concern the
key it asked for (:func:`concerns`).
"""

from __future__ import annotations

import enum
import json
from typing import Any, Iterable, NamedTuple

from ._errors import InvalidInputError
from ._record import Message
from ._system import TRACE_TOPIC

TRACE_QUEUES = 4  # queues of %TRACE% (trace records are spread over them round robin)
TRACE_FORMAT_VERSION = 1  # the first element of every record's body
TRACE_RECORD_MAX_EVENTS = 64  # events per %TRACE% record at most
TRACE_RECORD_MAX_KEYS_BYTES = 16 * 1024  # a record's keys at most (the field's limit is 64 KiB)
TRACE_EVENT_MAX_KEYS = 32  # a traced message's own keys kept in its events (the rest are cut)
_ENCODE = json.JSONEncoder(separators=(",", ":")).encode


class TraceKind(str, enum.Enum):
    """What happened to the message; each event names who saw it happen."""

    SENT = "sent"  # the producer's send was answered: stored at queue/offset (latency: submit to answer)
    STORED = "stored"  # reserved for a broker's own record of a store (clmq lets the producer's `sent` carry it)
    DELIVERED = "delivered"  # a consumer's receive() returned it (group, client id)
    ACKED = "acked"  # the consumer marked it processed
    SENT_BACK = "sent_back"  # a consumer nacked it / the broker stored its retry (attempt, due time)
    DEAD_LETTERED = "dead_lettered"  # the broker moved it to %DLQ%group
    RESENT = "resent"  # an operator sent a dead letter again (detail: the new message's id)
    COMMITTED = "committed"  # a transactional message committed (visible)
    ROLLED_BACK = "rolled_back"  # a transactional message rolled back (never visible)


class TraceFormatError(InvalidInputError):
    """A ``%TRACE%`` record whose body is not a trace event."""


class TraceEvent(NamedTuple):
    """One event of a message's life. ``msg_id`` is the id of the record the event is
    about (a retry's own id on its delivery); ``origin_msg_id`` the first message's id
    when that record is a retry or a dead letter (else ""). Numbers unknown to whoever
    recorded the event are -1 (queue, offset, latency). A named tuple: clients make
    one per traced message, and a tuple is the cheapest immutable record to make."""

    kind: str
    time_ms: int  # wall clock, ms since the epoch, of the recorder
    msg_id: str
    topic: str = ""
    queue_id: int = -1
    queue_offset: int = -1
    keys: str = ""  # the message's own keys (space separated)
    uniq_key: str = ""  # its UNIQ_KEY property
    group: str = ""  # the producer or consumer group
    client_id: str = ""  # the recording client (hostname@pid@...), or the consumer's member id
    latency_ms: int = -1  # sent: submit to answer; delivered: store to delivery
    broker: str = ""  # the broker (name or address) the event happened at
    attempt: int = 0  # deliveries before this one (the record's reconsume times)
    origin_msg_id: str = ""
    detail: str = ""  # free text: a retry's due time, a resent copy's id, a reason

    def sort_key(self) -> tuple[int, int, str, int, tuple[Any, ...]]:
        """Timeline order: time, then the order of a message's life for equal times,
        then the attempt (a client's step before the broker's record of it, which
        counts the next attempt), then every field: a total order, so that a trace
        reads the same however its events were found."""
        return (self.time_ms, _KIND_ORDER.get(self.kind, len(_KIND_ORDER)), self.msg_id, self.attempt, tuple(self))


_KIND_ORDER = {kind.value: i for i, kind in enumerate(TraceKind)}
_FIELDS = TraceEvent._fields
_INTS = frozenset({"time_ms", "queue_id", "queue_offset", "latency_ms", "attempt"})
MAX_TIME_MS = 253_402_300_799_999  # 9999-12-31T23:59:59.999Z: any later time cannot be shown as a date
_INT_RANGES = {name: (-1, 2**63 - 1) for name in _INTS} | {"time_ms": (0, MAX_TIME_MS)}
_REQUIRED = len(_FIELDS) - len(TraceEvent._field_defaults)  # kind, time_ms, msg_id
_VALID_KINDS = frozenset(k.value for k in TraceKind)


def trace_event(kind: TraceKind | str, msg_id: str, time_ms: int, **more: Any) -> TraceEvent:
    """A :class:`TraceEvent`, its kind checked (``ValueError`` for an unknown kind) and
    the message's keys cut to :data:`TRACE_EVENT_MAX_KEYS`."""
    if isinstance(kind, TraceKind):
        kind = kind.value
    elif kind not in _VALID_KINDS:
        kind = TraceKind(kind).value  # ValueError naming it for an unknown kind
    keys = more.pop("keys", "") or ""
    if keys.count(" ") >= TRACE_EVENT_MAX_KEYS:
        keys = " ".join(keys.split()[:TRACE_EVENT_MAX_KEYS])
    return TraceEvent(kind, int(time_ms), msg_id, keys=keys, **more)


def transaction_event(
    committed: bool,
    msg_id: str,
    time_ms: int,
    *,
    topic: str,
    queue_id: int,
    queue_offset: int,
    keys: str = "",
    uniq_key: str = "",
    group: str = "",
    broker: str = "",
    half_msg_id: str = "",
) -> TraceEvent:
    """The event of a transactional message's end: ``committed`` (visible at
    ``topic``/``queue_id``/``queue_offset``, id ``msg_id``) or rolled back (then the
    queue fields are those the message would have had, -1 if unknown).
    ``half_msg_id``: the half message's id, kept as ``origin_msg_id`` so that a trace
    by either id finds the event."""
    kind = TraceKind.COMMITTED if committed else TraceKind.ROLLED_BACK
    return trace_event(
        kind,
        msg_id,
        time_ms,
        topic=topic,
        queue_id=queue_id,
        queue_offset=queue_offset,
        keys=keys,
        uniq_key=uniq_key,
        group=group,
        broker=broker,
        origin_msg_id=half_msg_id,
    )


def trace_keys(event: TraceEvent) -> str:
    """The keys of a record of this event alone: its message's id, UNIQ_KEY, first id
    and own keys, space separated, each once."""
    return " ".join(_keys_of(event))


def _keys_of(event: TraceEvent) -> list[str]:
    parts = [k for k in (event.msg_id, event.uniq_key, event.origin_msg_id) if k]
    if event.keys:
        parts += event.keys.split()
    return list(dict.fromkeys(parts))


def encode_event(event: TraceEvent) -> bytes:
    """The body of a record of one event."""
    return encode_events([event])


def encode_events(events: Iterable[TraceEvent]) -> bytes:
    """A record's body: ``[1, [kind, time_ms, msg_id, topic, ...], ...]``, compact JSON."""
    return _ENCODE([TRACE_FORMAT_VERSION, *events]).encode()


def decode_events(body: bytes) -> list[TraceEvent]:
    """A record's body back as its events; :class:`TraceFormatError` saying what is
    wrong (fields past this version's are ignored: a newer writer's)."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise TraceFormatError(f"a trace record's body is not JSON: {e}") from None
    except RecursionError:  # a forged record: anyone allowed to trace can write one
        raise TraceFormatError("a trace record's body is nested too deeply") from None
    if not isinstance(data, list) or not data or type(data[0]) is not int:
        raise TraceFormatError(f"a trace record's body must be a JSON array [version, events...], got {body!r:.60}")
    return [_event_of(row) for row in data[1:]]


def decode_event(body: bytes) -> TraceEvent:
    """The one event of a record (:class:`TraceFormatError` unless it holds exactly one)."""
    events = decode_events(body)
    if len(events) != 1:
        raise TraceFormatError(f"a trace record of one event expected, it holds {len(events)}")
    return events[0]


def _event_of(row: Any) -> TraceEvent:
    if not isinstance(row, list):
        raise TraceFormatError(f"a trace event must be a JSON array of its fields, got {row!r:.40}")
    values = row[: len(_FIELDS)]
    if len(values) < _REQUIRED:
        raise TraceFormatError(f"a trace event lacks field {_FIELDS[len(values)]!r}")
    for name, value in zip(_FIELDS, values):
        wanted = int if name in _INTS else str
        if type(value) is not wanted:
            raise TraceFormatError(f"trace field {name!r} must be {wanted.__name__}, got {value!r:.40}")
        if isinstance(value, int) and not _INT_RANGES[name][0] <= value <= _INT_RANGES[name][1]:
            raise TraceFormatError(f"trace field {name!r} must be in {_INT_RANGES[name]}, got {value}")
    return TraceEvent(*values)


def trace_message(event: TraceEvent, queue_id: int = 0) -> Message:
    """The ``%TRACE%`` record of one event (queue ``queue_id``)."""
    return Message(TRACE_TOPIC, queue_id, encode_events([event]), event.kind, trace_keys(event))


def trace_messages(events: Iterable[TraceEvent], queue_id: int = 0) -> list[Message]:
    """The ``%TRACE%`` records of ``events``, in order: up to
    :data:`TRACE_RECORD_MAX_EVENTS` events and :data:`TRACE_RECORD_MAX_KEYS_BYTES` of
    keys per record (an event alone may exceed the latter: its keys are cut to
    :data:`TRACE_EVENT_MAX_KEYS` when made)."""
    out: list[Message] = []
    chunk: list[TraceEvent] = []
    keys: dict[str, None] = {}
    size = 0
    for event in events:
        mine = _keys_of(event)
        new = [k for k in mine if k not in keys]
        grown = size + sum(len(k) + 1 for k in new)
        if chunk and (len(chunk) >= TRACE_RECORD_MAX_EVENTS or grown > TRACE_RECORD_MAX_KEYS_BYTES):
            out.append(_record(chunk, keys, queue_id))
            chunk, keys = [], {}
            new, grown = mine, sum(len(k) + 1 for k in mine)
        chunk.append(event)
        keys.update(dict.fromkeys(new))
        size = grown
    if chunk:
        out.append(_record(chunk, keys, queue_id))
    return out


def _record(events: list[TraceEvent], keys: dict[str, None], queue_id: int) -> Message:
    kinds = dict.fromkeys(e.kind for e in events)
    return Message(TRACE_TOPIC, queue_id, encode_events(events), " ".join(kinds), " ".join(keys))


def concerns(event: TraceEvent, key: str) -> bool:
    """Whether ``event`` is about a message ``key`` names (its id, UNIQ_KEY, first id,
    or one of its own keys): a record holds other messages' events too."""
    return key in (event.msg_id, event.uniq_key, event.origin_msg_id) or key in event.keys.split()


def timeline(events: Iterable[TraceEvent]) -> list[TraceEvent]:
    """Events in the order they happened, each once (a record written twice, e.g. by a
    retried trace send, shows once)."""
    return sorted(set(events), key=lambda e: e.sort_key())

"""Message traces (docs/traces.md): the events of a message's life and their record
format. Sans-IO: building, encoding and decoding events; clients and brokers write
them as records of topic ``%TRACE%`` (:data:`TRACE_TOPIC`).

One record per event. Its body is the event as a compact JSON array: the format
version (1), then :class:`TraceEvent`'s fields in their order (a positional array,
not an object: it is encoded by the C encoder in one call, a sixth of the cost of an
object built field by field, and a client writes one per traced message; a newer
version only appends fields). Its tags are the event's kind; its keys are the traced
message's id, its ``UNIQ_KEY``, the first message's id (on a retry or a dead letter),
and the message's own keys, separated by spaces, so that the key index finds every
event of a message by any of them (:func:`trace_keys`).
"""

from __future__ import annotations

import enum
import json
from typing import Any, Iterable, NamedTuple

from ._errors import InvalidInputError
from ._record import Message
from ._system import TRACE_TOPIC

TRACE_QUEUES = 4  # queues of %TRACE% (trace records are spread over them round robin)
TRACE_FORMAT_VERSION = 1  # field "v" of every record's body
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

    def sort_key(self) -> tuple[int, int, str]:
        """Timeline order: time, then the order of a message's life for equal times."""
        return (self.time_ms, _KIND_ORDER.get(self.kind, len(_KIND_ORDER)), self.msg_id)


_KIND_ORDER = {kind.value: i for i, kind in enumerate(TraceKind)}
_FIELDS = TraceEvent._fields
_INTS = frozenset({"time_ms", "queue_id", "queue_offset", "latency_ms", "attempt"})
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
    """The keys of the event's record: its message's id, UNIQ_KEY, first id and own
    keys, space separated, each once."""
    parts = [k for k in (event.msg_id, event.uniq_key, event.origin_msg_id) if k]
    if event.keys:
        parts += event.keys.split()
    return " ".join(dict.fromkeys(parts))


def encode_event(event: TraceEvent) -> bytes:
    """The record body: ``[1, kind, time_ms, msg_id, topic, ...]`` as compact JSON."""
    return _ENCODE((TRACE_FORMAT_VERSION, *event)).encode()


def decode_event(body: bytes) -> TraceEvent:
    """A record body back as an event; :class:`TraceFormatError` saying what is wrong
    (fields past this version's are ignored: a newer writer's)."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise TraceFormatError(f"a trace record's body is not JSON: {e}") from None
    if not isinstance(data, list) or not data or type(data[0]) is not int:
        raise TraceFormatError(f"a trace record's body must be a JSON array [version, kind, ...], got {body!r:.60}")
    values = data[1 : 1 + len(_FIELDS)]
    if len(values) < _REQUIRED:
        raise TraceFormatError(f"a trace record lacks field {_FIELDS[len(values)]!r}")
    for name, value in zip(_FIELDS, values):
        wanted = int if name in _INTS else str
        if type(value) is not wanted:
            raise TraceFormatError(f"trace field {name!r} must be {wanted.__name__}, got {value!r:.40}")
    return TraceEvent(*values)


def trace_message(event: TraceEvent, queue_id: int = 0) -> Message:
    """The ``%TRACE%`` record of one event (queue ``queue_id``)."""
    return Message(TRACE_TOPIC, queue_id, encode_event(event), event.kind, trace_keys(event))


def timeline(events: Iterable[TraceEvent]) -> list[TraceEvent]:
    """Events in the order they happened, each once (a record written twice, e.g. by a
    retried trace send, shows once)."""
    return sorted(set(events), key=lambda e: e.sort_key())

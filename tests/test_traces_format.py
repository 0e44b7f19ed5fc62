"""The trace record format (common/_trace.py), for classes of events (Hypothesis):
every event survives its record unchanged, its record's keys name it by every id it
carries, a body that is not an event is a clear error, and a timeline orders events
by time and, within a millisecond, by the order of a message's life."""

from __future__ import annotations

import json
from random import Random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from clmq.broker.cli._timefmt import format_time_ms
from clmq.common import (
    MAX_TIME_MS,
    TRACE_RECORD_MAX_EVENTS,
    TRACE_RECORD_MAX_KEYS_BYTES,
    TRACE_TOPIC,
    TraceEvent,
    TraceFormatError,
    TraceKind,
    concerns,
    decode_event,
    decode_events,
    timeline,
    trace_event,
    trace_keys,
    trace_message,
    trace_messages,
    transaction_event,
)

words = st.text(st.characters(blacklist_categories=("Cs", "Zs", "Cc")), min_size=1, max_size=12)
ids = st.builds(lambda port, off: f"127.0.0.1:{port}@{off:016X}", st.integers(1, 65535), st.integers(0, 2**40))
events = st.builds(
    trace_event,
    st.sampled_from(list(TraceKind)),
    ids,
    st.integers(0, 2**45),
    topic=st.one_of(st.just(""), words),
    queue_id=st.integers(-1, 1000),
    queue_offset=st.integers(-1, 2**40),
    keys=st.lists(words, max_size=5).map(" ".join),
    uniq_key=st.one_of(st.just(""), st.text("0123456789abcdef", min_size=32, max_size=32)),
    group=st.one_of(st.just(""), words),
    client_id=st.one_of(st.just(""), words),
    latency_ms=st.integers(-1, 10**6),
    broker=st.one_of(st.just(""), words),
    attempt=st.integers(0, 16),
    origin_msg_id=st.one_of(st.just(""), ids),
    detail=st.text(max_size=40),
)


@given(events)
def test_an_event_survives_its_record(event: TraceEvent) -> None:
    message = trace_message(event, 3)
    assert message.topic == TRACE_TOPIC and message.queue_id == 3 and message.tags == event.kind
    assert decode_event(message.body) == event
    assert json.loads(message.body)[0] == 1 and json.loads(message.body)[1][:3] == [
        event.kind,
        event.time_ms,
        event.msg_id,
    ]


@given(events)
def test_the_record_keys_name_the_message_by_every_id_once(event: TraceEvent) -> None:
    keys = trace_keys(event).split(" ")
    assert event.msg_id in keys
    for k in (event.uniq_key, event.origin_msg_id, *event.keys.split()):
        assert not k or k in keys
    assert len(keys) == len(set(keys))


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"not json", "not JSON"),
        (b'{"kind": "sent"}', "JSON array"),
        (b"[]", "JSON array"),
        (b'[1, {"kind": "sent"}]', "JSON array of its fields"),
        (b'[1, ["sent", 1]]', "lacks field 'msg_id'"),
        (b'[1, ["sent", "1", "a@0"]]', "'time_ms' must be int"),
        (b'[1, ["sent", 1, "a@0", "t", "0"]]', "'queue_id' must be int"),
        (b'[1, ["sent", 1, "a@0"], ["acked", 2, "a@0"]]', "holds 2"),
        (b"\xff\xfe", "not JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b'[1, ["sent", 99999999999999999, "a@0"]]', "'time_ms' must be in"),
        (b'[1, ["sent", -5, "a@0"]]', "'time_ms' must be in"),
        (b'[1, ["sent", 1, "a@0", "t", 0, 18446744073709551615]]', "'queue_offset' must be in"),
    ],
)
def test_a_body_that_is_not_an_event_is_a_clear_error(body: bytes, why: str) -> None:
    with pytest.raises(TraceFormatError, match=why):
        decode_event(body)


def test_fields_a_newer_writer_added_are_ignored() -> None:
    body = b'[2, ["acked", 5, "h:1@00", "t", 1, 2, "", "", "", "", -1, "", 0, "", "", ["shiny"]]]'
    assert decode_event(body) == TraceEvent("acked", 5, "h:1@00", "t", 1, 2)


@given(st.lists(events, max_size=200), st.integers(0, 3))
def test_events_packed_into_records_come_back_in_order_and_each_is_found_by_its_ids(
    evs: list[TraceEvent], queue_id: int
) -> None:
    records = trace_messages(evs, queue_id)
    assert all(r.topic == TRACE_TOPIC and r.queue_id == queue_id for r in records)
    unpacked = [decode_events(r.body) for r in records]
    assert [e for chunk in unpacked for e in chunk] == evs
    for r, chunk in zip(records, unpacked):
        assert 1 <= len(chunk) <= TRACE_RECORD_MAX_EVENTS
        keys = r.keys.split(" ")
        assert len(keys) == len(set(keys))
        assert len(chunk) == 1 or len(r.keys) <= TRACE_RECORD_MAX_KEYS_BYTES
        for e in chunk:
            assert e.msg_id in keys and concerns(e, e.msg_id)
            assert not e.uniq_key or (e.uniq_key in keys and concerns(e, e.uniq_key))


def test_an_unknown_kind_is_refused_when_made() -> None:
    with pytest.raises(ValueError, match="lost"):
        trace_event("lost", "h:1@00", 1)


@given(st.lists(events, max_size=30))
def test_a_timeline_is_ordered_by_time_then_by_the_life_of_a_message(evs: list[TraceEvent]) -> None:
    order = [k.value for k in TraceKind]
    line = timeline(evs + evs)  # a record written twice shows once
    assert len(line) == len(set(evs))
    assert [(e.time_ms, order.index(e.kind)) for e in line] == sorted((e.time_ms, order.index(e.kind)) for e in line)


@given(st.lists(events, max_size=12), st.randoms())
def test_a_timeline_does_not_depend_on_the_order_events_were_found_in(evs: list[TraceEvent], rnd: Random) -> None:
    # Two look-ups of one trace (by id, by key) find the same events in another order:
    # CI saw two "sent_back" of one message in one millisecond (the client's, then the
    # broker's) come back in either order.
    twin = [e._replace(attempt=e.attempt + 1, client_id="", detail="stored") for e in evs]
    mixed = evs + twin
    rnd.shuffle(mixed)
    assert timeline(mixed) == timeline(evs + twin)


def test_a_clients_event_comes_before_the_brokers_of_the_same_step_in_one_millisecond() -> None:
    client = trace_event("sent_back", "h:1@00", 5, client_id="billing-1", attempt=0, detail="retry 1, due at 9")
    broker = trace_event("sent_back", "h:1@00", 5, attempt=1, detail="retry 1 stored, due at 9")
    assert timeline([broker, client]) == timeline([client, broker]) == [client, broker]


def test_transaction_events_are_found_by_the_half_message_too() -> None:
    event = transaction_event(
        True, "h:1@10", 7, topic="orders", queue_id=2, queue_offset=9, uniq_key="u" * 32, half_msg_id="h:1@05"
    )
    assert event.kind == "committed" and "h:1@05" in trace_keys(event).split()
    rolled = transaction_event(False, "h:1@05", 8, topic="orders", queue_id=-1, queue_offset=-1)
    assert rolled.kind == "rolled_back"


@given(st.recursive(st.integers() | st.text() | st.none(), lambda c: st.lists(c, max_size=4), max_leaves=30))
def test_any_json_is_either_events_or_a_trace_format_error(value: object) -> None:
    """A forged %TRACE% record (anyone allowed to trace can write one) never breaks a
    lookup with anything but TraceFormatError; what decodes can be shown."""
    try:
        decoded = decode_events(json.dumps([1, value]).encode())
    except TraceFormatError:
        return
    for e in decoded:
        assert 0 <= e.time_ms <= MAX_TIME_MS
        format_time_ms(e.time_ms)  # a table can show it

"""The trace record format (common/_trace.py), for classes of events (Hypothesis):
every event survives its record unchanged, its record's keys name it by every id it
carries, a body that is not an event is a clear error, and a timeline orders events
by time and, within a millisecond, by the order of a message's life."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from clmq.common import (
    TRACE_TOPIC,
    TraceEvent,
    TraceFormatError,
    TraceKind,
    decode_event,
    timeline,
    trace_event,
    trace_keys,
    trace_message,
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
    assert json.loads(message.body)[:4] == [1, event.kind, event.time_ms, event.msg_id]


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
        (b'[1, "sent", 1]', "lacks field 'msg_id'"),
        (b'[1, "sent", "1", "a@0"]', "'time_ms' must be int"),
        (b'[1, "sent", 1, "a@0", "t", "0"]', "'queue_id' must be int"),
        (b"\xff\xfe", "not JSON"),
    ],
)
def test_a_body_that_is_not_an_event_is_a_clear_error(body: bytes, why: str) -> None:
    with pytest.raises(TraceFormatError, match=why):
        decode_event(body)


def test_fields_a_newer_writer_added_are_ignored() -> None:
    body = b'[2, "acked", 5, "h:1@00", "t", 1, 2, "", "", "", "", -1, "", 0, "", "", ["shiny"]]'
    assert decode_event(body) == TraceEvent("acked", 5, "h:1@00", "t", 1, 2)


def test_an_unknown_kind_is_refused_when_made() -> None:
    with pytest.raises(ValueError, match="lost"):
        trace_event("lost", "h:1@00", 1)


@given(st.lists(events, max_size=30))
def test_a_timeline_is_ordered_by_time_then_by_the_life_of_a_message(evs: list[TraceEvent]) -> None:
    order = [k.value for k in TraceKind]
    line = timeline(evs + evs)  # a record written twice shows once
    assert len(line) == len(set(evs))
    assert [(e.time_ms, order.index(e.kind)) for e in line] == sorted((e.time_ms, order.index(e.kind)) for e in line)


def test_transaction_events_are_found_by_the_half_message_too() -> None:
    event = transaction_event(
        True, "h:1@10", 7, topic="orders", queue_id=2, queue_offset=9, uniq_key="u" * 32, half_msg_id="h:1@05"
    )
    assert event.kind == "committed" and "h:1@05" in trace_keys(event).split()
    rolled = transaction_event(False, "h:1@05", 8, topic="orders", queue_id=-1, queue_offset=-1)
    assert rolled.kind == "rolled_back"

"""Typed rows of multi-queue requests: they survive the wire, and every field of the
wrong type is refused with an error that names it."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from clmq.protocol import FetchAsk, FetchResult, PullStatus, RowError

ints = st.integers(min_value=-(2**63), max_value=2**63 - 1)
queue_ids, offsets = st.integers(0, 2**31 - 1), st.integers(0, 2**63 - 1)
asks = st.builds(
    FetchAsk, st.text(max_size=20), queue_ids, offsets, st.none() | st.lists(st.text(max_size=8), max_size=4)
)
results = st.builds(FetchResult, st.sampled_from(PullStatus), ints, st.integers(0, 2**31), st.integers(0, 2**31), ints)
not_int = st.one_of(
    st.text(max_size=5), st.floats(allow_nan=False), st.booleans(), st.none(), st.lists(st.integers(), max_size=2)
)


@given(asks)
def test_an_ask_survives_the_wire(ask: FetchAsk) -> None:
    assert FetchAsk.from_wire(msgpack.unpackb(msgpack.packb(ask.to_wire()))) == ask


@given(results)
def test_a_result_survives_the_wire(result: FetchResult) -> None:
    assert FetchResult.from_wire(msgpack.unpackb(msgpack.packb(result.to_wire()))) == result


@given(asks, st.integers(1, 2), st.sampled_from([-1, -(2**63), 2**63, 2**64 - 1]))
def test_an_ask_with_a_queue_id_or_offset_out_of_range_is_refused_by_name(ask: FetchAsk, index: int, bad: int) -> None:
    row = ask.to_wire()
    row[index] = bad
    with pytest.raises(RowError, match=["topic", "queue_id", "offset"][index]):
        FetchAsk.from_wire(row)


@given(asks, st.integers(0, 2), not_int)
def test_an_ask_with_a_field_of_the_wrong_type_is_refused_by_name(ask: FetchAsk, index: int, bad: Any) -> None:
    row = ask.to_wire()
    if index == 0 and isinstance(bad, str):
        bad = 7  # a string is a valid topic
    row[index] = bad
    with pytest.raises(RowError, match=["topic", "queue_id", "offset"][index]):
        FetchAsk.from_wire(row)


def test_bad_tags_and_bad_shapes_are_refused() -> None:
    with pytest.raises(RowError, match="tags"):
        FetchAsk.from_wire(["t", 0, 0, ["a", 1]])
    with pytest.raises(RowError, match="tags"):
        FetchAsk.from_wire(["t", 0, 0, "a"])
    for row in (None, [], ["t", 0, 0], ("t", 0, 0, None), {"topic": "t"}):
        with pytest.raises(RowError, match="fetch ask must be"):
            FetchAsk.from_wire(row)


@given(results, st.integers(1, 4), not_int)
def test_a_result_with_a_field_of_the_wrong_type_is_refused_by_name(result: FetchResult, index: int, bad: Any) -> None:
    row = result.to_wire()
    row[index] = bad
    with pytest.raises(RowError, match=["next_offset", "count", "bytes", "max_offset"][index - 1]):
        FetchResult.from_wire(row)


def test_an_unknown_status_or_a_negative_count_is_refused() -> None:
    with pytest.raises(RowError, match="unknown status 'LOST'"):
        FetchResult.from_wire(["LOST", 0, 0, 0, 0])
    with pytest.raises(RowError, match="not negative"):
        FetchResult.from_wire(["FOUND", 0, -1, 0, 0])


def test_a_skipped_queue_keeps_its_offset_and_reports_no_watermark() -> None:
    assert FetchResult.skipped(42).to_wire() == ["SKIPPED", 42, 0, 0, -1]

"""POP's state in the windows a fault can open: a checkpoint taken while an ACK is
being written, an orderly queue's redeliveries, a write that failed or was stored
without its confirmation, a topic deleted, a change of invisible time over members."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from clmq.broker.service.pop._inflight import Flight, PopState, QueueFlights
from clmq.broker.service.pop._records import Acks, Checkpoint


def _settling_state() -> tuple[PopState, QueueFlights]:
    state = PopState()
    state.apply(Checkpoint("g", "c1", "t", 0, [5, 6], [1, 1], 1_000, 3, 7), 40)
    q = state.groups["g"].queues[("t", 0)]
    q.flights[5].settling = True  # as judge() marks an accepted ACK while its record is written
    return state, q


def test_a_settling_delivery_is_neither_visible_nor_due_meanwhile() -> None:
    _state, q = _settling_state()
    assert q.due(2_000, 10) == ([6], [])
    assert not q.visible(2_000)
    assert q.busy(2_000)  # an orderly queue waits for the ACK


def test_a_checkpoint_taken_while_an_ack_is_written_keeps_the_real_deadline() -> None:
    state, _q = _settling_state()
    saved = PopState.from_json(state.to_json())
    adopted = saved.groups["g"].queues[("t", 0)]
    assert adopted.flights[5].deadline_ms == 1_000 and not adopted.flights[5].settling
    assert adopted.due(2_000, 10) == ([5, 6], [])  # the ACK never landed: it comes back


def test_the_ack_replayed_after_such_a_checkpoint_settles_it() -> None:
    state, _q = _settling_state()
    saved = PopState.from_json(state.to_json())
    saved.apply(Acks("g", [("t", 0, 5, 40)]), 41)
    q = saved.groups["g"].queues[("t", 0)]
    assert sorted(q.flights) == [6] and q.settled_offset() == 6


@given(st.permutations(list(range(6))), st.integers(1, 6))
def test_an_orderly_queue_gives_back_its_lowest_offsets_first(deadline_order: list[int], limit: int) -> None:
    q = QueueFlights(6)
    for rank, offset in enumerate(deadline_order):  # deadlines in any order over the offsets
        q.put(offset, Flight(offset, 100 + rank, 1, "c", 5))
    take, dead = q.due(1_000, limit, orderly=True)
    assert take == list(range(limit)) and dead == []
    assert q.due(1_000, 6, orderly=True) == (list(range(6)), [])


def test_an_orderly_queue_stops_at_the_first_offset_not_visible() -> None:
    q = QueueFlights(3)
    q.put(0, Flight(1, 100, 1, "c", 5))
    q.put(1, Flight(2, 5_000, 1, "c", 5))
    q.put(2, Flight(3, 100, 1, "c", 5))
    assert q.due(1_000, 10, orderly=True) == ([0], [])

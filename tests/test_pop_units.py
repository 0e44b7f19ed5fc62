"""POP's pure parts: CK/ACK records and receipt handles round-trip, the in-flight
state (due deliveries, dead letters, settling), a replay from any earlier point gives
the same state (what makes a low checkpoint safe), the checkpoint's JSON, and the
allocation of a pop across queues (fairness)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from trio.testing import wait_all_tasks_blocked

from clmq.broker.service.pop._batch import ACK_MAX_ROWS, BATCH_MAX_RECORDS, RecordBatcher
from clmq.broker.service.pop._inflight import Flight, PopState, QueueFlights
from clmq.broker.service.pop._reads import Fresh, read_inline
from clmq.broker.service.pop._records import (
    Acks,
    Checkpoint,
    Handle,
    ack_message,
    ck_message,
    decode_pop_record,
    encode_handles,
    parse_handle,
)
from clmq.broker.service.pop._state import PopCheckpoint, checkpoint_path, load_checkpoint, save_checkpoint
from clmq.broker.service.pop._take import allocate, fresh_after, next_after, rotated, within_bytes
from clmq.broker.store import PutResult, PutStatus, Store, StoreConfig
from clmq.common import Message, decode_record
from clmq.protocol import ErrorCode
from clmq.protocol.transport import RequestError

names = st.text(st.characters(codec="utf-8", exclude_characters="\n"), min_size=1, max_size=12)
offsets = st.integers(0, 2**40)


@given(names, names, st.integers(0, 1023), offsets, offsets, st.integers(0, 2**45))
def test_a_handle_round_trips_and_garbage_is_none(
    broker: str, topic: str, qid: int, off: int, ck: int, deadline: int
) -> None:
    h = Handle(broker, topic, qid, off, ck, deadline)
    text = h.encode()
    assert text.isascii() and parse_handle(text) == h
    assert parse_handle(text[:-2]) in (None, parse_handle(text[:-2]))  # never raises
    assert parse_handle("x" + text) is None


@given(names, names, st.integers(0, 1023), st.lists(offsets, max_size=5), offsets, st.integers(0, 2**45))
def test_a_pop_s_handles_are_each_offset_s_handle(
    broker: str, topic: str, qid: int, offs: list[int], ck: int, deadline: int
) -> None:
    expected = [Handle(broker, topic, qid, o, ck, deadline).encode() for o in offs]
    assert encode_handles(broker, topic, qid, offs, ck, deadline) == expected


@given(st.lists(st.tuples(st.sampled_from(["put", "settle", "drop"]), st.integers(0, 200)), max_size=80))
def test_the_settled_offset_kept_is_the_lowest_in_flight(ops: list[tuple[str, int]]) -> None:
    q = QueueFlights(201)
    for op, off in ops:
        if op == "put":
            q.put(off, Flight(off, 0, 1, "c", 16))
        elif op == "settle":
            q.settle(off, off)
        else:  # taken out without settle (a record gone to retention)
            q.flights.pop(off, None)
        assert q.settled_offset() == (min(q.flights) if q.flights else 201)


@given(st.text(max_size=40))
def test_any_text_parses_to_a_handle_or_none(text: str) -> None:
    parsed = parse_handle(text)
    assert parsed is None or isinstance(parsed, Handle)


@given(names, names, names, st.lists(st.tuples(offsets, st.integers(0, 20)), max_size=20), offsets)
def test_ck_and_ack_records_round_trip(group: str, client: str, topic: str, rows: list[Any], deadline: int) -> None:
    ck = Checkpoint(group, client, topic, 3, [r[0] for r in rows], [r[1] for r in rows], deadline, 16, 99)
    m = ck_message(ck)
    assert m.topic == "%POP%" and decode_pop_record(m.tags, m.body) == ck
    acks = Acks(group, [(topic, 1, r[0], r[1]) for r in rows])
    m = ack_message(acks)
    assert decode_pop_record(m.tags, m.body) == acks


def test_due_deliveries_come_in_order_and_past_their_limit_go_to_the_dead_letters() -> None:
    q = QueueFlights(10)
    for off, deadline, attempt in ((3, 100, 1), (1, 50, 3), (2, 500, 1), (5, 60, 1)):
        q.put(off, Flight(7, deadline, attempt, "c", 2))
    assert not q.visible(40) and q.visible(50)
    take, dead = q.due(200, 1)
    assert dead == [1] and take == [5]  # 1 had its third attempt (max 2 more); 5 first by deadline
    take, dead = q.due(200, 5)
    assert take == [3] and dead == []
    assert q.busy(200)  # 2 is not visible yet
    assert q.settle(2, 8) is False and q.settle(2, 7) is True
    assert q.settled_offset() == 1


ops = st.lists(
    st.one_of(
        st.tuples(st.just("ck"), st.lists(st.integers(0, 30), min_size=1, max_size=5, unique=True), st.integers(1, 5)),
        st.tuples(st.just("ack"), st.lists(st.tuples(st.integers(0, 30), st.integers(0, 40)), max_size=5)),
    ),
    max_size=40,
)


def _records(script: list[Any]) -> list[Checkpoint | Acks]:
    out: list[Checkpoint | Acks] = []
    nxt = 0
    for op in script:
        if op[0] == "ck":
            nxt = max(nxt, max(op[1]) + 1)
            out.append(Checkpoint("g", "c", "t", 0, op[1], [op[2]] * len(op[1]), 1000 + len(out), 3, nxt))
        else:
            out.append(Acks("g", [("t", 0, o, k) for o, k in op[1]]))
    return out


def _view(state: PopState) -> Any:
    """The state, flights in offset order (the JSON keeps the order they were put in)."""
    return {g: sorted([t, q, n, sorted(f)] for t, q, n, f in queues) for g, queues in state.to_json().items()}


@settings(max_examples=200)
@given(ops, st.data())
def test_a_replay_from_any_earlier_point_gives_the_same_state(script: list[Any], data: st.DataObject) -> None:
    records = _records(script)
    whole = PopState()
    for i, r in enumerate(records):
        whole.apply(r, i)
    at = data.draw(st.integers(0, len(records)))
    early = data.draw(st.integers(0, at))
    saved = PopState()
    for i, r in enumerate(records[:at]):
        saved.apply(r, i)
    again = PopState.from_json(saved.to_json())  # the checkpoint, as saved and loaded
    for i in range(early, len(records)):  # replayed from a point at or before the checkpoint's
        again.apply(records[i], i)
    assert _view(again) == _view(whole)


@given(
    st.dictionaries(st.integers(0, 7), st.integers(0, 50), min_size=1),
    st.integers(0, 200),
    st.integers(0, 20),
)
def test_allocation_spreads_over_the_queues_that_have_messages(avail: dict[int, int], budget: int, turn: int) -> None:
    order = rotated(sorted(avail), turn)
    alloc = allocate(avail, order, budget)
    assert sum(alloc.values()) == min(budget, sum(avail.values()))
    assert all(0 <= alloc[q] <= avail[q] for q in order)
    having = [q for q in order if avail[q]]
    if budget >= len(having):  # every queue that has messages gets some
        assert all(alloc[q] > 0 for q in having)


def test_within_bytes_keeps_the_first_record_and_next_offsets_skip_filtered_entries() -> None:
    fresh = {0: Fresh(0, [0, 1, 2], [0, 10, 20], [100, 100, 100], 3), 1: Fresh(5, [7], [30], [100], 9)}
    alloc = {0: 3, 1: 1}
    within_bytes(fresh, alloc, [1, 0], 250, 0)
    assert alloc == {1: 1, 0: 1}
    alloc = {0: 3}
    within_bytes(fresh, alloc, [0], 10, 0)
    assert alloc == {0: 1}  # the first record always goes
    f = Fresh(5, [7, 9], [1, 2], [1, 1], 12)
    assert next_after(f, 0) == 7 and next_after(f, 1) == 9 and next_after(f, 2) == 12
    assert fresh_after(f, 8).offsets == [9] and fresh_after(f, 3) is f


def test_the_checkpoint_file_round_trips_and_a_damaged_one_replays_from_the_start(tmp_path: Path) -> None:
    store = Store.open(StoreConfig(tmp_path / "s")).start()
    try:
        assert load_checkpoint(store) == PopCheckpoint(0, store.log.min_offset)  # none yet
        state = PopState()
        state.apply(Checkpoint("g", "c", "t", 0, [3, 4], [1, 2], 99, 16, 5), 7)
        cp = PopCheckpoint(8, 1234, state.to_json())
        save_checkpoint(store, cp)
        assert load_checkpoint(store) == cp
        path = checkpoint_path(store)
        for gen in (path, path.with_name(path.name + ".prev")):
            if gen.exists():
                gen.write_bytes(b"{not json")
        assert load_checkpoint(store) == PopCheckpoint(0, store.log.min_offset)
    finally:
        store.close()


def test_records_read_inline_are_checked_against_their_entries(tmp_path: Path) -> None:
    store = Store.open(StoreConfig(tmp_path / "s")).start()
    try:
        store.create_topic("t", 2)
        res = store.put_batch([Message("t", 0, b"m%d" % i, "x") for i in range(3)], wait_durable=True)
        store.catch_up()
        where = [(q, o, s) for q, o, s in zip(res.queue_offsets, res.commitlog_offsets, _sizes(store, res))]
        got = read_inline(store, "t", 0, where)
        assert [decode_record(b).body for b in got if b is not None] == [b"m0", b"m1", b"m2"]
        wrong = [(where[0][0] + 1, *where[0][1:]), where[1], (where[2][0], where[2][1], where[2][2] + 1)]
        assert [b is not None for b in read_inline(store, "t", 0, wrong)] == [False, True, False]
        assert read_inline(store, "t", 1, where[:1]) == [None]  # another queue's record
        assert read_inline(store, "u", 0, where[:1]) == [None]  # another topic
        assert read_inline(store, "t", 0, [(9, 10**9, 50)]) == [None]  # past the log
    finally:
        store.close()


def _sizes(store: Store, res: Any) -> list[int]:
    return [store.log.read_record(o).size for o in res.commitlog_offsets]  # type: ignore[union-attr]


class _Log:
    """A record list standing in for the append lane, with confirmations held at will
    (the batcher's own logic: which requests go together, who waits for what)."""

    def __init__(self) -> None:
        self.records: list[Message] = []
        self.appended = trio.Event()
        self.open_append = trio.Event()
        self.open_append.set()
        self.slow = trio.Event()  # confirmations of topic "slow" wait for it

    async def append(self, messages: list[Message], also: Any) -> PutResult:
        await self.open_append.wait()
        at = len(self.records)
        self.records += messages
        self.appended.set()
        return PutResult(PutStatus.OK, "", list(range(at, len(self.records))), [], len(self.records))

    async def confirm(self, result: PutResult, topics: list[str]) -> None:
        if "slow" in topics:
            await self.slow.wait()
        if any(t.startswith("%DLQ%") for t in topics):
            raise RequestError(ErrorCode.NOT_ENOUGH_REPLICAS, "the dead letters' topic is not held")


def _ck(n: int) -> Message:
    return ck_message(Checkpoint("g", "c", "t", 0, [n], [1], 1, 3, n + 1))


async def test_a_batch_waiting_for_its_durability_does_not_hold_back_the_next_append() -> None:
    log = _Log()
    batcher = RecordBatcher(log.append, log.confirm)
    slow_done = trio.Event()

    async def slow() -> None:
        await batcher.record([_ck(0)], ("slow",))
        slow_done.set()

    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            n.start_soon(slow)
            await log.appended.wait()
            fast = await batcher.record([_ck(1)])  # appended and answered while "slow" waits
            assert fast.queue_offsets == [1] and not slow_done.is_set()
            log.slow.set()
        assert slow_done.is_set()


async def test_a_dead_letter_s_topic_is_waited_for_only_by_its_own_request() -> None:
    log = _Log()
    batcher = RecordBatcher(log.append, log.confirm)
    results: dict[str, Any] = {}

    async def record(name: str, messages: list[Message]) -> None:
        try:
            results[name] = await batcher.record(messages)
        except RequestError as e:
            results[name] = e

    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            log.open_append = trio.Event()
            n.start_soon(record, "leader", [_ck(0)])
            await wait_all_tasks_blocked()
            n.start_soon(record, "ack", [ack_message(Acks("g", [("t", 0, 0, 0)]))])
            n.start_soon(record, "dead", [Message("%DLQ%g", 0, b"x"), ack_message(Acks("g", [("t", 0, 1, 0)]))])
            await wait_all_tasks_blocked()
            log.open_append.set()
    assert isinstance(results["leader"], PutResult) and isinstance(results["ack"], PutResult)
    assert isinstance(results["dead"], RequestError) and results["dead"].code == ErrorCode.NOT_ENOUGH_REPLICAS


async def test_a_pile_up_goes_in_appends_of_bounded_records_and_merged_acks_are_split() -> None:
    log = _Log()
    appends: list[list[Message]] = []
    batcher = RecordBatcher(log.append, log.confirm)
    real_append = log.append

    async def append(messages: list[Message], also: Any) -> PutResult:
        appends.append(messages)
        return await real_append(messages, also)

    batcher._append = append
    acks = 2 * ACK_MAX_ROWS + 1
    cks = BATCH_MAX_RECORDS + 3
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            log.open_append = trio.Event()
            n.start_soon(batcher.record, [_ck(0)])
            await wait_all_tasks_blocked()
            for off in range(acks):
                n.start_soon(batcher.record, [ack_message(Acks("g", [("t", 0, off, 0)]))])
            for off in range(cks):
                n.start_soon(batcher.record, [_ck(off)])
            await wait_all_tasks_blocked()
            log.open_append.set()
    assert all(len(a) <= BATCH_MAX_RECORDS + ACK_MAX_ROWS for a in appends)
    rows = []
    for m in log.records:
        record = decode_pop_record(m.tags, m.body)
        if isinstance(record, Acks):
            assert len(record.rows) <= ACK_MAX_ROWS
            rows += record.rows
    assert sorted(r[2] for r in rows) == list(range(acks))  # every ack's row, once
    assert sum(1 for m in log.records if isinstance(decode_pop_record(m.tags, m.body), Checkpoint)) == cks + 1


async def test_each_request_of_a_failed_batch_raises_its_own_error() -> None:
    log = _Log()
    batcher = RecordBatcher(log.append, log.confirm)
    errors: list[RequestError] = []

    async def record(n: int) -> None:
        try:
            await batcher.record([Message("%DLQ%g", 0, b"x"), _ck(n)])
        except RequestError as e:
            errors.append(e)

    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            log.open_append = trio.Event()
            n.start_soon(batcher.record, [_ck(0)])
            await wait_all_tasks_blocked()
            n.start_soon(record, 1)
            n.start_soon(record, 2)
            await wait_all_tasks_blocked()
            log.open_append.set()
    assert len(errors) == 2 and errors[0] is not errors[1]
    assert [e.code for e in errors] == [ErrorCode.NOT_ENOUGH_REPLICAS] * 2
    assert errors[0].__cause__ is errors[1].__cause__  # both caused by the batch's one error

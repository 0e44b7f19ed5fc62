"""POP's state in the windows a fault can open: a checkpoint taken while an ACK is
being written, an orderly queue's redeliveries, a write that failed or was stored
without its confirmation, a topic deleted, a change of invisible time over members."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from clmq.broker.service.kafka._share_acks import apply_acks
from clmq.broker.service.kafka._share_sessions import ShareSession
from clmq.broker.service.pop._base import Judged
from clmq.broker.service.pop._inflight import Flight, PopState, QueueFlights
from clmq.broker.service.pop._records import Acks, Checkpoint, Handle, decode_pop_record
from clmq.broker.service.pop._service import _place_changes
from clmq.broker.service.pop._state import PopCheckpoint, replay
from clmq.broker.service.pop._take import Ask, Taken
from clmq.broker.service.pop._taking import _undo
from clmq.client import open_admin
from clmq.protocol import ErrorCode
from clmq.protocol.transport import RequestError, RpcError
from tests.pop_helpers import FAST_POP, Popper
from tests.service_helpers import Cluster
from tests.waiting import await_until


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


def _ask() -> Ask:
    return Ask("g", "c1", "t", [0], 10, 1_000)


def _popped(q: QueueFlights, offsets: list[int]) -> Taken:
    """A pop's part of queue ``q``: new offsets reserved and the next offset moved past them."""
    p = Taken(0, q)
    for off in offsets:
        p.reserve(off, Flight(-1, 5_000, 1, "c1", 3), None, 1)
    p.advanced, q.next_offset = (q.next_offset, offsets[-1] + 1), offsets[-1] + 1
    return p


def test_a_failed_pop_gives_its_new_offsets_back_to_the_next_offset() -> None:
    q = QueueFlights(10)
    p = _popped(q, [10, 11, 12])
    assert not _undo({0: p}, _ask())  # nothing kept that no record holds
    assert q.next_offset == 10 and not q.flights
    ck = Checkpoint("g", "c2", "t", 0, [], [], 9_000, 3, q.next_offset)  # a later CK (a change's) carries it
    state = PopState()
    state.apply(ck, 0)
    assert state.groups["g"].queues[("t", 0)].next_offset == 10  # a replay skips nothing


def test_a_failed_pop_behind_a_later_one_keeps_its_offsets_visible() -> None:
    q = QueueFlights(10)
    first = _popped(q, [10, 11])
    _popped(q, [12, 13])  # another pop moved the next offset since
    assert _undo({0: first}, _ask()) == {0: [10, 11]}  # kept below a moved next offset: the service records them
    assert q.next_offset == 14
    assert q.due(1, 10) == ([10, 11], [])  # visible at once, delivered next with attempt 1
    assert [q.flights[o].attempt for o in (10, 11)] == [0, 0]


def test_a_change_of_invisible_time_keeps_each_delivery_s_owner_and_limit() -> None:
    q = QueueFlights(3)
    rows = []
    for off, owner, limit in [(0, "a", 1), (1, "b", 1), (2, "a", 7)]:
        f = Flight(5, 100, 1, owner, limit)
        q.put(off, f)
        rows.append((off, q, Handle("b", "t", 0, off, 5, 100), f))
    parts, cks, _placed = _place_changes("g", Judged(["ok"] * 3, rows), 9_000)
    assert len(parts) == len(cks) == 3
    state = PopState()
    for n, m in enumerate(cks):
        record = decode_pop_record(m.tags, m.body)
        assert record is not None
        state.apply(record, 50 + n)
    got = state.groups["g"].queues[("t", 0)].flights
    assert {o: (f.owner, f.max_reconsume_times, f.deadline_ms) for o, f in got.items()} == {
        0: ("a", 1, 9_000),
        1: ("b", 1, 9_000),
        2: ("a", 7, 9_000),
    }


async def test_a_deleted_topic_s_deliveries_go_and_a_rebuild_does_not_bring_them_back(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    broker = await c.start_broker(**{**FAST_POP, "pop_checkpoint_interval_ms": 10**9})  # a rebuild replays it all
    await c.create_topic("t", 1)
    await c.create_topic("u", 1)
    async with open_admin(c.ns) as admin:
        p = Popper(admin, broker.addr)
        await p.running()
        await p.send("t", [b"t0"])
        await p.send("u", [b"u0", b"u1"])
        await p.pop_all(1, topic="t", invisible_time_ms=60_000)
        await p.pop_all(2, topic="u", invisible_time_ms=60_000)
        await admin.delete_topic("u")
        pop = (await p.describe())["pop"]
        assert [(q["topic"], q["inflight"]) for q in pop["queues"]] == [("t", 1)]
        assert (await p.info())["pop_inflight"] == 1
        broker.handlers.pop.stand_down()  # the state is rebuilt from %POP% (which still holds u's CK record)
        await p.running()
        pop = (await p.describe())["pop"]
        assert [(q["topic"], q["inflight"]) for q in pop["queues"]] == [("t", 1)]


async def test_a_topic_deleted_and_created_again_before_a_checkpoint_starts_from_its_first_message(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """A deletion asks for a checkpoint at once: a rebuild must not replay the old
    topic's CK records into the new one (its old next offset and deliveries)."""
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    broker = await c.start_broker(**{**FAST_POP, "pop_checkpoint_interval_ms": 10**9})  # no timed checkpoint
    await c.create_topic("u", 1)
    async with open_admin(c.ns) as admin:
        p = Popper(admin, broker.addr)
        await p.running()
        await p.send("u", [b"old0", b"old1"])
        await p.pop_all(2, topic="u", invisible_time_ms=60_000)
        before = broker.handlers.pop.saved
        await admin.delete_topic("u")
        await await_until(lambda: _saved_since(broker, before), 10, "a checkpoint after the deletion")
        await c.create_topic("u", 1)
        await p.send("u", [b"new0", b"new1"])
        broker.handlers.pop.stand_down()  # rebuilt from the checkpoint and %POP%
        await p.running()
        got, _h = await p.pop_all(4, topic="u", invisible_time_ms=60_000)  # (the old CK replayed: 2 only)
        # as without the rebuild: the group starts the new topic over from its earliest entry (a deleted
        # topic's queues stay in the store, so the re-created one shows them too)
        assert sorted(bytes(r.body) for r in got) == [b"new0", b"new1", b"old0", b"old1"]


async def _saved_since(broker: Any, before: Any) -> bool:
    return broker.handlers.pop.saved is not before


async def test_dead_letters_noted_before_a_rebuild_are_judged_again_against_the_rebuilt_state(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """Deliveries noted as past their limit, then the state given up and rebuilt: a
    delivery of the rebuilt state that is within its limit (or not due) is not
    dead-lettered, and a group the rebuilt state does not hold is not made."""
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    broker = await c.start_broker(**FAST_POP)
    await c.create_topic("t", 1)
    async with open_admin(c.ns) as admin:
        p = Popper(admin, broker.addr)
        await p.running()
        await p.send("t", [b"m0"])
        _got, f = await p.pop(invisible_time_ms=60_000, max_wait_ms=5000)
        service = broker.handlers.pop
        service.dead += [("g", "t", 0, 0), ("ghost", "t", 0, 0)]  # stale: noted against an older state
        await service.dead_letter_due()
        assert "ghost" not in service.groups()
        assert (await p.describe())["pop"]["dead_lettered"] == 0
        assert await p.ack(f["handles"]) == ["ok"]


async def test_a_failed_pop_behind_a_later_one_records_its_offsets_given_back(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """Pop c1's CK write fails while pop c2's CK, which moved the next offset past c1's
    offsets, waits for the next append: c1's offsets are given back by a CK record of
    their own (attempt 0, visible at once), so ``%POP%`` replayed without any checkpoint
    still holds them (else a crash before the next checkpoint loses them for the group)."""
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    broker = await c.start_broker(**{**FAST_POP, "pop_checkpoint_interval_ms": 10**9})
    await c.create_topic("t", 1)
    async with open_admin(c.ns) as admin:
        p = Popper(admin, broker.addr)
        await p.running()
        await p.send("t", [b"m0", b"m1", b"m2", b"m3"])
        service = broker.handlers.pop
        real_put = service.batcher._append

        async def c1_fails(messages: list[Any], also: Any) -> Any:
            records = [decode_pop_record(m.tags, m.body) for m in messages]
            if any(isinstance(r, Checkpoint) and r.client_id == "c1" and r.attempts[0] > 0 for r in records):
                await await_until(lambda: bool(service.batcher._waiting), 10, "pop c2's CK waiting")
                raise OSError("injected: c1's CK write failed")
            return await real_put(messages, also)

        service.batcher._append = c1_fails
        got: dict[str, Any] = {}

        async def pop(client: str) -> None:
            try:
                got[client] = await p.pop(client_id=client, max_messages=2, invisible_time_ms=60_000)
            except RpcError as e:
                got[client] = e

        async with trio.open_nursery() as pops:
            pops.start_soon(pop, "c1")
            await await_until(lambda: service.batcher.appends == 1, 10, "pop c1's CK in flight")
            pops.start_soon(pop, "c2")
        assert isinstance(got["c1"], RpcError)
        assert [bytes(r.body) for r in got["c2"][0]] == [b"m2", b"m3"]
        store = service.store
        state, _end = await trio.to_thread.run_sync(replay, store, PopCheckpoint(0, store.log.min_offset))
        q = state.groups["g"].queues[("t", 0)]
        assert q.next_offset == 4
        assert sorted(q.flights) == [0, 1, 2, 3]
        assert [q.flights[o].attempt for o in (0, 1)] == [0, 0]  # given back: delivered next with attempt 1
        service.batcher._append = real_put
        again, _h = await p.pop_all(2, invisible_time_ms=60_000)
        assert sorted(bytes(r.body) for r in again) == [b"m0", b"m1"]


async def test_an_ack_or_change_over_the_handles_limit_is_refused_naming_it_and_settles_nothing(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    broker = await c.start_broker(**{**FAST_POP, "pop_max_handles_per_request": 2})
    await c.create_topic("t", 1)
    async with open_admin(c.ns) as admin:
        p = Popper(admin, broker.addr)
        await p.running()
        await p.send("t", [b"m0", b"m1", b"m2"])
        _got, handles = await p.pop_all(3, max_messages=3, invisible_time_ms=60_000)
        for call in (p.ack(handles), p.change(handles, 1000)):
            with pytest.raises(RpcError) as refused:
                await call
            assert refused.value.code == ErrorCode.MALFORMED_REQUEST
            assert "pop_max_handles_per_request" in str(refused.value)
        assert await p.ack(handles[:2]) == ["ok", "ok"]
        assert await p.ack(handles[2:]) == ["ok"]


async def test_share_acks_of_one_partition_report_what_was_applied_before_a_later_kind_failed(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """A partition's ACCEPTs applied, then its REJECT's write refused: the outcome says
    the accepted ones were applied (and are no longer held), not only the error."""
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    broker = await c.start_broker(**FAST_POP)
    await c.create_topic("t", 1)
    async with open_admin(c.ns) as admin:
        p = Popper(admin, broker.addr)
        await p.running()
        await p.send("t", [b"m0", b"m1"])
        await p.pop_all(2, client_id="m1", max_messages=2, invisible_time_ms=60_000)
        service = broker.handlers.pop
        real_append = service.batcher._append

        async def no_dead_letters(messages: list[Any], also: Any) -> Any:
            if any(m.topic.startswith("%DLQ%") for m in messages):
                raise RequestError(ErrorCode.IO_ERROR, "injected: the dead letter not stored")
            return await real_append(messages, also)

        service.batcher._append = no_dead_letters
        session = ShareSession("g", "m1")
        batches = [{"first_offset": 0, "last_offset": 1, "acknowledge_types": [1, 3]}]  # ACCEPT 0, REJECT 1
        outcome = await apply_acks(service, session, "t", 0, batches, (100, 30_000))
        service.batcher._append = real_append
        assert outcome.applied == 1 and outcome.code != 0
        assert outcome.message is not None and "1 applied" in outcome.message
        assert [q["inflight"] for q in (await p.describe())["pop"]["queues"]] == [1]  # offset 1 still held


async def test_a_failed_pop_wakes_the_group_s_long_polls(nursery: trio.Nursery, tmp_path: Path) -> None:
    """The offsets a failed pop gives back are there to take: a long poll of the group
    waiting meanwhile is woken (no arrival or redelivery would wake it)."""
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    broker = await c.start_broker(**FAST_POP)
    await c.create_topic("t", 1)
    async with open_admin(c.ns) as admin:
        p = Popper(admin, broker.addr)
        await p.running()
        await p.send("t", [b"m0"])
        service = broker.handlers.pop
        real_append = service.batcher._append

        async def fails(messages: list[Any], also: Any) -> Any:
            raise OSError("injected: the CK write failed")

        waiting = service.watch(_ask())  # (as a long poll of group g on t/0 waits)
        service.batcher._append = fails
        with pytest.raises(RpcError):
            await p.pop(invisible_time_ms=60_000)
        service.batcher._append = real_append
        assert waiting.is_set()
        service.unwatch(_ask(), waiting)
        got, _h = await p.pop_all(1, invisible_time_ms=60_000)
        assert [bytes(r.body) for r in got] == [b"m0"]


async def test_an_idle_group_is_forgotten_after_its_settled_offsets_are_committed(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    broker = await c.start_broker(**{**FAST_POP, "pop_group_idle_forget_ms": 1500})
    await c.create_topic("t", 1)
    async with open_admin(c.ns) as admin:
        p = Popper(admin, broker.addr)
        await p.running()
        await p.send("t", [b"m0", b"m1", b"m2"])
        _records, handles = await p.pop_all(3, max_messages=3, invisible_time_ms=60_000)

        async def committed() -> list[tuple[int, bool]]:
            d = await p.describe()
            return [(q["committed"], "pop" in d) for q in d["queues"]] or [(-1, "pop" in d)]

        assert await p.ack(handles) == ["ok"] * 3
        assert await committed() == [(-1, True)]  # a POP group's offsets stay its own while it pops
        await await_until(lambda: _is(committed, [(3, False)]), 10, "the idle group forgotten, its offsets committed")
        await await_until(lambda: "g" not in broker.handlers.pop.saved.state, 10, "a checkpoint without it")
        await p.send("t", [b"m3"])
        again, _h = await p.pop_all(1, invisible_time_ms=60_000)
        assert [bytes(r.body) for r in again] == [b"m3"]  # it goes on from the committed offset


async def _is(get: Any, want: Any) -> bool:
    return bool(await get() == want)


async def test_writes_stored_but_not_fsynced_in_time_change_the_state_as_the_log_says(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """sync_flush_timeout_ms=1 on a real disk: some %POP% appends are stored but not
    known fsynced in time (FLUSH_DISK_TIMEOUT). A pop answered so keeps its message in
    flight (its CK is in the log), an ack answered so has settled it (a repeat is
    "gone"); the state rebuilt from the log is the same."""
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    broker = await c.start_broker(**{**FAST_POP, "flush_mode": "sync", "sync_flush_timeout_ms": 1})
    await c.create_topic("t", 1)
    async with open_admin(c.ns) as admin:
        p = Popper(admin, broker.addr)
        await p.running()
        inflight, seen = 0, {"pop": 0, "ack": 0}
        with trio.fail_after(60):
            while min(seen.values()) < 2:
                await _unconfirmed_ok(p.send("t", [b"m"]))
                got = await _unconfirmed_ok(p.pop(invisible_time_ms=600_000, max_wait_ms=5000))
                if got is None:
                    seen["pop"], inflight = seen["pop"] + 1, inflight + 1  # its CK is in the log
                elif await _unconfirmed_ok(p.ack(got[1]["handles"])) is None:
                    seen["ack"] += 1
                    assert await p.ack(got[1]["handles"]) == ["gone"]  # its ACK is in the log
                assert (await p.describe())["pop"]["queues"][0]["inflight"] == inflight
        broker.handlers.pop.stand_down()  # rebuilt from the checkpoint and %POP%
        await p.running()
        assert (await p.describe())["pop"]["queues"][0]["inflight"] == inflight


async def _unconfirmed_ok(call: Any) -> Any:
    """``await call``; None if it was answered FLUSH_DISK_TIMEOUT (stored, not known fsynced)."""
    try:
        return await call
    except RpcError as e:
        if e.code != ErrorCode.FLUSH_DISK_TIMEOUT:
            raise
        return None


async def test_a_write_for_a_state_given_up_meanwhile_is_refused(nursery: trio.Nursery, tmp_path: Path) -> None:
    """A request that judged against a state the service gave up (an error, a
    stand-down) must not append after the rebuild began: the rebuild would miss it."""
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    broker = await c.start_broker(**FAST_POP)
    await c.create_topic("t", 1)
    async with open_admin(c.ns) as admin:
        p = Popper(admin, broker.addr)
        await p.running()
        await p.send("t", [b"m0"])
        _got, f = await p.pop(invisible_time_ms=60_000, max_wait_ms=5000)
        service = broker.handlers.pop
        judged = service.judge("g", f["handles"], service.now())
        assert judged.results == ["ok"]
        service.stand_down()
        await p.running()  # rebuilt from %POP%
        with pytest.raises(RequestError) as refused:
            await service.settle("g", judged)
        assert refused.value.code == ErrorCode.SYSTEM_BUSY
        assert await p.ack(f["handles"]) == ["ok"]  # the rebuilt state still has it in flight


async def test_an_orderly_queue_redelivers_its_earlier_offset_first_whatever_the_deadlines(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    broker = await c.start_broker(**FAST_POP)
    await c.create_topic("t", 1)
    async with open_admin(c.ns) as admin:
        p = Popper(admin, broker.addr)
        await p.running()
        await p.send("t", [b"m0", b"m1"])
        got, f = await p.pop(orderly=True, max_messages=2, invisible_time_ms=60_000, max_wait_ms=5000)
        assert [bytes(r.body) for r in got] == [b"m0", b"m1"]
        h0, h1 = f["handles"]
        assert [s for s, _h in await p.change([h1], 0)] == ["ok"]  # m1 visible first ...
        assert [s for s, _h in await p.change([h0], 50)] == ["ok"]  # ... m0 a little later
        with trio.fail_after(10):
            again, f2 = await p.pop(orderly=True, max_messages=1, invisible_time_ms=60_000, max_wait_ms=5000)
        assert [bytes(r.body) for r in again] == [b"m0"] and f2["attempts"] == [2]


async def test_one_change_over_two_members_deliveries_keeps_each_owner_across_a_rebuild(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    broker = await c.start_broker(**{**FAST_POP, "pop_checkpoint_interval_ms": 10**9})  # a rebuild replays it all
    await c.create_topic("t", 1)
    async with open_admin(c.ns) as admin:
        p = Popper(admin, broker.addr)
        await p.running()
        await p.send("t", [b"m0", b"m1"])
        _a, fa = await p.pop(client_id="a", max_messages=1, invisible_time_ms=60_000, max_wait_ms=5000)
        _b, fb = await p.pop(client_id="b", max_messages=1, invisible_time_ms=60_000, max_wait_ms=5000)
        changed = await p.change([fa["handles"][0], fb["handles"][0]], 120_000)
        assert [s for s, _h in changed] == ["ok", "ok"]
        service = broker.handlers.pop
        service.stand_down()
        await p.running()  # rebuilt from %POP% alone
        assert [service.owner_of("g", h) for _s, h in changed] == ["a", "b"]

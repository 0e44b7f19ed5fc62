"""POP consumption on a real broker, driven by raw requests (POP_MESSAGE, ACK_MESSAGE,
CHANGE_INVISIBLE_TIME): delivery, acknowledgement, redelivery after the invisible
time, dead letters, expired and repeated acknowledgements, changes of the invisible
time, groups and members, long polling, fairness across queues, orderly POP, the
in-flight limit, DESCRIBE_GROUP, BROKER_INFO and the metrics."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.exposition import generate_latest

from clmq.broker.service import Broker
from clmq.broker.service.pop._state import PopCheckpoint, replay
from clmq.client import Record, open_admin
from clmq.common import PROP_DLQ_GROUP, PROP_ORIGIN_TOPIC, dlq_topic
from clmq.protocol import ErrorCode, Frame, RequestCode, check_request
from clmq.protocol.transport import RpcError
from tests.pop_helpers import FAST_POP, Popper, bodies, pulled
from tests.service_helpers import Cluster
from tests.test_replication import caught_up, start_group
from tests.waiting import await_until


async def _cluster(nursery: trio.Nursery, root: Path, queues: int = 2, **settings: Any) -> tuple[Cluster, Broker]:
    c = Cluster(nursery, root)
    await c.start_nameserver()
    broker = await c.start_broker(**{**FAST_POP, **settings})
    await c.create_topic("t", queues)
    return c, broker


async def test_pop_ack_and_a_settled_message_never_comes_again(nursery: trio.Nursery, tmp_path: Path) -> None:
    c, broker = await _cluster(nursery, tmp_path)
    async with open_admin(c.ns) as admin:
        p = Popper(admin, broker.addr)
        await p.running()
        await p.send("t", [b"a0", b"a1", b"a2"], queue_id=0)
        await p.send("t", [b"b0"], queue_id=1)
        records, handles = await p.pop_all(4, invisible_time_ms=300, max_messages=10)
        assert sorted(bodies(records)) == [b"a0", b"a1", b"a2", b"b0"]
        assert [r.reconsume_times for r in records] == [0, 0, 0, 0]
        done = [h for r, h in zip(records, handles) if r.body != b"a1"]
        assert await p.ack(done) == ["ok", "ok", "ok"]
        again, f = await p.pop_all(1, invisible_time_ms=5000)
        assert bodies(again) == [b"a1"] and f and again[0].queue_offset == 1
        assert (await p.ack(f)) == ["ok"]
        got, _fields = await p.pop(max_wait_ms=600)
        assert got == []
        assert await p.ack(done[:1]) == ["gone"]


async def test_unacked_comes_back_with_its_attempt_then_goes_to_the_dead_letters(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    c, broker = await _cluster(nursery, tmp_path, queues=1)
    async with open_admin(c.ns) as admin:
        p = Popper(admin, broker.addr)
        await p.running()
        await p.send("t", [b"bad"], tags="x")
        seen = []
        for attempt in (1, 2, 3):  # max_reconsume_times=2: three deliveries
            with trio.fail_after(5):
                got, f = await p.pop(invisible_time_ms=150, max_reconsume_times=2, max_wait_ms=3000)
            assert bodies(got) == [b"bad"] and f["attempts"] == [attempt]
            seen.append(f["deadline_ms"])
        # Not acknowledged a third time: copied to %DLQ%g (as CONSUMER_SEND_BACK's), settled.
        dead = await await_until(lambda: _dlq(p), 10, "the dead letter")
        assert len(dead) == 1 and dead[0].body == b"bad" and dead[0].tags == "x"
        assert dead[0].properties[PROP_DLQ_GROUP] == "g" and dead[0].properties[PROP_ORIGIN_TOPIC] == "t"
        assert dead[0].reconsume_times == 3
        got, _f = await p.pop(max_wait_ms=400)
        assert got == []
        pop = (await p.describe())["pop"]
        assert pop["dead_lettered"] == 1 and pop["redelivered"] == 2 and pop["popped"] == 3
        assert pop["queues"][0]["inflight"] == 0 and pop["queues"][0]["settled_offset"] == 1


async def _dlq(p: Popper) -> list[Record]:
    try:
        return await pulled(p, dlq_topic("g"))
    except RpcError:
        return []


async def test_acks_after_the_deadline_or_a_redelivery_are_expired_twice_gone_garbage_invalid(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    c, broker = await _cluster(nursery, tmp_path, queues=1)
    async with open_admin(c.ns) as admin:
        p = Popper(admin, broker.addr)
        await p.running()
        await p.send("t", [b"m0", b"m1"])
        _got, first = await p.pop(invisible_time_ms=100, max_messages=1)
        await await_until(lambda: _redelivering(p, 1), 5, "the deadline to pass")
        assert await p.ack(first["handles"]) == ["expired"]  # past its invisible time
        again, second = await p.pop(invisible_time_ms=100, max_messages=1)
        assert bodies(again) == [b"m0"] and second["attempts"] == [2]
        assert await p.ack(first["handles"]) == ["expired"]  # delivered again since
        await await_until(lambda: _redelivering(p, 1), 5, "the second deadline to pass")
        _got, third = await p.pop(invisible_time_ms=60_000, max_messages=5)
        h = third["handles"]
        assert len(h) == 2  # m0 (its deadline passed again) and m1
        garbage = ["nonsense", "P1" + "A" * 10, h[0][:-3]]
        assert await p.ack([h[0], h[0], *garbage]) == ["ok", "gone", "invalid", "invalid", "invalid"]
        assert await p.ack([h[0]]) == ["gone"]
        assert await p.ack([h[1]], group="other") == ["gone"]
        pop = (await p.describe())["pop"]
        assert pop["ack_expired"] == 2 and pop["acked"] == 1
        page = generate_latest(broker.metrics).decode()
        assert 'clmq_pop_ack_expired_total{group="g"} 2.0' in page
        assert 'clmq_pop_acked_total{group="g"} 1.0' in page and 'clmq_pop_inflight{group="g"} 1.0' in page
        info = await p.info()
        assert info["pop_ack_expired"] == 2 and info["pop_inflight"] == 1 and info["pop_groups"] == 1


async def _redelivering(p: Popper, n: int) -> bool:
    return sum(q["redelivering"] for q in (await p.describe())["pop"]["queues"]) == n


@settings(max_examples=25, deadline=None)
@given(
    field=st.sampled_from(["group", "client_id", "topic", "invisible_time_ms", "max_messages", "tags", "queue_ids"]),
    value=st.one_of(st.none(), st.booleans(), st.floats(allow_nan=False), st.text(max_size=3), st.lists(st.none())),
)
def test_a_pop_field_of_a_wrong_type_is_malformed(field: str, value: Any) -> None:
    good: dict[str, Any] = {"group": "g", "client_id": "c", "topic": "t", "invisible_time_ms": 1000}
    good["max_messages"], good["tags"], good["queue_ids"] = 1, ["a"], [0]
    expected = {"group": str, "client_id": str, "topic": str, "tags": list, "queue_ids": list}.get(field, int)
    if type(value) is expected and (expected is not list or not value):
        return  # a right type (an empty list is a good list)
    if value is None and field in ("max_messages", "tags", "queue_ids"):
        return  # an optional field given as nil: absent
    problem = check_request(Frame(RequestCode.POP_MESSAGE, 1, {**good, field: value}))
    assert problem is not None and problem[0] == ErrorCode.MALFORMED_REQUEST and field in problem[1]
    if not (type(value) is list and not value):  # handles: a list of strings
        problem = check_request(Frame(RequestCode.ACK_MESSAGE, 1, {"group": "g", "handles": value}))
        assert problem is not None and problem[0] == ErrorCode.MALFORMED_REQUEST
    if type(value) is not int:
        fields = {"group": "g", "handles": ["h"], "invisible_time_ms": value}
        problem = check_request(Frame(RequestCode.CHANGE_INVISIBLE_TIME, 1, fields))
        assert problem is not None and problem[0] == ErrorCode.MALFORMED_REQUEST


async def test_malformed_and_refused_pops_answer_errors(nursery: trio.Nursery, tmp_path: Path) -> None:
    c, broker = await _cluster(nursery, tmp_path, queues=1, pop_invisible_time_max_ms=10_000)
    async with open_admin(c.ns) as admin:
        p = Popper(admin, broker.addr)
        await p.running()
        for more, code in (
            ({"invisible_time_ms": "1"}, ErrorCode.MALFORMED_REQUEST),
            ({"invisible_time_ms": 20_000}, ErrorCode.MALFORMED_REQUEST),
            ({"topic": "nope"}, ErrorCode.TOPIC_NOT_FOUND),
            ({"queue_ids": [3]}, ErrorCode.INVALID_QUEUE_ID),
            ({"group": "%DLQ%g"}, ErrorCode.MALFORMED_REQUEST),
        ):
            with pytest.raises(RpcError) as e:
                await p.pop(**more)
            assert e.value.code == code, (more, e.value)
        with pytest.raises(RpcError) as e:
            await p.change(["x"], 20_000)
        assert e.value.code == ErrorCode.MALFORMED_REQUEST


async def test_change_invisible_time_extends_and_zero_is_a_nack(nursery: trio.Nursery, tmp_path: Path) -> None:
    c, broker = await _cluster(nursery, tmp_path, queues=1)
    async with open_admin(c.ns) as admin:
        p = Popper(admin, broker.addr)
        await p.running()
        await p.send("t", [b"slow", b"nack"])
        got, f = await p.pop(invisible_time_ms=150, max_messages=2)
        assert bodies(got) == [b"slow", b"nack"]
        slow, _nack = f["handles"]
        [[status, longer]] = await p.change([slow], 60_000)
        assert status == "ok" and longer != slow
        # Long past the first deadline: the extended message stays with its member.
        again, _f = await p.pop(invisible_time_ms=150, max_wait_ms=700)
        assert bodies(again) == [b"nack"]  # the other one came back; not "slow"
        [[status, _new]] = await p.change([_f["handles"][0]], 0)  # a nack: visible at once
        assert status == "ok"
        back, f3 = await p.pop(invisible_time_ms=60_000)
        assert bodies(back) == [b"nack"] and f3["attempts"] == [3]
        assert await p.ack([slow]) == ["expired"]  # the old handle of a changed delivery
        assert await p.ack([longer, *f3["handles"]]) == ["ok", "ok"]
        assert await p.change([longer], 10) == [["gone", ""]]
        assert (await p.describe())["pop"]["queues"][0]["inflight"] == 0


async def test_groups_are_independent_and_members_share_the_work(nursery: trio.Nursery, tmp_path: Path) -> None:
    c, broker = await _cluster(nursery, tmp_path, queues=2)
    async with open_admin(c.ns) as admin:
        p = Popper(admin, broker.addr)
        await p.running()
        for q in (0, 1):
            await p.send("t", [b"%d-%03d" % (q, i) for i in range(60)], queue_id=q)
        everything = sorted(b"%d-%03d" % (q, i) for q in (0, 1) for i in range(60))
        by_member: dict[str, list[bytes]] = {}

        async def member(name: str) -> None:
            while True:
                got, _f = await p.pop(group="work", client_id=name, invisible_time_ms=60_000, max_messages=7)
                if not got:
                    return
                by_member.setdefault(name, []).extend(bodies(got))
                await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as n:
            for i in range(8):
                n.start_soon(member, f"m{i}")
        taken = [b for bs in by_member.values() for b in bs]
        assert sorted(taken) == everything  # each offset handed to one member only
        assert len(by_member) > 1
        other, _h = await p.pop_all(120, group="other", max_messages=200, invisible_time_ms=60_000)
        assert sorted(bodies(other)) == everything  # another group gets everything again
        members = (await p.describe("work"))["pop"]["members"]
        assert members == [f"m{i}" for i in range(8)]  # every member popped (some got nothing)


async def test_long_poll_wakes_on_a_new_message_and_on_a_redelivery(nursery: trio.Nursery, tmp_path: Path) -> None:
    c, broker = await _cluster(nursery, tmp_path, queues=2)
    async with open_admin(c.ns) as admin:
        p = Popper(admin, broker.addr)
        await p.running()
        got, _f = await p.pop(max_wait_ms=300)
        assert got == []  # the wait ended with nothing
        results: list[list[Record]] = []

        async def waiting_pop() -> None:
            results.append((await p.pop(max_wait_ms=20_000, invisible_time_ms=200))[0])

        with trio.fail_after(10):  # far less than the wait: woken by the arrival
            async with trio.open_nursery() as n:
                n.start_soon(waiting_pop)
                await await_until(lambda: broker.handlers.pop.waiters.get("g"), 5, "the pop to wait")
                await p.send("t", [b"new"], queue_id=1)
        assert bodies(results[0]) == [b"new"]
        with trio.fail_after(10):  # woken by the redelivery (its deadline passed, 200 ms)
            got, f = await p.pop(max_wait_ms=20_000)
        assert bodies(got) == [b"new"] and f["attempts"] == [2]


async def test_a_backlog_in_one_queue_does_not_starve_the_other(nursery: trio.Nursery, tmp_path: Path) -> None:
    c, broker = await _cluster(nursery, tmp_path, queues=3)
    async with open_admin(c.ns) as admin:
        p = Popper(admin, broker.addr)
        await p.running()
        await p.send("t", [b"hot-%03d" % i for i in range(300)], queue_id=0)
        await p.send("t", [b"cold-0", b"cold-1"], queue_id=2)
        got, _f = await p.pop(max_messages=10, invisible_time_ms=60_000)
        assert len(got) == 10 and {b"cold-0", b"cold-1"} <= set(bodies(got))
        for _ in range(3):  # a trickle: each new message is delivered within a pop or two
            await p.send("t", [b"trickle"], queue_id=1)
            got, _f = await p.pop(max_messages=4, invisible_time_ms=60_000)
            assert b"trickle" in bodies(got) and len(got) == 4


async def test_orderly_pop_gives_a_queue_s_next_message_only_once_settled(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    c, broker = await _cluster(nursery, tmp_path, queues=1)
    async with open_admin(c.ns) as admin:
        p = Popper(admin, broker.addr)
        await p.running()
        await p.send("t", [b"o0", b"o1", b"o2"])
        first, _f0 = await p.pop(orderly=True, max_messages=1, invisible_time_ms=200)
        assert bodies(first) == [b"o0"]
        nothing, _f = await p.pop(orderly=True, client_id="c2")
        assert nothing == []  # o0 in flight: nothing more from its queue
        # o0 not acknowledged: it comes back first, in order (with o1, o2 after it).
        back, f2 = await p.pop(orderly=True, client_id="c2", max_wait_ms=5000, invisible_time_ms=60_000)
        assert bodies(back) == [b"o0", b"o1", b"o2"] and f2["attempts"] == [2, 1, 1]
        assert await p.ack(f2["handles"][:1]) == ["ok"]
        nothing, _f = await p.pop(orderly=True)
        assert nothing == []  # o1, o2 still in flight


async def test_the_inflight_limit_per_queue_and_the_tag_filter(nursery: trio.Nursery, tmp_path: Path) -> None:
    c, broker = await _cluster(nursery, tmp_path, queues=1, pop_max_inflight_per_queue=3)
    async with open_admin(c.ns) as admin:
        p = Popper(admin, broker.addr)
        await p.running()
        await p.send("t", [b"x%d" % i for i in range(6)], tags="x")
        await p.send("t", [b"y0"], tags="y")
        got, f = await p.pop(max_messages=10, invisible_time_ms=60_000)
        assert bodies(got) == [b"x0", b"x1", b"x2"]  # the limit: 3 in flight
        assert (await p.pop(max_messages=10))[0] == []
        assert await p.ack(f["handles"][1:]) == ["ok", "ok"]
        assert (await p.pop(max_messages=10))[0] == []  # x0, the oldest, holds the window
        assert await p.ack(f["handles"][:1]) == ["ok"]
        got, _f = await p.pop(max_messages=10, invisible_time_ms=60_000)
        assert bodies(got) == [b"x3", b"x4", b"x5"]
        only_y, _f = await p.pop(group="gy", max_messages=10, tags=["y"])
        assert bodies(only_y) == [b"y0"]
        q = (await p.describe("gy"))["pop"]["queues"][0]
        assert (q["next_offset"], q["settled_offset"], q["inflight"], q["lag"]) == (7, 6, 1, 1)


async def test_partition_per_file_mode_refuses_pop(nursery: trio.Nursery, tmp_path: Path) -> None:
    c, broker = await _cluster(nursery, tmp_path, queues=1, storage_mode="partition-per-file")
    async with open_admin(c.ns) as admin:
        p = Popper(admin, broker.addr)
        for call in (p.pop(), p.ack(["x"]), p.change(["x"], 0)):
            with pytest.raises(RpcError) as e:
                await call
            assert e.value.code == ErrorCode.REQUEST_NOT_SUPPORTED


async def test_a_promoted_follower_answers_the_old_leader_s_handles(nursery: trio.Nursery, tmp_path: Path) -> None:
    """The follower copies its leader's checkpoint and log; promoted, it rebuilds the
    state: acknowledged messages stay settled, an in-flight handle the old leader gave
    out acknowledges there, an unacknowledged message comes back after its deadline."""
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    lead, (f,) = await start_group(c, 1, common=FAST_POP)
    await c.create_topic("t", 2)
    async with open_admin(None, broker_addrs=[lead.addr]) as admin:
        p = Popper(admin, lead.addr)
        await p.running()
        await p.send("t", [b"a", b"b", b"c", b"d"], queue_id=0)
        await p.send("t", [b"e", b"f"], queue_id=1)
        handles: dict[bytes, str] = {}
        with trio.fail_after(10):
            while len(handles) < 3:
                got, fields = await p.pop(max_messages=3 - len(handles), invisible_time_ms=1500, max_wait_ms=1000)
                handles.update(zip(bodies(got), fields["handles"]))
        first = sorted(handles)
        assert await p.ack([handles[first[0]]]) == ["ok"]
        await await_until(
            lambda: f.handlers.pop.saved.applied_to > 0, 10, "the follower adopting the leader's checkpoint"
        )
        assert await p.ack([handles[first[1]]]) == ["ok"]  # after the checkpoint: replayed from %POP%
    await caught_up(lead, [f])
    await c.stop_broker("g0")
    async with open_admin(None, broker_addrs=[f.addr]) as admin:
        promoted = await admin.rpc.request(f.addr, RequestCode.PROMOTE, {"force": True})
        assert promoted.fields["role"] == "leader"
        p = Popper(admin, f.addr)
        await p.running()
        assert await p.ack([handles[first[0]], handles[first[1]]]) == ["gone", "gone"]
        rest, _h = await p.pop_all(3, max_messages=10, invisible_time_ms=60_000)
        assert sorted(bodies(rest)) == sorted({b"a", b"b", b"c", b"d", b"e", b"f"} - set(first))
        back, f2 = await p.pop(max_wait_ms=10_000, invisible_time_ms=60_000)
        assert bodies(back) == [first[2]] and f2["attempts"] == [2]  # its deadline passed
        assert await p.ack([handles[first[2]]]) == ["expired"]


@pytest.mark.parametrize("checkpoint_ms", [50, 10**9], ids=["checkpointed", "not-checkpointed"])
async def test_retention_keeps_the_pop_records_a_start_would_replay(
    nursery: trio.Nursery, tmp_path: Path, checkpoint_ms: int
) -> None:
    """Records after the checkpoint stay (a start replays them); once a checkpoint covers
    them, retention goes on as if POP were never used; after a restart the acks hold."""
    settings = {"segment_bytes": 64 * 1024, "max_message_bytes": 8 * 1024, "pop_checkpoint_interval_ms": checkpoint_ms}
    c, broker = await _cluster(nursery, tmp_path, queues=1, **settings)
    async with open_admin(c.ns) as admin:
        p = Popper(admin, broker.addr)
        await p.running()
        await p.send("t", [b"a", b"b"])
        _got, f = await p.pop(max_messages=1, invisible_time_ms=60_000)
        assert await p.ack(f["handles"]) == ["ok"]
        first_pop_record = broker.store.log.min_offset
        pop = broker.handlers.pop
        if checkpoint_ms < 10**6:
            await await_until(lambda: pop.saved.applied_to == pop.pop_end() == 2, 10, "a checkpoint of both records")
        for _ in range(8):  # segments after the records
            await p.send("t", [b"x" * 7000] * 10)
        await trio.to_thread.run_sync(broker.store.apply_retention, time.time() + 10**6)
        if checkpoint_ms < 10**6:
            assert broker.store.log.min_offset > first_pop_record  # nothing held back
        else:
            assert broker.store.log.min_offset <= pop.saved.log_from  # the records a start replays
        await c.stop_broker("broker-a")
    broker = await c.start_broker(**{**FAST_POP, **settings})
    async with open_admin(c.ns) as admin:
        p = Popper(admin, broker.addr)
        await p.running()
        assert await p.ack(f["handles"]) == ["gone"]


async def test_the_python_api_rejects_to_the_dead_letters_and_names_owners(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """What the Kafka listener's share groups use: reject (dead letter now),
    delivery_of (acks by offset), owner_of, groups."""
    c, broker = await _cluster(nursery, tmp_path, queues=1)
    service = broker.handlers.pop
    async with open_admin(c.ns) as admin:
        p = Popper(admin, broker.addr)
        await p.running()
        await p.send("t", [b"r0", b"r1"])
        got = await service.pop("g", "member-1", "t", max_messages=2, invisible_time_ms=60_000)
        assert [(d.queue_offset, d.attempt) for d in got] == [(0, 1), (1, 1)]
        assert got[0].size > 0 and got[0].commitlog_offset >= 0
        assert service.owner_of("g", got[0].handle) == "member-1" and service.owner_of("g", "junk") is None
        found = service.delivery_of("g", "t", 0, 1)
        assert found is not None and found.handle == got[1].handle
        assert service.delivery_of("g", "t", 0, 5) is None and service.groups() == ["g"]
        assert await service.reject("g", [got[0].handle, "junk"]) == ["ok", "invalid"]
        dead = await await_until(lambda: _dlq(p), 10, "the dead letter")
        assert bodies(dead) == [b"r0"] and dead[0].reconsume_times == 1
        assert await service.ack("g", [got[0].handle, got[1].handle]) == ["gone", "ok"]
        assert (await p.describe())["pop"]["dead_lettered"] == 1


async def test_concurrent_orderly_members_never_hold_one_queue_together(nursery: trio.Nursery, tmp_path: Path) -> None:
    c, broker = await _cluster(nursery, tmp_path, queues=2)
    async with open_admin(c.ns) as admin:
        p = Popper(admin, broker.addr)
        await p.running()
        for q in (0, 1):
            await p.send("t", [b"%d-%02d" % (q, i) for i in range(40)], queue_id=q)
        holders: dict[int, str] = {}
        order: dict[int, list[bytes]] = {0: [], 1: []}

        async def member(name: str) -> None:
            while True:
                got, f = await p.pop(
                    client_id=name, orderly=True, max_messages=3, invisible_time_ms=60_000, max_wait_ms=200
                )
                if not got:  # woken by an acknowledgement of a queue's holder, or the wait ended
                    if sum(map(len, order.values())) == 80:
                        return
                    continue
                for qid in {r.queue_id for r in got}:
                    assert holders.get(qid) is None, f"{name} got queue {qid} while {holders[qid]} holds it"
                    holders[qid] = name
                for r in got:
                    order[r.queue_id].append(bytes(r.body))
                await trio.sleep(0.002)  # the handling: other members pop meanwhile
                for qid in {r.queue_id for r in got}:
                    holders[qid] = None  # type: ignore[assignment]
                assert await p.ack(f["handles"]) == ["ok"] * len(got)

        with trio.fail_after(30):
            async with trio.open_nursery() as n:
                for i in range(6):
                    n.start_soon(member, f"m{i}")
        assert order == {q: [b"%d-%02d" % (q, i) for i in range(40)] for q in (0, 1)}  # each queue in order


async def test_a_pop_answer_past_the_inline_size_goes_as_file_spans(nursery: trio.Nursery, tmp_path: Path) -> None:
    c, broker = await _cluster(nursery, tmp_path, queues=1)
    async with open_admin(c.ns) as admin:
        p = Popper(admin, broker.addr)
        await p.running()
        big = [bytes([65 + i]) * 250_000 for i in range(5)]  # 1.25 MB together: past INLINE_MAX_BYTES
        for body in big:
            await p.send("t", [body])
        got, f = await p.pop(max_messages=5, invisible_time_ms=60_000)
        assert bodies(got) == big and len(f["handles"]) == 5
        assert await p.ack(f["handles"]) == ["ok"] * 5


async def test_a_checkpoint_that_cannot_be_saved_is_reported_and_pop_goes_on(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    (tmp_path / "broker-a").mkdir()
    (tmp_path / "broker-a" / "pop").write_text("a file where the checkpoint's directory goes")
    c, broker = await _cluster(nursery, tmp_path, queues=1)
    async with open_admin(c.ns) as admin:
        p = Popper(admin, broker.addr)
        await p.running()
        await p.send("t", [b"a", b"b"])
        _got, f = await p.pop(max_messages=1, invisible_time_ms=60_000)
        assert await p.ack(f["handles"]) == ["ok"]
        failure = await await_until(lambda: _pop_failure(p), 10, "the checkpoint failure reported")
        assert "checkpoint not saved" in failure
        assert "clmq_pop_failing 1.0" in generate_latest(broker.metrics).decode()
        got, f = await p.pop(max_messages=5, invisible_time_ms=60_000)  # the state runs on
        assert bodies(got) == [b"b"] and await p.ack(f["handles"]) == ["ok"]
        (tmp_path / "broker-a" / "pop").unlink()  # fixed: the next save clears the report
        await await_until(lambda: _no_pop_failure(p), 10, "the checkpoint saved")


async def _pop_failure(p: Popper) -> str:
    failure: str = (await p.info())["pop_failure"]
    return failure


async def _no_pop_failure(p: Popper) -> bool:
    return not await _pop_failure(p)


async def test_concurrent_pops_and_acks_share_appends_and_the_log_says_the_same(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """Requests that arrive while an append of POP records is in flight go together in
    the next one (group commit); each pop's handles carry its own CK record, each ack
    is answered ok once stored, and a replay of ``%POP%`` gives the state in memory."""
    c, broker = await _cluster(nursery, tmp_path, queues=4)
    async with open_admin(c.ns) as admin:
        p = Popper(admin, broker.addr)
        await p.running()
        for q in range(4):
            await p.send("t", [b"%d-%02d" % (q, i) for i in range(30)], queue_id=q)
        service = broker.handlers.pop
        handles: list[str] = []
        acked: list[str] = []

        async def member(name: str) -> None:
            while True:
                got, f = await p.pop(client_id=name, invisible_time_ms=60_000, max_messages=3)
                if not got:
                    return
                handles.extend(f["handles"])
                acked.extend(await p.ack(f["handles"]))

        before = (service.batcher.appends, service.batcher.requests)
        async with trio.open_nursery() as n:
            for i in range(16):
                n.start_soon(member, f"m{i}")
        assert len(handles) == 120 and len(set(handles)) == 120 and acked == ["ok"] * 120
        appends, requests = service.batcher.appends - before[0], service.batcher.requests - before[1]
        assert appends < requests  # some requests shared an append
        info = await p.info()
        assert info["pop_record_appends"] == service.batcher.appends < info["pop_record_requests"]
        assert await p.ack(handles[:5]) == ["gone"] * 5
        store = broker.ctx.store
        state, _end = replay(store, PopCheckpoint())
        assert state.groups["g"].inflight() == 0 == service.state.groups["g"].inflight()
        assert {k: q.next_offset for k, q in state.groups["g"].queues.items()} == {("t", q): 30 for q in range(4)}

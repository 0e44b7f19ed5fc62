"""POP consumption on a real broker, driven by raw requests (POP_MESSAGE, ACK_MESSAGE,
CHANGE_INVISIBLE_TIME): delivery, acknowledgement, redelivery after the invisible
time, dead letters, expired and repeated acknowledgements, changes of the invisible
time, groups and members, long polling, fairness across queues, orderly POP, the
in-flight limit, DESCRIBE_GROUP, BROKER_INFO and the metrics."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.exposition import generate_latest

from clmq.broker.service import Broker
from clmq.client import Record, open_admin
from clmq.common import PROP_DLQ_GROUP, PROP_ORIGIN_TOPIC, dlq_topic
from clmq.protocol import ErrorCode, Frame, RequestCode, check_request
from clmq.protocol.transport import RpcError
from tests.pop_helpers import FAST_POP, Popper, bodies, pulled
from tests.service_helpers import Cluster
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

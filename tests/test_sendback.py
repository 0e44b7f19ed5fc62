"""CONSUMER_SEND_BACK on a real broker: retries through the timer with the group's
back-off, the attempt count carried along, dead letters after max_reconsume_times."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import trio

from clmq.client import Record, open_admin, open_producer
from clmq.common import (
    PROP_DELIVER_AT,
    PROP_DLQ_BODY_OF,
    PROP_DLQ_GROUP,
    PROP_ORIGIN_MSG_ID,
    PROP_ORIGIN_TOPIC,
    dlq_topic,
    retry_topic,
)
from clmq.protocol import ErrorCode, RequestCode, decode_records
from clmq.protocol.transport import RpcError
from tests.service_helpers import Cluster
from tests.waiting import await_until

SETTINGS = {"timer_tick_ms": 20, "retry_delays_ms": [200, 400], "max_reconsume_times": 2}


async def _start(nursery: trio.Nursery, root: Path) -> tuple[Cluster, str]:
    c = Cluster(nursery, root)
    await c.start_nameserver()
    broker = await c.start_broker(**SETTINGS)
    await c.create_topic("t", 1)
    return c, broker.addr


async def _request(addr: str, code: int, fields: dict[str, Any]) -> Any:
    async with open_admin(None, broker_addrs=[addr]) as admin:
        return await admin.rpc.request(addr, code, fields)


async def _records(addr: str, topic: str, n: int) -> list[Record]:
    """The first ``n`` records of ``topic`` queue 0, waiting for them."""

    async def pulled() -> list[Record] | None:
        try:
            reply = await _request(
                addr,
                RequestCode.PULL_MESSAGE,
                {"topic": topic, "queue_id": 0, "offset": 0, "max_messages": 100, "max_wait_ms": 0},
            )
        except RpcError:
            return None  # the topic does not exist yet
        records = decode_records(reply.body)
        return records if len(records) >= n else None

    found: list[Record] = await await_until(pulled, 10, f"{n} records in {topic}")
    return found


async def _send_back(addr: str, record: Record, delay_ms: int = -1, **more: Any) -> list[Any]:
    reply = await _request(
        addr, RequestCode.CONSUMER_SEND_BACK, {"group": "g", "messages": [[record.commitlog_offset, delay_ms]], **more}
    )
    results: list[Any] = reply.fields["results"]
    return results


async def test_retries_back_off_then_the_message_goes_to_the_dead_letters_once(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    c, addr = await _start(nursery, tmp_path)
    async with open_producer(c.ns) as producer:
        await producer.send("t", b"bad", tags="x", keys="k")
    (original,) = await _records(addr, "t", 1)
    current, seen = original, []
    for attempt, backoff in ((1, 200), (2, 400)):
        t0 = int(time.time() * 1000)
        [[where, times, due]] = await _send_back(addr, current)
        assert (where, times) == ("retry", attempt) and t0 + backoff <= due <= int(time.time() * 1000) + backoff
        current = (await _records(addr, retry_topic("g"), attempt))[-1]
        seen.append(current)
        assert current.store_timestamp_ms >= int(current.properties[PROP_DELIVER_AT])
        assert current.store_timestamp_ms - t0 >= backoff, "redelivered before its back-off"
    for r in seen:
        assert r.body == b"bad" and r.tags == "x" and r.keys == "k"
        assert r.properties[PROP_ORIGIN_TOPIC] == "t"
        assert r.properties[PROP_ORIGIN_MSG_ID] == f"{addr}@{original.commitlog_offset:016X}"
    assert [r.reconsume_times for r in seen] == [1, 2]
    [[where, times, _]] = await _send_back(addr, current)  # a third failure: past max_reconsume_times=2
    assert (where, times) == ("dlq", 3)
    (dead,) = await _records(addr, dlq_topic("g"), 1)
    assert dead.body == b"bad" and dead.reconsume_times == 3 and dead.properties[PROP_DLQ_GROUP] == "g"
    assert dead.properties[PROP_ORIGIN_TOPIC] == "t"
    await trio.sleep(0.5)  # nothing else may arrive: no second retry, no second dead letter
    assert len(await _records(addr, dlq_topic("g"), 1)) == 1
    assert len(await _records(addr, retry_topic("g"), 2)) == 2


async def test_an_explicit_delay_and_straight_to_the_dead_letters(nursery: trio.Nursery, tmp_path: Path) -> None:
    c, addr = await _start(nursery, tmp_path)
    async with open_producer(c.ns) as producer:
        await producer.send("t", b"a")
        await producer.send("t", b"b")
    a, b = await _records(addr, "t", 2)
    [[where, _, due]] = await _send_back(addr, a, delay_ms=50)
    assert where == "retry" and due - time.time() * 1000 <= 50
    [[where, times, _]] = await _send_back(addr, b, to_dlq=True)
    assert (where, times) == ("dlq", 1)
    assert [r.body for r in await _records(addr, retry_topic("g"), 1)] == [b"a"]
    assert [r.body for r in await _records(addr, dlq_topic("g"), 1)] == [b"b"]


@pytest.mark.parametrize(
    ("fields", "code"),
    [
        ({"group": "g", "messages": [[12345, -1]]}, ErrorCode.NOT_FOUND),  # no record starts there
        ({"group": "%DLQ%g", "messages": []}, ErrorCode.MALFORMED_REQUEST),  # not a group
        ({"group": "g", "messages": [[0, -2]]}, ErrorCode.MALFORMED_REQUEST),  # a delay below -1
        ({"group": "g", "messages": [["0", -1]]}, ErrorCode.MALFORMED_REQUEST),  # a wrong type
        ({"group": "g", "messages": [[0, 10**12]]}, ErrorCode.MALFORMED_REQUEST),  # a delay past timer_max_delay_ms
    ],
)
async def test_a_bad_send_back_is_refused_and_stores_nothing(
    nursery: trio.Nursery, tmp_path: Path, fields: dict[str, Any], code: ErrorCode
) -> None:
    _c, addr = await _start(nursery, tmp_path)
    with pytest.raises(RpcError) as e:
        await _request(addr, RequestCode.CONSUMER_SEND_BACK, fields)
    assert e.value.code == code, e.value
    topics = await _request(addr, RequestCode.LIST_TOPICS, {"include_system": True})
    assert set(topics.fields["topics"]) == {"t"}


async def test_a_record_too_large_to_carry_a_retry_s_properties_goes_to_the_dead_letters(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """A failed record near max_message_bytes cannot take the retry's properties: it goes
    to the dead letters, as a reference to the failed record if even that copy is too
    large, rather than block its queue; a resend sends its body."""
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    broker = await c.start_broker(**SETTINGS, max_message_bytes=4096)
    await c.create_topic("t", 1)
    async with open_producer(c.ns) as producer:
        await producer.send("t", b"x" * 3800, properties={"note": "y" * 40})
    (big,) = await _records(broker.addr, "t", 1)
    [[where, times, _]] = await _send_back(broker.addr, big)
    assert (where, times) == ("dlq", 1)
    (dead,) = await _records(broker.addr, dlq_topic("g"), 1)
    assert dead.properties[PROP_ORIGIN_TOPIC] == "t" and dead.properties[PROP_DLQ_GROUP] == "g"
    assert dead.body == b"" and dead.properties[PROP_DLQ_BODY_OF] == f"{broker.addr}@{big.commitlog_offset:016X}"
    async with open_admin(c.ns) as admin:  # resent with the body it refers to
        resent = await admin.resend_dead_letters("g")
    assert len(resent.resent) == 1 and not resent.errors
    again = (await _records(broker.addr, "t", 2))[1]
    assert again.body == big.body and PROP_DLQ_BODY_OF not in again.properties

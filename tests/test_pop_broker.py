"""POP consumption on a real broker, driven by raw requests (POP_MESSAGE, ACK_MESSAGE,
CHANGE_INVISIBLE_TIME): delivery, acknowledgement, redelivery after the invisible
time, dead letters, expired and repeated acknowledgements, changes of the invisible
time, groups and members, long polling, fairness across queues, orderly POP, the
in-flight limit, DESCRIBE_GROUP, BROKER_INFO and the metrics."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio

from clmq.broker.service import Broker
from clmq.client import open_admin
from tests.pop_helpers import FAST_POP, Popper, bodies
from tests.service_helpers import Cluster


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

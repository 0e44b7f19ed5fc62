"""Kafka consumer groups on clmq's group coordinator, with real librdkafka members
(confluent-kafka) joining and leaving while they consume, and the one group namespace
shared with clmq's own consumers."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from clmq import open_admin, open_consumer
from clmq.protocol.kafka import ApiKey, ErrorCode
from tests.kafka_procs import KafkaCluster, in_thread, open_kafka
from tests.kafka_wire import KafkaWire
from tests.waiting import await_until

ck = pytest.importorskip("confluent_kafka")
from confluent_kafka.admin import AdminClient, NewTopic  # noqa: E402

SESSION_TIMEOUT_MS = 6000


@pytest.fixture
async def kafka(tmp_path: Path) -> Any:
    async with open_kafka(tmp_path) as cluster:
        yield cluster


class Member(threading.Thread):
    """One group member: consumes in batches, commits each batch synchronously before the
    next poll (so a rebalance never hands a processed, uncommitted message to another)."""

    def __init__(self, bootstrap: str, group: str, topic: str, seen: list[tuple[int, int, str]]) -> None:
        super().__init__(daemon=True)
        self.name_ = f"m{id(self) % 1000}"
        self.seen = seen
        self.stop = threading.Event()
        self.assigned_at: list[float] = []
        self.error: BaseException | None = None
        self.consumer = ck.Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": group,
                "auto.offset.reset": "earliest",
                "enable.auto.commit": False,
                "session.timeout.ms": SESSION_TIMEOUT_MS,
                "heartbeat.interval.ms": 500,
            }
        )
        self.topic = topic

    def run(self) -> None:
        try:
            self.consumer.subscribe([self.topic], on_assign=lambda c, parts: self.assigned_at.append(time.monotonic()))
            while not self.stop.is_set():
                batch = self.consumer.consume(200, 0.2)
                for m in batch:
                    assert not m.error(), m.error()
                    self.seen.append((m.partition(), m.offset(), self.name_))
                if batch:
                    self.consumer.commit(asynchronous=False)
        except BaseException as e:  # reported to the test
            self.error = e
        finally:
            self.consumer.close()  # LeaveGroup: the others rebalance at once


def produce(bootstrap: str, topic: str, n: int, partitions: int = 6) -> None:
    """``n`` messages round robin over the partitions. (librdkafka's sticky partitioner
    may put a whole burst into one or two partitions: CI once had 5,999 of 6,000 in
    one, and the others had nothing to read or commit.)"""
    producer = ck.Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    for i in range(n):
        producer.produce(topic, value=b"m%d" % i, partition=i % partitions)
        if i % 1000 == 0:
            producer.poll(0)
    assert producer.flush(30) == 0


async def test_three_members_joining_and_leaving_read_every_message_once(kafka: KafkaCluster) -> None:
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
    await in_thread(lambda: admin.create_topics([NewTopic("work", 6, 1)])["work"].result(10))
    total = 6000
    seen: list[tuple[int, int, str]] = []
    first = Member(kafka.bootstrap, "workers", "work", seen)
    first.start()
    await in_thread(produce, kafka.bootstrap, "work", total // 2)
    await await_until(lambda: len(seen) >= 500, 30, "the first member to consume")
    others = [Member(kafka.bootstrap, "workers", "work", seen) for _ in range(2)]
    joined = time.monotonic()
    for m in others:
        m.start()
    await await_until(lambda: all(m.assigned_at for m in others), SESSION_TIMEOUT_MS / 1000, "the rebalance")
    assert max(m.assigned_at[0] for m in others) - joined < SESSION_TIMEOUT_MS / 1000
    await in_thread(produce, kafka.bootstrap, "work", total - total // 2)
    first.stop.set()  # leaves while messages are still coming
    await in_thread(first.join, 20)
    try:
        await await_until(lambda: len({(p, o) for p, o, _ in seen}) >= total, 60, "every message")
    except TimeoutError as e:
        state = [(m.name_, m.is_alive(), m.error, len(m.assigned_at)) for m in [first, *others]]
        raise AssertionError(f"{e}: {len(set(seen))} of {total} read; members {state}") from None
    for m in others:
        m.stop.set()
    for m in others:
        await in_thread(m.join, 20)
    assert [m.error for m in [first, *others]] == [None, None, None]
    positions = [(p, o) for p, o, _ in seen]
    assert len(positions) == len(set(positions)) == total, "a message read twice or not at all"
    assert len({who for _, _, who in seen}) >= 2  # the work was shared (the first may finish its own early)
    async with open_admin([kafka.namesrv]) as a:
        described = await a.describe_group("workers")
    assert len(described["queues"]) == 6 and described["lag"] == 0, described


async def test_a_group_is_kafka_or_clmq_at_a_time(kafka: KafkaCluster) -> None:
    """A group with live Kafka members refuses clmq members, and the other way round."""
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
    await in_thread(lambda: admin.create_topics([NewTopic("shared", 2, 1)])["shared"].result(10))
    seen: list[tuple[int, int, str]] = []
    member = Member(kafka.bootstrap, "kafka-side", "shared", seen)
    member.start()
    try:
        await await_until(lambda: bool(member.assigned_at), 15, "the Kafka member's assignment")
        async with (
            open_consumer(
                [kafka.namesrv], "kafka-side", {"shared": "*"}, pull_wait_ms=200, heartbeat_interval_ms=200
            ) as native,
            open_admin([kafka.namesrv]) as a,
        ):
            with trio.move_on_after(2):  # several of its heartbeats, each refused
                while True:
                    await native.receive()
            described = await a.describe_group("kafka-side")
        assert [m["mode"] for m in described["members"]] == ["kafka"], described["members"]
    finally:
        member.stop.set()
        await in_thread(member.join, 20)
    # the other way: native members alive, a Kafka join is refused
    async with open_consumer(
        [kafka.namesrv], "clmq-side", {"shared": "*"}, pull_wait_ms=200, heartbeat_interval_ms=200
    ):
        async with open_admin([kafka.namesrv]) as a:
            await await_until(_has_members(a, "clmq-side"), 15, "the clmq member to be known")
            assert [m["mode"] for m in (await a.describe_group("clmq-side"))["members"]] == ["clustering"]
        consumer = ck.Consumer(
            {"bootstrap.servers": kafka.bootstrap, "group.id": "clmq-side", "session.timeout.ms": SESSION_TIMEOUT_MS}
        )
        errors: list[Any] = []
        consumer.subscribe(["shared"])

        def poll() -> None:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not errors:
                m = consumer.poll(0.2)
                if m is not None and m.error():
                    errors.append(m.error())

        await in_thread(poll)
        consumer.close()
        assert errors and "INCONSISTENT_GROUP_PROTOCOL" in str(errors[0]), errors


def _has_members(admin: Any, group: str) -> Any:
    async def check() -> bool:
        return bool((await admin.describe_group(group))["members"])

    return check


async def test_a_topic_across_two_broker_groups(kafka: KafkaCluster) -> None:
    """Partitions numbered over both groups (by name, then queue); produce goes to each
    partition's leader; the group coordinator commits (and reads back) the offsets of
    the other group's partitions at that group's leader."""
    await kafka.start_broker("h0", broker_name="h")
    async with open_admin([kafka.namesrv]) as a:
        await await_until(lambda: _leaders(a, 2), 15, "both groups registered")
        await a.create_topic("wide", 2)
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap})

    async def four_partitions_two_leaders() -> bool:
        meta = await in_thread(lambda: admin.list_topics(timeout=10))
        parts = meta.topics["wide"].partitions if "wide" in meta.topics else {}
        return len(parts) == 4 and len({p.leader for p in parts.values()}) == 2

    await await_until(four_partitions_two_leaders, 15, "metadata naming both groups' leaders")
    producer = ck.Producer({"bootstrap.servers": kafka.bootstrap})
    for partition in range(4):
        for i in range(10):
            producer.produce("wide", value=b"p%d-%d" % (partition, i), partition=partition)
    assert await in_thread(producer.flush, 30) == 0
    seen: list[tuple[int, int, str]] = []
    member = Member(kafka.bootstrap, "wide-readers", "wide", seen)
    member.start()
    await await_until(lambda: len(seen) >= 40, 30, "every message read")
    member.stop.set()
    await in_thread(member.join, 20)
    assert sorted({p for p, _o, _w in seen}) == [0, 1, 2, 3] and len(seen) == 40
    reader = ck.Consumer({"bootstrap.servers": kafka.bootstrap, "group.id": "wide-readers"})
    committed = await in_thread(lambda: reader.committed([ck.TopicPartition("wide", p) for p in range(4)], timeout=10))
    reader.close()
    assert [tp.offset for tp in committed] == [10, 10, 10, 10]
    async with open_admin([kafka.namesrv]) as a:
        described = await a.describe_group("wide-readers")
    assert sorted((q["broker_name"], q["queue_id"], q["committed"]) for q in described["queues"]) == [
        ("g", 0, 10),
        ("g", 1, 10),
        ("h", 0, 10),
        ("h", 1, 10),
    ]


async def _leaders(admin: Any, n: int) -> bool:
    return len(await admin.leaders()) >= n


async def test_group_requests_to_a_broker_that_does_not_coordinate_are_told_not_coordinator(
    kafka: KafkaCluster,
) -> None:
    """With two broker groups each group id has one coordinator; the other broker answers
    join, sync, heartbeat and leave with NOT_COORDINATOR (no second copy of the group)."""
    await kafka.start_broker("h0", broker_name="h")
    async with open_admin([kafka.namesrv]) as a:
        await await_until(lambda: _leaders(a, 2), 15, "both groups registered")
        await a.create_topic("t", 1)

    def coordinators() -> dict[str, str]:
        with KafkaWire(kafka.kafka_addr("b0")) as w:
            keys = [f"group-{i}" for i in range(20)]
            body = w.request(ApiKey.FIND_COORDINATOR, 4, {"key_type": 0, "coordinator_keys": keys})
        return {c["key"]: f"{c['host']}:{c['port']}" for c in body["coordinators"] if c["error_code"] == 0}

    found = await await_until(lambda: (c := coordinators()) and len(set(c.values())) == 2 and c, 15, "two coordinators")
    group, addr = next((g, a) for g, a in found.items() if a != kafka.kafka_addr("b0"))
    join = {
        "group_id": group,
        "session_timeout_ms": 10000,
        "rebalance_timeout_ms": 10000,
        "member_id": "",
        "protocol_type": "consumer",
        "protocols": [{"name": "range", "metadata": b""}],
    }
    with KafkaWire(kafka.kafka_addr("b0")) as w:
        answers = [
            w.request(ApiKey.JOIN_GROUP, 7, join),
            w.request(
                ApiKey.SYNC_GROUP, 5, {"group_id": group, "generation_id": 1, "member_id": "m", "assignments": []}
            ),
            w.request(ApiKey.HEARTBEAT, 4, {"group_id": group, "generation_id": 1, "member_id": "m"}),
            w.request(ApiKey.LEAVE_GROUP, 4, {"group_id": group, "members": [{"member_id": "m"}]}),
        ]
    assert [x["error_code"] for x in answers] == [ErrorCode.NOT_COORDINATOR] * 4

    def coordinator_takes_it() -> bool:  # (first answer: MEMBER_ID_REQUIRED), once it knows both groups too
        with KafkaWire(addr) as w:
            return bool(w.request(ApiKey.JOIN_GROUP, 7, join)["error_code"] == ErrorCode.MEMBER_ID_REQUIRED)

    await await_until(coordinator_takes_it, 15, "the coordinator to take the join")


async def test_metadata_keeps_every_group_while_the_name_servers_are_down(kafka: KafkaCluster) -> None:
    """The cluster view comes from the name servers; while none answers, a broker keeps
    their last answer (not a view of itself alone, which would renumber the partitions of
    a topic spread over two broker groups) and produce goes on."""
    await kafka.start_broker("h0", broker_name="h")
    async with open_admin([kafka.namesrv]) as a:
        await await_until(lambda: _leaders(a, 2), 15, "both groups registered")
        await a.create_topic("wide", 2)
    admin = AdminClient({"bootstrap.servers": kafka.kafka_addr("b0")})

    async def shape() -> tuple[int, int]:
        meta = await in_thread(lambda: admin.list_topics(timeout=10))
        parts = meta.topics["wide"].partitions if "wide" in meta.topics else {}
        return len(parts), len({p.leader for p in parts.values()})

    await await_until(lambda: _is(shape(), (4, 2)), 15, "four partitions with two leaders")
    assert kafka.group.nameserver is not None
    await kafka.group.nameserver.kill()
    deadline = trio.current_time() + 3  # several refreshes of the view (one a second)
    while trio.current_time() < deadline:
        assert await shape() == (4, 2)
        await trio.sleep(0.25)
    producer = ck.Producer({"bootstrap.servers": kafka.kafka_addr("b0")})
    producer.produce("wide", value=b"v", partition=0)
    assert await in_thread(producer.flush, 30) == 0


async def _is(got: Any, want: Any) -> bool:
    return bool(await got == want)

"""Kafka share groups (KIP-932) on clmq's Kafka listener, judged by the real Java client
(kafka-clients 4.4.0's KafkaShareConsumer, tests/java/kafka-harness ``share`` mode)
against a real broker process: the share group's state is the broker's POP state, so
several share consumers split a topic's messages, a RELEASE comes back with delivery
count 2, a REJECT lands in ``%DLQ%group``, a consumer killed while holding records
loses them after the lock duration, and clmq's own PopConsumer shares the same work.

Each share consumer is one JVM writing its records to a file as it goes; the test
polls those files (with a deadline) and creates the stop file the harness waits for.
"""

from __future__ import annotations

import signal
from collections import Counter
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import pytest
import trio

from clmq import open_admin, open_pop_consumer, open_producer
from tests import java_deps
from tests.kafka_procs import KafkaCluster, open_kafka
from tests.waiting import await_until

pytestmark = pytest.mark.slow

LOCK_MS = 3000  # kafka_share_record_lock_duration_ms of these brokers
WAIT_S = 60  # every wait for the consumers' output ends by then


@pytest.fixture(scope="module")
def harness() -> list[str]:
    return java_deps.harness_command()


@pytest.fixture
async def kafka(tmp_path: Path) -> Any:
    async with open_kafka(
        tmp_path, kafka_share_record_lock_duration_ms=LOCK_MS, kafka_share_heartbeat_interval_ms=500
    ) as c:
        yield c


@dataclass(frozen=True)
class Got:
    """One record a share consumer printed: (partition, offset), delivery count, value, action."""

    partition: int
    offset: int
    delivery_count: int
    value: str
    action: str
    consumer: int


class ShareConsumers:
    """Share consumer JVMs of one group, each writing its output to its own file."""

    def __init__(self, root: Path, harness: list[str], cluster: KafkaCluster) -> None:
        self.root, self.harness, self.cluster = root, harness, cluster
        self.stop = root / "stop"
        self.procs: list[trio.Process] = []
        self.outs: list[Path] = []

    async def start(self, nursery: trio.Nursery, topic: str, group: str, policy: str) -> int:
        i = len(self.procs)
        out, err = self.root / f"share-{i}.out", self.root / f"share-{i}.err"
        self.outs.append(out)
        args = [*self.harness, "share", self.cluster.bootstrap, topic, group, policy, str(self.stop)]
        o, e = await trio.to_thread.run_sync(lambda: (open(out, "wb"), open(err, "wb")))  # noqa: SIM115
        try:
            proc = await nursery.start(partial(trio.run_process, args, stdout=o, stderr=e, check=False))
        finally:
            o.close()
            e.close()
        self.procs.append(proc)
        return i

    def got(self) -> list[Got]:
        rows = []
        for i, path in enumerate(self.outs):
            for line in path.read_text().splitlines():
                f = line.split("\t")
                if f[0] == "got" and len(f) == 6:
                    rows.append(Got(int(f[1]), int(f[2]), int(f[3]), f[4], f[5], i))
        return rows

    def text(self) -> str:
        return "\n".join(
            f"--- consumer {i}\n{p.read_text()[-2000:]}\n{p.with_suffix('.err').read_text()[-3000:]}"
            for i, p in enumerate(self.outs)
        )

    async def until(self, done: Callable[[list[Got]], bool], what: str) -> list[Got]:
        """The records got so far once ``done`` holds (fails after WAIT_S, with the output)."""
        try:
            return await await_until(lambda: (rows := self.got()) and done(rows) and rows, WAIT_S, what)
        except TimeoutError as e:
            raise AssertionError(f"{e}:\n{self.text()}") from None

    async def exited(self, i: int) -> None:
        await await_until(lambda: self.procs[i].returncode is not None, WAIT_S, f"share consumer {i} to exit")


@asynccontextmanager
async def share_consumers(
    tmp_path: Path, harness: list[str], cluster: KafkaCluster
) -> AsyncIterator[tuple[ShareConsumers, trio.Nursery]]:
    consumers = ShareConsumers(tmp_path, harness, cluster)
    async with trio.open_nursery() as nursery:
        try:
            yield consumers, nursery
        finally:
            consumers.stop.touch()
        try:
            await await_until(lambda: all(p.returncode is not None for p in consumers.procs), 30, "consumers to close")
        except TimeoutError:
            for p in consumers.procs:
                if p.returncode is None:
                    p.kill()


async def produce(cluster: KafkaCluster, topic: str, n: int, queues: int = 2) -> list[str]:
    async with open_admin([cluster.namesrv]) as admin:
        await admin.create_topic(topic, queues)
    values = [f"{topic}-{i:04d}" for i in range(n)]
    async with open_producer([cluster.namesrv]) as producer:
        for v in values:
            await producer.send(topic, v.encode())
    return values


async def test_three_share_consumers_split_the_work_each_record_accepted_once(
    tmp_path: Path, kafka: KafkaCluster, harness: list[str]
) -> None:
    values = await produce(kafka, "work", 300)
    async with share_consumers(tmp_path, harness, kafka) as (c, nursery):
        for _ in range(3):
            await c.start(nursery, "work", "sg", "accept")
        rows = await c.until(lambda rows: {r.value for r in rows} >= set(values), "every record")
    rows = c.got()
    assert sorted(r.value for r in rows) == sorted(values), "each record delivered once"
    assert all(r.delivery_count == 1 and r.action == "ACCEPT" for r in rows)
    assert len({r.consumer for r in rows}) >= 2, "the work is shared"
    assert "ackerror" not in "".join(p.read_text() for p in c.outs)
    pop = await _pop_state(kafka, "sg")
    assert pop["acked"] == len(values) and pop["redelivered"] == 0 and pop["dead_lettered"] == 0, pop
    assert all(q["settled_offset"] == q["max_offset"] for q in pop["queues"]), pop


async def _pop_state(cluster: KafkaCluster, group: str) -> dict[str, Any]:
    """DESCRIBE_GROUP's POP part of ``group`` on the one broker."""
    async with open_admin([cluster.namesrv]) as admin:
        pops = (await admin.describe_group(group))["pop"]
    assert len(pops) == 1, pops
    return dict(pops[0])


async def test_a_released_record_comes_back_with_delivery_count_two(
    tmp_path: Path, kafka: KafkaCluster, harness: list[str]
) -> None:
    values = await produce(kafka, "rel", 40)
    async with share_consumers(tmp_path, harness, kafka) as (c, nursery):
        await c.start(nursery, "rel", "sg", "release-once")
        await c.start(nursery, "rel", "sg", "release-once")
        rows = await c.until(lambda rows: {r.value for r in rows if r.action == "ACCEPT"} >= set(values), "accepts")
    firsts = Counter(r.value for r in rows if r.delivery_count == 1)
    seconds = Counter(r.value for r in rows if r.delivery_count == 2)
    assert firsts == seconds == Counter(values), "each released once, then delivered again and accepted"
    assert all(r.action == "RELEASE" for r in rows if r.delivery_count == 1)
    pop = await _pop_state(kafka, "sg")
    assert pop["acked"] == len(values) and pop["dead_lettered"] == 0, pop


async def test_a_rejected_record_goes_to_the_groups_dead_letter_queue(
    tmp_path: Path, kafka: KafkaCluster, harness: list[str]
) -> None:
    values = await produce(kafka, "rej", 10, queues=1)
    async with share_consumers(tmp_path, harness, kafka) as (c, nursery):
        await c.start(nursery, "rej", "sg", "reject")
        rows = await c.until(lambda rows: {r.value for r in rows} >= set(values), "every record")
    assert sorted(r.value for r in rows) == values and all(r.action == "REJECT" for r in rows)
    async with open_admin([kafka.namesrv]) as admin:

        async def all_dead() -> list[Any]:
            dead = await admin.dead_letters("sg")
            return dead if len(dead) >= len(values) else []

        dead = await await_until(all_dead, WAIT_S, "every rejected record in %DLQ%sg")
    assert sorted(d.record.body.decode() for d in dead) == values
    assert {d.origin_topic for d in dead} == {"rej"}
    assert (await _pop_state(kafka, "sg"))["dead_lettered"] == len(values)


async def test_a_killed_share_consumers_records_come_back_after_the_lock_and_a_closed_ones_at_once(
    tmp_path: Path, kafka: KafkaCluster, harness: list[str]
) -> None:
    values = await produce(kafka, "held", 30, queues=1)
    async with share_consumers(tmp_path, harness, kafka) as (c, nursery):
        holder = await c.start(nursery, "held", "sg", "hold")
        held = await c.until(lambda rows: len(rows) > 0, "a held batch")
        held_at = trio.current_time()
        c.procs[holder].send_signal(signal.SIGKILL)  # dies holding its records: no close, no release
        await c.start(nursery, "held", "sg", "accept")
        rows = await c.until(lambda rows: {r.value for r in rows if r.action == "ACCEPT"} >= set(values), "all")
        back_after = trio.current_time() - held_at
    taken = {r.value for r in held}
    again = {r.value: r.delivery_count for r in rows if r.action == "ACCEPT"}
    assert all(again[v] == 2 for v in taken), "the held records came back once, counted"
    assert all(again[v] == 1 for v in set(values) - taken)
    assert back_after >= LOCK_MS / 1000 * 0.9, "not before their lock ran out"


async def test_a_closed_share_consumer_releases_what_it_held(
    tmp_path: Path, kafka: KafkaCluster, harness: list[str]
) -> None:
    values = await produce(kafka, "closed", 10, queues=1)
    async with share_consumers(tmp_path, harness, kafka) as (c, nursery):
        await c.start(nursery, "closed", "sg", "hold")
        held = await c.until(lambda rows: len(rows) > 0, "a held batch")
        c.stop.touch()  # the holder closes its consumer (ShareAcknowledge with epoch -1)
        await c.exited(0)
        c.stop.unlink()
        released_at = trio.current_time()
        await c.start(nursery, "closed", "sg", "accept")
        rows = await c.until(lambda rows: {r.value for r in rows if r.action == "ACCEPT"} >= set(values), "all")
        took = trio.current_time() - released_at
    assert {r.value for r in rows if r.delivery_count == 2} == {r.value for r in held}
    assert took < WAIT_S


async def test_a_native_pop_consumer_and_a_kafka_share_consumer_share_one_groups_work(
    tmp_path: Path, kafka: KafkaCluster, harness: list[str]
) -> None:
    values = await produce(kafka, "mixed", 200)
    native: list[str] = []
    async with share_consumers(tmp_path, harness, kafka) as (c, nursery):
        await c.start(nursery, "mixed", "sg", "accept")
        await c.until(lambda rows: len(rows) > 0, "the share consumer's first records")
        async with open_pop_consumer([kafka.namesrv], "sg", {"mixed": "*"}, invisible_time_ms=LOCK_MS) as pop:
            more = [f"mixed-late-{i:04d}" for i in range(200)]
            async with open_producer([kafka.namesrv]) as producer:
                for v in more:
                    await producer.send("mixed", v.encode())
            values += more

            async def taken_all() -> bool:
                with trio.move_on_after(0.2):
                    records = await pop.receive()
                    native.extend(r.body.decode() for r in records)
                    await pop.ack(records)
                return len(native) + len({r.value for r in c.got()}) >= len(values)

            await await_until(taken_all, WAIT_S, "every record taken by one member or the other")
    java = [r.value for r in c.got()]
    assert sorted(native + java) == sorted(values), "every record once, across both kinds of member"
    assert native and java, (len(native), len(java))
    pop_state = await _pop_state(kafka, "sg")
    assert pop_state["acked"] == len(values) and pop_state["redelivered"] == 0, pop_state

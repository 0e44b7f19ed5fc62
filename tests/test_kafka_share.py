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
from hypothesis import given
from hypothesis import strategies as st

from clmq import open_admin, open_pop_consumer, open_producer
from clmq.broker.service.kafka._share_acks import GAP, RENEW, _planned
from clmq.broker.service.kafka._share_sessions import SHARE_SESSION_LIMIT_REACHED, ShareSession, ShareSessions
from clmq.client import NoRouteError, Routes
from clmq.protocol.kafka import ApiKey, ErrorCode
from tests import java_deps
from tests.failover_procs import FailoverGroup
from tests.kafka_procs import KafkaCluster, open_kafka, open_secure_kafka
from tests.kafka_wire import KafkaWire
from tests.pop_helpers import FAST_POP, Popper
from tests.replica_procs import free_port, open_group
from tests.service_helpers import Cluster
from tests.test_kafka_security import allow, create_topics, produce_one, wire_as
from tests.waiting import await_until

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

    def done(self) -> list[str]:
        """Values whose acknowledgement the broker confirmed (the harness's "done" lines)."""
        return [
            line.split("\t")[3]
            for path in self.outs
            for line in path.read_text().splitlines()
            if line.startswith("done\t") and len(line.split("\t")) == 4
        ]

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
        await await_until(admin.leaders, WAIT_S, "the broker registered with the name server")
        await admin.create_topic(topic, queues)
        routes = Routes(admin.rpc, [cluster.namesrv])

        async def routed() -> bool:  # brokers register a new topic at once; the name server tells nobody
            try:
                return len(await routes.queues(topic, refresh=True)) == queues
            except NoRouteError:
                return False

        await await_until(routed, WAIT_S, f"the name server to route {topic!r}")
    values = [f"{topic}-{i:04d}" for i in range(n)]
    async with open_producer([cluster.namesrv]) as producer:
        for v in values:
            await producer.send(topic, v.encode())
    return values


@pytest.mark.slow
async def test_three_share_consumers_split_the_work_each_record_accepted_once(
    tmp_path: Path, kafka: KafkaCluster, harness: list[str]
) -> None:
    await produce(kafka, "work", 0)
    async with share_consumers(tmp_path, harness, kafka) as (c, nursery):
        for _ in range(3):
            await c.start(nursery, "work", "sg", "accept")

        async def all_fetching() -> bool:  # every member asks before there is work (a JVM may start late)
            async with open_admin([kafka.namesrv]) as admin:
                pops = (await admin.describe_group("sg"))["pop"]
            return bool(pops) and len(pops[0]["members"]) == 3

        await await_until(all_fetching, WAIT_S, "three share members fetching")
        values = [f"work-{i:04d}" for i in range(300)]
        async with open_producer([kafka.namesrv]) as producer:
            for v in values:
                await producer.send("work", v.encode())
        rows = await c.until(lambda rows: {r.value for r in rows} >= set(values), "every record")
    rows = c.got()
    assert sorted(r.value for r in rows) == sorted(values), "each record delivered once"
    assert all(r.delivery_count == 1 and r.action == "ACCEPT" for r in rows)
    assert len({r.consumer for r in rows}) >= 2, "the work is shared (three members long-polling when it came)"
    assert "ackerror" not in "".join(p.read_text() for p in c.outs)
    pop = await _pop_state(kafka, "sg")
    assert pop["acked"] == len(values) and pop["redelivered"] == 0 and pop["dead_lettered"] == 0, pop
    assert all(q["settled_offset"] == q["max_offset"] for q in pop["queues"]), pop


async def _all_settled(cluster: KafkaCluster, count: int) -> bool:
    """Whether group sg's POP state has settled all ``count`` messages (an acknowledgement
    the client saw fail at a broker's death may still have been applied: its answer was
    lost; such a record is settled and not delivered again)."""
    pop = await _pop_state(cluster, "sg")
    queues = pop["queues"]
    return sum(q["max_offset"] for q in queues) == count and all(q["settled_offset"] == q["max_offset"] for q in queues)


async def _pop_state(cluster: KafkaCluster, group: str) -> dict[str, Any]:
    """DESCRIBE_GROUP's POP part of ``group`` on the one broker."""
    async with open_admin([cluster.namesrv]) as admin:
        pops = (await admin.describe_group(group))["pop"]
    assert len(pops) == 1, pops
    return dict(pops[0])


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
async def test_a_killed_share_consumers_records_come_back_after_the_lock(
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
    # the others were fetched once, or twice when the holder's client had them buffered
    # past its poll's max.poll.records (acquired by it, never shown)
    assert set(again) == set(values) and all(again[v] in (1, 2) for v in set(values) - taken)
    assert back_after >= LOCK_MS / 1000 * 0.9, "not before their lock ran out"


@pytest.mark.slow
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
    # released at the close: what it showed, and what its client had buffered past max.poll.records
    assert {r.value for r in rows if r.delivery_count == 2} >= {r.value for r in held}
    assert all(r.delivery_count in (1, 2) for r in rows if r.action == "ACCEPT")
    assert took < WAIT_S


@pytest.mark.slow
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


# ---------------------------------------------------------------- the protocol, by hand
def _fetch_body(group: str, member: str, epoch: int, tid: Any, wait_ms: int = 0) -> dict[str, Any]:
    return {
        "group_id": group,
        "member_id": member,
        "share_session_epoch": epoch,
        "max_wait_ms": wait_ms,
        "min_bytes": 1,
        "max_bytes": 1 << 20,
        "max_records": 5,
        "batch_size": 5,
        "share_acquire_mode": 0,
        "is_renew_ack": False,
        "topics": [{"topic_id": tid, "partitions": [{"partition_index": 0, "acknowledgement_batches": []}]}],
        "forgotten_topics_data": [],
    }


def _ack_body(group: str, member: str, epoch: int, tid: Any, batches: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "group_id": group,
        "member_id": member,
        "share_session_epoch": epoch,
        "is_renew_ack": False,
        "topics": [{"topic_id": tid, "partitions": [{"partition_index": 0, "acknowledgement_batches": batches}]}],
    }


def _partition(answer: dict[str, Any]) -> dict[str, Any]:
    assert answer["error_code"] == 0, answer
    [topic] = answer["responses"]
    [part] = topic["partitions"]
    return dict(part)


async def test_share_protocol_heartbeat_sessions_and_acks_by_hand(kafka: KafkaCluster) -> None:
    """Over the wire (v1 and v2): every member is assigned every partition; session
    epochs are checked; a member cannot settle records another holds (INVALID_RECORD_STATE,
    nothing settled); a malformed batch is INVALID_REQUEST; the holder's ACCEPT settles."""
    await produce(kafka, "wire", 6, queues=1)
    with KafkaWire(kafka.kafka_addr("b0")) as w:
        tid = w.request(ApiKey.METADATA, 12, {"topics": [{"name": "wire"}]})["topics"][0]["topic_id"]
        for member in ("m1", "m2"):
            hb = {"group_id": "hg", "member_id": member, "member_epoch": 0, "rack_id": None}
            joined = w.request(ApiKey.SHARE_GROUP_HEARTBEAT, 1, {**hb, "subscribed_topic_names": ["wire"]})
            assert joined["error_code"] == 0 and joined["member_epoch"] == 1, joined
            assert joined["assignment"]["topic_partitions"] == [{"topic_id": tid, "partitions": [0]}]
            again = w.request(
                ApiKey.SHARE_GROUP_HEARTBEAT, 1, {**hb, "member_epoch": 1, "subscribed_topic_names": None}
            )
            assert again["error_code"] == 0 and again["assignment"] is None, again
        stranger = {
            "group_id": "hg",
            "member_id": "m9",
            "member_epoch": 3,
            "rack_id": None,
            "subscribed_topic_names": None,
        }
        assert w.request(ApiKey.SHARE_GROUP_HEARTBEAT, 1, stranger)["error_code"] == ErrorCode.UNKNOWN_MEMBER_ID

        assert w.request(ApiKey.SHARE_FETCH, 2, _fetch_body("hg", "m1", 4, tid))["error_code"] == 122  # no session
        assert w.request(ApiKey.SHARE_ACKNOWLEDGE, 1, _ack_body("hg", "m1", 0, tid, []))["error_code"] == 123

        def first_fetch() -> dict[str, Any] | None:  # REPLICA_NOT_AVAILABLE while the broker's POP state loads
            part = _partition(w.request(ApiKey.SHARE_FETCH, 2, _fetch_body("hg", "m1", 0, tid, WAIT_S * 1000)))
            return None if part["error_code"] == ErrorCode.REPLICA_NOT_AVAILABLE else part

        got = await await_until(first_fetch, WAIT_S, "the POP state loaded")
        assert len(got["acquired_records"]) == 1, got
        [acquired] = got["acquired_records"]
        assert (acquired["first_offset"], acquired["delivery_count"]) == (0, 1) and got["records"], got
        first, last = acquired["first_offset"], acquired["last_offset"]
        opened = w.request(ApiKey.SHARE_FETCH, 2, _fetch_body("hg", "m2", 0, tid))  # m2's session
        assert opened["error_code"] == 0, opened
        theirs = [{"first_offset": first, "last_offset": last, "acknowledge_types": [1]}]
        refused = _partition(w.request(ApiKey.SHARE_ACKNOWLEDGE, 2, _ack_body("hg", "m2", 1, tid, theirs)))
        assert refused["error_code"] == ErrorCode.INVALID_RECORD_STATE, refused
        bad = [{"first_offset": first, "last_offset": last, "acknowledge_types": [1, 1, 1, 1, 1, 1, 1]}]
        malformed = _partition(w.request(ApiKey.SHARE_ACKNOWLEDGE, 2, _ack_body("hg", "m1", 1, tid, bad)))
        assert malformed["error_code"] == ErrorCode.INVALID_REQUEST, malformed
        stale = w.request(ApiKey.SHARE_ACKNOWLEDGE, 2, _ack_body("hg", "m1", 1, tid, theirs))
        assert stale["error_code"] == 123, "epoch 1 was used"
        ok = _partition(w.request(ApiKey.SHARE_ACKNOWLEDGE, 2, _ack_body("hg", "m1", 2, tid, theirs)))
        assert ok["error_code"] == 0, ok
    pop = await _pop_state(kafka, "hg")
    assert pop["acked"] == last - first + 1, pop


BATCH = st.fixed_dictionaries(
    {
        "first_offset": st.integers(-2, 40),
        "last_offset": st.integers(-2, 60),
        "acknowledge_types": st.lists(st.integers(-1, 6), min_size=0, max_size=25),
    }
)


@given(st.lists(BATCH, max_size=4), st.integers(1, 30))
def test_acknowledgement_batches_expand_to_offsets_or_are_refused_whole(
    batches: list[dict[str, Any]], cap: int
) -> None:
    """Any batches: either every non-gap offset with its own type (one type for all, or
    one per offset), or a reason naming the first malformed batch; never a partial plan."""
    plan = _planned(batches, cap)
    expected: list[tuple[int, int]] = []
    for b in batches:
        first, last, types = b["first_offset"], b["last_offset"], b["acknowledge_types"]
        span = last - first + 1
        valid = first >= 0 and 1 <= span <= cap and len(types) in (1, span) and all(GAP <= t <= RENEW for t in types)
        if not valid:
            assert isinstance(plan, str) and f"batch {first}..{last}" in plan
            return
        expected += [(first + i, types[0] if len(types) == 1 else types[i]) for i in range(span)]
    assert plan == [(o, t) for o, t in expected if t != GAP]


@pytest.mark.slow
async def test_a_broker_sigkill_loses_no_acknowledgement_of_a_share_consumer(
    tmp_path: Path, kafka: KafkaCluster, harness: list[str]
) -> None:
    """kill -9 of the broker while a Java share consumer works: the client reconnects
    (new session, rejoined), every record ends accepted, and no record whose
    acknowledgement the broker confirmed is delivered again."""
    values = await produce(kafka, "crash", 200)
    broker = kafka.brokers["b0"][0]
    async with share_consumers(tmp_path, harness, kafka) as (c, nursery):
        await c.start(nursery, "crash", "sg", "accept")
        await c.until(lambda rows: len(rows) >= 60, "some records")
        await broker.kill()
        confirmed_before = set(c.done())
        await broker.start()
        late = [f"crash-late-{i:04d}" for i in range(200)]  # served by the restarted broker only
        async with open_producer([kafka.namesrv]) as producer:
            for v in late:
                await producer.send("crash", v.encode())
        values += late
        await await_until(lambda: _all_settled(kafka, len(values)), WAIT_S, f"all settled:\n{c.text()}")
    rows = c.got()
    seen = Counter(r.value for r in rows)
    assert confirmed_before, "acknowledgements were confirmed before the kill"
    assert all(seen[v] == 1 for v in confirmed_before), "a confirmed acknowledgement was lost"
    assert set(seen) == set(values)


SLOW_POP_START_MS = 10_000  # pop_revive_interval_ms of a broker whose POP state starts this late


async def _share_fetches_counted(cluster: KafkaCluster) -> int:
    """ShareFetch requests the broker's Kafka listener answered (its metrics page)."""
    out = cluster.group["b0"].out.read_text()
    port = int(out.split("metrics on http://")[1].split(":")[1].split("/")[0])
    with trio.fail_after(10):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        page = b""
        while chunk := await stream.receive_some(65536):
            page += chunk
    rows = [
        line
        for line in page.decode().splitlines()
        if line.lower().startswith('clmq_kafka_requests_total{api="share_fetch"}')
    ]
    return int(float(rows[0].split()[-1])) if rows else 0


def _share_calls_while_starting(addr: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A ShareFetch and a ShareAcknowledge by hand, of a member of another group."""
    with KafkaWire(addr) as w:
        tid = w.request(ApiKey.METADATA, 12, {"topics": [{"name": "starting"}]})["topics"][0]["topic_id"]
        hb = {"group_id": "hand", "member_id": "h1", "member_epoch": 0, "rack_id": None}
        assert (
            w.request(ApiKey.SHARE_GROUP_HEARTBEAT, 1, {**hb, "subscribed_topic_names": ["starting"]})["error_code"]
            == 0
        )
        fetched = _partition(w.request(ApiKey.SHARE_FETCH, 2, _fetch_body("hand", "h1", 0, tid)))
        accept = [{"first_offset": 0, "last_offset": 0, "acknowledge_types": [1]}]
        acked = _partition(w.request(ApiKey.SHARE_ACKNOWLEDGE, 2, _ack_body("hand", "h1", 1, tid, accept)))
    return fetched, acked


@pytest.mark.slow
async def test_a_share_consumer_fetching_while_the_pop_state_starts_is_answered_a_code_it_retries(
    tmp_path: Path, harness: list[str]
) -> None:
    """A broker whose POP state starts late (pop_revive_interval_ms): meanwhile ShareFetch
    and ShareAcknowledge answer their partitions REPLICA_NOT_AVAILABLE, which kafka-clients
    4.4.0 retries (a metadata refresh; LEADER_NOT_AVAILABLE was "Unexpected error code 5"
    out of poll()); the Java share consumer fetching in that window gets every record once
    the state runs."""
    async with open_kafka(
        tmp_path, metrics_port=0, pop_revive_interval_ms=SLOW_POP_START_MS, kafka_share_heartbeat_interval_ms=500
    ) as kafka:
        values = await produce(kafka, "starting", 40, queues=1)
        async with share_consumers(tmp_path, harness, kafka) as (c, nursery):
            await c.start(nursery, "starting", "sg", "accept")
            await await_until(lambda: _share_fetches_counted(kafka), WAIT_S, "the Java consumer's first ShareFetch")
            fetched, acked = await trio.to_thread.run_sync(_share_calls_while_starting, kafka.kafka_addr("b0"))
            assert fetched["error_code"] == ErrorCode.REPLICA_NOT_AVAILABLE, ("POP still starting", fetched)
            assert acked["error_code"] == ErrorCode.REPLICA_NOT_AVAILABLE, acked
            rows = await c.until(lambda rows: {r.value for r in rows} >= set(values), "every record")
            assert c.procs[0].returncode is None, f"the consumer failed:\n{c.text()}"
        text = c.text()
        assert sorted(r.value for r in rows) == values and all(r.delivery_count == 1 for r in rows), text
        assert "ackerror" not in text and "Unexpected error" not in text, text


@pytest.mark.slow
async def test_a_zookeeper_failover_loses_no_acknowledgement_of_a_share_consumer(
    tmp_path: Path, harness: list[str], zk_connect: str
) -> None:
    """Three brokers (sync acks, two in sync) with Kafka listeners; the leader is killed
    while a Java share consumer works: the client follows the new leader (coordinator
    and partitions), every record ends accepted, and none whose acknowledgement the old
    leader confirmed is delivered again (the POP state is carried by the follower). An
    acknowledgement the client saw fail at the kill may still have been applied (its
    answer was lost): such a record is settled, not delivered again."""
    async with open_group(tmp_path) as g:
        fg = FailoverGroup(g, zk_connect)
        ports = {f"g{i}": free_port() for i in range(3)}
        shared = {"kafka_share_record_lock_duration_ms": LOCK_MS, "kafka_share_heartbeat_interval_ms": 500}
        async with trio.open_nursery() as nursery:
            for i, key in enumerate(ports):
                nursery.start_soon(partial(fg.start_broker, key, i, kafka_listen_port=ports[key], **shared))
        leader = await fg.wait_leader()
        cluster = KafkaCluster(g, {k: (g[k], p) for k, p in ports.items()})
        values = await produce(cluster, "ft", 200)
        await fg.wait_settled(leader)
        async with share_consumers(tmp_path, harness, cluster) as (c, nursery):
            await c.start(nursery, "ft", "sg", "accept")
            await c.until(lambda rows: len(rows) >= 60, "some records")
            await fg.kill(leader)
            confirmed_before = set(c.done())
            await fg.wait_leader(exclude=frozenset({leader}))
            late = [f"ft-late-{i:04d}" for i in range(200)]
            async with open_producer([cluster.namesrv]) as producer:
                for v in late:
                    await producer.send("ft", v.encode())
            values += late
            await await_until(lambda: _all_settled(cluster, len(values)), WAIT_S, f"all settled:\n{c.text()}")
        seen = Counter(r.value for r in c.got())
        assert confirmed_before, "acknowledgements were confirmed before the kill"
        assert all(seen[v] == 1 for v in confirmed_before), "a confirmed acknowledgement was lost"
        assert set(seen) == set(values)


@pytest.mark.slow
async def test_share_apis_need_read_on_the_group_and_on_each_topic(tmp_path: Path) -> None:
    """With ACLs: alice may READ group ag and topic "ok" but not topic "no": her share
    fetch of both is served for "ok" and answered TOPIC_AUTHORIZATION_FAILED for "no"
    (nothing popped there); another group is GROUP_AUTHORIZATION_FAILED whole."""
    acls = [allow("User:alice", "READ", "GROUP", "ag"), allow("User:alice", "READ", "TOPIC", "ok")]
    async with open_secure_kafka(tmp_path, acls=acls) as cluster:
        with wire_as(cluster, "admin") as admin:
            create_topics(admin, "ok", "no")
            for topic in ("ok", "no"):
                assert produce_one(admin, topic, b"x") == 0
            meta = admin.request(ApiKey.METADATA, 12, {"topics": [{"name": "ok"}, {"name": "no"}]})
            tids = {t["name"]: t["topic_id"] for t in meta["topics"]}
        with wire_as(cluster, "alice") as alice:
            body = _fetch_body("ag", "m1", 0, tids["ok"], WAIT_S * 1000)
            body["topics"].append({**body["topics"][0], "topic_id": tids["no"]})

            def served() -> dict[str, Any] | None:  # REPLICA_NOT_AVAILABLE while the broker's POP state loads
                answer = alice.request(ApiKey.SHARE_FETCH, 2, body)
                rows = {t["topic_id"]: t["partitions"][0] for t in answer["responses"]}
                return None if rows[tids["ok"]]["error_code"] == ErrorCode.REPLICA_NOT_AVAILABLE else rows

            rows = await await_until(served, WAIT_S, "alice's share fetch served")
            assert rows[tids["ok"]]["error_code"] == 0 and rows[tids["ok"]]["acquired_records"], rows
            assert rows[tids["no"]]["error_code"] == ErrorCode.TOPIC_AUTHORIZATION_FAILED, rows
            other = alice.request(ApiKey.SHARE_FETCH, 2, {**body, "group_id": "other"})
            assert other["error_code"] == ErrorCode.GROUP_AUTHORIZATION_FAILED and other["responses"] == [], other
            hb = {"group_id": "other", "member_id": "m1", "member_epoch": 0, "rack_id": None}
            denied = alice.request(ApiKey.SHARE_GROUP_HEARTBEAT, 1, {**hb, "subscribed_topic_names": ["ok"]})
            assert denied["error_code"] == ErrorCode.GROUP_AUTHORIZATION_FAILED, denied


OPS = st.lists(st.tuples(st.sampled_from("abc"), st.integers(-1, 5), st.booleans()), max_size=40)


@given(OPS, st.integers(1, 3))
def test_share_sessions_follow_kip_932_epochs(ops: list[tuple[str, int, bool]], limit: int) -> None:
    """Any requests: epoch 0 opens (ShareFetch only; SHARE_SESSION_LIMIT_REACHED past
    the limit), -1 closes, an epoch without a session is SHARE_SESSION_NOT_FOUND, one
    older than expected INVALID_SHARE_SESSION_EPOCH, a later one is taken (lenient)."""
    sessions = ShareSessions(limit, idle_ms=10**9)
    model: dict[str, int] = {}
    for member, epoch, opening in ops:
        got = sessions.enter("g", member, epoch, opening=opening)
        if epoch == 0 and not opening:
            assert got == ErrorCode.INVALID_SHARE_SESSION_EPOCH
        elif epoch == 0:
            full = member not in model and len(model) >= limit
            assert got == SHARE_SESSION_LIMIT_REACHED if full else got == sessions.sessions[("g", member)]
            if not full:
                model[member] = 1
        elif member not in model:
            assert got == ErrorCode.SHARE_SESSION_NOT_FOUND
        elif epoch == -1:
            assert isinstance(got, ShareSession)
            sessions.close("g", member)
            del model[member]
        elif epoch < model[member]:
            assert got == ErrorCode.INVALID_SHARE_SESSION_EPOCH
        else:
            assert isinstance(got, ShareSession) and got.epoch == epoch + 1
            model[member] = epoch + 1
    assert {m for _, m in sessions.sessions} == set(model)


def test_a_full_session_table_drops_its_idle_sessions() -> None:
    sessions = ShareSessions(1, idle_ms=0)
    assert isinstance(sessions.enter("g", "gone", 0, opening=True), ShareSession)
    assert isinstance(sessions.enter("g", "new", 0, opening=True), ShareSession), "the idle one made room"
    assert set(sessions.sessions) == {("g", "new")}
    busy = ShareSessions(1, idle_ms=10**9)
    busy.enter("g", "a", 0, opening=True)
    assert busy.enter("g", "b", 0, opening=True) == SHARE_SESSION_LIMIT_REACHED


async def test_a_session_forgets_held_records_whose_lock_ran_out_and_went_to_another_member(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """m1 acquires 3 records and lets their lock run out; m2 acquires them (delivery
    count 2). m1's next ShareFetch forgets them (its held map kept them for ever before);
    m2's keeps its own. An in-process broker, so that the sessions can be looked at."""
    with trio.fail_after(WAIT_S):  # every await bounded
        c = Cluster(nursery, tmp_path)
        await c.start_nameserver()
        b = await c.start_broker(kafka_listen_port=0, kafka_share_record_lock_duration_ms=300, **FAST_POP)
        await c.create_topic("held", 1)
        async with open_admin(c.ns) as admin:
            await Popper(admin, b.addr).send("held", [b"a", b"b", b"c"])
        assert b.kafka is not None
        sessions = b.kafka.share.sessions.sessions
        with KafkaWire(b.kafka.kafka_addr()) as w:

            async def call(api: ApiKey, version: int, body: dict[str, Any]) -> dict[str, Any]:
                return await trio.to_thread.run_sync(w.request, api, version, body)

            tid = (await call(ApiKey.METADATA, 12, {"topics": [{"name": "held"}]}))["topics"][0]["topic_id"]
            for member in ("m1", "m2"):
                hb = {"group_id": "hg", "member_id": member, "member_epoch": 0, "rack_id": None}
                joined = await call(ApiKey.SHARE_GROUP_HEARTBEAT, 1, {**hb, "subscribed_topic_names": ["held"]})
                assert joined["error_code"] == 0, joined
            epochs = {"m1": 0, "m2": 0}

            async def acquire(member: str, want: int, wait_ms: int) -> list[dict[str, Any]]:
                got: list[dict[str, Any]] = []
                with trio.fail_after(20):
                    while True:  # one fetch at least
                        body = _fetch_body("hg", member, epochs[member], tid, wait_ms)
                        part = _partition(await call(ApiKey.SHARE_FETCH, 2, body))
                        epochs[member] += 1
                        if part["error_code"] == ErrorCode.REPLICA_NOT_AVAILABLE:  # the POP state loads
                            epochs[member] = 0
                            continue
                        got += part["acquired_records"]
                        if sum(a["last_offset"] - a["first_offset"] + 1 for a in got) >= want:
                            return got

            assert {a["delivery_count"] for a in await acquire("m1", 3, 2000)} == {1}
            assert len(sessions[("hg", "m1")].held) == 3
            assert {a["delivery_count"] for a in await acquire("m2", 3, 2000)} == {2}  # m1's lock ran out
            assert await acquire("m1", 0, 0) == []  # a fetch: nothing new, the stale ones forgotten
            assert len(sessions[("hg", "m1")].held) == 0
            assert await acquire("m2", 0, 0) == []
            assert len(sessions[("hg", "m2")].held) == 3

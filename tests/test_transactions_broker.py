"""Transactional messages on a real broker, driven by raw requests (the client's side is
tested in its own files): the checks at the door, commit, rollback, a second end,
check-back after transaction_timeout_ms, unresolved halves rolled back or kept,
retention holding a pending half, the rebuild after a restart, metrics, and the op
record a commit lost (the rebuild's scan of the log after the checkpoint's mark)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.exposition import generate_latest

from clmq.broker.service import Broker
from clmq.broker.service.transaction._pending import COMMITTED, ROLLED_BACK, Ended, Half, PendingSet
from clmq.broker.service.transaction._requests import check_half
from clmq.broker.service.transaction._state import OpMarks, TransactionCheckpoint, rebuild
from clmq.broker.store import Store, StoreConfig
from clmq.client import Record, open_admin, open_consumer
from clmq.commitlog import CommitLog, CommitLogConfig
from clmq.common import (
    PROP_TRAN_HALF,
    TRANS_HALF_TOPIC,
    TRANS_OP_COMMIT,
    TRANS_OP_TOPIC,
    Message,
    decode_record,
)
from clmq.protocol import ErrorCode, RequestCode, encode_batch
from clmq.protocol.kafka import ApiKey
from clmq.protocol.kafka import ErrorCode as KafkaError
from clmq.protocol.transport import RequestError, RpcClient, RpcError
from tests.cli_helpers import ENV
from tests.kafka_procs import in_thread, kcat, open_kafka
from tests.kafka_wire import KafkaWire
from tests.service_helpers import FAST_CONSUMER, Cluster, cluster_in_thread
from tests.test_kafka_faults import FETCH_V, fetch_body
from tests.test_replication import caught_up, start_group
from tests.test_security_native import ADMIN, ALICE, login, seeded_with
from tests.waiting import await_until

from .conftest import msgs

FAST = {"transaction_check_interval_ms": 50, "transaction_checkpoint_interval_ms": 100}


def half(body: bytes, group: str = "pg", topic: str = "t", qid: int = 1, **extra: str) -> Message:
    props = {"REAL_TOPIC": topic, "REAL_QID": str(qid), "REAL_TAGS": "TagA", "TRAN_GROUP": group}
    props["UNIQ_KEY"] = "U-" + body.decode()
    return Message(TRANS_HALF_TOPIC, 0, body, "", "key-" + body.decode(), {**props, **extra})


class Raw:
    """Raw requests to one broker (the transactional producer's side of the wire)."""

    def __init__(self, admin: Any, addr: str) -> None:
        self.admin, self.addr = admin, addr

    async def send(self, *messages: Message) -> list[int]:
        reply = await self.admin.rpc.request(
            self.addr, RequestCode.SEND_MESSAGE, {"topic": TRANS_HALF_TOPIC}, encode_batch(list(messages))
        )
        offsets: list[int] = reply.fields["commitlog_offsets"]
        return offsets

    async def end(self, offset: int, action: str, group: str = "pg", **more: Any) -> dict[str, Any]:
        fields = {"group": group, "commitlog_offset": offset, "action": action, **more}
        reply = await self.admin.rpc.request(self.addr, RequestCode.END_TRANSACTION, fields)
        return dict(reply.fields)

    async def check(self, group: str = "pg", wait_ms: int = 0) -> tuple[list[list[int]], bytes]:
        fields = {"group": group, "client_id": "c1", "max_wait_ms": wait_ms}
        reply = await self.admin.rpc.request(
            self.addr, RequestCode.CHECK_TRANSACTIONS, fields, timeout_ms=wait_ms + 5000
        )
        return reply.fields["checks"], reply.body

    async def list(self, group: str | None = None) -> dict[str, Any]:
        fields = {"group": group} if group else {}
        return dict((await self.admin.rpc.request(self.addr, RequestCode.LIST_TRANSACTIONS, fields)).fields)

    async def info(self) -> dict[str, Any]:
        return dict((await self.admin.rpc.request(self.addr, RequestCode.BROKER_INFO, {})).fields)


async def _cluster(nursery: trio.Nursery, root: Path, **settings: Any) -> tuple[Cluster, Broker]:
    c = Cluster(nursery, root)
    await c.start_nameserver()
    broker = await c.start_broker(**{**FAST, **settings})
    await c.create_topic("t", 2)
    return c, broker


async def _running(raw: Raw) -> None:
    await await_until(lambda: _pending_known(raw), 10, "the transaction service to start")


async def _pending_known(raw: Raw) -> bool:
    return int((await raw.info())["transactions_pending"]) >= 0


async def _receive(c: Cluster, n: int, quiet_s: float = 0.5) -> list[Record]:
    """``n`` records of topic t, then whatever else comes within ``quiet_s`` (nothing should)."""
    got: list[Record] = []
    async with open_consumer(c.ns, "cg", {"t": "*"}, **FAST_CONSUMER) as consumer:
        with trio.fail_after(15):
            while len(got) < n:
                got += await consumer.receive()
        with trio.move_on_after(quiet_s):
            while True:
                got += await consumer.receive()
    return got


async def test_commit_shows_the_message_once_rollback_never(nursery: trio.Nursery, tmp_path: Path) -> None:
    c, broker = await _cluster(nursery, tmp_path)
    async with open_admin(c.ns) as admin:
        raw = Raw(admin, broker.addr)
        await _running(raw)
        yes, no = await raw.send(half(b"yes"), half(b"no"))
        listed = await raw.list("pg")
        assert listed["total"] == 2 and [r["commitlog_offset"] for r in listed["pending"]] == [yes, no]
        assert listed["pending"][0]["uniq_key"] == "U-yes" and listed["pending"][0]["topic"] == "t"
        assert (await raw.list("other"))["total"] == 0
        committed = await raw.end(yes, "commit")
        assert committed["state"] == "committed" and committed["queue_id"] == 1
        assert (await raw.end(no, "rollback"))["state"] == "rolled_back"
        # Exactly once: a second end of either, whatever it asks, appends nothing.
        again = await raw.end(yes, "commit")
        assert again["state"] == "already_committed" and again["msg_id"] == committed["msg_id"]
        assert (await raw.end(yes, "rollback"))["state"] == "already_committed"
        assert (await raw.end(no, "commit"))["state"] == "already_rolled_back"
        with pytest.raises(RpcError) as e:
            await raw.end(no + 1, "commit")
        assert e.value.code == ErrorCode.NOT_FOUND
        got = await _receive(c, 1)
        assert [r.body for r in got] == [b"yes"]
        r = got[0]
        assert (r.topic, r.queue_id, r.queue_offset, r.tags, r.keys) == (
            "t",
            1,
            committed["queue_offset"],
            "TagA",
            "key-yes",
        )
        assert r.properties["UNIQ_KEY"] == "U-yes" and r.properties[PROP_TRAN_HALF] == str(yes)
        assert not {"REAL_TOPIC", "REAL_QID", "REAL_TAGS", "TRAN_GROUP"} & r.properties.keys()
        listed = await raw.list()
        assert (listed["total"], listed["committed"], listed["rolled_back"]) == (0, 1, 1)
        page = generate_latest(broker.metrics).decode()
        assert "clmq_transactions_committed_total 1.0" in page and "clmq_transactions_pending 0.0" in page
        assert "clmq_transactions_rolled_back_total 1.0" in page


@pytest.mark.parametrize(
    "why",
    ["no real topic", "unknown topic", "bad queue", "no group", "no tags", "system topic", "forged", "queue 1"],
)
async def test_a_malformed_half_message_is_refused_naming_it(nursery: trio.Nursery, tmp_path: Path, why: str) -> None:
    c, broker = await _cluster(nursery, tmp_path)
    bad = half(b"bad")
    props = dict(bad.properties)
    qid = 0
    if why == "no real topic":
        del props["REAL_TOPIC"]
    elif why == "unknown topic":
        props["REAL_TOPIC"] = "nope"
    elif why == "bad queue":
        props["REAL_QID"] = "7"
    elif why == "no group":
        del props["TRAN_GROUP"]
    elif why == "no tags":
        del props["REAL_TAGS"]
    elif why == "system topic":
        props["REAL_TOPIC"] = "%TIMER%"
    elif why == "forged":
        props[PROP_TRAN_HALF] = "0"
    else:
        qid = 1
    msgs = [half(b"good"), Message(TRANS_HALF_TOPIC, qid, b"bad", "", "", props)]
    async with open_admin(c.ns) as admin:
        raw = Raw(admin, broker.addr)
        with pytest.raises(RpcError) as e:
            await raw.send(*msgs)
        assert e.value.code in (ErrorCode.INVALID_MESSAGE, ErrorCode.TOPIC_NOT_FOUND, ErrorCode.INVALID_QUEUE_ID)
        assert "message 1" in e.value.text
        await _running(raw)
        assert (await raw.list())["total"] == 0  # nothing of the batch was stored


async def test_the_op_topic_and_too_many_pending_are_refused(nursery: trio.Nursery, tmp_path: Path) -> None:
    c, broker = await _cluster(nursery, tmp_path, transaction_max_pending=2)
    async with open_admin(c.ns) as admin:
        raw = Raw(admin, broker.addr)
        await _running(raw)
        with pytest.raises(RpcError) as e:
            op = Message(TRANS_OP_TOPIC, TRANS_OP_COMMIT, b"", "0", "", {})
            await admin.rpc.request(
                broker.addr, RequestCode.SEND_MESSAGE, {"topic": TRANS_OP_TOPIC}, encode_batch([op])
            )
        assert e.value.code == ErrorCode.INVALID_TOPIC
        first = await raw.send(half(b"1"), half(b"2"))
        await await_until(lambda: _pending_is(raw, 2), 5, "both halves pending")
        with pytest.raises(RpcError) as e:
            await raw.send(half(b"3"))
        assert e.value.code == ErrorCode.SYSTEM_BUSY and "transaction_max_pending" in e.value.text
        await raw.end(first[0], "rollback")
        await raw.send(half(b"3"))  # room again


async def _pending_is(raw: Raw, n: int) -> bool:
    return int((await raw.info())["transactions_pending"]) == n


async def test_a_half_left_open_is_checked_back_after_the_timeout(nursery: trio.Nursery, tmp_path: Path) -> None:
    c, broker = await _cluster(nursery, tmp_path, transaction_timeout_ms=400)
    async with open_admin(c.ns) as admin:
        raw = Raw(admin, broker.addr)
        await _running(raw)
        sent_at = time.monotonic()
        (off,) = await raw.send(half(b"unsure"))
        checks, body = await raw.check("pg", wait_ms=5000)
        waited = time.monotonic() - sent_at
        assert checks == [[off, 1]] and waited >= 0.35, f"checked after {waited:.2f} s"
        record = decode_record(body, 0)
        assert (record.commitlog_offset, record.body, record.properties["TRAN_GROUP"]) == (off, b"unsure", "pg")
        assert (await raw.check("other", wait_ms=200))[0] == []  # another group is never asked
        assert (await raw.check("pg", wait_ms=100))[0] == []  # asked again only after the timeout
        assert (await raw.list("pg"))["pending"][0]["checks"] == 1
        assert (await raw.end(off, "commit", from_check=True))["state"] == "committed"
    assert [r.body for r in await _receive(c, 1)] == [b"unsure"]


@pytest.mark.parametrize("unresolved", ["rollback", "keep"])
async def test_an_unresolved_half_is_rolled_back_or_kept_after_the_most_checks(
    nursery: trio.Nursery, tmp_path: Path, unresolved: str, caplog: pytest.LogCaptureFixture
) -> None:
    c, broker = await _cluster(
        nursery, tmp_path, transaction_timeout_ms=150, transaction_check_max=2, transaction_unresolved=unresolved
    )
    async with open_admin(c.ns) as admin:
        raw = Raw(admin, broker.addr)
        await _running(raw)
        (off,) = await raw.send(half(b"limbo"))
        for n in (1, 2):  # asked, left unanswered (UNKNOWN)
            assert (await raw.check("pg", wait_ms=3000))[0] == [[off, n]]
        if unresolved == "rollback":
            await await_until(lambda: _pending_is(raw, 0), 5, "the unresolved half rolled back")
            assert (await raw.end(off, "commit"))["state"] == "already_rolled_back"
            assert any("rolled back" in r.message and "pg" in r.message for r in caplog.records)
        else:
            assert (await raw.check("pg", wait_ms=600))[0] == []  # never asked again
            assert (await raw.list())["pending"][0]["checks"] == 2
            assert (await raw.end(off, "commit"))["state"] == "committed"
    assert [r.body for r in await _receive(c, 1 if unresolved == "keep" else 0)] == (
        [b"limbo"] if unresolved == "keep" else []
    )


async def test_a_restart_keeps_pending_halves_and_their_check_counts(nursery: trio.Nursery, tmp_path: Path) -> None:
    settings = {**FAST, "transaction_timeout_ms": 200}
    c, broker = await _cluster(nursery, tmp_path, **settings)
    async with open_admin(c.ns) as admin:
        raw = Raw(admin, broker.addr)
        await _running(raw)
        a, b, d = await raw.send(half(b"a"), half(b"b"), half(b"d"))
        await raw.end(a, "commit")
        assert (await raw.check("pg", wait_ms=3000))[0] == [[b, 1], [d, 1]]
        await raw.end(d, "rollback")
    await c.stop_broker("broker-a")
    broker = await c.start_broker(**settings)
    async with open_admin(c.ns) as admin:
        raw = Raw(admin, broker.addr)
        await _running(raw)
        listed = await raw.list()
        assert [(r["commitlog_offset"], r["checks"]) for r in listed["pending"]] == [(b, 1)]
        assert (await raw.end(a, "commit"))["state"] == "already_committed"
        assert (await raw.end(d, "commit"))["state"] == "already_rolled_back"
        assert (await raw.check("pg", wait_ms=3000))[0] == [[b, 2]]
        assert (await raw.end(b, "commit"))["state"] == "committed"
    assert sorted(r.body for r in await _receive(c, 2)) == [b"a", b"b"]


async def test_retention_keeps_a_pending_half(nursery: trio.Nursery, tmp_path: Path) -> None:
    c, broker = await _cluster(nursery, tmp_path, segment_bytes=64 * 1024, max_message_bytes=8 * 1024)
    async with open_admin(c.ns) as admin:
        raw = Raw(admin, broker.addr)
        await _running(raw)
        (off,) = await raw.send(half(b"held"))
        filler = [Message("t", 0, b"x" * 4000) for _ in range(16)]
        for _ in range(8):  # several segments after it
            await admin.rpc.request(broker.addr, RequestCode.SEND_MESSAGE, {"topic": "t"}, encode_batch(filler))
        await await_until(lambda: _pending_is(raw, 1), 5, "the half pending")
        far_future = time.time() + 10**6  # every segment is past retention_ms then
        assert await trio.to_thread.run_sync(broker.store.apply_retention, far_future) == 0
        assert broker.store.log.min_offset <= off, "retention deleted a pending half message"
        assert (await raw.end(off, "commit"))["state"] == "committed"

        async def released() -> bool:  # at the checker's next look (the floor is read between looks)
            return await trio.to_thread.run_sync(broker.store.apply_retention, far_future) > 0

        await await_until(released, 5, "retention to delete the segments once the half is committed")


def test_a_commit_whose_op_record_was_lost_gets_it_at_the_rebuild(tmp_path: Path) -> None:
    """The one case a crash splits a commit (a segment roll between the message and its
    op, or a follower's partial copy): the rebuild finds the committed copy after the
    checkpoint's mark and reports the half as committed, never pending again."""
    store = Store.open(StoreConfig(tmp_path / "s")).start()
    try:
        store.create_topic("t", 2)
        store.create_topic(TRANS_HALF_TOPIC, 1)
        store.create_topic(TRANS_OP_TOPIC, 3)
        put = store.put_batch([half(b"lost-op"), half(b"pending")], wait_durable=True)
        lost, pending = put.commitlog_offsets
        mark = store.log.write_offset
        real = Message("t", 1, b"lost-op", "TagA", "", {PROP_TRAN_HALF: str(lost), "UNIQ_KEY": "U-lost-op"})
        store.put_batch([real], wait_durable=True)  # the message, its op record gone
        store.catch_up()
        rebuilt = rebuild(store, TransactionCheckpoint(mark, 0, 0))
        assert rebuilt.orphans == [lost]
        assert sorted(rebuilt.halves.pending) == [lost, pending]  # the service ends the orphan first
        assert rebuild(store, TransactionCheckpoint(store.log.write_offset, 0, 0)).orphans == []  # mark past it
    finally:
        store.close()


@pytest.mark.parametrize("floors", [(None, None), (None, 2), (5, 2), (2, 5), (7, None)])
def test_retention_keeps_from_the_lowest_floor_of_every_holder(tmp_path: Path, floors: tuple[int | None, ...]) -> None:
    """The timer and transactions each hold the log from their oldest pending record
    (``hold_retention``): retention deletes only below the lowest of them."""
    cfg = CommitLogConfig(segment_bytes=32 * 1024, max_message_bytes=4096, retention_ms=1000)
    lg = CommitLog.open(tmp_path, cfg, clean=True, checkpoint_offset=None)
    try:
        for i in range(20):
            lg.append(msgs("t", 20, 1, size=900, start=i * 20))
        bases = [base for base, _, _ in lg.segments()]
        assert len(bases) > 8
        for segment in floors:  # a floor inside segment ``segment`` (None: holds nothing)
            lg.hold_retention(lambda s=segment: None if s is None else bases[s] + 10)
        held = [s for s in floors if s is not None]
        lg.delete_expired(now=time.time() + 10)
        expect = bases[min(held)] if held else bases[-1]
        assert lg.min_offset == expect
    finally:
        lg.close()


# ---------------------------------------------------------------- invisible until committed
async def test_clmq_consume_and_listings_never_show_a_half_message(nursery: trio.Nursery, tmp_path: Path) -> None:
    c, broker = await _cluster(nursery, tmp_path)
    async with open_admin(c.ns) as admin:
        raw = Raw(admin, broker.addr)
        await _running(raw)
        hidden, shown = await raw.send(half(b"hidden"), half(b"shown"))
        assert not [t for t in await admin.list_topics() if t.startswith("%")]
        before = await _clmq_consume(c.ns[0], tmp_path, "g1")
        assert before == [], before
        await raw.end(shown, "commit")
        await raw.end(hidden, "rollback")
        after = await _clmq_consume(c.ns[0], tmp_path, "g2")
        assert [json.loads(line)["body"] for line in after] == ["shown"]


async def _clmq_consume(ns: str, cwd: Path, group: str) -> list[str]:
    done = await trio.run_process(
        [sys.executable, "-m", "clmq", "consume", "t", "--group", group, "-o", "json"]
        + ["--namesrv", ns, "--idle-timeout", "1.5"],
        cwd=cwd,
        capture_stdout=True,
        capture_stderr=True,
        env=ENV,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    return [line for line in done.stdout.decode().splitlines() if line.strip()]


async def test_the_kafka_listener_never_shows_a_half_message(tmp_path: Path) -> None:
    async with open_kafka(tmp_path) as kafka:
        broker = kafka.brokers["b0"][0]
        async with open_admin(None, broker_addrs=[broker.addr]) as admin:
            await admin.create_topic("t", 2)
            raw = Raw(admin, broker.addr)
            await _running(raw)
            (off,) = await raw.send(half(b"secret", qid=0))
            listing = json.loads(await kcat("-L", "-b", kafka.bootstrap, "-J"))
            assert sorted(t["topic"] for t in listing["topics"]) == ["t"]
            fmt = "%t %p %o %s\\n"
            assert await kcat("-C", "-b", kafka.bootstrap, "-t", "t", "-o", "beginning", "-e", "-f", fmt) == ""
            # Asked for by name over the wire, the system topics do not exist for Kafka clients.
            with KafkaWire(kafka.kafka_addr("b0")) as w:
                for name in (TRANS_HALF_TOPIC, TRANS_OP_TOPIC):
                    (p,) = (await in_thread(w.request, ApiKey.FETCH, FETCH_V, fetch_body(name, 0, 0)))["responses"][0][
                        "partitions"
                    ]
                    assert p["error_code"] == KafkaError.UNKNOWN_TOPIC_OR_PARTITION and not p["records"], p
            await raw.end(off, "commit")
        out = await kcat("-C", "-b", kafka.bootstrap, "-t", "t", "-o", "beginning", "-e", "-f", fmt)
        assert out.splitlines() == ["t 0 0 secret"]


@pytest.mark.slow
def test_the_spark_reader_never_shows_a_half_message(spark: Any, tmp_path: Path) -> None:
    with cluster_in_thread(tmp_path) as c:
        broker = c.brokers["broker-a"]

        async def send_half_then(action: str | None, offset: int = 0) -> int:
            async with open_admin(None, broker_addrs=[broker.addr]) as admin:
                raw = Raw(admin, broker.addr)
                await _running(raw)
                if action is not None:
                    await raw.end(offset, action)
                    return offset
                await admin.rpc.request(
                    broker.addr,
                    RequestCode.SEND_MESSAGE,
                    {"topic": "sync"},
                    encode_batch([Message("sync", 0, b"plain")]),
                )
                return (await raw.send(half(b"pending", topic="sync")))[0]

        def read(**options: str) -> list[tuple[str, bytes]]:
            store = broker.store
            assert store.wait_durable(store.end_offset, 10)
            store.catch_up()
            df = spark.read.format("clmq").options(nameserver=c.ns[0], **options).load()
            return sorted((r["topic"], bytes(r["body"])) for r in df.collect())

        offset = trio.run(send_half_then, None)
        assert read() == [("sync", b"plain")]  # every user topic: system topics only when named
        assert read(topics="sync") == [("sync", b"plain")]
        trio.run(send_half_then, "commit", offset)
        assert read(topics="sync") == [("sync", b"pending"), ("sync", b"plain")]


# ---------------------------------------------------------------- access control
async def test_transactional_requests_need_write_on_the_group_and_the_real_topic(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """alice may WRITE topic v and the transactional id (producer group) pg: her half
    messages for 'secret' or of group 'other' are refused; she cannot end admin's half
    for 'secret' (it stays pending) nor poll group 'other'; a check-back hands her only
    her own topic's halves; the pending list needs DESCRIBE on the cluster."""
    cluster = Cluster(nursery, tmp_path)
    acl = [
        ["TOPIC", "v", "LITERAL", "User:alice", "*", "WRITE", "ALLOW"],
        ["TRANSACTIONAL_ID", "pg", "LITERAL", "User:alice", "*", "WRITE", "ALLOW"],
    ]
    addr = await seeded_with(cluster, tmp_path, acl, **FAST, transaction_timeout_ms=200)
    async with trio.open_nursery() as n:
        admin, alice = RpcClient(n), RpcClient(n)
        assert (await login(admin, addr, *ADMIN)).error_code == 0
        assert (await login(alice, addr, *ALICE)).error_code == 0
        as_admin, as_alice = Raw(_Rpc(admin), addr), Raw(_Rpc(alice), addr)
        await _running(as_admin)
        (secret,) = await as_admin.send(half(b"s", topic="secret", qid=0))
        for refused, named in ((half(b"a", topic="secret", qid=0), "secret"), (half(b"b", "other", "v", 0), "other")):
            with pytest.raises(RpcError) as e:
                await as_alice.send(refused)
            assert e.value.code == ErrorCode.NOT_AUTHORIZED and named in e.value.text, e.value
        (mine,) = await as_alice.send(half(b"v", topic="v", qid=0))
        with pytest.raises(RpcError) as e:
            await as_alice.end(secret, "commit")
        assert e.value.code == ErrorCode.NOT_AUTHORIZED
        with pytest.raises(RpcError) as e:
            await as_alice.check("other", wait_ms=0)
        assert e.value.code == ErrorCode.NOT_AUTHORIZED
        assert (await as_alice.check("pg", wait_ms=3000))[0] == [[mine, 1]]
        with pytest.raises(RpcError) as e:
            await as_alice.list()
        assert e.value.code == ErrorCode.NOT_AUTHORIZED
        listed = await as_admin.list()
        assert [r["commitlog_offset"] for r in listed["pending"]] == [secret, mine]
        assert (await as_alice.end(mine, "commit"))["state"] == "committed"
        await admin.aclose()
        await alice.aclose()


class _Rpc:
    """An RpcClient where :class:`Raw` expects an admin (``.rpc``)."""

    def __init__(self, rpc: RpcClient) -> None:
        self.rpc = rpc


# ---------------------------------------------------------------- the pending set, pure
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["add", "commit", "rollback", "look", "ask"]), st.integers(0, 30), st.integers(0, 50)
        ),
        max_size=120,
    )
)
@settings(max_examples=300, deadline=None)
def test_the_pending_set_hands_every_due_half_once_and_never_revives_an_ended_one(
    ops: list[tuple[str, int, int]],
) -> None:
    """Whatever the order of sends, ends, looks and checks: an ended half never comes
    back (not even when read again from the queue), every half stored or asked about
    ``timeout`` ago is ready for its group's poll, none sooner, and the retention
    floor is at or below every pending half."""
    timeout, now = 10, 0
    s = PendingSet(ended_kept=5)
    ended: set[int] = set()
    for op, key, dt in ops:
        now += dt // 10
        offset = 100 * key
        if op == "add" and offset >= s.read_to:  # read from the queue, or found by an END: never behind read_to
            before = offset in s.pending or offset in s.ended
            assert s.add(Half(offset, 100, key, f"g{key % 3}", "t", 0, now)) == (not before)
        elif op in ("commit", "rollback") and offset in s.pending:
            s.end(offset, Ended(COMMITTED if op == "commit" else ROLLED_BACK))
            ended.add(offset)
            s.read_to = max(s.read_to, offset + 100)
        elif op == "look":
            for half in s.take_due(now, timeout):
                assert max(half.stored_ms, half.last_check_ms) <= now - timeout
                s.make_ready(half)
        elif op == "ask":
            group = f"g{key % 3}"
            s.asked(s.ready_of(group)[:2], now)
        assert not ended & s.pending.keys()
        assert all(s.floor() <= off for off in s.pending)
        assert len(s.ended) <= 5 or min(s.ended) >= s.read_to
    for half in s.take_due(now, timeout):
        s.make_ready(half)
    for half in s.pending.values():
        due = max(half.stored_ms, half.last_check_ms) <= now - timeout
        assert (half in s.ready_of(half.group)) == due, (half.offset, half.stored_ms, half.last_check_ms, now)


def test_an_old_pending_half_does_not_make_the_set_grow_with_every_later_end() -> None:
    s = PendingSet()
    s.add(Half(0, 100, 0, "g", "t", 0, 0))  # kept pending for ever (transaction_unresolved "keep")
    for i in range(1, 20_001):
        s.add(Half(100 * i, 100, i, "g", "t", 0, i))
        s.end(100 * i, Ended(COMMITTED))
        s.read_to = 100 * i + 100
        if i % 1000 == 0:  # a checkpoint
            assert s.lowest_queue_offset() == 0
    assert len(s.order) <= 2 * len(s.pending) + 1024 + 1000 and s.floor() == 0
    assert len(s.ended) <= s.ended_kept


async def test_a_broker_writes_the_op_record_a_commit_lost_once_and_commits_nothing_twice(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """A store left with a committed message whose op record is missing (what a crash
    inside a segment roll leaves): the broker starting on it writes the op record once,
    answers already_committed, and the message is in its queue once, across restarts."""
    store = Store.open(StoreConfig(tmp_path / "broker-a")).start()
    try:
        for topic, queues in (("t", 2), (TRANS_HALF_TOPIC, 1), (TRANS_OP_TOPIC, 3)):
            store.create_topic(topic, queues)
        lost, pending = store.put_batch([half(b"lost-op"), half(b"pending")], wait_durable=True).commitlog_offsets
        real = Message("t", 1, b"lost-op", "TagA", "", {PROP_TRAN_HALF: str(lost), "UNIQ_KEY": "U-lost-op"})
        store.put_batch([real], wait_durable=True)
    finally:
        store.close()
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    for _ in range(2):  # the start that repairs, then one more
        broker = await c.start_broker(**FAST)
        async with open_admin(None, broker_addrs=[broker.addr]) as admin:
            raw = Raw(admin, broker.addr)
            await _running(raw)
            assert [r["commitlog_offset"] for r in (await raw.list())["pending"]] == [pending]
            assert (await raw.end(lost, "commit"))["state"] == "already_committed"
            ops = await admin.rpc.request(
                broker.addr, RequestCode.QUERY_OFFSETS, {"topic": TRANS_OP_TOPIC, "queue_id": 0}
            )
            assert ops.fields["max_offset"] == 1  # one op record, written once
        await c.stop_broker("broker-a")
    broker = await c.start_broker(**FAST)
    await c.wait_routed("t", {"broker-a"})
    assert [r.body for r in await _receive(c, 1)] == [b"lost-op"]


async def test_a_follower_keeps_the_leader_s_pending_half_and_promoted_ends_it(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """The follower adopts its leader's checkpoint: its retention keeps the pending half
    message; promoted, it rebuilds and the half ends there (once)."""
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    common = {**FAST, "segment_bytes": 64 * 1024, "max_message_bytes": 8 * 1024}
    lead, (f,) = await start_group(c, 1, common=common)
    await c.create_topic("t", 2)
    async with open_admin(None, broker_addrs=[lead.addr]) as admin:
        raw = Raw(admin, lead.addr)
        await _running(raw)
        (off,) = await raw.send(half(b"held"))
        filler = encode_batch([Message("t", 0, b"x" * 4000) for _ in range(16)])
        for _ in range(8):  # segments after it
            await admin.rpc.request(lead.addr, RequestCode.SEND_MESSAGE, {"topic": "t"}, filler)
        await await_until(lambda: _pending_is(raw, 1), 5, "the half pending on the leader")
    end = await caught_up(lead, [f])
    await await_until(
        lambda: f.handlers.transactions.saved.mark_offset >= end, 10, "the follower adopting a checkpoint"
    )
    assert f.handlers.transactions.saved.floor_offset <= off and f.handlers.transactions.halves is None
    await trio.to_thread.run_sync(f.store.apply_retention, time.time() + 10**6)
    assert f.store.log.min_offset <= off, "the follower's retention deleted a pending half message"
    await c.stop_broker("g0")
    async with open_admin(None, broker_addrs=[f.addr]) as admin:
        promoted = await admin.rpc.request(f.addr, RequestCode.PROMOTE, {"force": True})
        assert promoted.fields["role"] == "leader"
        raw = Raw(admin, f.addr)
        await _running(raw)
        assert [r["commitlog_offset"] for r in (await raw.list())["pending"]] == [off]
        assert (await raw.end(off, "commit"))["state"] == "committed"
        assert (await raw.end(off, "commit"))["state"] == "already_committed"


def test_a_message_of_another_queue_carrying_tran_half_is_no_commit(tmp_path: Path) -> None:
    store = Store.open(StoreConfig(tmp_path / "s")).start()
    try:
        for topic, queues in (("t", 2), (TRANS_HALF_TOPIC, 1), (TRANS_OP_TOPIC, 3)):
            store.create_topic(topic, queues)
        (off,) = store.put_batch([half(b"h", qid=1)], wait_durable=True).commitlog_offsets
        forged = Message("t", 0, b"forged", "", "", {PROP_TRAN_HALF: str(off)})  # queue 0, not the half's 1
        store.put_batch([forged], wait_durable=True)
        store.catch_up()
        assert rebuild(store, TransactionCheckpoint(0, 0, 0)).orphans == []
    finally:
        store.close()


async def test_a_restart_reads_the_op_queues_only_from_the_checkpoint(nursery: trio.Nursery, tmp_path: Path) -> None:
    """Ends older than the oldest pending half are not read again at a start (the
    checkpoint's ops_from): the pending set comes out the same; an END of a half ended
    that long ago is NOT_FOUND (the ended map holds the recent ones only)."""
    c, broker = await _cluster(nursery, tmp_path)
    async with open_admin(c.ns) as admin:
        raw = Raw(admin, broker.addr)
        await _running(raw)
        old = await raw.send(*[half(b"old%d" % i) for i in range(10)])
        for off in old:
            await raw.end(off, "commit")
        service = broker.handlers.transactions
        await await_until(lambda: service.saved.ops_from[0] == 10, 5, "a checkpoint past the ten commits")
        (new,) = await raw.send(half(b"new"))
        await await_until(lambda: service.saved.floor_offset == new, 5, "a checkpoint with the new half pending")
        assert service.saved.ops_from[0] == 10
    await c.stop_broker("broker-a")
    broker = await c.start_broker(**FAST)
    async with open_admin(c.ns) as admin:
        raw = Raw(admin, broker.addr)
        await _running(raw)
        assert [r["commitlog_offset"] for r in (await raw.list())["pending"]] == [new]
        with pytest.raises(RpcError) as e:
            await raw.end(old[0], "commit")
        assert e.value.code == ErrorCode.NOT_FOUND
        assert (await raw.end(new, "commit"))["state"] == "committed"
    assert sorted(r.body for r in await _receive(c, 11)) == sorted([b"new", *(b"old%d" % i for i in range(10))])


def test_op_marks_give_the_op_queue_ends_from_before_the_floor() -> None:
    marks = OpMarks(TransactionCheckpoint(0, 0, 100, (1, 2, 3)))
    for i in range(1, 200):
        marks.add(100 + 10 * i, (i, i, i))
        assert len(marks.samples) <= OpMarks.MAX_SAMPLES + 1
    assert marks.ops_from(99) == (0, 0, 0)  # below every sample: read the queues whole
    assert marks.ops_from(100) == (1, 2, 3)
    got = marks.ops_from(1000)  # the sample at 1000 may have been thinned: an older one, never a later one
    assert got[0] <= 90 and marks.ops_from(2080) == (198, 198, 198)


async def test_ends_in_flight_are_appended_together_and_one_bad_end_fails_alone(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    c, broker = await _cluster(nursery, tmp_path)
    await c.create_topic("gone", 1)
    async with open_admin(c.ns) as admin:
        raw = Raw(admin, broker.addr)
        await _running(raw)
        offsets = await raw.send(*[half(b"m%02d" % i, qid=i % 2) for i in range(40)])
        (doomed,) = await raw.send(half(b"doomed", topic="gone", qid=0))
        await admin.delete_topic("gone")  # its half's commit can no longer be stored
        states: dict[int, str] = {}

        async def end(off: int) -> None:
            try:
                states[off] = (await raw.end(off, "commit"))["state"]
            except RpcError as e:
                states[off] = ErrorCode(e.code).name

        async with trio.open_nursery() as n:
            for off in [*offsets, doomed]:
                n.start_soon(end, off)
        assert states == {**{off: "committed" for off in offsets}, doomed: "TOPIC_NOT_FOUND"}
        appends = broker.handlers.transaction_requests.appends.appends
        assert appends < 41, f"{appends} store calls for 41 ends: none went together"
        assert [r["commitlog_offset"] for r in (await raw.list())["pending"]] == [doomed]  # still pending
    got = await _receive(c, 40)
    assert sorted(r.body for r in got) == sorted(b"m%02d" % i for i in range(40))


_HALF_KEYS = ["REAL_TOPIC", "REAL_QID", "REAL_TAGS", "TRAN_GROUP", "TRAN_HALF", "DELIVER_AT_MS", "UNIQ_KEY", "x"]


@given(
    st.integers(0, 2),
    st.dictionaries(
        st.sampled_from(_HALF_KEYS), st.sampled_from(["", "t", "%TIMER%", "7", "a" * 70_000, "pg"]), max_size=8
    ),
)
@settings(max_examples=400, deadline=None)
def test_the_door_takes_exactly_the_well_formed_half_messages(qid: int, props: dict[str, str]) -> None:
    well_formed = (
        qid == 0
        and all(props.get(k) for k in ("REAL_TOPIC", "REAL_QID", "TRAN_GROUP"))
        and "REAL_TAGS" in props
        and not {"TRAN_HALF", "DELIVER_AT_MS"} & props.keys()
        and len(props["REAL_TAGS"]) <= 65_535
        and not props["REAL_TOPIC"].startswith("%")
    )
    try:
        check_half(3, qid, props)
    except RequestError as e:
        assert not well_formed, e.text
        assert e.code == ErrorCode.INVALID_MESSAGE and e.text.startswith("message 3:")
    else:
        assert well_formed, props


def test_a_rebuild_remembers_the_latest_ends_in_log_order(tmp_path: Path) -> None:
    """The ended map after a start holds the latest ends, commits and rollbacks mixed
    as they were written (not all of one kind, then the other)."""
    store = Store.open(StoreConfig(tmp_path / "s")).start()
    try:
        for topic, queues in (("t", 2), (TRANS_HALF_TOPIC, 1), (TRANS_OP_TOPIC, 3)):
            store.create_topic(topic, queues)
        offsets = store.put_batch([half(b"%d" % i) for i in range(6)], wait_durable=True).commitlog_offsets
        for i, off in enumerate(offsets):  # commit, rollback, commit, ...: the op records in this order
            store.put_batch([Message(TRANS_OP_TOPIC, i % 2, b"", str(off))], wait_durable=True)
        store.catch_up()
        rebuilt = rebuild(store, TransactionCheckpoint(0, 0, 0), ended_kept=3)
        assert not rebuilt.halves.pending
        assert {off: e.state for off, e in rebuilt.halves.ended.items()} == {
            offsets[3]: ROLLED_BACK,
            offsets[4]: COMMITTED,
            offsets[5]: ROLLED_BACK,
        }
    finally:
        store.close()

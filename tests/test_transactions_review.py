"""The defects a review found in the transaction service, each shown by a test that
fails without its fix: a busy lane during the one-by-one retry of a batch of ENDs, a
forged half laid out inside another message's body, a plain send carrying TRAN_HALF
taken for a commit by a rebuild, a rebuild racing an END in flight, an END of another
group's ended half, a Unicode-digit REAL_QID, and retention's thread reading the
pending set's floor while the event loop pops it."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Sequence

import crc32c
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from clmq.broker.service import Broker
from clmq.broker.service.transaction._ending import EndAppends, _Slot, committed_message, op_record
from clmq.broker.service.transaction._pending import Half, PendingSet
from clmq.broker.service.transaction._polls import COUNT_RECORDS_PER_CALL, count_unasked
from clmq.broker.service.transaction._state import (
    TransactionCheckpoint,
    half_from_record,
    op_tags,
    queue_number,
    rebuild,
)
from clmq.broker.store import PutResult, Store, StoreConfig
from clmq.client import open_admin
from clmq.client._admin_reads import DROPPED_ON_RESEND
from clmq.common import (
    PROP_TRAN_GROUP,
    PROP_TRAN_HALF,
    TRANS_HALF_TOPIC,
    TRANS_OP_CHECK,
    TRANS_OP_COMMIT,
    TRANS_OP_TOPIC,
    Message,
    Record,
    encode_properties,
)
from clmq.common._record import HEADER, RECORD_MAGIC
from clmq.protocol import ErrorCode, RequestCode, encode_batch
from clmq.protocol.transport import RequestError, RpcClient, RpcError
from tests.service_helpers import Cluster
from tests.test_security_native import ADMIN, ALICE, login, seeded_with
from tests.test_transactions_broker import FAST, Raw, _cluster, _receive, _Rpc, _running, half
from tests.waiting import await_until


class _FullLaneOnThirdCall(EndAppends):
    """The real append lane, made genuinely full (a producer's batch queued in it) just
    before the third store call: the second END's retry on its own."""

    def __init__(self, broker: Broker) -> None:
        super().__init__(broker.handlers.transaction_requests.ctx)
        self.calls = 0

    async def _put(self, messages: Sequence[Message]) -> PutResult:
        self.calls += 1
        if self.calls == 3:
            filler = encode_batch([Message("fill", 0, b"f" * 4096)])
            self.ctx.lane.submit("fill", filler, ("127.0.0.1", 1))  # queued: the next submit finds the lane full
        return await super()._put(messages)


async def test_a_busy_lane_on_one_retry_fails_that_end_only_never_one_stored(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    c, broker = await _cluster(nursery, tmp_path, max_inflight_produce_bytes=1024)
    await c.create_topic("gone", 1)
    await c.create_topic("fill", 1)
    async with open_admin(c.ns) as admin:
        raw = Raw(admin, broker.addr)
        await _running(raw)
        good, bad = await raw.send(half(b"good"), half(b"bad", topic="gone", qid=0))
        await admin.delete_topic("gone")
        store = broker.store
        assert isinstance(store, Store)
        records = {off: store.log.read_record(off) for off in (good, bad)}
        slots = [_Slot([committed_message(r), op_record(TRANS_OP_COMMIT, off)]) for off, r in records.items()]
        appends = _FullLaneOnThirdCall(broker)
        await appends._append(slots)
        assert appends.calls == 3  # the batch, refused as bad input; then each END alone
        assert slots[0].error is None and slots[0].result is not None and slots[0].result.ok
        assert slots[1].error is not None and slots[1].error.code == ErrorCode.SYSTEM_BUSY
    got = await _receive(c, 1)
    assert [r.body for r in got] == [b"good"]


def _forged_record(commitlog_offset: int, props: dict[str, str]) -> bytes:
    """A CRC-valid %TRANS_HALF% record, as a client could lay it out in a message body."""
    topic, prop_bytes, body = TRANS_HALF_TOPIC.encode(), encode_properties(props), b"forged"
    size = HEADER.size + len(topic) + len(prop_bytes) + len(body)
    host = b"\0" * 10 + b"\xff\xff" + bytes([127, 0, 0, 1])
    head = HEADER.pack(
        size, RECORD_MAGIC, 0, commitlog_offset, 0, 0, 0, 1, 1, host, 1, host, 1, 0,
        len(topic), 0, 0, len(prop_bytes), len(body),
    )  # fmt: skip
    rest = head[12:] + topic + prop_bytes + body
    return head[:8] + struct.pack("<I", crc32c.crc32c(rest)) + rest


async def test_a_half_forged_inside_a_message_body_cannot_be_ended(nursery: trio.Nursery, tmp_path: Path) -> None:
    c, broker = await _cluster(nursery, tmp_path)
    props = {"REAL_TOPIC": "t", "REAL_QID": "1", "REAL_TAGS": "", "TRAN_GROUP": "pg", "UNIQ_KEY": "U-forged"}
    async with open_admin(c.ns) as admin:
        raw = Raw(admin, broker.addr)
        await _running(raw)
        store = broker.store
        assert isinstance(store, Store)
        at = store.log.write_offset + HEADER.size + len("t")  # where the carrier's body will be
        forged = _forged_record(at, props)
        reply = await admin.rpc.request(
            broker.addr, RequestCode.SEND_MESSAGE, {"topic": "t"}, encode_batch([Message("t", 0, forged)])
        )
        (carrier,) = reply.fields["commitlog_offsets"]
        record = store.log.read_record(carrier)
        assert record is not None and carrier + record.size - len(forged) == at
        assert store.log.read_record(at).topic == TRANS_HALF_TOPIC  # a CRC-valid half at that offset
        for action in ("commit", "rollback"):
            with pytest.raises(RpcError) as e:
                await raw.end(at, action)
            assert e.value.code == ErrorCode.NOT_FOUND
        assert (await raw.list())["total"] == 0
    got = await _receive(c, 1)
    assert [r.body for r in got] == [forged]  # the carrier only: nothing committed


def test_a_half_naming_a_system_topic_is_never_committed() -> None:
    props = {"REAL_TOPIC": TRANS_OP_TOPIC, "REAL_QID": "0", "REAL_TAGS": "123", "TRAN_GROUP": "pg"}
    record = _half_record(props)
    with pytest.raises(RequestError) as e:
        committed_message(record)
    assert e.value.code == ErrorCode.INVALID_MESSAGE


def test_a_plain_message_carrying_tran_half_is_no_commit_at_a_rebuild(tmp_path: Path) -> None:
    store = Store.open(StoreConfig(tmp_path / "s")).start()
    try:
        for topic, queues in (("t", 2), (TRANS_HALF_TOPIC, 1), (TRANS_OP_TOPIC, 3)):
            store.create_topic(topic, queues)
        (off,) = store.put_batch([half(b"victim", qid=1)], wait_durable=True).commitlog_offsets
        plain = [
            Message("t", 1, b"other", "", "", {PROP_TRAN_HALF: str(off), "UNIQ_KEY": "U-victim"}),  # its key
            Message("t", 1, b"victim", "", "", {PROP_TRAN_HALF: str(off), "UNIQ_KEY": "U-mine"}),  # its body
        ]
        store.put_batch(plain, wait_durable=True)
        store.catch_up()
        rebuilt = rebuild(store, TransactionCheckpoint(0, 0, 0))
        assert rebuilt.orphans == [] and list(rebuilt.halves.pending) == [off]
    finally:
        store.close()


async def test_a_plain_send_carrying_tran_half_is_refused_naming_the_message(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    c, broker = await _cluster(nursery, tmp_path)
    batch = [Message("t", 0, b"fine"), Message("t", 0, b"marked", "", "", {PROP_TRAN_HALF: "0"})]
    async with open_admin(c.ns) as admin:
        with pytest.raises(RpcError) as e:
            await admin.rpc.request(broker.addr, RequestCode.SEND_MESSAGE, {"topic": "t"}, encode_batch(batch))
        assert e.value.code == ErrorCode.INVALID_MESSAGE and "message 1" in e.value.text
        body_only = [Message("t", 0, b"a body saying TRAN_HALF is fine")]
        reply = await admin.rpc.request(broker.addr, RequestCode.SEND_MESSAGE, {"topic": "t"}, encode_batch(body_only))
        assert reply.fields["commitlog_offsets"]
    assert [r.body for r in await _receive(c, 1)] == [b"a body saying TRAN_HALF is fine"]  # nothing of the batch
    assert {PROP_TRAN_HALF, PROP_TRAN_GROUP} <= DROPPED_ON_RESEND  # a dead letter resent is no commit either


async def test_a_rebuild_waits_for_the_ends_in_flight(nursery: trio.Nursery, tmp_path: Path) -> None:
    """An END whose append lands after the service failed must be in the rebuilt set:
    the start waits for it (else the half is pending again and a retry commits twice)."""
    c, broker = await _cluster(nursery, tmp_path)
    async with open_admin(c.ns) as admin:
        raw = Raw(admin, broker.addr)
        await _running(raw)
        (off,) = await raw.send(half(b"in-flight"))
        service = broker.handlers.transactions
        requests = broker.handlers.transaction_requests
        await await_until(lambda: off in service.running_halves().pending, 5, "the half pending")
        record = broker.store.log.read_record(off)
        in_flight = service.ending[off] = trio.Event()  # an END under way, its append not yet made
        service.halves = None  # as _failed leaves it
        started = trio.Event()

        async def start() -> None:
            await service._start()
            started.set()

        nursery.start_soon(start)
        with trio.move_on_after(0.5):  # a start that does not wait for the END has rebuilt by then
            await started.wait()
        assert not started.is_set(), "the rebuild ran with an END in flight"
        await requests.appends.store([committed_message(record), op_record(TRANS_OP_COMMIT, off)])  # it lands
        del service.ending[off]
        in_flight.set()
        await started.wait()
        assert off not in service.running_halves().pending
        assert (await raw.end(off, "commit"))["state"] == "already_committed"
    assert [r.body for r in await _receive(c, 1)] == [b"in-flight"]


async def test_an_end_of_another_group_s_ended_half_is_not_found(nursery: trio.Nursery, tmp_path: Path) -> None:
    c, broker = await _cluster(nursery, tmp_path)
    async with open_admin(c.ns) as admin:
        raw = Raw(admin, broker.addr)
        await _running(raw)
        (off,) = await raw.send(half(b"mine"))
        assert (await raw.end(off, "commit"))["state"] == "committed"
        with pytest.raises(RpcError) as e:
            await raw.end(off, "commit", group="other")
        assert e.value.code == ErrorCode.NOT_FOUND and "msg_id" not in e.value.text
        assert (await raw.end(off, "rollback"))["state"] == "already_committed"
    await c.stop_broker("broker-a")
    broker = await c.start_broker(transaction_check_interval_ms=50)
    async with open_admin(c.ns) as admin:
        raw = Raw(admin, broker.addr)
        await _running(raw)  # the ended map rebuilt from the op records: the group read from the half
        with pytest.raises(RpcError) as e:
            await raw.end(off, "commit", group="other")
        assert e.value.code == ErrorCode.NOT_FOUND
        assert (await raw.end(off, "commit"))["state"] == "already_committed"


async def test_a_unicode_digit_real_qid_is_refused_as_a_bad_queue(nursery: trio.Nursery, tmp_path: Path) -> None:
    c, broker = await _cluster(nursery, tmp_path)
    async with open_admin(c.ns) as admin:
        raw = Raw(admin, broker.addr)
        with pytest.raises(RpcError) as e:
            await raw.send(half(b"ok"), half(b"sq", REAL_QID="²"))
        assert e.value.code == ErrorCode.INVALID_QUEUE_ID and "message 1" in e.value.text


@given(st.text(max_size=6) | st.sampled_from(["²", "٣", "0", "17", "-1", "1²", "¹²"]))
@settings(max_examples=300, deadline=None)
def test_a_queue_number_is_ascii_digits_and_nothing_else_ever_raises(text: str) -> None:
    ascii_number = text != "" and all("0" <= ch <= "9" for ch in text)
    assert queue_number(text) == (int(text) if ascii_number else None)
    record = _half_record({**_HALF_PROPS, "REAL_QID": text})
    found = half_from_record(record, 0)
    assert (found is not None) == ascii_number


_HALF_PROPS = {"REAL_TOPIC": "t", "REAL_TAGS": "", "TRAN_GROUP": "pg"}


def _half_record(props: dict[str, str]) -> Record:
    host = ("127.0.0.1", 1)
    return Record(TRANS_HALF_TOPIC, 0, 0, 7, 200, b"x", "", "", props, 0, 1, 1, host, host, 0)


class _PoppedBetween(list[tuple[int, int]]):
    """The heap as retention's thread can see it: emptied by the event loop right after
    the thread found it non-empty (CPython 3.11 rarely switches there; other versions,
    free-threading, may)."""

    def __bool__(self) -> bool:
        was = len(self) > 0
        self.clear()
        return was


def test_retention_s_floor_never_fails_while_the_event_loop_pops_the_last_half() -> None:
    halves = PendingSet()
    halves.add(Half(100, 10, 0, "g", "t", 0, 0))
    halves.read_to = 500
    assert halves.floor() == 100
    halves.order = _PoppedBetween(halves.order)
    assert halves.floor() in (100, 500)  # the half, or the read mark once it is gone: never an IndexError
    halves.order = []
    assert halves.floor() == 500


async def test_a_poller_never_handed_a_topic_s_halves_does_not_hold_their_count_back(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """alice may poll group pg but not WRITE topic 'secret': she is never handed admin's
    half for it, and her polls must not keep it from being counted (else it is pending
    for ever and holds the CommitLog's retention); nor may she learn how admin's ended
    half of that topic ended."""
    cluster = Cluster(nursery, tmp_path)
    acl = [
        ["TOPIC", "v", "LITERAL", "User:alice", "*", "WRITE", "ALLOW"],
        ["TRANSACTIONAL_ID", "pg", "LITERAL", "User:alice", "*", "WRITE", "ALLOW"],
    ]
    settings = {"transaction_timeout_ms": 200, "transaction_orphan_after_ms": 300, "transaction_check_max": 3}
    addr = await seeded_with(cluster, tmp_path, acl, **FAST, **settings)
    async with trio.open_nursery() as n:
        admin, alice = RpcClient(n), RpcClient(n)
        assert (await login(admin, addr, *ADMIN)).error_code == 0
        assert (await login(alice, addr, *ALICE)).error_code == 0
        as_admin, as_alice = Raw(_Rpc(admin), addr), Raw(_Rpc(alice), addr)
        await _running(as_admin)
        secret, ended = await as_admin.send(half(b"s", topic="secret", qid=0), half(b"e", topic="secret", qid=0))
        assert (await as_admin.end(ended, "commit"))["state"] == "committed"
        with pytest.raises(RpcError) as e:  # its outcome and place are not told to who may not WRITE its topic
            await as_alice.end(ended, "commit")
        assert e.value.code == ErrorCode.NOT_AUTHORIZED

        async def alice_polls() -> None:
            while True:
                assert (await as_alice.check("pg", wait_ms=100))[0] == []

        n.start_soon(alice_polls)

        async def counted() -> bool:
            rows = {r["commitlog_offset"]: r["checks"] for r in (await as_admin.list())["pending"]}
            return rows.get(secret, 3) >= 1  # (gone: rolled back after transaction_check_max counts)

        await await_until(counted, 10, "the half of a topic no poller may take counted as checked")
        n.cancel_scope.cancel()
    await admin.aclose()
    await alice.aclose()


async def test_many_unpolled_halves_are_counted_in_store_calls_of_bounded_size(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """More orphans than one store call takes (COUNT_RECORDS_PER_CALL): every one is
    counted once, by one check op record each."""
    c, broker = await _cluster(nursery, tmp_path)
    async with open_admin(c.ns) as admin:
        raw = Raw(admin, broker.addr)
        await _running(raw)
        await raw.send(half(b"creates the op topic"))
    n = 2 * COUNT_RECORDS_PER_CALL + 7
    halves = PendingSet()
    orphans = [Half(1_000_000 + i, 10, i, "gone", "t", 0, 0) for i in range(n)]
    for h in orphans:
        halves.add(h)
    store = broker.store
    assert isinstance(store, Store)
    before = store.max_offset(TRANS_OP_TOPIC, TRANS_OP_CHECK)
    await count_unasked(broker.handlers.transaction_requests.ctx, halves, orphans, 1)
    assert all(h.checks == 1 for h in orphans) and halves.stats.checks == n
    await await_until(lambda: store.max_offset(TRANS_OP_TOPIC, TRANS_OP_CHECK) == before + n, 10, "the check ops")
    assert op_tags(store, TRANS_OP_CHECK, before).tolist() == [h.offset for h in orphans]

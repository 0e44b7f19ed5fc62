"""Validation before side effects: a put with a field of the wrong type or range is
refused naming the message and the field, and takes no queue offset (no hole); a get
with a bad argument is refused at the API; both storage modes, and the CommitLog alone."""

from __future__ import annotations

import errno
import socket
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import clmq.protocol._frame as protocol_frame
from clmq.broker.service._handlers import registration
from clmq.broker.store import GetStatus, PutStatus, Store
from clmq.client import RpcClient, SendError, open_admin, open_producer
from clmq.commitlog import AppendStatus, CommitLog, CommitLogConfig
from clmq.common import InvalidInputError, Message
from clmq.protocol import (
    PROTOCOL_VERSION,
    REQUEST_FIELDS,
    SUPPORTED_VERSIONS,
    ErrorCode,
    Frame,
    FrameDecoder,
    RequestCode,
    encode_batch,
    encode_frame,
)
from tests.faults import Fault, inject
from tests.service_helpers import Cluster
from tests.waiting import await_until, wait_until

from .conftest import small_config

# Per field of a Message: values of the wrong type, or out of range.
WRONG: dict[str, list[Any]] = {
    "topic": [5, None, b"orders", ["orders"]],
    "queue_id": [1.0, True, "1", None, 2**40, [1]],
    "body": ["text", None, 5, ["x"], {"b": 1}],
    "tags": [7, None, b"tag", ["a"], 0],
    "keys": [7, None, b"key", ["a"], 0],
    "properties": [{"a": 1}, {1: "a"}, ["a"], None, "ab", {"a": b"x"}, 0],
    "flags": [-1, 2**32, 1.5, "1", None, True],
    "born_timestamp_ms": [-1, 2**64, 1.5, None, "1", False],
    "born_host": [
        ("1.2.3.4",),
        ("nope", 1),
        ("1.2.3.4", 70000),
        ("1.2.3.4", "80"),
        "1.2.3.4:80",
        None,
        ["1.2.3.4", 80],
        (1234, 5),
        ("1.2.3.4", -1),
    ],
    "reconsume_times": [-1, 2**32, 0.5, None, "0"],
}
FIELD_VALUES = [(f, v) for f, values in WRONG.items() for v in values]


def good(queue: int, i: int) -> Message:
    return Message("orders", queue, b"good-%d" % i, tags="T", keys=f"k{i}", properties={"p": "v"})


def bad_message(field: str, value: Any, queue: int) -> Message:
    m = good(queue, -1)
    setattr(m, field, value)
    return m


def expected_error(field: str) -> str:
    return "'born_host'" if field == "born_host" else repr(field)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=st.sampled_from(FIELD_VALUES), before=st.integers(0, 5), after=st.integers(0, 5), queue=st.integers(0, 3))
def test_a_wrong_field_is_refused_naming_it_and_leaves_no_hole(
    store: Store, case: tuple[str, Any], before: int, after: int, queue: int
) -> None:
    field, value = case
    probe = store.put_batch([good(queue, 0)])  # where the queue is now
    assert probe.ok
    end = store.end_offset
    batch = [good(queue, 1) for _ in range(before)] + [bad_message(field, value, queue)] + [good(queue, 2)] * after
    res = store.put_batch(batch)
    if field == "queue_id" and type(value) is int:  # an int, but no queue of the topic
        assert res.status is PutStatus.INVALID_QUEUE_ID, (value, res)
    else:
        assert res.status is PutStatus.INVALID_MESSAGE, (field, value, res)
        assert f"message {before} of {len(batch)}" in res.error and expected_error(field) in res.error
    assert store.end_offset == end  # nothing of the batch was written
    nxt = store.put_batch([good(queue, 3)])
    assert nxt.ok and nxt.queue_offsets == [probe.queue_offsets[0] + 1]  # dense: no offset was lost
    store.catch_up()
    got = store.get("orders", queue, probe.queue_offsets[0], 10)
    assert [r.body for r in got.messages] == [b"good-0", b"good-3"]


def test_every_wrong_field_is_refused_by_the_commitlog_alone(tmp_path: Path) -> None:
    """CommitLog.append without the store in front: the encoder checks before it takes
    queue offsets, so a refused batch leaves the queue-offset table as it was."""
    log = CommitLog.open(
        tmp_path, CommitLogConfig(segment_bytes=1 << 20, max_message_bytes=1 << 16), clean=True, checkpoint_offset=None
    )
    try:
        assert log.append([good(0, 0)]).ok
        for field, value in FIELD_VALUES:
            if field == "topic" and value is None:
                continue  # None is refused too; covered by the next line's kinds
            table = log.queue_offset_table()
            res = log.append([good(0, 1), good(1, 1), bad_message(field, value, 0)])
            assert res.status is AppendStatus.INVALID_MESSAGE, (field, value, res)
            assert "message 2 of 3" in res.error and expected_error(field) in res.error, res.error
            assert log.queue_offset_table() == table, (field, value)
        res = log.append([good(0, 2)])
        assert res.ok and res.queue_offsets == [1]
    finally:
        log.close()


# ----------------------------------------------------------------------- get
@pytest.mark.parametrize(
    ("args", "name"),
    [
        (("orders", 0, 0, 0), "max_messages"),
        (("orders", 0, 0, -3), "max_messages"),
        (("orders", 0, 0, 1.5), "max_messages"),
        (("orders", 0, 0, None), "max_messages"),
        (("orders", 0, "0", 10), "offset"),
        (("orders", 0, 1.0, 10), "offset"),
        (("orders", 0, None, 10), "offset"),
        (("orders", "0", 0, 10), "queue_id"),
        (("orders", True, 0, 10), "queue_id"),
        ((5, 0, 0, 10), "topic"),
        ((None, 0, 0, 10), "topic"),
    ],
)
def test_get_with_a_bad_argument_is_refused_naming_it(store: Store, args: tuple[Any, ...], name: str) -> None:
    store.put_batch([good(0, 0)])
    store.catch_up()
    for read in (store.get, store.read_raw):
        with pytest.raises(InvalidInputError, match=repr(name)):
            read(*args)
    with pytest.raises(InvalidInputError, match="'tags'"):
        store.get("orders", 0, 0, 10, tags="T")  # a string is not a set of tags (it would be its letters)
    with pytest.raises(InvalidInputError, match="'tags'"):
        store.get("orders", 0, 0, 10, tags=[1])
    with pytest.raises(InvalidInputError, match="'max_bytes'"):
        store.read_raw("orders", 0, 0, 10, max_bytes=0)
    got = store.get("orders", 0, 0, 1)  # the store still answers
    assert got.status is GetStatus.FOUND and len(got.messages) == 1


def test_get_at_a_negative_offset_is_a_result(store: Store) -> None:
    store.put_batch([good(0, 0)])
    store.catch_up()
    got = store.get("orders", 0, -5, 10)
    assert got.status is GetStatus.OFFSET_TOO_SMALL and got.next_offset == 0


# ------------------------------------------------------------- over the wire
GOOD_BROKER: dict[int, dict[str, Any]] = {
    RequestCode.SEND_MESSAGE: {"topic": "v", "dedup": False},
    RequestCode.PULL_MESSAGE: {
        "topic": "v",
        "queue_id": 0,
        "offset": 0,
        "max_messages": 4,
        "max_wait_ms": 0,
        "tags": ["T"],
        "group": "g",
    },
    RequestCode.PULL_MESSAGES: {
        "queues": [["v", 0, 0, None]],
        "max_messages": 4,
        "max_per_queue": 4,
        "max_wait_ms": 0,
        "max_bytes": 1 << 20,
    },
    RequestCode.QUERY_OFFSETS: {"topic": "v", "queue_id": 0},
    RequestCode.SEARCH_OFFSET: {"topic": "v", "queue_id": 0, "timestamp_ms": 0},
    RequestCode.COMMIT_OFFSET: {"group": "g", "offsets": [["v", 0, 0]]},
    RequestCode.QUERY_CONSUMER_OFFSET: {"group": "g", "topic": "v", "queue_id": 0},
    RequestCode.QUERY_QUEUE_OFFSETS: {"group": "g", "queues": [["v", 0]]},
    RequestCode.HEARTBEAT: {"client_id": "c", "groups": [{"group": "g", "topics": ["v"], "mode": "clustering"}]},
    RequestCode.UNREGISTER_CLIENT: {"client_id": "c"},
    RequestCode.GET_GROUP_MEMBERS: {"group": "g"},
    RequestCode.LIST_GROUPS: {},
    RequestCode.DESCRIBE_GROUP: {"group": "g"},
    RequestCode.DELETE_GROUP: {"group": "g"},
    RequestCode.CREATE_TOPIC: {"topic": "v2", "queue_count": 2},
    RequestCode.DELETE_TOPIC: {"topic": "v"},
    RequestCode.LIST_TOPICS: {"include_system": False},
    RequestCode.DESCRIBE_TOPIC: {"topic": "v"},
    RequestCode.GET_MESSAGE: {"commitlog_offset": 0},
    RequestCode.QUERY_INDEX: {"topic": "v", "key": "k", "since_ms": 0, "until_ms": 1 << 42, "max_results": 5},
    RequestCode.CONSUMER_SEND_BACK: {"group": "g", "messages": [[0, -1]], "max_reconsume_times": 2, "to_dlq": False},
    RequestCode.LOCK_QUEUES: {"group": "g", "client_id": "c", "queues": [["v", 0]]},
    RequestCode.UNLOCK_QUEUES: {"group": "g", "client_id": "c", "queues": [["v", 0]]},
    RequestCode.CANCEL_MESSAGE: {"commitlog_offset": 0},
    RequestCode.END_TRANSACTION: {"group": "g", "commitlog_offset": 0, "action": "commit", "from_check": False},
    RequestCode.CHECK_TRANSACTIONS: {"group": "g", "client_id": "c", "max_messages": 5, "max_wait_ms": 0},
    RequestCode.LIST_TRANSACTIONS: {"group": "g", "max_messages": 5},
    RequestCode.POP_MESSAGE: {
        "group": "g",
        "client_id": "c",
        "topic": "v",
        "invisible_time_ms": 1000,
        "max_messages": 4,
        "max_wait_ms": 0,
        "tags": ["T"],
        "queue_ids": [0],
        "orderly": False,
        "start_from": "earliest",
        "max_reconsume_times": 2,
        "max_bytes": 1 << 20,
    },
    RequestCode.ACK_MESSAGE: {"group": "g", "handles": ["h"]},
    RequestCode.CHANGE_INVISIBLE_TIME: {"group": "g", "handles": ["h"], "invisible_time_ms": 0},
    RequestCode.BROKER_INFO: {},
    RequestCode.GET_LOG_LAYOUT: {},
    RequestCode.READ_LOG: {"offset": 0, "max_bytes": 100, "end_offset": 100},
    RequestCode.REPLICA_JOIN: {
        "broker_name": "zz",
        "broker_id": 7,
        "epoch": 0,
        "end_offset": 0,
        "segment_bytes": 1024,
        "addr": "127.0.0.1:1",
    },
    RequestCode.REPLICA_FETCH: {
        "broker_id": 7,
        "session": 1,
        "epoch": 0,
        "offset": 0,
        "flushed": 0,
        "max_bytes": 100,
        "max_wait_ms": 0,
        "topics_version": 0,
    },
    RequestCode.REPLICA_METADATA: {"broker_id": 7, "session": 1, "queue_ends_before": 0},
    RequestCode.PROMOTE: {"force": False},
    RequestCode.REPLICA_STATUS: {},
    RequestCode.TRANSFER_LEADERSHIP: {"broker_id": 7, "timeout_ms": 100},
    RequestCode.AUTHENTICATE: {"mechanism": "SCRAM-SHA-256", "data": b"n,,n=u,r=abc"},
    RequestCode.USER_UPSERT: {"user": "zz", "credentials": {"SCRAM-SHA-256": {}}},
    RequestCode.USER_DELETE: {"user": "zz"},
    RequestCode.USER_LIST: {},
    RequestCode.ACL_CREATE: {"acls": []},
    RequestCode.ACL_DESCRIBE: {"filter": ["", "", "", "", "", "", ""]},
    RequestCode.ACL_DELETE: {"filter": ["", "", "", "", "", "", ""]},
}
GOOD_NAMESERVER: dict[int, dict[str, Any]] = {
    RequestCode.REGISTER_BROKER: {
        "cluster": "c",
        "broker_name": "x",
        "addr": "127.0.0.1:1",
        "topics": {"t": 1},
        "healthy": True,
        "failure": "",
        "broker_id": 0,
        "role": "leader",
        "epoch": 0,
        "kafka_addr": "127.0.0.1:9092",
    },
    RequestCode.UNREGISTER_BROKER: {"addr": "127.0.0.1:1", "broker_name": "x"},
    RequestCode.GET_ROUTE: {"topic": "t"},
    RequestCode.GET_CLUSTER: {},
    RequestCode.AUTHENTICATE: {"mechanism": "SCRAM-SHA-256", "data": b"n,,n=u,r=abc"},
}
OPTIONAL = {
    (RequestCode.PULL_MESSAGE, "max_messages"),
    (RequestCode.PULL_MESSAGE, "max_wait_ms"),
    (RequestCode.PULL_MESSAGE, "tags"),
    (RequestCode.PULL_MESSAGE, "group"),
    (RequestCode.PULL_MESSAGES, "max_messages"),
    (RequestCode.PULL_MESSAGES, "max_per_queue"),
    (RequestCode.PULL_MESSAGES, "max_wait_ms"),
    (RequestCode.PULL_MESSAGES, "max_bytes"),
    (RequestCode.REGISTER_BROKER, "cluster"),
    (RequestCode.REGISTER_BROKER, "healthy"),
    (RequestCode.REGISTER_BROKER, "failure"),
    (RequestCode.UNREGISTER_BROKER, "broker_name"),
    (RequestCode.REGISTER_BROKER, "broker_id"),
    (RequestCode.REGISTER_BROKER, "role"),
    (RequestCode.REGISTER_BROKER, "kafka_addr"),
    (RequestCode.REGISTER_BROKER, "epoch"),
    (RequestCode.PROMOTE, "force"),
    (RequestCode.REPLICA_JOIN, "addr"),
    (RequestCode.REPLICA_FETCH, "topics_version"),
    (RequestCode.REPLICA_METADATA, "queue_ends_before"),
    (RequestCode.TRANSFER_LEADERSHIP, "timeout_ms"),
    (RequestCode.SEND_MESSAGE, "dedup"),
    (RequestCode.LIST_TOPICS, "include_system"),
    (RequestCode.CONSUMER_SEND_BACK, "max_reconsume_times"),
    (RequestCode.CONSUMER_SEND_BACK, "to_dlq"),
    (RequestCode.AUTHENTICATE, "mechanism"),
    (RequestCode.END_TRANSACTION, "from_check"),
    (RequestCode.CHECK_TRANSACTIONS, "max_messages"),
    (RequestCode.CHECK_TRANSACTIONS, "max_wait_ms"),
    (RequestCode.LIST_TRANSACTIONS, "group"),
    (RequestCode.LIST_TRANSACTIONS, "max_messages"),
    (RequestCode.QUERY_INDEX, "since_ms"),
    (RequestCode.QUERY_INDEX, "until_ms"),
    (RequestCode.QUERY_INDEX, "max_results"),
    *((RequestCode.POP_MESSAGE, name) for name in ("max_messages", "max_wait_ms", "tags", "queue_ids", "orderly")),
    *((RequestCode.POP_MESSAGE, name) for name in ("start_from", "max_reconsume_times", "max_bytes")),
}
# A wrong value of each kind: every one is refused unless it has the field's own type
# (a string for a string field) and is in range.
WRONG_VALUES: list[Any] = ["x", [1], {"a": 1}, None, 1.5, 2**64 - 1, -1, True, b"raw"]


def wrong_values(code: int, name: str, good_value: Any) -> list[Any]:
    out = []
    for value in WRONG_VALUES:
        if value is None and (code, name) in OPTIONAL:
            continue  # nil is "absent" for an optional field
        if value == -1 and name in ("epoch", "topics_version") and type(value) is int:
            continue  # -1 is "no epoch yet", "no topics copied yet"
        if type(value) is type(good_value) and type(value) is not int:
            continue  # the field's own type ("x" for a name, True for a flag): may be valid
        out.append(value)
    return out


@pytest.fixture
async def cluster(nursery: trio.Nursery, tmp_path: Path) -> Cluster:
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    await c.start_broker("broker-a")
    await c.create_topic("v", 1)
    return c


async def refuse_every_wrong_field(rpc: RpcClient, addr: str, table: dict[int, dict[str, Any]]) -> int:
    """Send, for every code and field, every wrong kind of value (and the field left
    out); each must be MALFORMED_REQUEST naming the field. Returns how many were sent."""
    sent = 0
    for code, good in table.items():
        body = encode_batch([Message("v", 0, b"bad")]) if code == RequestCode.SEND_MESSAGE else b""
        for name, good_value in good.items():
            cases = [{**good, name: v} for v in wrong_values(code, name, good_value)]
            if (code, name) not in OPTIONAL:
                cases.append({k: v for k, v in good.items() if k != name})
            for fields in cases:
                reply = await rpc.request(addr, code, fields, body, check=False)
                sent += 1
                assert reply.error_code == ErrorCode.MALFORMED_REQUEST, (RequestCode(code).name, fields, reply)
                assert repr(name) in reply.error_text, (RequestCode(code).name, name, reply.error_text)
        info = await rpc.request(addr, RequestCode.BROKER_INFO if addr != "ns" else RequestCode.GET_CLUSTER)
        assert info.error_code == 0  # the same connection goes on serving
    return sent


async def test_every_field_of_every_request_of_the_wrong_type_is_malformed_and_changes_nothing(
    cluster: Cluster,
) -> None:
    broker = cluster.brokers["broker-a"]
    assert cluster.nameserver is not None
    # The tables above cover every code each server handles, and every field documented.
    assert set(GOOD_BROKER) == set(broker.rpc.handlers)
    assert set(GOOD_NAMESERVER) == set(cluster.nameserver.rpc.handlers)
    for code, good in {**GOOD_BROKER, **GOOD_NAMESERVER}.items():
        assert set(good) == set(REQUEST_FIELDS[code]), RequestCode(code).name
    async with trio.open_nursery() as n:
        rpc = RpcClient(n)
        sent = await refuse_every_wrong_field(rpc, broker.addr, GOOD_BROKER)
        for code, good in GOOD_NAMESERVER.items():
            for name, good_value in good.items():
                for value in wrong_values(code, name, good_value):
                    reply = await rpc.request(cluster.ns[0], code, {**good, name: value}, check=False)
                    assert reply.error_code == ErrorCode.MALFORMED_REQUEST and repr(name) in reply.error_text, reply
                    sent += 1
        assert sent > 300
        # Nothing changed: no message stored, no offset committed, no topic made or lost,
        # no broker registered.
        offsets = await rpc.request(broker.addr, RequestCode.QUERY_OFFSETS, {"topic": "v", "queue_id": 0})
        assert offsets.fields["max_offset"] == 0
        topics = await rpc.request(broker.addr, RequestCode.LIST_TOPICS)
        assert topics.fields["topics"] == {"v": 1}
        committed = await rpc.request(
            broker.addr, RequestCode.QUERY_CONSUMER_OFFSET, GOOD_BROKER[RequestCode.QUERY_CONSUMER_OFFSET]
        )
        assert committed.fields["offset"] == -1
        brokers = await rpc.request(cluster.ns[0], RequestCode.GET_CLUSTER)
        assert [b["broker_name"] for b in brokers.fields["brokers"]] == ["broker-a"]
        # ... and good requests of every kind still work.
        sent_ok = await rpc.request(
            broker.addr, RequestCode.SEND_MESSAGE, {"topic": "v"}, encode_batch([Message("v", 0, b"ok")])
        )
        assert sent_ok.fields["queue_offsets"] == [0]
        await rpc.aclose()


def _exchange(addr: str, frame: bytes) -> Frame:
    """One raw request on a fresh socket, and its response."""
    host, port = addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(frame)
        decoder = FrameDecoder()
        while True:
            event = decoder.next_event()
            if isinstance(event, Frame):
                return event
            data = sock.recv(65536)
            assert data, "connection closed without an answer"
            decoder.receive_data(data)


@pytest.mark.parametrize("version", [0, 2, 99])
async def test_a_frame_of_a_version_the_server_does_not_speak_is_refused_with_the_versions_it_does(
    cluster: Cluster, version: int
) -> None:
    for addr, code, fields in [
        (cluster.brokers["broker-a"].addr, RequestCode.SEND_MESSAGE, {"topic": "v"}),
        (cluster.brokers["broker-a"].addr, RequestCode.BROKER_INFO, {}),
        (cluster.ns[0], RequestCode.GET_ROUTE, {"topic": "v"}),
    ]:
        body = encode_batch([Message("v", 0, b"new")]) if code == RequestCode.SEND_MESSAGE else b""
        frame = Frame(code, 7, fields, body, version=version)
        reply = await trio.to_thread.run_sync(_exchange, addr, encode_frame(frame))
        assert reply.request_id == 7 and reply.error_code == ErrorCode.UNSUPPORTED_VERSION
        assert f"version {version} is not supported" in reply.error_text and "speaks version(s) 1" in reply.error_text
        assert reply.fields["versions"] == sorted(SUPPORTED_VERSIONS)
    async with open_producer(cluster.ns) as p:  # nothing stored by the refused frames
        assert (await p.send("v", b"good")).queue_offset == 0


async def test_a_producer_refused_for_its_version_raises_a_clear_error(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A broker that speaks only another version (as a newer one would): the producer
    does not retry and says which version it spoke."""
    async with open_producer(cluster.ns) as p:
        await p.send("v", b"first")  # routes are known before the broker changes
        monkeypatch.setattr(protocol_frame, "SUPPORTED_VERSIONS", frozenset({PROTOCOL_VERSION + 1}))
        with pytest.raises(SendError) as e:
            await p.send("v", b"refused")
        assert e.value.code == ErrorCode.UNSUPPORTED_VERSION
        assert f"protocol version {PROTOCOL_VERSION}" in str(
            e.value
        ) and f"speaks version(s) {PROTOCOL_VERSION + 1}" in str(e.value)


# ------------------------------------------------------------ a failed store
def test_failure_listeners_are_told_once_and_late_ones_at_once(tmp_path: Path) -> None:
    """The broker learns of its store's failure from a listener (to re-register as
    unhealthy at once): told once, from the failing thread, or at once if it came late."""
    store = Store.open(small_config(tmp_path / "s", cq_flush_interval_ms=20, cq_flush_min_bytes=20)).start()
    try:
        told: list[object] = []
        store.add_failure_listener(told.append)
        store.create_topic("orders", 1)
        eio = [Fault(op, errno.EIO, path="/consumequeue/", times=None) for op in ("pwrite", "fdatasync", "fsync")]
        with inject(*eio):
            assert store.put_batch([good(0, i) for i in range(20)]).ok
            wait_until(lambda: told, 10, "the housekeeping thread to fail on EIO and tell the listener")
        assert told == [store.failure] and not store.healthy
        late: list[object] = []
        store.add_failure_listener(late.append)
        assert late == [store.failure]
        assert store.put_batch([good(0, 99)]).status is PutStatus.STORE_FAILED
    finally:
        store.close()
    assert told == [late[0]]  # closing did not tell anyone again


async def sync_cluster(nursery: trio.Nursery, root: Path, *names: str) -> Cluster:
    c = Cluster(nursery, root)
    await c.start_nameserver()
    for name in names:
        await c.start_broker(name, flush_mode="sync", sync_flush_timeout_ms=5000)
    await c.create_topic("f", 2)
    return c


def fsync_fails(broker: str) -> Fault:
    """Every fdatasync of this broker's commit log fails with EIO (as a dying disk's)."""
    return Fault("fdatasync", errno.EIO, path=f"/{broker}/commitlog/", times=None)


async def test_a_failed_store_answers_store_failed_and_reports_itself_unhealthy(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    c = await sync_cluster(nursery, tmp_path, "broker-a")
    broker = c.brokers["broker-a"]
    body = encode_batch([Message("f", 0, b"m")])
    async with trio.open_nursery() as n:
        rpc = RpcClient(n)
        ok = await rpc.request(broker.addr, RequestCode.SEND_MESSAGE, {"topic": "f"}, body)
        assert ok.fields["durable"] is True
        with inject(fsync_fails("broker-a")) as faults:
            # A sync produce waiting for the flush that fails: STORE_FAILED, not "OK" nor a timeout.
            waiting = await rpc.request(broker.addr, RequestCode.SEND_MESSAGE, {"topic": "f"}, body, check=False)
            assert faults.fired
            assert waiting.error_code == ErrorCode.STORE_FAILED and "Input/output error" in waiting.error_text
            # Every later produce: refused at once.
            later = await rpc.request(broker.addr, RequestCode.SEND_MESSAGE, {"topic": "f"}, body, check=False)
            assert later.error_code == ErrorCode.STORE_FAILED
            info = await rpc.request(broker.addr, RequestCode.BROKER_INFO)
            assert info.fields["healthy"] is False and info.fields["failure"]
            # Its registration says so, and the name server's routes mark it (producers skip it).
            await rpc.request(c.ns[0], RequestCode.REGISTER_BROKER, registration(broker.ctx))
            route = await rpc.request(c.ns[0], RequestCode.GET_ROUTE, {"topic": "f"})
            (routed,) = route.fields["brokers"]
            assert routed["broker_name"] == "broker-a" and routed["healthy"] is False
            assert routed["failure"] == info.fields["failure"]
            listing = await rpc.request(c.ns[0], RequestCode.GET_CLUSTER)
            (entry,) = listing.fields["brokers"]
            assert entry["healthy"] is False and entry["failure"] == info.fields["failure"]
            # Reads still answer (what was stored before the failure).
            pulled = await rpc.request(
                broker.addr, RequestCode.PULL_MESSAGE, {"topic": "f", "queue_id": 0, "offset": 0}
            )
            assert pulled.fields["count"] >= 1
        await rpc.aclose()


async def test_a_producer_fails_over_from_a_broker_whose_store_failed(nursery: trio.Nursery, tmp_path: Path) -> None:
    c = await sync_cluster(nursery, tmp_path, "broker-a", "broker-b")
    async with open_producer(c.ns, retries=2) as p:
        with inject(fsync_fails("broker-a")):
            results = [await p.send("f", b"%d" % i) for i in range(12)]  # round robin: half would go to broker-a
        assert {r.queue.broker_name for r in results[-6:]} == {"broker-b"}
        assert all(r.durable for r in results)
    # With no healthy broker left the error says why.
    async with open_producer(c.ns, retries=1) as p:
        with inject(fsync_fails("broker-b")), pytest.raises(SendError) as e:
            for i in range(6):
                await p.send("f", b"late %d" % i)
        assert e.value.code == ErrorCode.STORE_FAILED and "STORE_FAILED" in str(e.value)


async def test_a_broker_whose_store_failed_registers_unhealthy_by_itself(nursery: trio.Nursery, tmp_path: Path) -> None:
    c = await sync_cluster(nursery, tmp_path, "broker-a")
    async with open_producer(c.ns, retries=0) as p:
        with inject(fsync_fails("broker-a")), pytest.raises(SendError):
            await p.send("f", b"lost")
        async with open_admin(c.ns) as admin:

            async def unhealthy() -> bool:
                return [b.get("healthy") for b in await admin.brokers()] == [False]

            await await_until(unhealthy, 10, "the name server to list broker-a as unhealthy")

"""Records decoded many at once (what a consumer's fetch answer goes through) keep their
properties encoded until read: each such record equals the eagerly decoded one, and
damage is still reported with the file and log offset."""

from __future__ import annotations

import pickle
import struct
from collections import OrderedDict, defaultdict
from pathlib import Path

import crc32c
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from clmq.broker.service import BrokerConfig
from clmq.broker.store import Store, load_json
from clmq.client import Consumer, LocalTransactionState, RpcClient, open_consumer, open_producer
from clmq.client.producer._checkback import CheckBack
from clmq.commitlog import encode_message
from clmq.common import (
    PROP_REAL_QID,
    PROP_REAL_TOPIC,
    TRANS_HALF_TOPIC,
    CorruptRecordError,
    Message,
    Record,
    decode_record,
    decode_records_many,
)
from clmq.common._record import CRC_START, HEADER_SIZE, OFF_CRC, OFF_PROPS_LEN
from clmq.protocol import RequestCode, decode_records, encode_batch
from tests.service_helpers import FAST_CONSUMER, Cluster

# Every test here runs with the compiled record decoder and with its pure-Python fallback.
pytestmark = pytest.mark.usefixtures("each_decoder")

text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)
messages = st.builds(
    Message,
    topic=st.from_regex(r"[A-Za-z0-9_.%|-]{1,30}", fullmatch=True),
    queue_id=st.integers(0, 2**32 - 1),
    body=st.binary(max_size=2000),
    tags=text,
    keys=text,
    properties=st.dictionaries(text, text, max_size=6),
    flags=st.integers(0, 2**32 - 1),
    born_timestamp_ms=st.integers(1, 2**63 - 1),
    reconsume_times=st.integers(0, 2**32 - 1),
)


def _encode_all(msgs: list[Message]) -> tuple[bytes, list[int]]:
    """The records of ``msgs`` back to back (as a fetch answer carries them), and where each starts."""
    out, starts = b"", []
    for i, m in enumerate(msgs):
        starts.append(len(out))
        out += encode_message(m, 1000 + len(out), i, 7, ("10.0.0.1", 9876))
    return out, starts


@given(st.lists(messages, min_size=1, max_size=12), st.data())
@settings(max_examples=150, deadline=None)
def test_a_lazily_decoded_record_equals_the_eagerly_decoded_one(msgs: list[Message], data: st.DataObject) -> None:
    body, starts = _encode_all(msgs)
    lazy = decode_records(body, "fetch from test")
    eager = [decode_record(body, p) for p in starts]
    assert len(lazy) == len(eager)
    for i, (lz, eg, m) in enumerate(zip(lazy, eager, msgs)):
        assert isinstance(lz, Record)
        if data.draw(st.booleans(), label=f"compare {i} before reading properties"):
            assert lz == eg and eg == lz  # both ways, properties still encoded on one side
        assert type(lz.properties) is dict
        assert lz.properties == dict(m.properties) == eg.properties
        assert lz.properties is lz.properties  # decoded once, then kept
        assert lz == eg and eg == lz
        assert pickle.loads(pickle.dumps(lz)) == eg
        assert repr(lz) == repr(eg)


@given(messages)
@settings(max_examples=50, deadline=None)
def test_properties_set_on_a_lazy_record_are_kept(msg: Message) -> None:
    (rec,) = decode_records(encode_message(msg))
    rec.properties = {"a": "b"}
    assert rec.properties == {"a": "b"}
    for mapping in (OrderedDict(a="b"), defaultdict(str, a="b"), _Props(a="b")):
        (rec,) = decode_records(encode_message(msg))
        rec.properties = mapping
        assert rec.properties is mapping  # a dict of any kind is kept as it is, never decoded


class _Props(dict[str, str]):
    """An application's own kind of dict."""


@given(st.lists(messages, min_size=1, max_size=6), st.data())
@settings(max_examples=100, deadline=None)
def test_a_changed_byte_is_reported_with_where_and_offset(msgs: list[Message], data: st.DataObject) -> None:
    body, starts = _encode_all(msgs)
    which = data.draw(st.integers(0, len(msgs) - 1))
    end = starts[which + 1] if which + 1 < len(starts) else len(body)
    pos = data.draw(st.integers(starts[which] + CRC_START, end - 1))  # covered by the CRC
    raw = bytearray(body)
    raw[pos] ^= data.draw(st.integers(1, 255))
    with pytest.raises(CorruptRecordError) as info:
        decode_records_many(bytes(raw), "segment-7", base_offset=5000)
    assert info.value.file == "segment-7"
    assert info.value.offset <= 5000 + starts[which]  # this record, or an earlier one it made unreadable


def _with_bad_properties(topic: str = "t", queue_id: int = 3, log_offset: int = 4096, queue_offset: int = 11) -> bytes:
    """A record whose CRC is right but whose properties say a key runs past their end
    (what only a faulty writer makes): the CRC check cannot see it."""
    raw = bytearray(encode_message(Message(topic, queue_id, b"body", properties={"k": "v"}), log_offset, queue_offset))
    (props_len,) = struct.unpack_from("<I", raw, OFF_PROPS_LEN)
    at = HEADER_SIZE + len(topic.encode())  # after the topic, no tags, no keys: the first key's length
    struct.pack_into("<H", raw, at, props_len + 10)
    struct.pack_into("<I", raw, OFF_CRC, crc32c.crc32c(bytes(raw[CRC_START:])))
    return bytes(raw)


def test_properties_that_do_not_parse_raise_the_record_error_when_read() -> None:
    raw = _with_bad_properties()
    with pytest.raises((ValueError, struct.error)):
        decode_record(raw)  # eager: fails at once, with no record offset
    (rec,) = decode_records(raw, "fetch from test")
    assert rec.body == b"body" and rec.queue_offset == 11  # the rest reads
    with pytest.raises(CorruptRecordError) as info:
        _ = rec.properties
    assert info.value.offset == 4096 and info.value.check == "properties"
    assert "t/3 offset 11" in info.value.file


class _Unknown:
    """A transaction listener whose checks answer UNKNOWN; it keeps the bodies it checked."""

    def __init__(self) -> None:
        self.checked: list[bytes] = []

    def execute_local_transaction(self, message: Message, arg: object) -> LocalTransactionState:
        return LocalTransactionState.UNKNOWN

    def check_local_transaction(self, record: Record) -> LocalTransactionState:
        self.checked.append(record.body)
        return LocalTransactionState.UNKNOWN


async def test_a_half_record_whose_properties_do_not_parse_is_skipped_by_the_check_back(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The check-back logs and skips such a record (as it did when records were decoded
    eagerly, inside the answer's error handling) and checks the others of the answer;
    before, reading its properties raised out of the check and ended the producer."""
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    broker = await c.start_broker("broker-a")
    listener = _Unknown()
    good = Message(TRANS_HALF_TOPIC, 0, b"good", properties={PROP_REAL_TOPIC: "orders", PROP_REAL_QID: "0"})
    answer = _with_bad_properties(TRANS_HALF_TOPIC, 0, 4096, 11) + encode_message(good, 8192, 12)
    async with open_producer(c.ns, transaction_group="tg", transaction_listener=listener) as producer:
        checks = CheckBack(producer, listener, 4, 5_000)
        with trio.fail_after(30):
            await checks._answer(broker.addr, {}, answer)  # as a CHECK_TRANSACTIONS answer carries them
    assert listener.checked == [b"good"] and checks.unknown == 1
    assert any("properties" in r.getMessage() and "4096" in r.getMessage() for r in caplog.records), caplog.text


async def test_a_tracing_consumer_receives_a_record_whose_properties_do_not_parse(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """Such a record (put into the log as a follower copies its leader's bytes: only a
    faulty writer makes one) is delivered to a consumer with ``trace=True``, traced
    without properties; before, the tracer raised out of receive()."""
    config = BrokerConfig(
        data_dir=str(tmp_path / "broker-a"), segment_bytes=4 * 1024 * 1024, max_message_bytes=256 * 1024
    )
    with Store.open(config.store_config()) as store:
        store.create_topic("lazy", 1)
        bad = _with_bad_properties("lazy", 0, 0, 0)
        good = encode_message(Message("lazy", 0, b"good", properties={"k": "v"}), len(bad), 1)
        assert store.log.append_raw(0, bad + good).ok
        store.catch_up()
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    await c.start_broker("broker-a", trace_enabled=True)
    await c.wait_routed("lazy", {"broker-a"})
    traced = {"trace": True, "trace_flush_interval_ms": 20}
    async with open_consumer(c.ns, "g", {"lazy": "*"}, **{**FAST_CONSUMER, **traced}) as consumer:
        got = await _read(consumer, 2)
        tracer = consumer.state.tracer
    assert [r.body for r in got] == [b"body", b"good"]
    assert tracer is not None and tracer.dispatcher.recorded >= 2


SPARSE_QUEUES = 2048


async def test_sparse_queues_are_read_once_with_their_properties_and_the_commits_survive_a_restart(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """1 to 3 messages in each of 2,048 queues, each with properties (decoded lazily):
    a consumer reads each once with its properties, commits them all (the offsets
    file, one row per group and topic), and after a restart of the broker the group
    reads only what was produced since."""
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    broker = await c.start_broker("broker-a")
    await c.create_topic("sparse", SPARSE_QUEUES)
    first = {q: [f"a-{q}-{i}".encode() for i in range(1 + q % 3)] for q in range(SPARSE_QUEUES)}
    await _fill(broker.addr, first)
    want = {b: {"q": b.decode().split("-")[1]} for bs in first.values() for b in bs}
    async with open_consumer(c.ns, "g", {"sparse": "*"}, **FAST_CONSUMER) as consumer:
        got = await _read(consumer, len(want))
        assert sorted(r.body for r in got) == sorted(want)
        assert all(r.properties == want[r.body] for r in got)
    # closing acknowledged and committed everything; the broker writes its offsets at stop
    await c.stop_broker("broker-a")
    saved = load_json(tmp_path / "broker-a" / "consumer_offsets.json").value
    assert saved["version"] == 2 and [(g, t, len(qs)) for g, t, qs, _os in saved["offsets"]] == [
        ("g", "sparse", SPARSE_QUEUES)
    ]
    broker = await c.start_broker("broker-a")
    await _fill(broker.addr, {q: [f"b-{q}".encode()] for q in range(0, SPARSE_QUEUES, 7)})
    async with open_consumer(c.ns, "g", {"sparse": "*"}, **FAST_CONSUMER) as consumer:
        rest = await _read(consumer, len(range(0, SPARSE_QUEUES, 7)))
    assert sorted(r.body for r in rest) == sorted(f"b-{q}".encode() for q in range(0, SPARSE_QUEUES, 7))


async def _fill(addr: str, bodies: dict[int, list[bytes]]) -> None:
    messages = [Message("sparse", q, b, properties={"q": str(q)}) for q, bs in bodies.items() for b in bs]
    async with trio.open_nursery() as n:
        rpc = RpcClient(n)
        for i in range(0, len(messages), 2000):
            await rpc.request(addr, RequestCode.SEND_MESSAGE, {"topic": "sparse"}, encode_batch(messages[i : i + 2000]))
        await rpc.aclose()
        n.cancel_scope.cancel()


async def _read(consumer: Consumer, want: int) -> list[Record]:
    got: list[Record] = []
    with trio.fail_after(30):
        while len(got) < want:
            got += await consumer.receive()
    return got

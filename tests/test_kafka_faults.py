"""Bad input and limits on the Kafka listener, as classes of faults, against a real
broker process over real sockets (``kafka_procs.open_kafka``, ``kafka_wire.KafkaWire``).

The rule: bad input gets Kafka's error code for what is wrong (or the connection is
closed, where Kafka closes it) and loses nothing; never a crash, never a partial write;
a well-behaved client alongside is unaffected. Each test checks what the broker holds
afterwards and that its log has no traceback.

What a partition holds is read exactly as the offset a marker record is given (offsets
are given at append), not with ListOffsets: an acknowledged produce can be missing from
ListOffsets and Fetch for a moment (the consume queue is built after the answer), so
reads of acknowledged records long-poll (``fetch(..., want=n)``).
"""

from __future__ import annotations

import struct
import threading
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator

import pytest
import trio
from hypothesis import HealthCheck, given, settings

from clmq.broker.service._stalls import log as stall_log
from clmq.protocol.kafka import (
    NEED_DATA,
    ApiKey,
    Compression,
    ErrorCode,
    KafkaResponseReader,
    build_batch,
    parse_batches,
)
from tests.kafka_procs import KafkaCluster, in_thread, open_kafka
from tests.kafka_wire import ConnectionClosed, Fault, KafkaWire, fault_strategy, one_batch, split_frames
from tests.waiting import await_until

PRODUCE_V, FETCH_V, LIST_V, META_V, CREATE_V = 9, 12, 7, 9, 5
TS = 1_700_000_000_000


# ---------------------------------------------------------------- helpers
@pytest.fixture
async def kafka(tmp_path: Path) -> AsyncIterator[KafkaCluster]:
    async with open_kafka(tmp_path) as cluster:
        yield cluster
        assert_clean_log(cluster)


def assert_clean_log(cluster: KafkaCluster) -> None:
    """The broker is alive and logged no traceback and no failed handler."""
    broker = cluster.group["b0"]
    assert broker.running, f"the broker exited ({broker.returncode()}): {broker.tail()}"
    text = broker.err.read_text(errors="replace") if broker.err.exists() else ""
    for bad in ("Traceback", "failed; closing the connection", "CRITICAL"):
        assert bad not in text, f"{bad!r} in the broker's log:\n{text[-4000:]}"


def wire(cluster: KafkaCluster, timeout_s: float = 10.0) -> KafkaWire:
    return KafkaWire(cluster.kafka_addr("b0"), timeout_s)


def create_topic(w: KafkaWire, name: str, partitions: int = 1) -> None:
    body = {"topics": [{"name": name, "num_partitions": partitions, "replication_factor": 1}], "timeout_ms": 5000}
    (row,) = w.request(ApiKey.CREATE_TOPICS, CREATE_V, body)["topics"]
    assert row["error_code"] == 0, row


def produce_body(topic: str, parts: dict[int, bytes | None], acks: int = -1, txn: str | None = None) -> dict[str, Any]:
    return {
        "transactional_id": txn,
        "acks": acks,
        "timeout_ms": 5000,
        "topic_data": [{"name": topic, "partition_data": [{"index": i, "records": r} for i, r in parts.items()]}],
    }


def produce(
    w: KafkaWire, topic: str, parts: dict[int, bytes | None], acks: int = -1, txn: str | None = None
) -> dict[int, dict[str, Any]]:
    """Produce; partition index -> its answer."""
    body = w.request(ApiKey.PRODUCE, PRODUCE_V, produce_body(topic, parts, acks, txn))
    ((t,),) = [body["responses"]]
    assert t["name"] == topic
    return {p["index"]: p for p in t["partition_responses"]}


def produce_one(w: KafkaWire, topic: str, records: bytes | None, partition: int = 0, acks: int = -1) -> dict[str, Any]:
    return produce(w, topic, {partition: records}, acks)[partition]


def end_offset(w: KafkaWire, topic: str, partition: int = 0) -> int:
    body = {
        "replica_id": -1,
        "topics": [{"name": topic, "partitions": [{"partition_index": partition, "timestamp": -1}]}],
    }
    ((p,),) = [w.request(ApiKey.LIST_OFFSETS, LIST_V, body)["topics"][0]["partitions"]]
    assert p["error_code"] == 0, p
    return int(p["offset"])


def next_offset(w: KafkaWire, topic: str, partition: int = 0) -> int:
    """The offset a marker record gets: how many records the partition holds (exact, as
    offsets are given at append; ListOffsets may lag an acknowledged produce, see the module doc)."""
    answer = produce_one(w, topic, one_batch([b"marker"]), partition)
    assert answer["error_code"] == 0, answer
    return int(answer["base_offset"])


def fetch_body(topic: str, partition: int, offset: int, max_wait_ms: int = 0) -> dict[str, Any]:
    return {
        "replica_id": -1,
        "max_wait_ms": max_wait_ms,
        "min_bytes": 1,
        "max_bytes": 1 << 22,
        "session_id": 0,
        "session_epoch": -1,
        "topics": [
            {
                "topic": topic,
                "partitions": [{"partition": partition, "fetch_offset": offset, "partition_max_bytes": 1 << 22}],
            }
        ],
    }


def fetch(
    w: KafkaWire, topic: str, partition: int = 0, offset: int = 0, want: int = 0
) -> tuple[int, list[bytes | None]]:
    """(error code, the values from ``offset``); with ``want``, long-polls until that many are visible."""
    deadline = time.monotonic() + 10
    while True:
        body = fetch_body(topic, partition, offset, max_wait_ms=500 if want else 0)
        (p,) = w.request(ApiKey.FETCH, FETCH_V, body)["responses"][0]["partitions"]
        records = p["records"] or b""
        values = [r.value for b in parse_batches(records, max_uncompressed_bytes=1 << 26) for r in b.records]
        if p["error_code"] or len(values) >= want or time.monotonic() > deadline:
            return p["error_code"], values


def corrupt_crc(batch: bytes) -> bytes:
    out = bytearray(batch)
    out[17] ^= 0xFF  # the crc field: bytes 17..20
    return bytes(out)


def idempotent(values: list[bytes], pid: int, epoch: int, seq: int) -> bytes:
    return one_batch(values, producer_id=pid, producer_epoch=epoch, base_sequence=seq)


def init_producer_id(w: KafkaWire) -> tuple[int, int]:
    body = w.request(ApiKey.INIT_PRODUCER_ID, 4, {"transactional_id": None, "transaction_timeout_ms": 60000})
    assert body["error_code"] == 0, body
    return int(body["producer_id"]), int(body["producer_epoch"])


# ---------------------------------------------------------------- produce: bad batches
async def test_bad_crc_is_corrupt_message_and_nothing_is_written(kafka: KafkaCluster) -> None:
    with wire(kafka) as w:
        create_topic(w, "t", 2)
        good = one_batch([b"a", b"b"])
        answer = produce(w, "t", {0: corrupt_crc(good), 1: good})
        assert answer[0]["error_code"] == ErrorCode.CORRUPT_MESSAGE and answer[0]["base_offset"] == -1
        assert answer[1]["error_code"] == 0 and answer[1]["base_offset"] == 0  # the other partition is unaffected
        # one good and one bad batch in a partition: nothing of that partition
        two = good + corrupt_crc(one_batch([b"c"]))
        assert produce_one(w, "t", two)["error_code"] == ErrorCode.CORRUPT_MESSAGE
        bad_first = corrupt_crc(good) + one_batch([b"c"])
        assert produce_one(w, "t", bad_first)["error_code"] == ErrorCode.CORRUPT_MESSAGE
        assert produce_one(w, "t", good)["base_offset"] == 0  # nothing written; good batches taken after
        assert fetch(w, "t", want=2) == (0, [b"a", b"b"])
        assert next_offset(w, "t", 1) == 2


@pytest.mark.parametrize(
    "mangle, code",
    [
        (lambda b: b[:-1], ErrorCode.CORRUPT_MESSAGE),  # truncated
        (lambda b: b + b"\x00" * 5, ErrorCode.CORRUPT_MESSAGE),  # trailing bytes
        (lambda b: b[:16] + b"\x00" + b[17:], ErrorCode.UNSUPPORTED_FOR_MESSAGE_FORMAT),  # magic 0
        (lambda b: b[:16] + b"\x01" + b[17:], ErrorCode.UNSUPPORTED_FOR_MESSAGE_FORMAT),  # magic 1
        (lambda b: b[:16] + b"\x07" + b[17:], ErrorCode.CORRUPT_MESSAGE),  # magic 7
        (lambda b: b"", ErrorCode.CORRUPT_MESSAGE),  # no records
        (lambda b: None, ErrorCode.CORRUPT_MESSAGE),  # null records
    ],
    ids=["truncated", "trailing", "magic0", "magic1", "magic7", "empty", "null"],
)
async def test_malformed_batches_get_their_error_and_write_nothing(kafka: KafkaCluster, mangle: Any, code: int) -> None:
    with wire(kafka) as w:
        create_topic(w, "t")
        answer = produce_one(w, "t", mangle(one_batch([b"x", b"y"])))
        assert (answer["error_code"], answer["base_offset"]) == (code, -1), answer
        assert next_offset(w, "t") == 0


async def test_transactional_batches_and_transactional_ids_are_refused(kafka: KafkaCluster) -> None:
    with wire(kafka) as w:
        create_topic(w, "t")
        txn_batch = one_batch([b"x"], producer_id=5, producer_epoch=0, base_sequence=0, transactional=True)
        assert produce_one(w, "t", txn_batch)["error_code"] == ErrorCode.INVALID_RECORD
        answer = produce(w, "t", {0: one_batch([b"x"])}, txn="my-txn")[0]
        assert answer["error_code"] == ErrorCode.TRANSACTIONAL_ID_AUTHORIZATION_FAILED
        assert next_offset(w, "t") == 0


async def test_decompression_bomb_is_message_too_large(tmp_path: Path) -> None:
    async with open_kafka(tmp_path, max_frame_bytes=4 << 20) as kafka:
        with wire(kafka) as w:
            create_topic(w, "t")
            bomb = build_batch(0, [(TS, None, bytes(8 << 20), [])], compression=Compression.ZSTD)
            assert len(bomb) < 4096
            assert produce_one(w, "t", bomb)["error_code"] == ErrorCode.MESSAGE_TOO_LARGE
            # many small bombs in one partition: the budget is the partition's, not each batch's
            small = build_batch(0, [(TS, None, bytes(1 << 20), [])], compression=Compression.GZIP)
            assert produce_one(w, "t", small * 6)["error_code"] == ErrorCode.MESSAGE_TOO_LARGE
            assert next_offset(w, "t") == 0
        assert_clean_log(kafka)


async def test_record_larger_than_max_message_bytes_is_message_too_large(kafka: KafkaCluster) -> None:
    # BROKER_DEFAULTS: max_message_bytes = 64 KiB
    with wire(kafka) as w:
        create_topic(w, "t")
        big = one_batch([b"small", bytes(100 << 10)])
        assert produce_one(w, "t", big)["error_code"] == ErrorCode.MESSAGE_TOO_LARGE
        compressed = build_batch(0, [(TS, None, bytes(100 << 10), [])], compression=Compression.LZ4)
        assert produce_one(w, "t", compressed)["error_code"] == ErrorCode.MESSAGE_TOO_LARGE
        assert next_offset(w, "t") == 0  # not even the small one


@pytest.mark.parametrize("acks", [2, -2, 5, 32767, -32768])
async def test_acks_other_than_0_1_all_are_invalid_required_acks(kafka: KafkaCluster, acks: int) -> None:
    with wire(kafka) as w:
        create_topic(w, "t")
        answer = produce_one(w, "t", one_batch([b"x"]), acks=acks)
        assert answer["error_code"] == ErrorCode.INVALID_REQUIRED_ACKS
        assert next_offset(w, "t") == 0


async def test_unknown_topic_or_partition(kafka: KafkaCluster) -> None:
    with wire(kafka) as w:
        create_topic(w, "t", 2)
        batch = one_batch([b"x"])
        assert produce_one(w, "nope", batch)["error_code"] == ErrorCode.UNKNOWN_TOPIC_OR_PARTITION
        for index in (2, -1, 2**31 - 1):
            assert produce_one(w, "t", batch, partition=index)["error_code"] == ErrorCode.UNKNOWN_TOPIC_OR_PARTITION
            assert fetch(w, "t", index)[0] == ErrorCode.UNKNOWN_TOPIC_OR_PARTITION
        assert fetch(w, "nope")[0] == ErrorCode.UNKNOWN_TOPIC_OR_PARTITION
        assert next_offset(w, "t", 0) == next_offset(w, "t", 1) == 0


async def test_fetch_out_of_range_is_offset_out_of_range(kafka: KafkaCluster) -> None:
    with wire(kafka) as w:
        create_topic(w, "t")
        assert produce_one(w, "t", one_batch([b"a", b"b", b"c"]))["error_code"] == 0
        for offset in (4, 1000, 2**63 - 1, -1, -(2**63)):
            assert fetch(w, "t", offset=offset)[0] == ErrorCode.OFFSET_OUT_OF_RANGE, offset
        assert fetch(w, "t", offset=3) == (0, [])  # the end itself is in range: nothing yet
        assert fetch(w, "t", offset=1, want=2) == (0, [b"b", b"c"])


async def test_an_acknowledged_produce_is_visible_at_once(kafka: KafkaCluster) -> None:
    """Kafka's rule: once acks=-1 is answered, the high watermark covers the records
    (the answer waits for the queue's entries, which the dispatcher makes a moment
    after the append: before, a few in 200 were missing here)."""
    with wire(kafka) as w:
        create_topic(w, "t")
        for i in range(200):
            assert produce_one(w, "t", one_batch([b"v%d" % i]))["base_offset"] == i
            assert end_offset(w, "t") == i + 1, f"ListOffsets lags the acknowledged offset {i}"


# ---------------------------------------------------------------- idempotence
async def test_duplicate_batch_is_answered_with_its_first_offsets_and_stored_once(kafka: KafkaCluster) -> None:
    with wire(kafka) as w:
        create_topic(w, "t")
        pid, epoch = init_producer_id(w)
        first = produce_one(w, "t", idempotent([b"a", b"b"], pid, epoch, 0))
        second = produce_one(w, "t", idempotent([b"c"], pid, epoch, 2))
        assert (first["base_offset"], second["base_offset"]) == (0, 2)
        again = produce_one(w, "t", idempotent([b"a", b"b"], pid, epoch, 0))
        assert (again["error_code"], again["base_offset"]) == (0, 0)
        # a duplicate pipelined right behind its original: the same answer
        w.send(ApiKey.PRODUCE, PRODUCE_V, produce_body("t", {0: idempotent([b"d"], pid, epoch, 3)}))
        w.send(ApiKey.PRODUCE, PRODUCE_V, produce_body("t", {0: idempotent([b"d"], pid, epoch, 3)}))
        answers = [w.receive().body["responses"][0]["partition_responses"][0] for _ in range(2)]
        assert [(a["error_code"], a["base_offset"]) for a in answers] == [(0, 3), (0, 3)]
        assert fetch(w, "t", want=4) == (0, [b"a", b"b", b"c", b"d"])


async def test_out_of_order_sequence_and_old_epoch_are_refused(kafka: KafkaCluster) -> None:
    with wire(kafka) as w:
        create_topic(w, "t")
        pid, epoch = init_producer_id(w)
        assert produce_one(w, "t", idempotent([b"a"], pid, epoch, 0))["error_code"] == 0
        gap = produce_one(w, "t", idempotent([b"x"], pid, epoch, 5))
        assert gap["error_code"] == ErrorCode.OUT_OF_ORDER_SEQUENCE_NUMBER
        # a bumped epoch must start at 0; then the old epoch is fenced
        bumped = produce_one(w, "t", idempotent([b"x"], pid, epoch + 1, 1))
        assert bumped["error_code"] == ErrorCode.OUT_OF_ORDER_SEQUENCE_NUMBER
        assert produce_one(w, "t", idempotent([b"b"], pid, epoch + 1, 0))["error_code"] == 0
        old = produce_one(w, "t", idempotent([b"y"], pid, epoch, 1))
        assert old["error_code"] == ErrorCode.INVALID_PRODUCER_EPOCH
        # a refused batch in a request with a good one: only the good partition is written
        create_topic(w, "u", 2)
        assert produce_one(w, "u", idempotent([b"u0"], pid, epoch + 1, 0))["error_code"] == 0
        mixed = produce(w, "u", {0: idempotent([b"z"], pid, epoch + 1, 7), 1: one_batch([b"ok"])})
        assert mixed[0]["error_code"] == ErrorCode.OUT_OF_ORDER_SEQUENCE_NUMBER and mixed[1]["error_code"] == 0
        assert fetch(w, "t", want=2) == (0, [b"a", b"b"])
        assert (next_offset(w, "u", 0), next_offset(w, "u", 1)) == (1, 1)


# ---------------------------------------------------------------- acks=0
async def test_acks_zero_answers_nothing_but_stores(kafka: KafkaCluster) -> None:
    with wire(kafka) as w:
        create_topic(w, "t")
        for i in range(20):
            w.send(ApiKey.PRODUCE, PRODUCE_V, produce_body("t", {0: one_batch([b"v%d" % i])}, acks=0))
        w.reader = type(w.reader)()  # no answers are expected for those
        cid = w.send(ApiKey.API_VERSIONS, 3, {})
        got = w.receive()
        assert got.correlation_id == cid  # the first answer is the ApiVersions one: none for the produces
        assert fetch(w, "t", want=20) == (0, [b"v%d" % i for i in range(20)])
        # a refused acks=0 produce is not answered either, and writes nothing
        w.send(ApiKey.PRODUCE, PRODUCE_V, produce_body("t", {0: corrupt_crc(one_batch([b"bad"]))}, acks=0))
        w.reader = type(w.reader)()
        assert next_offset(w, "t") == 20


# ---------------------------------------------------------------- versions and framing
async def test_api_versions_of_an_unknown_version_gets_the_v0_answer(kafka: KafkaCluster) -> None:
    with wire(kafka) as w:
        for version in (5, 99, 32767, -1):
            w.reader.expect(100 + version, ApiKey.API_VERSIONS, 0)
            w.send_raw(struct.pack(">ihhih", 10, ApiKey.API_VERSIONS, version, 100 + version, -1))
            got = w.receive()
            assert got.correlation_id == 100 + version
            assert got.body["error_code"] == ErrorCode.UNSUPPORTED_VERSION
            listed = {k["api_key"]: (k["min_version"], k["max_version"]) for k in got.body["api_keys"]}
            assert listed[ApiKey.API_VERSIONS] == (0, 4) and listed[ApiKey.PRODUCE][0] == 3
        assert w.request(ApiKey.API_VERSIONS, 3, {})["error_code"] == 0  # the connection still serves


@pytest.mark.parametrize(
    "api_key, version",
    [(99, 0), (-1, 0), (ApiKey.PRODUCE, 0), (ApiKey.PRODUCE, 2), (ApiKey.FETCH, 3), (ApiKey.FETCH, 99), (24, 0)],
    ids=["key99", "key-1", "produce-v0", "produce-v2", "fetch-v3", "fetch-v99", "txn-not-advertised"],
)
async def test_unknown_apis_and_versions_close_the_connection(kafka: KafkaCluster, api_key: int, version: int) -> None:
    with wire(kafka) as w:
        create_topic(w, "t")
        cid = w.send(ApiKey.METADATA, META_V, {"topics": None})
        # pipelined: answered, then the unknown request closes the connection; nothing after it is done
        w.send_raw(struct.pack(">ihhih", 10 + 4, api_key, version, 77, -1) + b"\x00" * 4)
        w.send(ApiKey.PRODUCE, PRODUCE_V, produce_body("t", {0: one_batch([b"after"])}))
        assert w.receive().correlation_id == cid
        with pytest.raises(ConnectionClosed):
            w.receive()
    with wire(kafka) as w:
        assert next_offset(w, "t") == 0


# ---------------------------------------------------------------- limits
async def test_frame_over_kafka_max_frame_bytes_closes_before_the_bytes_arrive(tmp_path: Path) -> None:
    async with open_kafka(tmp_path, kafka_max_frame_bytes=64 << 10) as kafka:
        with wire(kafka) as w:
            create_topic(w, "t")
        with wire(kafka) as w:
            # the size alone, then nothing: closed at once
            w.send_raw(struct.pack(">i", (64 << 10) + 1))
            assert w.read_until_closed(5) == (b"", True)
        with wire(kafka) as w:  # a frame at the limit is read
            body = produce_body("t", {0: one_batch([bytes(40 << 10)])})
            assert produce_one(w, "t", one_batch([bytes(40 << 10)]))["error_code"] == 0, body["acks"]
            big = w.frame(ApiKey.PRODUCE, PRODUCE_V, produce_body("t", {0: one_batch([bytes(70 << 10)])}))
            try:
                w.send_raw(big)
            except (BrokenPipeError, ConnectionResetError):
                pass
            assert w.read_until_closed(5)[1]
        with wire(kafka) as w:
            assert next_offset(w, "t") == 1
        assert_clean_log(kafka)


async def test_kafka_max_connections_closes_one_more_and_keeps_the_others(tmp_path: Path) -> None:
    async with open_kafka(tmp_path, kafka_max_connections=3) as kafka:
        conns = [wire(kafka) for _ in range(3)]
        try:
            for w in conns:
                assert w.request(ApiKey.API_VERSIONS, 3, {})["error_code"] == 0
            for _ in range(3):
                with wire(kafka) as extra:
                    try:
                        extra.send(ApiKey.API_VERSIONS, 3, {})
                    except (BrokenPipeError, ConnectionResetError):
                        pass
                    assert extra.read_until_closed(5) == (b"", True)
            create_topic(conns[0], "t")
            for i, w in enumerate(conns):
                assert produce_one(w, "t", one_batch([b"v%d" % i]))["error_code"] == 0
            conns.pop().close()

            def admitted() -> int | None:
                """The partition's next offset, asked on a new connection (None: refused,
                the broker has not seen a close yet: each try's own close counts too)."""
                with wire(kafka) as w:
                    try:
                        return next_offset(w, "t")
                    except (ConnectionClosed, ConnectionResetError, BrokenPipeError):
                        return None

            assert await await_until(admitted, 10, "a connection admitted once one closed") == 3
        finally:
            for w in conns:
                w.close()
        text = kafka.group["b0"].tail(20000)
        assert text.count("kafka_max_connections=3 reached") >= 1
        assert_clean_log(kafka)


async def test_idle_connection_is_closed_but_not_one_waiting_on_a_long_fetch(tmp_path: Path) -> None:
    async with open_kafka(tmp_path, kafka_idle_timeout_ms=500, kafka_max_fetch_wait_ms=3000) as kafka:
        with wire(kafka) as setup:
            create_topic(setup, "t")
        with wire(kafka) as never, wire(kafka) as once, wire(kafka) as waiting:
            assert once.request(ApiKey.API_VERSIONS, 3, {})["error_code"] == 0
            started = time.monotonic()
            cid = waiting.send(ApiKey.FETCH, FETCH_V, fetch_body("t", 0, 0, max_wait_ms=2500))
            assert never.read_until_closed(5) == (b"", True)  # never asked anything
            assert once.read_until_closed(5) == (b"", True)  # asked, answered, then idle
            got = waiting.receive(10)
            assert got.correlation_id == cid and time.monotonic() - started >= 2.0
            # and it is usable after the long wait
            assert waiting.request(ApiKey.API_VERSIONS, 3, {})["error_code"] == 0
            assert waiting.read_until_closed(5) == (b"", True)  # idle again: closed
        assert_clean_log(kafka)


async def test_pipelined_requests_beyond_max_inflight_are_all_answered_in_order(tmp_path: Path) -> None:
    async with open_kafka(tmp_path, kafka_max_inflight_requests=4) as kafka:
        with wire(kafka) as w:
            create_topic(w, "t", 2)
            sent: list[int] = []
            frames = b""
            for i in range(200):
                kind = i % 4
                if kind == 0:
                    frames += w.frame(
                        ApiKey.PRODUCE, PRODUCE_V, produce_body("t", {i // 4 % 2: one_batch([b"p%d" % i])})
                    )
                elif kind == 1:
                    frames += w.frame(ApiKey.FETCH, FETCH_V, fetch_body("t", 0, 0, max_wait_ms=20))
                elif kind == 2:
                    frames += w.frame(ApiKey.METADATA, META_V, {"topics": None})
                else:
                    frames += w.frame(ApiKey.API_VERSIONS, 3, {})
                sent.append(w.next_id - 1)
            w.send_raw(frames)  # all at once: the broker reads ahead only 4
            got = [w.receive(30) for _ in sent]
            assert [g.correlation_id for g in got] == sent
            produced = [g.body["responses"][0]["partition_responses"][0] for g in got if g.api_key == ApiKey.PRODUCE]
            assert all(p["error_code"] == 0 for p in produced)
            # per partition, offsets in the order sent
            for part in (0, 1):
                offsets = [p["base_offset"] for p in produced if p["index"] == part]
                assert offsets == list(range(25))
            assert fetch(w, "t", 0, want=25)[1] == [b"p%d" % i for i in range(0, 200, 8)]
        assert_clean_log(kafka)


async def test_garbage_after_a_good_request_closes_and_keeps_what_was_answered(kafka: KafkaCluster) -> None:
    with wire(kafka) as w:
        create_topic(w, "t")
        good = w.frame(ApiKey.PRODUCE, PRODUCE_V, produce_body("t", {0: one_batch([b"kept"])}))
        w.send_raw(good + struct.pack(">ihhi", 8, ApiKey.PRODUCE, PRODUCE_V, 9) + b"\xff")
        data, closed = w.finish_and_read(10)
        frames, rest = split_frames(data)
        assert closed and len(frames) == 1 and rest == b""
    with wire(kafka) as w:
        assert fetch(w, "t", want=1) == (0, [b"kept"])


# ---------------------------------------------------------------- the wire fuzzer
# Examples per fault kind: the field replacements are the most numerous (every field of
# every served API and version is a target).
FUZZ_EXAMPLES = {"field": 500, "mutated": 150, "truncated": 100, "garbage-body": 100, "lying-size": 60}
FUZZ_EXAMPLES.update({"random": 60, "unknown": 60})
STEADY = "steady"
EXPECTED_WARNINGS = ("kafka: closing the connection from", "is not served")
# The stall detector's lines say the machine was slow, not that the code under test erred:
# they are told apart by their logger's name (the detector itself stays on).
STALL_LOGGER = stall_log.name


def unexpected_warnings(log_text: str) -> list[str]:
    """The log's WARNING and ERROR lines other than the expected ones and the stall detector's."""
    return [
        line
        for line in log_text.splitlines()
        if ("WARNING" in line or "ERROR" in line)
        and not any(e in line for e in EXPECTED_WARNINGS)
        and f" {STALL_LOGGER}: " not in line
    ]


class SteadyTraffic:
    """A confluent-kafka idempotent producer and a consumer on topic ``steady``, in
    threads, all along: every message produced must be read back exactly, in order."""

    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap
        self.stop_producing = threading.Event()
        self.stop_consuming = threading.Event()
        self.produced: list[bytes] = []
        self.delivered: dict[bytes, tuple[int, int]] = {}
        self.errors: list[str] = []
        self.consumed: list[tuple[int, int, bytes]] = []

    def produce(self) -> None:
        ck = pytest.importorskip("confluent_kafka")
        producer = ck.Producer(
            {"bootstrap.servers": self.bootstrap, "enable.idempotence": True, "linger.ms": 2, "acks": "all"}
        )

        def report(err: Any, msg: Any) -> None:
            if err is not None:
                self.errors.append(f"delivery: {err}")
            else:
                self.delivered[msg.value()] = (msg.partition(), msg.offset())

        n = 0
        while not self.stop_producing.is_set():
            value = b"steady-%06d" % n
            producer.produce(STEADY, value=value, key=b"k%d" % (n % 7), on_delivery=report)
            self.produced.append(value)
            n += 1
            producer.poll(0.005)
        if producer.flush(30):
            self.errors.append("producer: messages left unsent")

    def consume(self) -> None:
        ck = pytest.importorskip("confluent_kafka")
        consumer = ck.Consumer(
            {
                "bootstrap.servers": self.bootstrap,
                "group.id": "steady-readers",
                "auto.offset.reset": "earliest",
                "enable.auto.commit": True,
            }
        )
        consumer.subscribe([STEADY])
        deadline = None
        try:
            while True:
                if self.stop_consuming.is_set():
                    if len(self.consumed) >= len(self.produced):
                        break
                    deadline = deadline or time.monotonic() + 30
                    if time.monotonic() > deadline:
                        self.errors.append(f"consumer: {len(self.consumed)} of {len(self.produced)} after 30 s")
                        break
                for m in consumer.consume(500, 0.1):
                    if m.error():
                        self.errors.append(f"consume: {m.error()}")
                        continue
                    self.consumed.append((m.partition(), m.offset(), m.value()))
        finally:
            consumer.close()

    def check(self) -> None:
        assert not self.errors, self.errors[:10]
        assert len(self.produced) > 100, "the steady producer hardly ran"
        assert set(self.delivered) == set(self.produced)
        by_partition: dict[int, list[tuple[int, bytes]]] = {}
        for partition, offset, value in self.consumed:
            by_partition.setdefault(partition, []).append((offset, value))
        for partition, rows in by_partition.items():
            assert [o for o, _v in rows] == list(range(len(rows))), f"partition {partition}: gaps or duplicates"
        assert sorted(v for _p, _o, v in self.consumed) == sorted(self.produced)  # each exactly once
        where = {v: (p, o) for p, o, v in self.consumed}
        assert where == self.delivered  # read where the delivery report said


def _check_answers(fault: Fault, data: bytes, closed: bool, probe: int) -> None:
    """What came back for ``fault`` then a probe: whole frames only, answers only to
    requests sent, in the order sent, each one decodable; the connection closed."""
    assert closed, f"{fault.kind} {fault.note}: the broker kept the connection after the client's end"
    frames, rest = split_frames(data)
    assert rest == b"", f"{fault.kind} {fault.note}: a partial answer {rest[:40]!r}"
    cids = [struct.unpack_from(">i", f)[0] for f in frames]
    if fault.known is None:  # garbage headers: whatever was answered came whole
        return
    order = [*fault.known, probe]
    assert set(cids) <= set(order), f"{fault.kind} {fault.note}: answers {cids}"
    assert [order.index(c) for c in cids] == sorted(set(order.index(c) for c in cids)), (
        f"{fault.kind} {fault.note}: answers out of order or twice {cids}"
    )
    reader = KafkaResponseReader()
    for cid, (api_key, version) in fault.known.items():
        reader.expect(cid, api_key, version)
    reader.expect(probe, ApiKey.METADATA, META_V)
    reader.receive_data(data)
    while reader.next_response() is not NEED_DATA:
        pass


def _fuzz_one(addr: str, fault: Fault) -> None:
    with KafkaWire(addr, timeout_s=15) as w:
        probe = 7
        try:
            w.send_raw(fault.data + w.frame(ApiKey.METADATA, META_V, {"topics": None}, correlation_id=probe))
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed while sending: as good as after
        data, closed = w.finish_and_read(15)
    _check_answers(fault, data, closed, probe)
    with KafkaWire(addr, timeout_s=15) as w:  # the broker serves a new connection
        assert w.request(ApiKey.API_VERSIONS, 3, {})["error_code"] == 0


def run_fuzz(addr: str, topic_uuid: uuid.UUID) -> dict[str, int]:
    counts: dict[str, int] = {}
    for kind, examples in FUZZ_EXAMPLES.items():

        @settings(
            max_examples=examples,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(fault=fault_strategy(kind, "fz", topic_uuid))
        def fuzz(fault: Fault) -> None:
            counts[fault.kind] = counts.get(fault.kind, 0) + 1
            _fuzz_one(addr, fault)

        fuzz()
    return counts


async def test_wire_fuzz_against_a_live_broker_with_real_clients_alongside(tmp_path: Path) -> None:
    """Every class of wire garbage, on connections of their own, while a confluent-kafka
    producer and consumer work on the same broker: they see every message exactly once,
    the broker answers or closes each bad connection and logs nothing unexpected."""
    pytest.importorskip("confluent_kafka")
    settings_ = {"kafka_max_fetch_wait_ms": 200, "kafka_max_frame_bytes": 1 << 20}
    async with open_kafka(tmp_path, **settings_) as kafka:
        with wire(kafka) as w:
            create_topic(w, STEADY, 2)
            create_topic(w, "fz", 1)
            meta = w.request(ApiKey.METADATA, 12, {"topics": [{"name": "fz"}]})
            topic_uuid = meta["topics"][0]["topic_id"]
        traffic = SteadyTraffic(kafka.bootstrap)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(in_thread, traffic.produce)
            nursery.start_soon(in_thread, traffic.consume)
            try:
                await await_until(lambda: len(traffic.consumed) >= 50, 30, "the steady clients' first messages")
            except TimeoutError as e:
                state = f"produced {len(traffic.produced)}, delivered {len(traffic.delivered)}"
                raise AssertionError(f"{e}: {state}, consumed {len(traffic.consumed)}, {traffic.errors[:5]}") from None
            try:
                counts = await in_thread(run_fuzz, kafka.kafka_addr("b0"), topic_uuid)
            finally:
                traffic.stop_producing.set()
                traffic.stop_consuming.set()
        traffic.check()
        assert counts == FUZZ_EXAMPLES
        assert_clean_log(kafka)
        unexpected = unexpected_warnings(kafka.group["b0"].err.read_text(errors="replace"))
        assert not unexpected, "\n".join(unexpected[:20])


def test_the_no_warning_check_ignores_only_the_stall_detector() -> None:
    """A stall line (by its logger's name) passes; any other warning, even one naming a stall, does not."""
    stall = f"2026-11-28 03:28:00,095 WARNING {STALL_LOGGER}: broker g: event loop stalled 13.4 ms"
    other = "2026-11-28 03:28:00,096 WARNING clmq.broker.service: event loop stalled (not the detector)"
    assert unexpected_warnings(f"{stall}\n{other}\n") == [other]


@pytest.mark.parametrize("codec", ["gzip", "snappy", "lz4", "zstd"])
async def test_fetch_answers_compressed_batches_with_kafka_fetch_compression(tmp_path: Path, codec: str) -> None:
    """``kafka_fetch_compression``: Fetch's batches come compressed with that codec, and
    librdkafka reads them back exactly."""
    async with open_kafka(tmp_path, kafka_fetch_compression=codec) as cluster:
        with wire(cluster) as w:
            create_topic(w, "t")
            produce_one(w, "t", one_batch([b"value %d" % i * 20 for i in range(50)]))
            answer = w.request(ApiKey.FETCH, FETCH_V, fetch_body("t", 0, 0, max_wait_ms=5000))
        records = answer["responses"][0]["partitions"][0]["records"]
        batches = parse_batches(records, max_uncompressed_bytes=1 << 20)
        assert [b.compression.name.lower() for b in batches] == [codec]
        assert [r.value for r in batches[0].records] == [b"value %d" % i * 20 for i in range(50)]
        ck = pytest.importorskip("confluent_kafka")
        consumer = ck.Consumer(
            {"bootstrap.servers": cluster.bootstrap, "group.id": "z", "auto.offset.reset": "earliest"}
        )
        consumer.subscribe(["t"])
        got: list[bytes] = []
        with trio.fail_after(30):
            while len(got) < 50:
                got += [m.value() for m in await in_thread(consumer.consume, 100, 0.5) if not m.error()]
        consumer.close()
        assert got == [b"value %d" % i * 20 for i in range(50)]

"""The Kafka codec (clmq.protocol.kafka): golden bytes written from the protocol guide, round
trips and fuzzing of every schema and version with Hypothesis, framing, and the first
request real clients (kcat, confluent-kafka, kafka-python, aiokafka) send.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clmq.protocol.kafka import (
    NEED_DATA,
    SUPPORTED_VERSIONS,
    ApiKey,
    ErrorCode,
    KafkaDecodeError,
    KafkaEncodeError,
    KafkaFrameTooLarge,
    KafkaProtocolError,
    KafkaRequest,
    KafkaRequestReader,
    KafkaResponseReader,
    KafkaUnsupportedVersion,
    UnsupportedRequest,
    codec,
    decode_request_body,
    encode_api_versions_unsupported,
    encode_request,
    encode_response,
    encode_response_body,
)
from clmq.protocol.kafka._primitives import INT_RANGES, Buffer
from clmq.protocol.kafka._schema import Field, message
from clmq.protocol.kafka._walk import diagnose_decode

ROOT = Path(__file__).resolve().parents[1]
KAFKA_GIT = Path("/work/.mirror/apache+kafka/repo")
COMBOS = [
    (int(key), version, response)
    for key in ApiKey
    for response in (False, True)
    for version in range(message(key, response).valid_versions[0], message(key, response).valid_versions[1] + 1)
]


def frame_of(hex_text: str) -> bytes:
    return bytes.fromhex(re.sub(r"\s+", "", hex_text))


def one_request(data: bytes) -> KafkaRequest | UnsupportedRequest:
    reader = KafkaRequestReader()
    reader.receive_data(data)
    request = reader.next_request()
    assert not isinstance(request, type(NEED_DATA))
    assert reader.next_request() is NEED_DATA
    return request


# ------------------------------------------------------------------ golden bytes
API_VERSIONS_V0 = frame_of("0000000e 0012 0000 00000001 0004 74657374")
API_VERSIONS_V3 = frame_of("00000019 0012 0003 00000001 0004 74657374 00  05 6b636174 04 312e30 00")
METADATA_V1 = frame_of("00000017 0003 0001 0000002a 0004 74657374  00000001 0003 666f6f")
# ApiVersions v3 response: header v0 (KIP-511), one API, two tagged fields (1 and 3).
API_VERSIONS_V3_RESPONSE = frame_of(
    "00000020 00000007  0000 02 0012 0000 0004 00 00000000  02 01 08 0000000000000005 03 01 01"
)


def test_api_versions_v0_request() -> None:
    request = one_request(API_VERSIONS_V0)
    assert request == KafkaRequest(18, 0, 1, "test", {}, len(API_VERSIONS_V0), {})
    assert encode_request(18, 0, 1, {}, "test") == API_VERSIONS_V0


def test_api_versions_v3_request_has_header_v2_and_compact_strings() -> None:
    request = one_request(API_VERSIONS_V3)
    assert isinstance(request, KafkaRequest)
    assert (request.client_id, request.body) == (
        "test",
        {"client_software_name": "kcat", "client_software_version": "1.0"},
    )
    assert encode_request(18, 3, 1, request.body, "test") == API_VERSIONS_V3


def test_metadata_v1_request_and_its_null_topics() -> None:
    request = one_request(METADATA_V1)
    assert isinstance(request, KafkaRequest)
    assert (request.api_key, request.correlation_id, request.body) == (3, 42, {"topics": [{"name": "foo"}]})
    assert encode_request(3, 1, 42, request.body, "test") == METADATA_V1
    assert decode_request_body(3, 1, b"\xff\xff\xff\xff") == {"topics": None}  # null: all topics
    with pytest.raises(KafkaDecodeError, match=r"topics: invalid array length -1"):
        decode_request_body(3, 0, b"\xff\xff\xff\xff")  # not nullable before v1


def test_flexible_response_with_tagged_fields() -> None:
    body = {
        "error_code": 0,
        "api_keys": [{"api_key": 18, "min_version": 0, "max_version": 4}],
        "throttle_time_ms": 0,
        "finalized_features_epoch": 5,
        "zk_migration_ready": True,
    }
    assert encode_response(18, 3, 7, body) == API_VERSIONS_V3_RESPONSE
    reader = KafkaResponseReader()
    reader.expect(7, 18, 3)
    reader.receive_data(API_VERSIONS_V3_RESPONSE)
    response = reader.next_response()
    assert not isinstance(response, type(NEED_DATA))
    assert response.body == {**body, "supported_features": [], "finalized_features": []}


def test_unknown_tags_are_skipped_and_known_ones_must_fill_their_size() -> None:
    body = frame_of("0000 01 00000000 02 03 01 01 09 02 abcd")  # tag 9 is unknown
    assert codec(18, 3, True).decode(body)["zk_migration_ready"] is True
    with pytest.raises(KafkaDecodeError, match="zk_migration_ready: tagged field 3 has 1 bytes left over"):
        codec(18, 3, True).decode(frame_of("0000 01 00000000 01 03 02 0101"))


def test_response_headers_v1_for_flexible_versions_except_api_versions() -> None:
    assert encode_response(3, 9, 5, {})[4:9] == frame_of("00000005 00")  # tagged fields after the id
    assert encode_response(3, 8, 5, {})[4:8] == frame_of("00000005")
    assert encode_response(18, 4, 5, {})[4:10] == frame_of("00000005 0000")  # v0 header, then error_code


def test_defaults_fill_missing_fields_and_unknown_keys_are_ignored() -> None:
    produce = codec(0, 9)
    body = produce.decode(produce.encode({"topic_data": [{"name": "t"}], "no_such_field": 1}))
    assert body == {
        "transactional_id": None,
        "acks": 0,
        "timeout_ms": 0,
        "topic_data": [{"name": "t", "partition_data": []}],
    }
    fetch = codec(1, 4).decode(codec(1, 4).encode({}))
    assert (fetch["replica_id"], fetch["isolation_level"]) == (-1, 0)  # JSON defaults
    assert codec(60, 0, True).decode(codec(60, 0, True).encode({}))["cluster_authorized_operations"] == -(2**31)


def test_records_and_uuids_decode_to_bytes_and_uuid_from_any_buffer() -> None:
    topic_id = uuid.uuid4()
    fetch = codec(1, 13, True)
    data = fetch.encode({"responses": [{"topic_id": topic_id, "partitions": [{"records": bytearray(b"batch")}]}]})
    for buf in (data, bytearray(data), memoryview(data)):
        decoded = fetch.decode(buf)["responses"][0]
        assert decoded["topic_id"] == topic_id
        assert type(decoded["partitions"][0]["records"]) is bytes
        assert decoded["partitions"][0]["records"] == b"batch"


# ------------------------------------------------------------------ decode errors
def test_truncation_at_every_byte_is_a_decode_error_or_need_data() -> None:
    produce = encode_request(0, 9, 3, {"topic_data": [{"name": "t", "partition_data": [{"records": b"r" * 40}]}]})
    for data, key, version in ((API_VERSIONS_V3, 18, 3), (METADATA_V1, 3, 1), (produce, 0, 9)):
        request = one_request(data)
        assert isinstance(request, KafkaRequest)
        body = codec(key, version).encode(request.body)
        assert data.endswith(body)
        for cut in range(len(body)):
            with pytest.raises(KafkaDecodeError, match=r"at byte \d+"):
                decode_request_body(key, version, body[:cut])
        reader = KafkaRequestReader()
        for byte in data[:-1]:
            reader.receive_data(bytes([byte]))
            assert reader.next_request() is NEED_DATA
        reader.receive_data(data[-1:])
        assert isinstance(reader.next_request(), KafkaRequest)


def test_trailing_bytes_after_a_body_are_refused_by_the_codec_but_not_in_a_request_frame() -> None:
    with pytest.raises(KafkaDecodeError, match="1 trailing bytes after the body"):
        codec(18, 3).decode(frame_of("05 6b636174 04 312e30 00 00"))
    # A broker ignores them, as Kafka's do (librdkafka sends some: see _frames).
    request = one_request(frame_of("0000000f 0012 0000 00000001 0004 74657374 00"))
    assert isinstance(request, KafkaRequest) and request.body == {}


def test_a_huge_array_count_fails_before_allocating() -> None:
    with pytest.raises(KafkaDecodeError, match=r"topics: array count 2147483647 needs at least"):
        decode_request_body(3, 1, frame_of("7fffffff 0000 0000 00"))
    with pytest.raises(KafkaDecodeError, match=r"topics: array count"):
        decode_request_body(3, 12, frame_of("ffffffff07 00 00 00"))  # compact count 2**32 - 2


def test_invalid_utf8_and_bad_lengths_name_the_field() -> None:
    with pytest.raises(KafkaDecodeError, match=r"topics\[0\]\.name: invalid UTF-8 .* \(at byte 7\)"):
        decode_request_body(3, 1, frame_of("00000001 0002 41ff"))
    with pytest.raises(KafkaDecodeError, match=r"topics\[0\]\.name: invalid string length -2"):
        decode_request_body(3, 1, frame_of("00000001 fffe"))
    with pytest.raises(KafkaDecodeError, match="unsigned varint longer than 5 bytes"):
        decode_request_body(18, 3, frame_of("ffffffffff01"))


def test_header_errors_carry_what_was_read() -> None:
    with pytest.raises(KafkaDecodeError) as caught:
        one_request(frame_of("0000000c 0003 0001 0000002a 0004 7465"))
    assert (caught.value.api_key, caught.value.api_version, caught.value.correlation_id) == (3, 1, 42)
    assert caught.value.path.startswith("<header>")
    with pytest.raises(KafkaDecodeError, match="request header needs 8 bytes"):
        one_request(frame_of("00000002 0003"))


# ------------------------------------------------------------------ encode errors
def test_encode_errors_name_the_field_path() -> None:
    produce = codec(0, 9)
    bad = {"topic_data": [{"name": "t", "partition_data": [{}, {}, {"index": "x"}]}]}
    with pytest.raises(
        KafkaEncodeError, match=r"^topic_data\[0\]\.partition_data\[2\]\.index: expected int32, got 'x'$"
    ):
        produce.encode(bad)
    with pytest.raises(KafkaEncodeError, match=r"^acks: int16 out of range: 40000$"):
        produce.encode({"acks": 40000})
    with pytest.raises(KafkaEncodeError, match=r"^topic_data\[0\]\.name: expected string, got None"):
        produce.encode({"topic_data": [{"name": None}]})
    with pytest.raises(KafkaEncodeError, match=r"^topic_data: expected a list"):
        produce.encode({"topic_data": "abc"})
    with pytest.raises(KafkaEncodeError, match=r"^topics\[0\]\.is_internal: expected bool, got 1$"):
        codec(3, 1, True).encode({"topics": [{"is_internal": 1}]})


def test_a_failed_encode_appends_nothing() -> None:
    out = bytearray(b"head")
    with pytest.raises(KafkaEncodeError, match=r"^topics\[1\]\.name: expected string, got b'x'"):
        codec(3, 1).encode_into({"topics": [{"name": "a"}, {"name": b"x"}]}, out)
    assert out == b"head"


def test_strings_over_32767_bytes_are_refused_both_ways() -> None:
    with pytest.raises(KafkaEncodeError, match="string of 32768 bytes is over 32767"):
        codec(3, 12).encode({"topics": [{"name": "é" * 16384}]})
    with pytest.raises(KafkaDecodeError, match="string length 32768 over 32767"):
        codec(18, 3).decode(frame_of("818002") + b"a" * 32768 + b"\x01\x00")


# ------------------------------------------------------------------ framing
def test_unsupported_versions_and_keys_are_results_carrying_the_correlation_id() -> None:
    reader = KafkaRequestReader()
    reader.receive_data(frame_of("0000000e 0012 0063 00000009 0004 74657374"))  # ApiVersions v99
    reader.receive_data(frame_of("0000000a 0063 0000 0000000a ffff"))  # api key 99
    reader.receive_data(encode_request(0, 2, 11, {}))  # Produce v2: message sets, not spoken
    first, second, third = reader.next_request(), reader.next_request(), reader.next_request()
    assert first == UnsupportedRequest(18, 99, 9, 18) and first.is_api_versions
    assert second == UnsupportedRequest(99, 0, 10, 14) and not second.is_api_versions
    assert isinstance(third, UnsupportedRequest) and (third.api_key, third.correlation_id) == (0, 11)
    answer = KafkaResponseReader()
    answer.expect(9, 18, 0)
    answer.receive_data(encode_api_versions_unsupported(9))
    response = answer.next_response()
    assert not isinstance(response, type(NEED_DATA))
    assert response.body["error_code"] == ErrorCode.UNSUPPORTED_VERSION == 35
    assert {e["api_key"]: (e["min_version"], e["max_version"]) for e in response.body["api_keys"]} == SUPPORTED_VERSIONS


def test_supported_versions_are_kafkas_except_old_produce_and_fetch() -> None:
    assert SUPPORTED_VERSIONS[ApiKey.PRODUCE][0] == 3 and SUPPORTED_VERSIONS[ApiKey.FETCH][0] == 4
    assert SUPPORTED_VERSIONS[ApiKey.SASL_HANDSHAKE] == (0, 1)  # librdkafka insists on v0 being listed
    assert SUPPORTED_VERSIONS[ApiKey.SASL_AUTHENTICATE] == (0, 2)
    for key in (ApiKey.DESCRIBE_ACLS, ApiKey.CREATE_ACLS, ApiKey.DELETE_ACLS):
        assert SUPPORTED_VERSIONS[key] == (0, 3)
    assert SUPPORTED_VERSIONS[ApiKey.API_VERSIONS] == (0, 4) and len(SUPPORTED_VERSIONS) == 35
    # share groups: the stable versions (Kafka 4.1+; v0 was early access, removed)
    assert SUPPORTED_VERSIONS[ApiKey.SHARE_GROUP_HEARTBEAT] == (1, 1)
    assert SUPPORTED_VERSIONS[ApiKey.SHARE_FETCH] == SUPPORTED_VERSIONS[ApiKey.SHARE_ACKNOWLEDGE] == (1, 2)
    with pytest.raises(KafkaUnsupportedVersion):
        codec(18, 5)


def test_a_frame_too_large_is_refused_from_its_size_alone() -> None:
    reader = KafkaRequestReader(max_frame_bytes=1000)
    reader.receive_data(frame_of("000003e9"))
    with pytest.raises(KafkaFrameTooLarge) as caught:
        reader.next_request()
    assert (caught.value.size, caught.value.max_frame_bytes) == (1001, 1000)
    negative = KafkaRequestReader()
    negative.receive_data(frame_of("ffffffff"))
    with pytest.raises(KafkaDecodeError, match="negative frame size"):
        negative.next_request()


def test_several_requests_in_one_read() -> None:
    reader = KafkaRequestReader()
    reader.receive_data(API_VERSIONS_V0 + METADATA_V1 + API_VERSIONS_V3[:5])
    assert [type(reader.next_request()) for _ in range(3)] == [KafkaRequest, KafkaRequest, type(NEED_DATA)]
    assert reader.buffered == 5


# ------------------------------------------------------------------ Hypothesis
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=6)


def struct_values(fields: tuple[Field, ...], version: int) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({f.name: field_values(f, version) for f in fields if f.present(version)})


def field_values(f: Field, version: int) -> st.SearchStrategy[Any]:
    values = st.lists(element_values(f, version), max_size=3) if f.is_array else element_values(f, version)
    return st.none() | values if f.nullable(version) else values


def element_values(f: Field, version: int) -> st.SearchStrategy[Any]:
    if f.fields is not None:
        return st.deferred(lambda: struct_values(f.fields or (), version))
    kind = f.element
    if kind in INT_RANGES:
        return st.integers(*INT_RANGES[kind])
    simple: dict[str, st.SearchStrategy[Any]] = {
        "bool": st.booleans(),
        "uuid": st.uuids(),
        "float64": st.floats(allow_nan=False),
        "string": TEXT,
    }
    return simple.get(kind, st.binary(max_size=12))


@st.composite
def messages(draw: st.DrawFn) -> tuple[int, int, bool, dict[str, Any]]:
    key, version, response = draw(st.sampled_from(COMBOS))
    return key, version, response, draw(struct_values(message(key, response).fields, version))


def careful(key: int, version: int, response: bool, data: Buffer) -> dict[str, Any]:
    schema = message(key, response)
    return diagnose_decode(data, 0, schema.fields, version, schema.flexible(version))[0]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages())
def test_every_schema_and_version_round_trips(case: tuple[int, int, bool, dict[str, Any]]) -> None:
    key, version, response, value = case
    data = codec(key, version, response).encode(value)
    assert codec(key, version, response).decode(data) == value
    assert careful(key, version, response, data) == value  # the careful walk agrees


def decodes_like_the_walk(key: int, version: int, response: bool, data: bytes) -> None:
    """The compiled decoder and the careful walk agree; only KafkaDecodeError ever escapes."""
    try:
        fast: dict[str, Any] | None = codec(key, version, response).decode(data)
    except KafkaDecodeError as e:
        assert "compiled decoder failed" not in str(e)
        fast = None
    try:
        slow: dict[str, Any] | None = careful(key, version, response, data)
    except KafkaDecodeError:
        slow = None
    assert fast == slow


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(COMBOS), st.binary(max_size=48))
def test_random_bytes_only_ever_raise_decode_errors(combo: tuple[int, int, bool], data: bytes) -> None:
    decodes_like_the_walk(*combo, data)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages(), st.data())
def test_mutated_bodies_only_ever_raise_decode_errors(
    case: tuple[int, int, bool, dict[str, Any]], data: st.DataObject
) -> None:
    key, version, response, value = case
    body = bytearray(codec(key, version, response).encode(value))
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(body)))
        edit = data.draw(st.sampled_from(["set", "insert", "delete"]))
        if edit == "insert" or at == len(body):
            body[at:at] = data.draw(st.binary(min_size=1, max_size=4))
        elif edit == "set":
            body[at] = data.draw(st.integers(0, 255))
        else:
            del body[at : at + data.draw(st.integers(1, 4))]
    decodes_like_the_walk(key, version, response, bytes(body))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64), st.integers(0, 80), st.binary(max_size=8))
def test_mutated_frames_only_ever_raise_protocol_errors(garbage: bytes, at: int, insert: bytes) -> None:
    stream = bytearray(API_VERSIONS_V3 + METADATA_V1)
    stream[at:at] = insert
    reader = KafkaRequestReader(max_frame_bytes=4096)
    reader.receive_data(bytes(stream) + garbage)
    try:
        while reader.next_request() is not NEED_DATA:
            pass
    except KafkaProtocolError:
        pass


# ------------------------------------------------------------------ real clients
# The first request each client sends (captured as in test_live_client_capture; size included).
CAPTURES = {
    "kcat 1.7 / librdkafka 2.0.2": (
        "000000240012000300000001000772646b61666b61000b6c696272646b61666b6106322e302e3200",
        ("rdkafka", 3, {"client_software_name": "librdkafka", "client_software_version": "2.0.2"}),
    ),
    "confluent-kafka 2.16.1": (
        "000000400012000300000001000772646b61666b610017636f6e666c75656e742d6b61666b612d707974686f6e16322e3136"
        "2e312d72646b61666b612d322e31362e3000",
        (
            "rdkafka",
            3,
            {"client_software_name": "confluent-kafka-python", "client_software_version": "2.16.1-rdkafka-2.16.0"},
        ),
    ),
    "kafka-python 3.0.12": (
        "00000033001200040000000100136b61666b612d707974686f6e2d332e302e3132000d6b61666b612d707974686f6e07332e30"
        "2e313200",
        ("kafka-python-3.0.12", 4, {"client_software_name": "kafka-python", "client_software_version": "3.0.12"}),
    ),
    "aiokafka 0.14.0": ("000000190012000000000001000f61696f6b61666b612d302e31342e30", ("aiokafka-0.14.0", 0, {})),
}


@pytest.mark.parametrize("client", sorted(CAPTURES))
def test_captured_client_requests_decode(client: str) -> None:
    captured, (client_id, version, body) = CAPTURES[client]
    request = one_request(bytes.fromhex(captured))
    assert isinstance(request, KafkaRequest)
    assert (request.api_key, request.api_version, request.correlation_id) == (ApiKey.API_VERSIONS, version, 1)
    assert (request.client_id, request.body) == (client_id, body)


def capture_first_frame(command: list[str]) -> bytes:
    """Run a client against a throwaway server on 127.0.0.1 that keeps the first frame and hangs up."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(10)
    port = server.getsockname()[1]
    client = subprocess.Popen(
        [part.replace("PORT", str(port)) for part in command], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        connection, _ = server.accept()
        with connection:
            connection.settimeout(10)
            data = b""
            while len(data) < 4 or len(data) < 4 + int.from_bytes(data[:4], "big"):
                chunk = connection.recv(65536)
                assert chunk, f"{command[0]} hung up after {len(data)} bytes"
                data += chunk
        return data
    finally:
        client.kill()
        client.wait()
        server.close()


LIVE_CLIENTS = {
    "kcat": ["kcat", "-L", "-b", "127.0.0.1:PORT", "-m", "2"],
    "confluent-kafka": [
        sys.executable,
        "-c",
        "from confluent_kafka.admin import AdminClient\n"
        "AdminClient({'bootstrap.servers': '127.0.0.1:PORT'}).list_topics(timeout=2)",
    ],
    "kafka-python": [
        sys.executable,
        "-c",
        "from kafka import KafkaAdminClient\n"
        "KafkaAdminClient(bootstrap_servers='127.0.0.1:PORT', request_timeout_ms=2000)",
    ],
}


def test_live_client_capture() -> None:
    """Real clients' first requests, captured now, decode (the clients run side by side: a few seconds)."""
    if shutil.which("kcat") is None:
        pytest.skip("kcat is not installed")
    frames: dict[str, bytes] = {}
    threads = [
        threading.Thread(target=lambda name=name, cmd=cmd: frames.__setitem__(name, capture_first_frame(cmd)))
        for name, cmd in LIVE_CLIENTS.items()
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(frames) == sorted(LIVE_CLIENTS)
    for name, data in frames.items():
        request = one_request(data)
        assert isinstance(request, KafkaRequest), name
        assert request.api_key == ApiKey.API_VERSIONS, name
        assert request.body.get("client_software_name", "").startswith(("librdkafka", "confluent", "kafka-python")), (
            name
        )


# ------------------------------------------------------------------ the generated tables
@pytest.mark.skipif(not KAFKA_GIT.exists(), reason="no Kafka mirror")
def test_generated_schemas_are_up_to_date(tmp_path: Path) -> None:
    out = tmp_path / "_schemas.py"
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_kafka_schemas.py"), str(KAFKA_GIT), "-o", str(out)], check=True
    )
    assert out.read_text() == (ROOT / "protocol" / "kafka" / "_schemas.py").read_text()


@pytest.mark.skipif(not KAFKA_GIT.exists(), reason="no Kafka mirror")
def test_error_codes_are_kafkas() -> None:
    errors_java = "clients/src/main/java/org/apache/kafka/common/protocol/Errors.java"
    source = subprocess.run(
        ["git", "-C", str(KAFKA_GIT), "show", f"HEAD:{errors_java}"], capture_output=True, text=True, check=True
    ).stdout
    kafka = {name: int(code) for name, code in re.findall(r"^\s+([A-Z_]+)\((-?\d+),", source, re.MULTILINE)}
    assert {e.name: e.value for e in ErrorCode} == kafka
    assert ErrorCode.UNKNOWN_TOPIC_ID == 100 and ErrorCode.NOT_LEADER_OR_FOLLOWER == 6


def test_bodies_encode_back_to_the_same_bytes() -> None:
    body = {"error_code": 0, "api_keys": [{"api_key": 0, "min_version": 3, "max_version": 11}], "throttle_time_ms": 0}
    data = encode_response_body(18, 2, body)
    assert data == frame_of("0000 00000001 0000 0003 000b 00000000")

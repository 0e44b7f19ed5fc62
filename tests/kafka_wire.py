"""A minimal raw Kafka client over a blocking socket, built on clmq's sans-IO codec, for
the Kafka listener's fault tests (``test_kafka_faults.py``): requests as the codec
encodes them, bytes as a broken client sends them, and where each request field sits
in a frame (so that a test can put a value of the wrong type or size in its place).

Blocking on purpose: the broker is another process, and Hypothesis drives its examples
from a worker thread (``kafka_procs.in_thread``).
"""

from __future__ import annotations

import socket
import struct
import time
import uuid
from dataclasses import dataclass
from typing import Any

from clmq.protocol.kafka import (
    NEED_DATA,
    ApiKey,
    KafkaResponse,
    KafkaResponseReader,
    build_batch,
    encode_request,
)
from clmq.protocol.kafka._codec import is_flexible
from clmq.protocol.kafka._primitives import FIXED, Reader
from clmq.protocol.kafka._schema import Field, message

SIZE = struct.Struct(">i")
HEADER = struct.Struct(">ihhi")  # size, api key, api version, correlation id


class ConnectionClosed(Exception):
    """The broker closed the connection (what it sent before is in ``data``)."""

    def __init__(self, data: bytes = b"") -> None:
        super().__init__(f"closed by the broker after {len(data)} bytes")
        self.data = data


class KafkaWire:
    """One Kafka connection: send requests (or any bytes), read responses in order."""

    def __init__(self, addr: str, timeout_s: float = 10.0, client_id: str | None = "fault-test") -> None:
        host, port = addr.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.timeout_s = timeout_s
        self.client_id = client_id
        self.reader = KafkaResponseReader()
        self.next_id = 1

    def __enter__(self) -> KafkaWire:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close()

    def frame(self, api_key: int, version: int, body: dict[str, Any], correlation_id: int | None = None) -> bytes:
        """An encoded request; its response is expected (correlation ids count up)."""
        cid = self.next_id if correlation_id is None else correlation_id
        self.next_id = max(self.next_id, cid + 1)
        self.reader.expect(cid, api_key, version)
        return encode_request(api_key, version, cid, body, client_id=self.client_id)

    def send(self, api_key: int, version: int, body: dict[str, Any], correlation_id: int | None = None) -> int:
        data = self.frame(api_key, version, body, correlation_id)
        self.sock.sendall(data)
        return int(SIZE.unpack_from(data, 8)[0])

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def receive(self, timeout_s: float | None = None) -> KafkaResponse:
        """The next response; ConnectionClosed if the broker closes first, TimeoutError if none comes."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        while True:
            got = self.reader.next_response()
            if got is not NEED_DATA:
                assert isinstance(got, KafkaResponse)
                return got
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no response")
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(1 << 16)
            except ConnectionResetError:
                chunk = b""
            except TimeoutError:
                raise TimeoutError("no response") from None
            if not chunk:
                raise ConnectionClosed()
            self.reader.receive_data(chunk)

    def request(self, api_key: int, version: int, body: dict[str, Any]) -> dict[str, Any]:
        cid = self.send(api_key, version, body)
        got = self.receive()
        assert got.correlation_id == cid, (got.correlation_id, cid)
        return got.body

    def read_until_closed(self, timeout_s: float) -> tuple[bytes, bool]:
        """Every byte the broker sends until it closes (True) or ``timeout_s`` passes (False)."""
        deadline = time.monotonic() + timeout_s
        got = b""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return got, False
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(1 << 16)
            except ConnectionResetError:
                return got, True
            except TimeoutError:
                return got, False
            if not chunk:
                return got, True
            got += chunk

    def finish_and_read(self, timeout_s: float) -> tuple[bytes, bool]:
        """Half-close (the broker sees the end of the requests) and read until it closes."""
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        return self.read_until_closed(timeout_s)


def split_frames(data: bytes) -> tuple[list[bytes], bytes]:
    """Whole frames (without their size) and the bytes left over."""
    frames, pos = [], 0
    while pos + 4 <= len(data):
        (size,) = SIZE.unpack_from(data, pos)
        if size < 0 or pos + 4 + size > len(data):
            break
        frames.append(data[pos + 4 : pos + 4 + size])
        pos += 4 + size
    return frames, data[pos:]


def reframe(frame_with_size: bytes) -> bytes:
    """The same frame with its size prefix made true again."""
    return SIZE.pack(len(frame_with_size) - 4) + frame_with_size[4:]


# ---------------------------------------------------------------- where fields sit
@dataclass(frozen=True)
class Span:
    """A request field's bytes ``[start, end)`` in a whole frame (size prefix included)."""

    path: str
    kind: str  # the field's type ("int32", "string", "[]int32", "records", a struct's name...)
    start: int
    end: int
    nullable: bool
    compact: bool


def request_spans(frame: bytes) -> list[Span]:
    """Every field of a request frame, with where its bytes are (a tagged section is skipped;
    arrays are listed whole and element by element)."""
    _size, api_key, version, _cid = HEADER.unpack_from(frame)
    r = Reader(frame, HEADER.size)
    spans = [Span("<client_id>", "string", r.pos, 0, True, False)]
    r.string(compact=False, nullable=True)
    spans[0] = Span("<client_id>", "string", spans[0].start, r.pos, True, False)
    flexible = is_flexible(api_key, version)
    if flexible:
        r.tagged_fields()
    _walk(r, message(api_key, False).fields, version, flexible, "", spans)
    return spans


def _walk(r: Reader, fields: tuple[Field, ...], version: int, flexible: bool, prefix: str, out: list[Span]) -> None:
    for f in fields:
        if not f.present(version) or f.tagged(version):
            continue
        start, path = r.pos, f"{prefix}{f.name}"
        compact, nullable = f.compact(flexible), f.nullable(version)
        if f.is_array:
            count = r.length(compact=compact, wide=True, nullable=nullable, what="array")
            for i in range(count or 0):
                _element(r, f, version, flexible, f"{path}[{i}]", out)
        else:
            _element(r, f, version, flexible, path, out)
        out.append(Span(path, f.type, start, r.pos, nullable, compact))
    if flexible:
        r.tagged_fields()


def _element(r: Reader, f: Field, version: int, flexible: bool, path: str, out: list[Span]) -> None:
    start = r.pos
    if f.fields is not None:
        _walk(r, f.fields, version, flexible, path + ".", out)
        return
    kind = f.element
    if kind in FIXED:
        r.fixed(kind)
    elif kind == "string":
        r.string(compact=f.compact(flexible), nullable=f.nullable(version))
    else:
        r.blob(compact=f.compact(flexible), nullable=f.nullable(version))
    if f.is_array:
        out.append(Span(path, kind, start, r.pos, False, f.compact(flexible)))


# ---------------------------------------------------------------- valid requests
def one_batch(values: list[bytes], **kw: Any) -> bytes:
    return build_batch(0, [(1_700_000_000_000 + i, None, v, []) for i, v in enumerate(values)], **kw)


# A DescribeAcls/DeleteAcls filter matching anything (ANY of everything; names any)
ACL_FILTER: dict[str, Any] = {
    "resource_type_filter": 1,
    "resource_name_filter": None,
    "pattern_type_filter": 1,
    "principal_filter": None,
    "host_filter": None,
    "operation": 1,
    "permission_type": 1,
}


def template(api_key: int, version: int, topic: str, topic_uuid: uuid.UUID) -> dict[str, Any]:
    """A valid request body of ``api_key`` (fields the version lacks are ignored by the encoder)."""
    group = "fz-group"
    bodies: dict[int, dict[str, Any]] = {
        ApiKey.PRODUCE: {
            "transactional_id": None,
            "acks": 1,
            "timeout_ms": 5000,
            "topic_data": [{"name": topic, "partition_data": [{"index": 0, "records": one_batch([b"fz"])}]}],
        },
        ApiKey.FETCH: {
            "replica_id": -1,
            "max_wait_ms": 10,
            "min_bytes": 1,
            "max_bytes": 1 << 20,
            "isolation_level": 0,
            "session_id": 0,
            "session_epoch": -1,
            "topics": [
                {
                    "topic": topic,
                    "topic_id": topic_uuid,
                    "partitions": [
                        {
                            "partition": 0,
                            "current_leader_epoch": -1,
                            "fetch_offset": 0,
                            "last_fetched_epoch": -1,
                            "log_start_offset": -1,
                            "partition_max_bytes": 1 << 16,
                        }
                    ],
                }
            ],
            "forgotten_topics_data": [],
            "rack_id": "",
        },
        ApiKey.LIST_OFFSETS: {
            "replica_id": -1,
            "isolation_level": 0,
            "topics": [
                {
                    "name": topic,
                    "partitions": [
                        {"partition_index": 0, "current_leader_epoch": -1, "timestamp": -1, "max_num_offsets": 1}
                    ],
                }
            ],
            "timeout_ms": 1000,
        },
        ApiKey.METADATA: {
            "topics": [{"name": topic, "topic_id": topic_uuid}],
            "allow_auto_topic_creation": False,
            "include_cluster_authorized_operations": False,
            "include_topic_authorized_operations": False,
        },
        ApiKey.OFFSET_COMMIT: {
            "group_id": group,
            "generation_id_or_member_epoch": -1,
            "member_id": "",
            "group_instance_id": None,
            "retention_time_ms": -1,
            "topics": [
                {
                    "name": topic,
                    "partitions": [
                        {
                            "partition_index": 0,
                            "committed_offset": 0,
                            "committed_leader_epoch": -1,
                            "commit_timestamp": -1,
                            "committed_metadata": "",
                        }
                    ],
                }
            ],
        },
        ApiKey.OFFSET_FETCH: {
            "group_id": group,
            "topics": [{"name": topic, "partition_indexes": [0]}],
            "groups": [
                {
                    "group_id": group,
                    "member_id": None,
                    "member_epoch": -1,
                    "topics": [{"name": topic, "partition_indexes": [0]}],
                }
            ],
            "require_stable": False,
        },
        ApiKey.FIND_COORDINATOR: {"key": group, "key_type": 0, "coordinator_keys": [group]},
        ApiKey.JOIN_GROUP: {
            "group_id": group,
            "session_timeout_ms": 6000,
            "rebalance_timeout_ms": 1000,
            "member_id": "",
            "group_instance_id": None,
            "protocol_type": "consumer",
            "protocols": [{"name": "range", "metadata": b"\x00"}],
            "reason": None,
        },
        ApiKey.HEARTBEAT: {"group_id": group, "generation_id": 1, "member_id": "m", "group_instance_id": None},
        ApiKey.LEAVE_GROUP: {
            "group_id": group,
            "member_id": "m",
            "members": [{"member_id": "m", "group_instance_id": None, "reason": None}],
        },
        ApiKey.SYNC_GROUP: {
            "group_id": group,
            "generation_id": 1,
            "member_id": "m",
            "group_instance_id": None,
            "protocol_type": "consumer",
            "protocol_name": "range",
            "assignments": [{"member_id": "m", "assignment": b""}],
        },
        ApiKey.DESCRIBE_GROUPS: {"groups": [group], "include_authorized_operations": False},
        ApiKey.LIST_GROUPS: {"states_filter": ["Stable"], "types_filter": ["classic"]},
        ApiKey.API_VERSIONS: {"client_software_name": "fz", "client_software_version": "1"},
        ApiKey.CREATE_TOPICS: {
            "topics": [
                {
                    "name": "fz-new",
                    "num_partitions": 1,
                    "replication_factor": 1,
                    "assignments": [],
                    "configs": [{"name": "retention.ms", "value": "1000"}],
                }
            ],
            "timeout_ms": 1000,
            "validate_only": True,
        },
        ApiKey.DELETE_TOPICS: {
            "topics": [{"name": "fz-gone", "topic_id": uuid.UUID(int=0)}],
            "topic_names": ["fz-gone"],
            "timeout_ms": 1000,
        },
        ApiKey.INIT_PRODUCER_ID: {
            "transactional_id": None,
            "transaction_timeout_ms": 1000,
            "producer_id": -1,
            "producer_epoch": -1,
        },
        ApiKey.OFFSET_FOR_LEADER_EPOCH: {
            "replica_id": -1,
            "topics": [
                {"topic": topic, "partitions": [{"partition": 0, "current_leader_epoch": -1, "leader_epoch": 0}]}
            ],
        },
        ApiKey.DESCRIBE_CONFIGS: {
            "resources": [{"resource_type": 2, "resource_name": topic, "configuration_keys": None}],
            "include_synonyms": False,
            "include_documentation": False,
        },
        ApiKey.CREATE_PARTITIONS: {
            "topics": [{"name": topic, "count": 2, "assignments": None}],
            "timeout_ms": 1000,
            "validate_only": True,
        },
        ApiKey.DELETE_GROUPS: {"groups_names": ["fz-group-gone"]},
        ApiKey.DESCRIBE_CLUSTER: {"include_cluster_authorized_operations": False, "endpoint_type": 1},
        ApiKey.SASL_HANDSHAKE: {"mechanism": "SCRAM-SHA-256"},
        ApiKey.SASL_AUTHENTICATE: {"auth_bytes": b"n,,n=fz,r=fznonce"},
        ApiKey.DESCRIBE_ACLS: {**ACL_FILTER, "resource_name_filter": topic},
        ApiKey.CREATE_ACLS: {
            "creations": [
                {
                    "resource_type": 2,
                    "resource_name": "fz-acl",
                    "resource_pattern_type": 3,
                    "principal": "User:fz",
                    "host": "*",
                    "operation": 3,
                    "permission_type": 3,
                }
            ]
        },
        ApiKey.DELETE_ACLS: {"filters": [{**ACL_FILTER, "resource_name_filter": "fz-acl"}]},
        ApiKey.SHARE_GROUP_HEARTBEAT: {
            "group_id": group,
            "member_id": "m",
            "member_epoch": 0,
            "rack_id": None,
            "subscribed_topic_names": [topic],
        },
        ApiKey.SHARE_FETCH: {
            "group_id": group,
            "member_id": "m",
            "share_session_epoch": 0,
            "max_wait_ms": 0,
            "min_bytes": 1,
            "max_bytes": 1 << 20,
            "max_records": 10,
            "batch_size": 10,
            "share_acquire_mode": 0,
            "is_renew_ack": False,
            "topics": [{"topic_id": topic_uuid, "partitions": [{"partition_index": 0, "acknowledgement_batches": []}]}],
            "forgotten_topics_data": [],
        },
        ApiKey.SHARE_ACKNOWLEDGE: {
            "group_id": group,
            "member_id": "m",
            "share_session_epoch": 1,
            "is_renew_ack": False,
            "topics": [
                {
                    "topic_id": topic_uuid,
                    "partitions": [
                        {
                            "partition_index": 0,
                            "acknowledgement_batches": [
                                {"first_offset": 0, "last_offset": 0, "acknowledge_types": [1]}
                            ],
                        }
                    ],
                }
            ],
        },
    }
    return bodies[api_key]


# ---------------------------------------------------------------- wire faults (Hypothesis)
def served_versions() -> list[tuple[int, int]]:
    """Every (API, version) the listener serves (what ApiVersions lists)."""
    from clmq.broker.service.kafka._metadata import ADVERTISED

    return [(int(key), v) for key, (low, high) in ADVERTISED.items() for v in range(low, high + 1)]


FAULT_KINDS = ("random", "mutated", "truncated", "lying-size", "garbage-body", "field", "unknown")


@dataclass(frozen=True)
class Fault:
    """Bytes to send, and the requests in them whose header is intact (correlation id ->
    (API, version)): only those may be answered (None: no telling, the header is garbage)."""

    kind: str
    data: bytes
    known: dict[int, tuple[int, int]] | None
    note: str = ""


def _wrong_values(draw: Any, st: Any, span: Span, original: bytes) -> bytes:
    """A value of the wrong type or size for ``span``, or the right size and a value the field should not hold."""
    size = len(original)
    options: list[Any] = [
        st.binary(max_size=12),  # anything: mostly the wrong size
        st.just(original[: max(0, size - 1)]),  # one byte short
        st.binary(min_size=1, max_size=8).map(lambda tail: original + tail),  # longer
    ]
    base = span.kind.removeprefix("[]")
    if base in FIXED and not span.kind.startswith("[]"):
        code = ">" + FIXED[base]
        width = struct.calcsize(code)
        extremes = [b"\xff" * width, b"\x00" * width, b"\x7f" + b"\xff" * (width - 1), b"\x80" + b"\x00" * (width - 1)]
        options += [st.sampled_from(extremes), st.binary(min_size=width, max_size=width)]
        options.append(st.sampled_from([b"\x00\x02hi", b"\x00" * 8, b"\x01"]))  # a string, an int64, an int8
    else:  # strings, bytes, records, arrays: a length or count that lies
        if span.compact:
            lies = [b"\x00", b"\xff\xff\xff\xff\x0f", b"\xff\xff\xff\xff\x7f", b"\x80\x80\x80\x80\x80\x01"]
            lies += [bytes([min(127, size + 5)])]
        else:
            wide = span.kind != "string"
            pack = struct.Struct(">i" if wide else ">h").pack
            lies = [pack(-2), pack(-1), pack(0x7FFF), pack(size + 5)]
            if wide:
                lies += [pack(0x7FFFFFFF), pack(-(2**31))]
        options.append(st.sampled_from(lies).map(lambda lie: lie + original[1 if span.compact else 2 :]))
        options.append(st.sampled_from(lies))
        if span.kind == "string":  # invalid UTF-8 of the right length
            prefix = 1 if span.compact else 2
            options.append(st.just(original[:prefix] + b"\xff" * (size - prefix)))
        options.append(st.just(struct.pack(">i", 7)))  # an int32 where a string/array was
    return bytes(draw(st.one_of(*options)))


def fault_strategy(kind: str, topic: str, topic_uuid: uuid.UUID) -> Any:
    """A Hypothesis strategy of :class:`Fault` of one kind (``FAULT_KINDS``): bytes a broken
    or hostile Kafka client sends."""
    from hypothesis import strategies as st

    versions = served_versions()

    @st.composite
    def faults(draw: Any) -> Fault:
        api_key, version = draw(st.sampled_from(versions))
        cid = draw(st.integers(1000, 2**31 - 1))
        frame = encode_request(api_key, version, cid, template(api_key, version, topic, topic_uuid), client_id="fz")
        if kind == "random":
            return Fault(kind, draw(st.binary(min_size=1, max_size=300)), None)
        if kind == "mutated":  # random bytes of a valid frame overwritten (its header too)
            out = bytearray(frame)
            for _ in range(draw(st.integers(1, 8))):
                at = draw(st.integers(0, len(out) - 1))
                out[at] = draw(st.integers(0, 255))
            known = {cid: (api_key, version)} if out[: HEADER.size] == frame[: HEADER.size] else None
            return Fault(kind, bytes(out), known, f"api {api_key} v{version}")
        if kind == "truncated":  # a valid frame cut, its size made true: the body ends early
            cut = draw(st.integers(8, len(frame) - 1))
            return Fault(kind, reframe(frame[:cut]), {cid: (api_key, version)}, f"api {api_key} v{version} cut {cut}")
        if kind == "lying-size":
            size = draw(
                st.one_of(
                    st.integers(-(2**31), -1),
                    st.integers(0, len(frame) - 5),
                    st.integers(len(frame) - 3, len(frame) + 64),
                    st.just(2**31 - 1),
                )
            )
            data = SIZE.pack(size) + frame[4:]
            return Fault(kind, data, {cid: (api_key, version)}, f"api {api_key} v{version} size {size}")
        if kind == "garbage-body":  # a valid header, then anything
            head = encode_request(api_key, version, cid, {}, client_id="fz")
            body_at = len(head) - len(_empty_body(api_key, version))
            data = reframe(head[:body_at] + draw(st.binary(max_size=200)))
            return Fault(kind, data, {cid: (api_key, version)}, f"api {api_key} v{version}")
        if kind == "field":  # one field (or its length) replaced by a value of the wrong type or size
            spans = request_spans(frame)
            span = draw(st.sampled_from(spans))
            value = _wrong_values(draw, st, span, frame[span.start : span.end])
            replaced = frame[: span.start] + value + frame[span.end :]
            if draw(st.booleans()):
                replaced = reframe(replaced)
            note = f"api {api_key} v{version} {span.path}={value.hex()}"
            return Fault(kind, replaced, {cid: (api_key, version)}, note)
        # unknown API keys and versions (ApiVersions is answered: its own test)
        key = draw(st.one_of(st.integers(-(2**15), 2**15 - 1), st.sampled_from([api_key])))
        served = dict.fromkeys(k for k, _ in versions)
        bad_version = draw(st.integers(-(2**15), 2**15 - 1))
        if key == ApiKey.API_VERSIONS or (key in served and (key, bad_version) in set(versions)):
            key = 99
        body = draw(st.binary(max_size=40))
        data = reframe(HEADER.pack(0, key, bad_version, cid) + b"\xff\xff" + body)
        return Fault(kind, data, {}, f"api {key} v{bad_version}")

    return faults()


def _empty_body(api_key: int, version: int) -> bytes:
    from clmq.protocol.kafka import encode_request_body

    return encode_request_body(api_key, version, {})

"""Kafka framing, sans-IO: requests out of a byte stream, responses into bytes (the model is h11).

A frame is an int32 size, then that many bytes: a header, then the body. A request
header is v1 (api key, version, correlation id, client id as a non-compact nullable
string) or, for a flexible API version, v2 (the same, then tagged fields). A response
header is v0 (correlation id) or v1 (and tagged fields) for flexible versions, except
that ApiVersions responses always use v0 (KIP-511: a client that asked with a version
the broker does not know must still read the answer).

Feed bytes with :meth:`KafkaRequestReader.receive_data`; call
:meth:`KafkaRequestReader.next_request` until it returns ``NEED_DATA``. A frame whose
size is over ``max_frame_bytes`` raises :class:`KafkaFrameTooLarge` as soon as its size
is read; an undecodable one raises :class:`KafkaDecodeError`: in both cases the stream
is dead. A frame of an API or version clmq does not speak is an
:class:`UnsupportedRequest` (the stream stays usable): the broker answers ApiVersions
with :func:`encode_api_versions_unsupported` and closes the connection for the others.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from ._apis import SUPPORTED_VERSIONS, ApiKey, ErrorCode
from ._codec import codec, is_flexible, response_header_codec
from ._errors import KafkaDecodeError, KafkaFrameTooLarge
from ._primitives import Reader, write_string, write_tagged_fields

DEFAULT_MAX_FRAME_BYTES: Final = 100 * 1024 * 1024  # Kafka's socket.request.max.bytes
_SIZE = struct.Struct(">i")
_FIRST = struct.Struct(">hhi")  # api key, api version, correlation id: in every request header
_BY_INT: dict[int, tuple[int, int]] = {int(key): span for key, span in SUPPORTED_VERSIONS.items()}


class NeedData:
    """More bytes are needed before the next request (or response) is complete."""

    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA: Final = NeedData()


@dataclass(slots=True)
class KafkaRequest:
    """A decoded request. ``size`` counts the whole frame, its 4-byte size included."""

    api_key: int
    api_version: int
    correlation_id: int
    client_id: str | None
    body: dict[str, Any]
    size: int
    header_tagged_fields: dict[int, bytes] = field(default_factory=dict)


@dataclass(slots=True)
class UnsupportedRequest:
    """A request of an API key or version not supported; its body was skipped, not decoded."""

    api_key: int
    api_version: int
    correlation_id: int
    size: int

    @property
    def is_api_versions(self) -> bool:
        """Answer with :func:`encode_api_versions_unsupported` (other APIs: close the connection)."""
        return self.api_key == ApiKey.API_VERSIONS


@dataclass(slots=True)
class KafkaResponse:
    """A decoded response (for clients and tests). ``size`` counts the whole frame."""

    api_key: int
    api_version: int
    correlation_id: int
    body: dict[str, Any]
    size: int


class _FrameBuffer:
    """Bytes received, cut into frames by their int32 size."""

    def __init__(self, max_frame_bytes: int) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._buf = bytearray()

    def receive_data(self, data: bytes) -> None:
        self._buf += data

    @property
    def buffered(self) -> int:
        """Bytes received and not yet taken as a frame."""
        return len(self._buf)

    def next_frame(self) -> bytes | None:
        """The next whole frame without its size, or None; KafkaFrameTooLarge as soon as a size is over the limit."""
        buf = self._buf
        if len(buf) < 4:
            return None
        (size,) = _SIZE.unpack_from(buf)
        if size > self.max_frame_bytes:
            raise KafkaFrameTooLarge(size, self.max_frame_bytes)
        if size < 0:
            raise KafkaDecodeError(f"negative frame size {size}", 0, "<frame>")
        if len(buf) < 4 + size:
            return None
        with memoryview(buf) as view:
            frame = bytes(view[4 : 4 + size])
        del buf[: 4 + size]  # a bytearray drops a prefix without moving the rest
        return frame


class KafkaRequestReader:
    """Requests out of a byte stream (a server's side of a connection)."""

    def __init__(
        self,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        supported: Mapping[ApiKey, tuple[int, int]] = SUPPORTED_VERSIONS,
    ) -> None:
        self._frames = _FrameBuffer(max_frame_bytes)
        self.supported: dict[int, tuple[int, int]] = {int(key): span for key, span in supported.items()}

    @property
    def max_frame_bytes(self) -> int:
        return self._frames.max_frame_bytes

    @property
    def buffered(self) -> int:
        """Bytes received and not yet returned as a request."""
        return self._frames.buffered

    def receive_data(self, data: bytes) -> None:
        """Add bytes read from the connection."""
        self._frames.receive_data(data)

    def next_request(self) -> KafkaRequest | UnsupportedRequest | NeedData:
        """The next request, an unsupported one, or NEED_DATA."""
        frame = self._frames.next_frame()
        if frame is None:
            return NEED_DATA
        return decode_request_frame(frame, self.supported)


def decode_request_frame(
    frame: bytes, supported: Mapping[int, tuple[int, int]] = _BY_INT
) -> KafkaRequest | UnsupportedRequest:
    """One request frame (the bytes after its 4-byte size)."""
    if len(frame) < _FIRST.size:
        raise KafkaDecodeError(f"request header needs {_FIRST.size} bytes, frame has {len(frame)}", 0, "<header>")
    api_key, api_version, correlation_id = _FIRST.unpack_from(frame)
    span = supported.get(api_key)
    if span is None or not span[0] <= api_version <= span[1]:
        return UnsupportedRequest(api_key, api_version, correlation_id, len(frame) + 4)
    try:
        r = Reader(frame, _FIRST.size)
        try:
            client_id = r.string(compact=False, nullable=True)
            flexible = is_flexible(api_key, api_version)
            tagged = r.tagged_fields() if flexible else {}
        except KafkaDecodeError as e:
            raise e.within("<header>") from None
        # Bytes after the body are ignored, as Kafka's brokers ignore them: librdkafka sends
        # some (e.g. an empty tagged field after Metadata v12's last field).
        body, _end = codec(api_key, api_version).decode_prefix(frame, r.pos)
    except KafkaDecodeError as e:
        e.api_key, e.api_version, e.correlation_id = api_key, api_version, correlation_id
        raise
    return KafkaRequest(api_key, api_version, correlation_id, client_id, body, len(frame) + 4, tagged)


def _finish(out: bytearray) -> bytes:
    """Write the frame's size into its first 4 bytes."""
    _SIZE.pack_into(out, 0, len(out) - 4)
    return bytes(out)


def response_header_version(api_key: int, api_version: int) -> int:
    """0 or 1 (flexible); always 0 for ApiVersions (KIP-511)."""
    if api_key == ApiKey.API_VERSIONS:
        return 0
    return 1 if is_flexible(api_key, api_version, True) else 0


def encode_response(api_key: int, api_version: int, correlation_id: int, body: Mapping[str, Any]) -> bytes:
    """A whole response frame: size, header, body (KafkaEncodeError if the body does not fit the schema)."""
    body_codec = codec(api_key, api_version, True)
    out = bytearray(4)
    header = response_header_codec(response_header_version(api_key, api_version))
    header.encode_into({"correlation_id": correlation_id}, out)
    body_codec.encode_into(body, out)
    return _finish(out)


def encode_request(
    api_key: int,
    api_version: int,
    correlation_id: int,
    body: Mapping[str, Any],
    client_id: str | None = "clmq",
    header_tagged_fields: Mapping[int, bytes] | None = None,
) -> bytes:
    """A whole request frame (size, header v1 or v2, body): what a client sends."""
    body_codec = codec(api_key, api_version)
    out = bytearray(_SIZE.pack(0) + _FIRST.pack(api_key, api_version, correlation_id))
    out += write_string(client_id, compact=False)  # never compact, even in header v2
    if body_codec.flexible:
        out += write_tagged_fields(dict(header_tagged_fields or {}))
    body_codec.encode_into(body, out)
    return _finish(out)


def api_versions_keys(supported: Mapping[ApiKey, tuple[int, int]] = SUPPORTED_VERSIONS) -> list[dict[str, int]]:
    """The ``api_keys`` of an ApiVersions response: one entry per supported API."""
    return [{"api_key": int(key), "min_version": low, "max_version": high} for key, (low, high) in supported.items()]


def encode_api_versions_unsupported(
    correlation_id: int, supported: Mapping[ApiKey, tuple[int, int]] = SUPPORTED_VERSIONS
) -> bytes:
    """The answer to an ApiVersions request of a version not supported: a v0 response with
    UNSUPPORTED_VERSION and the supported versions, which the client reads to pick one."""
    body = {"error_code": ErrorCode.UNSUPPORTED_VERSION, "api_keys": api_versions_keys(supported)}
    return encode_response(ApiKey.API_VERSIONS, 0, correlation_id, body)


class KafkaResponseReader:
    """Responses out of a byte stream (a client's side, for tests): a response carries no
    API key, so each request sent is registered with :meth:`expect`."""

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self._frames = _FrameBuffer(max_frame_bytes)
        self._pending: dict[int, tuple[int, int]] = {}

    def expect(self, correlation_id: int, api_key: int, api_version: int) -> None:
        """A request was sent: its response will carry ``correlation_id``."""
        self._pending[correlation_id] = (api_key, api_version)

    def receive_data(self, data: bytes) -> None:
        self._frames.receive_data(data)

    def next_response(self) -> KafkaResponse | NeedData:
        """The next response or NEED_DATA; KafkaDecodeError for an unexpected correlation id or bad bytes."""
        frame = self._frames.next_frame()
        if frame is None:
            return NEED_DATA
        if len(frame) < 4:
            raise KafkaDecodeError("response header needs 4 bytes", 0, "<header>")
        (correlation_id,) = _SIZE.unpack_from(frame)
        if correlation_id not in self._pending:
            raise KafkaDecodeError(f"response to no request sent (correlation id {correlation_id})", 0, "<header>")
        api_key, api_version = self._pending.pop(correlation_id)
        header = response_header_codec(response_header_version(api_key, api_version))
        _, pos = header.decode_prefix(frame)
        body = codec(api_key, api_version, True).decode(frame, pos)
        return KafkaResponse(api_key, api_version, correlation_id, body, len(frame) + 4)

"""Frames: the unit of the wire protocol, and a sans-IO decoder for a byte stream.

Layout (integers little-endian, like the record format)::

    u32  frame_length    bytes after this field: 4 + header_length + body length
    u32  header_length
    header               msgpack map (see :class:`Frame`)
    body                 raw bytes (message batches, records)

The decoder never does I/O: feed it bytes with :meth:`FrameDecoder.receive_data` and
take events with :meth:`FrameDecoder.next_event` until it returns ``NEED_DATA``.
A frame longer than ``max_frame_bytes`` is not buffered: its header is read (so the
sender can be told which request failed), its body skipped, and a
:class:`FrameRejected` event is produced; the stream stays usable.
Anything undecodable raises :class:`ProtocolError`, after which the stream is dead.

Versions. The header's ``v`` is the protocol version of the frame (a header without
it is version 0, which no one speaks). The *envelope* never changes between versions:
the prefix, and a msgpack map with ``v``, ``c`` (code), ``i`` (request id) and ``f``
(flags), so any peer can read who asked what, whatever the version. A server answers
a request whose version is not in its :data:`SUPPORTED_VERSIONS` with
UNSUPPORTED_VERSION, a text naming the versions it speaks and the field ``versions``
(the list), in a response of its own version; it does nothing else with the request
(:func:`check_request`). A client sends :data:`PROTOCOL_VERSION` and, refused, raises
an error naming both sides' versions (it does not retry: another broker of the same
cluster speaks the same). A new version is added to ``SUPPORTED_VERSIONS`` on servers
before clients start sending it.
"""

from __future__ import annotations

import struct
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Final

import msgpack

from clmq.common import ProtocolError

from ._codes import ErrorCode, request_error

PROTOCOL_VERSION: Final = 1  # what this side sends
SUPPORTED_VERSIONS: Final = frozenset({1})  # what this side answers
FLAG_RESPONSE: Final = 1
FLAG_ONEWAY: Final = 2

_PREFIX = struct.Struct("<II")
PREFIX_SIZE: Final = _PREFIX.size
MAX_HEADER_BYTES: Final = 1 << 20  # a header is small; anything bigger is garbage
DEFAULT_MAX_FRAME_BYTES: Final = 64 << 20


class _NeedData:
    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA: Final = _NeedData()


@dataclass(slots=True)
class Frame:
    """One request or response. ``fields`` are the request's named arguments."""

    code: int
    request_id: int
    fields: dict[str, Any] = field(default_factory=dict)
    body: bytes = b""
    flags: int = 0
    error_code: int = 0
    error_text: str = ""
    version: int = PROTOCOL_VERSION

    @property
    def is_response(self) -> bool:
        return bool(self.flags & FLAG_RESPONSE)

    @property
    def is_oneway(self) -> bool:
        return bool(self.flags & FLAG_ONEWAY)

    def header(self) -> dict[str, Any]:
        h: dict[str, Any] = {"v": self.version, "c": self.code, "i": self.request_id, "f": self.flags}
        if self.error_code:
            h["e"], h["m"] = self.error_code, self.error_text
        if self.fields:
            h["x"] = self.fields
        return h


@dataclass(frozen=True, slots=True)
class FrameRejected:
    """A frame the decoder skipped: too large. ``request_id`` is -1 if its header
    could not be read either."""

    request_id: int
    code: int
    flags: int
    frame_bytes: int
    reason: str


def encode_frame(frame: Frame) -> bytes:
    """The bytes of one frame."""
    header = msgpack.packb(frame.header(), use_bin_type=True)
    return b"".join((_PREFIX.pack(4 + len(header) + len(frame.body), len(header)), header, frame.body))


def encode_frame_prefix(frame: Frame, body_length: int) -> bytes:
    """A frame's prefix and header, for a body sent separately (e.g. with sendfile)."""
    header: bytes = msgpack.packb(frame.header(), use_bin_type=True)  # msgpack is untyped
    return _PREFIX.pack(4 + len(header) + body_length, len(header)) + header


def response_to(
    request: Frame, fields: dict[str, Any] | None = None, body: bytes = b"", error_code: int = 0, error_text: str = ""
) -> Frame:
    return Frame(request.code, request.request_id, fields or {}, body, FLAG_RESPONSE, error_code, error_text)


def check_request(frame: Frame) -> tuple[ErrorCode, str] | None:
    """Why a server must refuse a request before doing anything with it: a version it
    does not speak (UNSUPPORTED_VERSION) or fields that are not as documented
    (MALFORMED_REQUEST, naming the field); None if it may go ahead."""
    if frame.version not in SUPPORTED_VERSIONS:
        return ErrorCode.UNSUPPORTED_VERSION, (
            f"protocol version {frame.version} is not supported; this server speaks version(s) "
            f"{', '.join(map(str, sorted(SUPPORTED_VERSIONS)))}"
        )
    why = request_error(frame.code, frame.fields)
    return None if why is None else (ErrorCode.MALFORMED_REQUEST, why)


def _frame_from_header(h: object, body: bytes) -> Frame:
    if not isinstance(h, dict):
        raise ProtocolError(f"frame header is a {type(h).__name__}, not a map")
    try:
        code, rid, flags = h["c"], h["i"], h.get("f", 0)
        fields = h.get("x", {})
        err, text, version = h.get("e", 0), h.get("m", ""), h.get("v", 0)
    except KeyError as e:
        raise ProtocolError(f"frame header lacks {e.args[0]!r}") from None
    ints = isinstance(code, int) and isinstance(rid, int) and isinstance(flags, int)  # no generator: once per frame
    if not (ints and isinstance(err, int) and isinstance(version, int)):
        raise ProtocolError("frame header: code, id, flags, error code and version must be integers")
    if not isinstance(fields, dict) or not isinstance(text, str):
        raise ProtocolError("frame header: fields must be a map and the error text a string")
    return Frame(code, rid, fields, body, flags, err, text, version)


class _Chunks:
    """Received bytes, kept as the chunks they came in.

    Why not one growing bytearray: appending a chunk to it copies the chunk, resizing
    copies everything buffered, and cutting a frame out copies again. Here a frame's
    body costs at most one copy (none when it is exactly one chunk).
    """

    def __init__(self) -> None:
        self._chunks: deque[bytes] = deque()
        self._head = 0  # bytes of the first chunk already taken
        self.size = 0

    def append(self, data: bytes | bytearray) -> None:
        if data:
            self._chunks.append(data if type(data) is bytes else bytes(data))
            self.size += len(data)

    def first(self) -> tuple[bytes, int]:
        """The first chunk and how many of its bytes are taken already (``size > 0``)."""
        return self._chunks[0], self._head

    def skip_within_first(self, n: int) -> None:
        """Remove the first ``n`` bytes, all within the first chunk."""
        self._advance(n)

    def peek(self, n: int) -> bytes:
        """The first ``n`` bytes (``n <= size``), left in place."""
        first, head = self._chunks[0], self._head
        if len(first) - head >= n:
            return first[head : head + n]
        return b"".join(self._pieces(n))

    def take(self, n: int) -> bytes:
        """Remove and return the first ``n`` bytes (``n <= size``)."""
        if not n:
            return b""
        first, head = self._chunks[0], self._head
        if len(first) - head < n:
            out = b"".join(self._pieces(n))
            self.drop(n)
            return out
        out = first if head == 0 and n == len(first) else first[head : head + n]
        self._advance(n)
        return out

    def drop(self, n: int) -> None:
        """Remove the first ``n`` bytes (``n <= size``)."""
        while n:
            step = min(n, len(self._chunks[0]) - self._head)
            self._advance(step)
            n -= step

    def _advance(self, n: int) -> None:  # within the first chunk
        self._head += n
        self.size -= n
        if self._head == len(self._chunks[0]):
            self._chunks.popleft()
            self._head = 0

    def _pieces(self, n: int) -> list[memoryview]:
        pieces, head = [], self._head
        for chunk in self._chunks:
            piece = memoryview(chunk)[head : head + n]
            pieces.append(piece)
            n -= len(piece)
            head = 0
            if not n:
                break
        return pieces


class FrameDecoder:
    """Turns a byte stream into :class:`Frame` and :class:`FrameRejected` events."""

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._buf = _Chunks()
        self._skip = 0  # body bytes of a rejected frame still to drop
        self._dead: ProtocolError | None = None

    @property
    def buffered_bytes(self) -> int:
        return self._buf.size

    def receive_data(self, data: bytes | bytearray) -> None:  # as a trio stream's receive_some gives it
        if self._skip:
            dropped = min(self._skip, len(data))
            self._skip -= dropped
            data = data[dropped:]
        self._buf.append(data)

    def next_event(self) -> Frame | FrameRejected | _NeedData:
        if self._dead is not None:
            raise self._dead
        try:
            return self._next()
        except ProtocolError as e:
            self._dead = e
            raise

    def _next(self) -> Frame | FrameRejected | _NeedData:
        buf = self._buf
        if self._skip or buf.size < PREFIX_SIZE:
            return NEED_DATA
        first, head = buf.first()
        if len(first) - head >= PREFIX_SIZE:
            length, hlen = _PREFIX.unpack_from(first, head)
        else:
            length, hlen = _PREFIX.unpack(buf.peek(PREFIX_SIZE))
        if length < 4 or hlen > length - 4 or hlen > MAX_HEADER_BYTES or hlen == 0:
            raise ProtocolError(f"bad frame prefix: frame_length={length}, header_length={hlen}")
        if length + 4 > self.max_frame_bytes:
            return self._reject(length, hlen)
        if buf.size < 4 + length:
            return NEED_DATA
        if len(first) - head >= 4 + length:  # the whole frame in one chunk (small pipelined requests)
            start = head + PREFIX_SIZE
            header = self._unpack_header(first[start : start + hlen])
            body = first[start + hlen : head + 4 + length]
            buf.skip_within_first(4 + length)
            return _frame_from_header(header, body)
        buf.drop(PREFIX_SIZE)
        header = self._unpack_header(buf.take(hlen))
        body = buf.take(length - 4 - hlen)
        return _frame_from_header(header, body)

    def _reject(self, length: int, hlen: int) -> FrameRejected | _NeedData:
        if self._buf.size < PREFIX_SIZE + hlen:
            return NEED_DATA
        h = self._unpack_header(self._buf.peek(PREFIX_SIZE + hlen)[PREFIX_SIZE:])
        rid, code, flags = (h.get("i", -1), h.get("c", 0), h.get("f", 0)) if isinstance(h, dict) else (-1, 0, 0)
        rest = 4 + length  # bytes of the whole frame
        have = self._buf.size
        self._buf.drop(min(rest, have))
        self._skip = max(0, rest - have)
        reason = f"frame of {length + 4} bytes exceeds max_frame_bytes={self.max_frame_bytes}"
        return FrameRejected(
            rid if isinstance(rid, int) else -1,
            code if isinstance(code, int) else 0,
            flags if isinstance(flags, int) else 0,
            length + 4,
            reason,
        )

    @staticmethod
    def _unpack_header(raw: bytes) -> Any:
        try:
            return msgpack.unpackb(raw, raw=False, strict_map_key=False)
        except Exception as e:  # msgpack raises several types for garbage
            raise ProtocolError(f"undecodable frame header ({type(e).__name__}: {e})") from None

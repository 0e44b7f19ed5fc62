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
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, Final

import msgpack

PROTOCOL_VERSION: Final = 1
FLAG_RESPONSE: Final = 1
FLAG_ONEWAY: Final = 2

_PREFIX = struct.Struct("<II")
PREFIX_SIZE: Final = _PREFIX.size
MAX_HEADER_BYTES: Final = 1 << 20  # a header is small; anything bigger is garbage
DEFAULT_MAX_FRAME_BYTES: Final = 64 << 20


class ProtocolError(Exception):
    """The byte stream is not valid protocol; the connection must be closed."""


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
    header = msgpack.packb(frame.header(), use_bin_type=True)
    return _PREFIX.pack(4 + len(header) + body_length, len(header)) + header


def response_to(request: Frame, fields: dict[str, Any] | None = None, body: bytes = b"",
                error_code: int = 0, error_text: str = "") -> Frame:  # fmt: skip
    return Frame(request.code, request.request_id, fields or {}, body, FLAG_RESPONSE, error_code, error_text)


def _frame_from_header(h: object, body: bytes) -> Frame:
    if not isinstance(h, dict):
        raise ProtocolError(f"frame header is a {type(h).__name__}, not a map")
    try:
        code, rid, flags = h["c"], h["i"], h.get("f", 0)
        fields = h.get("x", {})
        err, text, version = h.get("e", 0), h.get("m", ""), h.get("v", 0)
    except KeyError as e:
        raise ProtocolError(f"frame header lacks {e.args[0]!r}") from None
    if not all(isinstance(v, int) for v in (code, rid, flags, err, version)):
        raise ProtocolError("frame header: code, id, flags, error code and version must be integers")
    if not isinstance(fields, dict) or not isinstance(text, str):
        raise ProtocolError("frame header: fields must be a map and the error text a string")
    return Frame(code, rid, fields, body, flags, err, text, version)


class FrameDecoder:
    """Turns a byte stream into :class:`Frame` and :class:`FrameRejected` events."""

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._buf = bytearray()
        self._pos = 0
        self._skip = 0  # body bytes of a rejected frame still to drop
        self._dead: ProtocolError | None = None

    @property
    def buffered_bytes(self) -> int:
        return len(self._buf) - self._pos

    def receive_data(self, data: bytes) -> None:
        if self._skip:
            dropped = min(self._skip, len(data))
            self._skip -= dropped
            data = data[dropped:]
        self._buf += data

    def next_event(self) -> Frame | FrameRejected | _NeedData:
        if self._dead is not None:
            raise self._dead
        try:
            return self._next()
        except ProtocolError as e:
            self._dead = e
            raise

    def _next(self) -> Frame | FrameRejected | _NeedData:
        if self._skip or self.buffered_bytes < PREFIX_SIZE:
            return NEED_DATA
        length, hlen = _PREFIX.unpack_from(self._buf, self._pos)
        if length < 4 or hlen > length - 4 or hlen > MAX_HEADER_BYTES or hlen == 0:
            raise ProtocolError(f"bad frame prefix: frame_length={length}, header_length={hlen}")
        if length + 4 > self.max_frame_bytes:
            return self._reject(length, hlen)
        if self.buffered_bytes < 4 + length:
            return NEED_DATA
        start = self._pos + PREFIX_SIZE
        header = self._unpack_header(start, hlen)
        body = bytes(self._buf[start + hlen : self._pos + 4 + length])
        self._consume(4 + length)
        return _frame_from_header(header, body)

    def _reject(self, length: int, hlen: int) -> FrameRejected | _NeedData:
        if self.buffered_bytes < PREFIX_SIZE + hlen:
            return NEED_DATA
        h = self._unpack_header(self._pos + PREFIX_SIZE, hlen)
        rid, code, flags = (h.get("i", -1), h.get("c", 0), h.get("f", 0)) if isinstance(h, dict) else (-1, 0, 0)
        rest = 4 + length  # bytes of the whole frame
        have = self.buffered_bytes
        self._consume(min(rest, have))
        self._skip = max(0, rest - have)
        reason = f"frame of {length + 4} bytes exceeds max_frame_bytes={self.max_frame_bytes}"
        return FrameRejected(rid if isinstance(rid, int) else -1, code if isinstance(code, int) else 0,
                             flags if isinstance(flags, int) else 0, length + 4, reason)  # fmt: skip

    def _unpack_header(self, start: int, hlen: int) -> Any:
        try:
            return msgpack.unpackb(bytes(self._buf[start : start + hlen]), raw=False, strict_map_key=False)
        except Exception as e:  # msgpack raises several types for garbage
            raise ProtocolError(f"undecodable frame header ({type(e).__name__}: {e})") from None

    def _consume(self, n: int) -> None:
        self._pos += n
        if self._pos == len(self._buf):
            self._buf.clear()
            self._pos = 0
        elif self._pos > (1 << 20) and self._pos > len(self._buf) // 2:
            del self._buf[: self._pos]
            self._pos = 0

"""Kafka's primitive types (docs/protocol.html, "Protocol Primitive Types"), read and written.

:class:`Reader` is the careful reader: every read is bounds-checked and fails with a
:class:`KafkaDecodeError` at its byte offset. The compiled codecs (``_compile``) inline
their own fast reads and fall back on it only to explain a failure; the framing layer
uses it for the request header. The ``write_*`` functions return bytes.
"""

from __future__ import annotations

import struct
import uuid
from typing import Any, Final

from ._errors import KafkaDecodeError

Buffer = bytes | bytearray | memoryview

MAX_STRING_BYTES: Final = 0x7FFF  # Kafka refuses longer strings, compact ones included
INT_RANGES: Final[dict[str, tuple[int, int]]] = {
    "int8": (-(1 << 7), (1 << 7) - 1),
    "int16": (-(1 << 15), (1 << 15) - 1),
    "int32": (-(1 << 31), (1 << 31) - 1),
    "int64": (-(1 << 63), (1 << 63) - 1),
    "uint16": (0, (1 << 16) - 1),
    "uint32": (0, (1 << 32) - 1),
}
# The fixed-size types: their struct code (big-endian) and size.
FIXED: Final[dict[str, str]] = {
    "int8": "b",
    "int16": "h",
    "int32": "i",
    "int64": "q",
    "uint16": "H",
    "uint32": "I",
    "float64": "d",
    "bool": "?",
    "uuid": "16s",
}
ZERO_UUID: Final = uuid.UUID(int=0)


def read_uvarint(buf: Buffer, pos: int) -> tuple[int, int]:
    """An unsigned varint (at most 5 bytes, 32 bits) at ``pos``: (value, next position).

    Raises IndexError when the bytes end and ValueError when it is too long: the compiled
    codecs catch both; :meth:`Reader.uvarint` gives the precise error.
    """
    value = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 28:
            raise ValueError("unsigned varint longer than 5 bytes")


def write_uvarint(value: int) -> bytes:
    """``value`` (0 ≤ value < 2**32) as an unsigned varint."""
    if not 0 <= value < 1 << 32:
        raise ValueError(f"unsigned varint out of range: {value}")
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def write_varint(value: int) -> bytes:
    """A signed 32-bit value, zig-zag encoded as a varint."""
    return write_uvarint(((value << 1) ^ (value >> 31)) & 0xFFFFFFFF)


def write_varlong(value: int) -> bytes:
    """A signed 64-bit value, zig-zag encoded as a varint of up to 10 bytes."""
    zigzag = ((value << 1) ^ (value >> 63)) & 0xFFFFFFFFFFFFFFFF
    out = bytearray()
    while zigzag > 0x7F:
        out.append((zigzag & 0x7F) | 0x80)
        zigzag >>= 7
    out.append(zigzag)
    return bytes(out)


def write_string(value: str | None, *, compact: bool) -> bytes:
    """A (nullable) string: int16 length, or unsigned varint length + 1 when compact; null is -1 / 0."""
    if value is None:
        return b"\x00" if compact else b"\xff\xff"
    data = value.encode()
    if len(data) > MAX_STRING_BYTES:
        raise ValueError(f"string of {len(data)} bytes is over {MAX_STRING_BYTES}")
    return (write_uvarint(len(data) + 1) if compact else struct.pack(">h", len(data))) + data


def write_tagged_fields(fields: dict[int, bytes]) -> bytes:
    """A tagged-field section: count, then tag, size and data of each, tags ascending."""
    parts = [write_uvarint(len(fields))]
    for tag in sorted(fields):
        parts += [write_uvarint(tag), write_uvarint(len(fields[tag])), bytes(fields[tag])]
    return b"".join(parts)


class Reader:
    """Bounds-checked reads from ``buf[pos:end]``; each failure is a KafkaDecodeError at its offset."""

    __slots__ = ("buf", "end", "pos")

    def __init__(self, buf: Buffer, pos: int = 0, end: int | None = None) -> None:
        self.buf = buf
        self.pos = pos
        self.end = len(buf) if end is None else end

    def error(self, reason: str, offset: int | None = None) -> KafkaDecodeError:
        """An error at ``offset`` (default: the current position)."""
        return KafkaDecodeError(reason, self.pos if offset is None else offset)

    def take(self, size: int, what: str) -> int:
        """Consume ``size`` bytes; return where they start."""
        start = self.pos
        if size > self.end - start:
            raise self.error(f"{what} needs {size} bytes, {self.end - start} left")
        self.pos = start + size
        return start

    def fixed(self, kind: str) -> Any:
        """A value of a fixed-size type (``FIXED``); uuid as :class:`uuid.UUID`, bool any non-zero byte."""
        code = ">" + FIXED[kind]
        start = self.take(struct.calcsize(code), kind)
        (value,) = struct.unpack_from(code, self.buf, start)
        return uuid.UUID(bytes=bytes(value)) if kind == "uuid" else value

    def uvarint(self) -> int:
        """An unsigned varint of at most 5 bytes."""
        start = self.pos
        value = shift = 0
        while True:
            byte = self.buf[self.take(1, "unsigned varint")]
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                return value
            shift += 7
            if shift > 28:
                raise self.error("unsigned varint longer than 5 bytes", start)

    def length(self, *, compact: bool, wide: bool, nullable: bool, what: str) -> int | None:
        """A length or count: int16 (``wide`` False) / int32, or unsigned varint - 1; None is null."""
        start = self.pos
        if compact:
            size = self.uvarint() - 1
        else:
            size = self.fixed("int32" if wide else "int16")
        if size < -1 or (size == -1 and not nullable):
            raise self.error(f"invalid {what} length {size}", start)
        return None if size == -1 else size

    def string(self, *, compact: bool, nullable: bool) -> str | None:
        """A (compact, nullable) UTF-8 string."""
        start = self.pos
        size = self.length(compact=compact, wide=False, nullable=nullable, what="string")
        if size is None:
            return None
        if size > MAX_STRING_BYTES:
            raise self.error(f"string length {size} over {MAX_STRING_BYTES}", start)
        begin = self.take(size, "string")
        try:
            return str(self.buf[begin : begin + size], "utf-8")
        except UnicodeDecodeError as e:
            raise self.error(f"invalid UTF-8 in string: {e.reason}", begin + e.start) from None

    def blob(self, *, compact: bool, nullable: bool) -> bytes | None:
        """A (compact, nullable) byte string (also the ``records`` type)."""
        size = self.length(compact=compact, wide=True, nullable=nullable, what="bytes")
        if size is None:
            return None
        begin = self.take(size, "bytes")
        return bytes(self.buf[begin : begin + size])

    def tagged_fields(self) -> dict[int, bytes]:
        """A tagged-field section, every field raw: {tag: data}."""
        fields: dict[int, bytes] = {}
        for _ in range(self.uvarint()):
            tag = self.uvarint()
            size = self.uvarint()
            begin = self.take(size, f"tagged field {tag}")
            fields[tag] = bytes(self.buf[begin : begin + size])
        return fields

"""The four codecs of Kafka's record batches (attributes bits 0-2), through cramjam.

Decompression is bounded: a batch of a few kilobytes can expand to gigabytes (a
decompression bomb), so every codec decompresses into a buffer no larger than the
caller's limit and stops there, and snappy's declared lengths are checked before any
output is made. Stream formats are the ones the Java client writes and reads:

- gzip: a gzip stream (``GZIPOutputStream``);
- snappy: xerial snappy-java's framing (``SnappyOutputStream``: a 16-byte header, then
  blocks of a big-endian int32 length and raw snappy); raw snappy is accepted on input
  too, as the Java client (``SnappyInputStream``) and librdkafka both accept it;
- lz4: the LZ4 frame format with independent blocks (``Lz4BlockInputStream`` refuses
  linked blocks);
- zstd: a zstd frame.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from enum import IntEnum
from typing import Any

import cramjam


class Compression(IntEnum):
    """The compression codec of a record batch: bits 0-2 of its attributes."""

    NONE = 0
    GZIP = 1
    SNAPPY = 2
    LZ4 = 3
    ZSTD = 4


class DecompressionFailed(Exception):
    """The compressed stream is not valid for its codec."""


class DecompressionTooLarge(Exception):
    """The stream expands beyond the limit given; nothing beyond the limit was allocated."""


XERIAL_MAGIC = b"\x82SNAPPY\x00"
# Version 1, minimum compatible version 1: what snappy-java writes.
XERIAL_HEADER = XERIAL_MAGIC + struct.pack(">ii", 1, 1)
# snappy-java's default block size; librdkafka reads any block size.
_XERIAL_BLOCK = 32 * 1024
_INT32 = struct.Struct(">i")
# Kafka's default levels (KIP-390) are gzip 6 and zstd 3; lz4 uses cramjam's fast default
# rather than Kafka's HC level 9 because batches are compressed on the fetch path.
_GZIP_LEVEL = 6
_ZSTD_LEVEL = 3
# The first output buffer is this many times the compressed size (or the limit, if smaller);
# it grows by _GROWTH when too small, so a batch costs about one decompression and a bomb
# never more memory than the limit.
_FIRST_RATIO = 8
_GROWTH = 4
_MIN_FIRST = 64 * 1024
# What cramjam's *_into functions say when the output buffer is full (Rust's WriteZero).
_FULL_BUFFER = "failed to write whole buffer"


def compress(codec: Compression, data: bytes | bytearray) -> bytes | bytearray | cramjam.Buffer:
    """The ``codec`` stream of ``data`` (a bytes-like object), in the format the Java client reads."""
    if codec == Compression.GZIP:
        return cramjam.gzip.compress(data, level=_GZIP_LEVEL)
    if codec == Compression.SNAPPY:
        return _xerial_compress(data)
    if codec == Compression.LZ4:
        # Independent blocks (Java refuses linked ones); no content checksum (Java skips it).
        lz4 = cramjam.lz4.Compressor(content_checksum=False, block_linked=False)
        lz4.compress(bytes(data))  # the streaming compressor takes bytes only
        return lz4.finish()
    if codec == Compression.ZSTD:
        return cramjam.zstd.compress(data, level=_ZSTD_LEVEL)
    if codec == Compression.NONE:
        return data
    raise ValueError(f"unknown compression codec {codec}")


def _xerial_compress(data: bytes | bytearray) -> bytearray:
    out = bytearray(XERIAL_HEADER)
    view = memoryview(data)
    for start in range(0, len(data), _XERIAL_BLOCK):
        block = cramjam.snappy.compress_raw(view[start : start + _XERIAL_BLOCK])
        out += _INT32.pack(len(block))
        out += block
    return out


def decompress(codec: Compression, data: bytes | memoryview, limit: int) -> bytes:
    """The bytes that ``data`` decompresses to, if at most ``limit`` of them.

    Raises DecompressionTooLarge beyond ``limit`` (without allocating more than about
    ``limit`` bytes) and DecompressionFailed for a stream that does not decode.
    """
    if codec == Compression.SNAPPY:
        return _snappy_decompress(data, limit)
    if codec == Compression.GZIP:
        return _bounded(cramjam.gzip.decompress_into, data, limit)
    if codec == Compression.LZ4:
        return _bounded(cramjam.lz4.decompress_into, data, limit)
    if codec == Compression.ZSTD:
        return _bounded(cramjam.zstd.decompress_into, data, limit)
    raise DecompressionFailed(f"no decompressor for codec {codec}")


def _bounded(decompress_into: Callable[[Any, bytearray], int], data: bytes | memoryview, limit: int) -> bytes:
    """Decompress into buffers of growing size, never above ``limit + 1`` bytes."""
    size = min(limit + 1, max(_MIN_FIRST, _FIRST_RATIO * len(data)))
    while True:
        out = bytearray(size)
        try:
            written = decompress_into(data, out)
        except cramjam.DecompressionError as exc:
            if _FULL_BUFFER not in str(exc):
                raise DecompressionFailed(str(exc)) from None
            if size > limit:
                raise DecompressionTooLarge(f"more than {limit} bytes") from None
            size = min(limit + 1, size * _GROWTH)
            continue
        if written > limit:
            raise DecompressionTooLarge(f"more than {limit} bytes")
        return bytes(memoryview(out)[:written])


def _snappy_decompress(data: bytes | memoryview, limit: int) -> bytes:
    if bytes(data[:8]) != XERIAL_MAGIC or len(data) < len(XERIAL_HEADER):
        return _raw_snappy(data, limit)
    parts: list[bytes] = []
    pos = len(XERIAL_HEADER)
    while pos < len(data):
        if pos + 4 > len(data):
            raise DecompressionFailed(f"xerial block length cut at byte {pos}")
        (length,) = _INT32.unpack_from(data, pos)
        pos += 4
        if length < 0 or pos + length > len(data):
            raise DecompressionFailed(f"xerial block of {length} bytes at byte {pos} overruns {len(data)} bytes")
        block = _raw_snappy(data[pos : pos + length], limit)
        limit -= len(block)
        parts.append(block)
        pos += length
    return b"".join(parts)


def _raw_snappy(data: bytes | memoryview, limit: int) -> bytes:
    # Raw snappy declares its length up front: check it before allocating anything.
    try:
        length = cramjam.snappy.decompress_raw_len(data)
    except cramjam.DecompressionError as exc:
        raise DecompressionFailed(str(exc)) from None
    if length > limit:
        raise DecompressionTooLarge(f"{length} bytes declared, more than {limit}")
    out = bytearray(length)
    try:
        written = cramjam.snappy.decompress_raw_into(data, out)
    except cramjam.DecompressionError as exc:
        raise DecompressionFailed(str(exc)) from None
    return bytes(memoryview(out)[:written])

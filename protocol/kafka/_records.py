"""Kafka's record batch format, magic 2 (``DefaultRecordBatch`` and ``DefaultRecord``).

A batch is a 61-byte header then its records, compressed as one stream when the
attributes say so::

    baseOffset int64, batchLength int32 (bytes after this field), partitionLeaderEpoch int32,
    magic int8 (2), crc uint32 (CRC-32C of attributes..end), attributes int16, lastOffsetDelta int32,
    baseTimestamp int64, maxTimestamp int64, producerId int64, producerEpoch int16,
    baseSequence int32, records count int32, records...

    record: length varint, attributes int8, timestampDelta varlong, offsetDelta varint,
            key (varint length, -1 = null), value (likewise), header count varint,
            headers (varint key length + UTF-8 key, varint value length (-1 = null) + value)

Varints are zig-zag. :func:`parse_batches` checks a Produce request's records blob and
raises only :class:`RecordsError`, whose ``error_code`` is the Kafka error to answer;
:func:`build_batch` encodes records for Fetch responses.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from crc32c import crc32c

from clmq.common import ClmqError

from ._compression import Compression, DecompressionFailed, DecompressionTooLarge, compress, decompress

__all__ = [
    "CORRUPT_MESSAGE",
    "INVALID_RECORD",
    "MESSAGE_TOO_LARGE",
    "UNSUPPORTED_COMPRESSION_TYPE",
    "UNSUPPORTED_FOR_MESSAGE_FORMAT",
    "Compression",
    "KafkaRecord",
    "RecordBatch",
    "RecordsError",
    "batch_header_info",
    "build_batch",
    "parse_batches",
]

# Kafka error codes (org.apache.kafka.common.protocol.Errors) that parse_batches answers with.
CORRUPT_MESSAGE = 2
MESSAGE_TOO_LARGE = 10
UNSUPPORTED_FOR_MESSAGE_FORMAT = 43
UNSUPPORTED_COMPRESSION_TYPE = 76
INVALID_RECORD = 87

_HEADER = struct.Struct(">qiibIhiqqqhii")
_AFTER_CRC = struct.Struct(">hiqqqhii")  # attributes .. records count, written before the CRC
_FIRST = struct.Struct(">qiibI")  # base offset .. crc
_LOG = struct.Struct(">qi")  # base offset, batch length
_MAGIC_AT = 16
HEADER_SIZE = _HEADER.size  # 61
LOG_OVERHEAD = 12  # base offset + batch length
_CRC_START = 21  # attributes: the CRC covers from here to the end of the batch
_MIN_LENGTH = HEADER_SIZE - LOG_OVERHEAD  # the smallest batchLength: a header and no records
_MIN_RECORD = 7  # length, attributes, timestamp, offset, key, value, header count: a byte each
_MAGIC = 2

_COMPRESSION_MASK = 0x07
_CODECS = tuple(Compression)  # by attributes & _COMPRESSION_MASK: indexing is cheaper than Compression(n)
_LOG_APPEND_TIME = 0x08
_TRANSACTIONAL = 0x10
_CONTROL = 0x20


class RecordsError(ClmqError):
    """A records blob Kafka would refuse; ``error_code`` is the Kafka error to answer with."""

    def __init__(self, error_code: int, message: str) -> None:
        super().__init__(message)
        self.error_code = error_code


@dataclass(slots=True)
class KafkaRecord:
    """One record of a batch, with its offset and timestamp made absolute."""

    offset: int
    timestamp: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes | None]]


@dataclass(slots=True)
class RecordBatch:
    """A decoded batch: its header fields and its records (decompressed)."""

    base_offset: int
    partition_leader_epoch: int
    attributes: int
    last_offset_delta: int
    base_timestamp: int
    max_timestamp: int
    producer_id: int
    producer_epoch: int
    base_sequence: int
    records: list[KafkaRecord]

    @property
    def compression(self) -> Compression:
        """The codec the records were compressed with (attributes bits 0-2)."""
        return Compression(self.attributes & _COMPRESSION_MASK)

    @property
    def is_transactional(self) -> bool:
        """Whether the batch belongs to a transaction (attributes bit 4)."""
        return bool(self.attributes & _TRANSACTIONAL)

    @property
    def is_control(self) -> bool:
        """Whether the batch holds control records (commit/abort markers; attributes bit 5)."""
        return bool(self.attributes & _CONTROL)

    @property
    def timestamp_type(self) -> int:
        """0 for CreateTime, 1 for LogAppendTime (attributes bit 3)."""
        return 1 if self.attributes & _LOG_APPEND_TIME else 0

    @property
    def record_count(self) -> int:
        """How many records the batch holds."""
        return len(self.records)


class _Malformed(Exception):
    """A record that does not decode; parse_batches turns it into INVALID_RECORD."""


# ----------------------------------------------------------------------------- parsing
def parse_batches(data: bytes, *, max_uncompressed_bytes: int) -> list[RecordBatch]:
    """Every batch of a Produce partition's records blob, checked as Kafka checks it.

    Checks each batch's length, magic, CRC-32C, codec, record count, offset deltas and
    records, and that the blob ends with a whole batch. The compressed batches together
    may decompress to at most ``max_uncompressed_bytes``; beyond that the call stops
    with MESSAGE_TOO_LARGE having allocated about that much at most. An empty blob gives
    ``[]`` (Kafka answers a Produce without batches with INVALID_RECORD: the caller's
    choice). Raises :class:`RecordsError` and nothing else, whatever the bytes.
    """
    if not isinstance(data, bytes):
        data = bytes(data)
    batches: list[RecordBatch] = []
    budget = max_uncompressed_bytes
    pos = 0
    while pos < len(data):
        batch, end, used = _parse_batch(data, pos, budget)
        batches.append(batch)
        budget -= used
        pos = end
    return batches


def batch_header_info(data: bytes, pos: int) -> tuple[int, int] | None:
    """``(base_offset, total size in bytes)`` of the batch at ``pos``, or None if it is not whole in ``data``."""
    if len(data) - pos < LOG_OVERHEAD:
        return None
    base_offset, length = _LOG.unpack_from(data, pos)
    size = LOG_OVERHEAD + length
    if length < 0 or pos + size > len(data):
        return None
    return base_offset, size


def _parse_batch(data: bytes, pos: int, budget: int) -> tuple[RecordBatch, int, int]:
    """The batch at ``pos``, the position after it, and how many bytes decompression used."""
    end = _check_frame(data, pos)
    base_offset, _, epoch, _, crc, attributes, last_delta, base_ts, max_ts, pid, p_epoch, sequence, count = (
        _HEADER.unpack_from(data, pos)
    )
    actual = crc32c(memoryview(data)[pos + _CRC_START : end])
    if actual != crc:
        raise _error(CORRUPT_MESSAGE, pos, f"crc32c expected 0x{crc:08x} (crc field), actual 0x{actual:08x}")
    codec = attributes & _COMPRESSION_MASK
    if codec >= len(_CODECS):
        raise _error(UNSUPPORTED_COMPRESSION_TYPE, pos, f"unknown compression codec {codec}")
    # Kafka's LogValidator checks these for client batches: a positive count that matches the offset range.
    if count <= 0 or last_delta != count - 1:
        raise _error(
            INVALID_RECORD,
            pos,
            f"record count {count} and last offset delta {last_delta} disagree "
            f"(expected a positive count, and last offset delta = count - 1)",
        )
    records, used = _batch_records(data, pos, end, _CODECS[codec], count, base_offset, base_ts, budget)
    batch = RecordBatch(base_offset, epoch, attributes, last_delta, base_ts, max_ts, pid, p_epoch, sequence, records)
    return batch, end, used


def _error(code: int, pos: int, text: str) -> RecordsError:
    return RecordsError(code, f"batch at byte {pos}: {text}")


def _batch_records(
    data: bytes, pos: int, end: int, codec: Compression, count: int, base_offset: int, base_ts: int, budget: int
) -> tuple[list[KafkaRecord], int]:
    """The records of the batch at ``pos`` (CRC checked) and how many bytes decompression used."""
    if codec == Compression.NONE:
        buf, start, where = data, pos + HEADER_SIZE, ""
    else:
        buf = _decompress(memoryview(data)[pos + HEADER_SIZE : end], pos, codec, budget)
        start, end, where = 0, len(buf), f" (in the decompressed {codec.name} records)"
    try:
        return _read_records(buf, start, end, count, base_offset, base_ts), len(buf) if codec else 0
    except _Malformed as exc:
        raise _error(INVALID_RECORD, pos, f"{exc}{where}") from None
    except IndexError:
        raise _error(INVALID_RECORD, pos, f"a record runs past the batch's end{where}") from None


def _check_frame(data: bytes, pos: int) -> int:
    """The end of the batch at ``pos``, once its length and magic are plausible."""
    remaining = len(data) - pos
    if remaining < LOG_OVERHEAD:
        text = f"{remaining} trailing bytes, expected at least {LOG_OVERHEAD} (a Produce request holds whole batches)"
        raise _error(CORRUPT_MESSAGE, pos, text)
    length: int = _LOG.unpack_from(data, pos)[1]
    # Magic 0 and 1 keep their magic byte at the same place (offset, size, crc, magic).
    if remaining > _MAGIC_AT:
        magic = data[pos + _MAGIC_AT]
        magic = magic - 256 if magic > 127 else magic
        if magic != _MAGIC:
            code = UNSUPPORTED_FOR_MESSAGE_FORMAT if magic in (0, 1) else CORRUPT_MESSAGE
            raise _error(code, pos, f"magic expected {_MAGIC}, actual {magic}")
    if length < _MIN_LENGTH:
        raise _error(CORRUPT_MESSAGE, pos, f"batch length expected at least {_MIN_LENGTH}, actual {length}")
    if length > remaining - LOG_OVERHEAD:
        text = f"batch length says {length} bytes follow, actual {remaining - LOG_OVERHEAD} (a truncated batch)"
        raise _error(CORRUPT_MESSAGE, pos, text)
    return pos + LOG_OVERHEAD + length


def _decompress(payload: memoryview, pos: int, codec: Compression, budget: int) -> bytes:
    try:
        return decompress(codec, payload, max(budget, 0))
    except DecompressionTooLarge as exc:
        raise _error(MESSAGE_TOO_LARGE, pos, f"{codec.name} records decompress to {exc} (the limit left)") from None
    except DecompressionFailed as exc:
        raise _error(CORRUPT_MESSAGE, pos, f"{codec.name} records do not decompress: {exc}") from None


def _varint(buf: bytes, pos: int, max_bytes: int) -> tuple[int, int]:
    """The zig-zag varint at ``pos`` (at most ``max_bytes`` long: 5 for varint, 10 for varlong) and its end."""
    raw = shift = 0
    for _ in range(max_bytes):
        byte = buf[pos]
        pos += 1
        raw |= (byte & 0x7F) << shift
        if byte < 0x80:
            return (raw >> 1) ^ -(raw & 1), pos
        shift += 7
    raise _Malformed(f"varint at byte {pos - max_bytes} longer than {max_bytes} bytes")


def _read_records(buf: bytes, pos: int, end: int, count: int, base_offset: int, base_ts: int) -> list[KafkaRecord]:
    """``count`` records filling ``buf[pos:end]`` exactly, offset deltas 0, 1, 2...

    The hot loop of Produce: varints of one or two bytes (deltas, lengths under 8 KiB)
    are decoded inline, as a call per field would cost about as much as the rest.
    """
    if count > (end - pos) // _MIN_RECORD:
        raise _Malformed(f"record count {count} cannot fit in {end - pos} bytes of records")
    records: list[KafkaRecord] = []
    append = records.append
    for index in range(count):
        if pos >= end:  # the count lies; without this the next batch's bytes would be read as records
            raise _Malformed(f"record count {count} expected, but the records end after {index}")
        start = pos
        byte = buf[pos]
        if byte < 0x80:
            length, pos = (byte >> 1) ^ -(byte & 1), pos + 1
        elif buf[pos + 1] < 0x80:
            raw = (byte & 0x7F) | (buf[pos + 1] << 7)
            length, pos = (raw >> 1) ^ -(raw & 1), pos + 2
        else:
            length, pos = _varint(buf, pos, 5)
        record_end = pos + length
        if length < _MIN_RECORD - 1 or record_end > end:
            raise _Malformed(f"record {index} at byte {start}: length {length} runs past the batch's end at {end}")
        byte = buf[pos + 1]  # after the record's attributes, unused by Kafka
        if byte < 0x80:
            ts_delta, pos = (byte >> 1) ^ -(byte & 1), pos + 2
        elif buf[pos + 2] < 0x80:
            raw = (byte & 0x7F) | (buf[pos + 2] << 7)
            ts_delta, pos = (raw >> 1) ^ -(raw & 1), pos + 3
        else:
            ts_delta, pos = _varint(buf, pos + 1, 10)
        delta, pos = _read_varint(buf, pos)
        if delta != index:
            raise _Malformed(f"record {index} at byte {start}: offset delta expected {index}, actual {delta}")
        key, pos = _read_bytes(buf, pos)
        value, pos = _read_bytes(buf, pos)
        if buf[pos] == 0:  # no headers: the usual case
            headers: list[tuple[str, bytes | None]] = []
            pos += 1
        else:
            headers, pos = _read_headers(buf, pos, record_end)
        if pos != record_end:
            raise _Malformed(
                f"record {index} at byte {start}: length expected {length}, actual {pos - record_end + length}"
            )
        append(KafkaRecord(base_offset + index, base_ts + ts_delta, key, value, headers))
    if pos != end:
        raise _Malformed(f"record count {count} expected, but {end - pos} bytes remain after record {count - 1}")
    return records


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    """The zig-zag varint at ``pos`` and its end, with one and two bytes decoded without a loop."""
    byte = buf[pos]
    if byte < 0x80:
        return (byte >> 1) ^ -(byte & 1), pos + 1
    if buf[pos + 1] < 0x80:
        raw = (byte & 0x7F) | (buf[pos + 1] << 7)
        return (raw >> 1) ^ -(raw & 1), pos + 2
    return _varint(buf, pos, 5)


def _read_bytes(buf: bytes, pos: int) -> tuple[bytes | None, int]:
    """A varint length (-1 = null) and that many bytes: a key, value or header value."""
    byte = buf[pos]
    if byte < 0x80:
        size, pos = (byte >> 1) ^ -(byte & 1), pos + 1
    elif buf[pos + 1] < 0x80:
        raw = (byte & 0x7F) | (buf[pos + 1] << 7)
        size, pos = (raw >> 1) ^ -(raw & 1), pos + 2
    else:
        size, pos = _varint(buf, pos, 5)
    if size >= 0:
        # A size past the record's end leaves pos past it, which the record length check reports.
        return buf[pos : pos + size], pos + size
    if size == -1:
        return None, pos
    raise _Malformed(f"negative length {size} at byte {pos}")


def _read_headers(buf: bytes, pos: int, end: int) -> tuple[list[tuple[str, bytes | None]], int]:
    count, pos = _read_varint(buf, pos)
    # Each header takes at least two bytes: a bound before looping on an untrusted count.
    if count < 0 or count > (end - pos) // 2:
        raise _Malformed(f"header count {count} at byte {pos} does not fit the record")
    headers: list[tuple[str, bytes | None]] = []
    for _ in range(count):
        key, pos = _read_bytes(buf, pos)
        if key is None or pos > end:
            raise _Malformed(f"header key at byte {pos} is null or runs past the record")
        try:
            name = key.decode()
        except UnicodeDecodeError as exc:
            raise _Malformed(f"header key before byte {pos} is not UTF-8: {exc}") from None
        value, pos = _read_bytes(buf, pos)
        headers.append((name, value))
    return headers, pos


# ---------------------------------------------------------------------------- building
def _zigzag(value: int) -> bytes:
    """The zig-zag varint (or varlong) encoding of ``value``."""
    raw = (value << 1) ^ (value >> 63)
    out = bytearray()
    while raw >= 0x80:
        out.append((raw & 0x7F) | 0x80)
        raw >>= 7
    out.append(raw)
    return bytes(out)


# The encodings of 0..16383 (deltas, lengths up to 16 KiB): a list index instead of a loop per field.
_SMALL = 16384
_ZZ = [_zigzag(value) for value in range(_SMALL)]
_NULL = _zigzag(-1)


def build_batch(
    base_offset: int,
    records: Sequence[tuple[int, bytes | None, bytes | None, Sequence[tuple[str, bytes | None]]]],
    *,
    compression: Compression = Compression.NONE,
    producer_id: int = -1,
    producer_epoch: int = -1,
    base_sequence: int = -1,
    partition_leader_epoch: int = -1,
    transactional: bool = False,
    log_append_time: bool = False,
) -> bytes:
    """One batch of ``records`` (``(timestamp_ms, key, value, headers)``) at consecutive offsets from ``base_offset``.

    The base timestamp is the first record's and the max timestamp the largest; with
    ``log_append_time`` consumers take the max timestamp as every record's, so pass the
    append time as the records' timestamps. Raises ValueError for no records.
    """
    if not records:
        raise ValueError("a record batch holds at least one record")
    base_ts = records[0][0]
    encoded, max_ts = _encode_records(records, base_ts)
    body = compress(compression, encoded) if compression != Compression.NONE else encoded
    attributes = compression | (_LOG_APPEND_TIME if log_append_time else 0) | (_TRANSACTIONAL if transactional else 0)
    after_crc = _AFTER_CRC.pack(
        attributes, len(records) - 1, base_ts, max_ts, producer_id, producer_epoch, base_sequence, len(records)
    )
    crc = crc32c(body, crc32c(after_crc))
    first = _FIRST.pack(base_offset, _MIN_LENGTH + len(body), partition_leader_epoch, _MAGIC, crc)
    return b"".join((first, after_crc, body))


def _encode_records(
    records: Sequence[tuple[int, bytes | None, bytes | None, Sequence[tuple[str, bytes | None]]]], base_ts: int
) -> tuple[bytes, int]:
    """The encoded records and the largest timestamp.

    The hot loop of Fetch: each varint comes from the _ZZ table when small, the record's
    length is summed from its parts' sizes so nothing is encoded twice, and one join
    copies everything once (faster than appending to a bytearray part by part).
    """
    zz, small, null = _ZZ, _SMALL, _NULL
    max_ts = base_ts
    parts: list[bytes] = []
    for index, (timestamp, key, value, headers) in enumerate(records):
        if timestamp > max_ts:
            max_ts = timestamp
        delta = timestamp - base_ts
        ts_enc = zz[delta] if 0 <= delta < small else _zigzag(delta)
        index_enc = zz[index] if index < small else _zigzag(index)
        if key is None:
            key_enc, key = null, b""
        else:
            size = len(key)
            key_enc = zz[size] if size < small else _zigzag(size)
        if value is None:
            value_enc, value = null, b""
        else:
            size = len(value)
            value_enc = zz[size] if size < small else _zigzag(size)
        headers_enc = _encode_headers(headers) if headers else b"\x00"
        size = 1 + len(ts_enc) + len(index_enc) + len(key_enc) + len(key) + len(value_enc) + len(value)
        size += len(headers_enc)
        parts += (
            zz[size] if size < small else _zigzag(size),
            b"\x00",
            ts_enc,
            index_enc,
            key_enc,
            key,
            value_enc,
            value,
        )
        parts.append(headers_enc)
    return b"".join(parts), max_ts


def _encode_headers(headers: Sequence[tuple[str, bytes | None]]) -> bytes:
    """A record's header count and headers (keys UTF-8, values null or bytes)."""
    zz, small = _ZZ, _SMALL
    parts = [zz[len(headers)] if len(headers) < small else _zigzag(len(headers))]
    for name, value in headers:
        encoded = name.encode()
        parts += (zz[len(encoded)] if len(encoded) < small else _zigzag(len(encoded)), encoded)
        if value is None:
            parts.append(_NULL)
        else:
            parts += (zz[len(value)] if len(value) < small else _zigzag(len(value)), value)
    return b"".join(parts)

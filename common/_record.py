"""The CommitLog record format, version 1.

Every message of every queue is stored as one self-describing record. All integers
are little-endian (native on the machines we run on, so numpy can read columns
without byte-swapping). A record is a fixed 106-byte header followed by five
variable-length fields::

    off  size  field
      0     4  total_size         whole record, this field included
      4     4  magic              RECORD_MAGIC (high 3 bytes: "clm", low byte: version)
      8     4  crc32c             CRC32C of bytes [12, total_size)
     12     8  commitlog_offset   physical offset of this record in the log
     20     8  queue_offset       position in its (topic, queue)
     28     4  queue_id
     32     4  flags              opaque to the store, carried for the application
     36     8  born_timestamp     ms since the epoch, set by the producer
     44     8  store_timestamp    ms since the epoch, set by the store at append
     52    16  born_host          IPv6 address (IPv4 as ::ffff:a.b.c.d)
     68     2  born_port
     70    16  store_host
     86     2  store_port
     88     4  reconsume_times
     92     2  topic_length       bytes of UTF-8
     94     2  tags_length
     96     2  keys_length
     98     4  properties_length
    102     4  body_length
    106     -  topic, tags, keys, properties, body (in that order)

``properties`` is a string map encoded as repeated ``u16 key length, key, u32 value
length, value`` (UTF-8), so any characters are allowed in keys and values.

A segment that cannot hold the next record ends with a *blank marker*: 8 bytes
``u32 remaining, u32 BLANK_MAGIC`` where ``remaining`` is the number of bytes from the
marker to the end of the segment. No record ever crosses a segment.
"""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Mapping

import crc32c as _crc32c

from ._compiled import COMPILED as _COMPILED
from ._errors import CorruptRecordError

FORMAT_VERSION = 1
RECORD_MAGIC = 0x636C6D00 | FORMAT_VERSION  # b"clm" + version
BLANK_MAGIC = 0x636C6DFF  # b"clm" + 0xFF: end-of-segment filler

HEADER = struct.Struct("<IIIQQIIQQ16sH16sHIHHHII")
HEADER_SIZE = HEADER.size
BLANK = struct.Struct("<II")
BLANK_SIZE = BLANK.size
CRC_START = 12  # the CRC covers everything after its own field

# Offsets of single fields, for readers that pick columns straight out of a buffer
# (the dispatcher, recovery and the vectorised Spark reader).
OFF_TOTAL_SIZE = 0
OFF_MAGIC = 4
OFF_CRC = 8
OFF_COMMITLOG_OFFSET = 12
OFF_QUEUE_OFFSET = 20
OFF_QUEUE_ID = 28
OFF_FLAGS = 32
OFF_BORN_TS = 36
OFF_STORE_TS = 44
OFF_BORN_HOST = 52
OFF_BORN_PORT = 68
OFF_STORE_HOST = 70
OFF_STORE_PORT = 86
OFF_RECONSUME = 88
OFF_TOPIC_LEN = 92
OFF_TAGS_LEN = 94
OFF_KEYS_LEN = 96
OFF_PROPS_LEN = 98
OFF_BODY_LEN = 102

assert HEADER_SIZE == 106, HEADER_SIZE
assert BLANK_SIZE == 8
assert struct.calcsize("<IIIQQIIQQ16sH16sHIHHH") == OFF_PROPS_LEN
assert struct.calcsize("<IIIQQIIQQ16sH16sHIHHHI") == OFF_BODY_LEN

MAX_TOPIC_BYTES = 255
MAX_TAGS_BYTES = 0xFFFF
MAX_KEYS_BYTES = 0xFFFF

Host = tuple[str, int]
NO_HOST: Host = ("0.0.0.0", 0)

_PROP_KEY = struct.Struct("<H")
_PROP_VALUE = struct.Struct("<I")


@dataclass(slots=True)
class Message:
    """A message as a producer hands it to the store (before it has offsets)."""

    topic: str
    queue_id: int
    body: bytes
    tags: str = ""
    keys: str = ""
    properties: Mapping[str, str] = field(default_factory=dict)
    flags: int = 0
    born_timestamp_ms: int = 0  # 0: the store uses the append time
    born_host: Host = NO_HOST
    reconsume_times: int = 0


@dataclass(slots=True)
class Record:
    """A message as stored: everything in :class:`Message` plus where and when.

    Not frozen on purpose: a frozen dataclass sets each field through
    ``object.__setattr__``, which made building a record 8 times slower (1.5 us against
    0.2 us), and consumers build one per message. Treat records as read-only.
    """

    topic: str
    queue_id: int
    queue_offset: int
    commitlog_offset: int
    size: int
    body: bytes
    tags: str
    keys: str
    properties: dict[str, str]
    flags: int
    born_timestamp_ms: int
    store_timestamp_ms: int
    born_host: Host
    store_host: Host
    reconsume_times: int


@lru_cache(maxsize=4096)
def encode_host(host: Host) -> tuple[bytes, int]:
    """``(ip, port)`` -> 16 address bytes and the port (IPv4 is stored IPv4-mapped)."""
    addr = ipaddress.ip_address(host[0])
    if isinstance(addr, ipaddress.IPv4Address):
        addr = ipaddress.IPv6Address(b"\0" * 10 + b"\xff\xff" + addr.packed)
    return addr.packed, host[1]


@lru_cache(maxsize=4096)
def decode_host(packed: bytes, port: int) -> Host:
    addr = ipaddress.IPv6Address(packed)
    mapped = addr.ipv4_mapped
    return (str(mapped) if mapped is not None else str(addr), port)


def encode_properties(props: Mapping[str, str]) -> bytes:
    if not props:
        return b""
    out = bytearray()
    for key, value in props.items():
        kb, vb = key.encode(), value.encode()
        if len(kb) > 0xFFFF:
            raise ValueError(f"property key of {len(kb)} bytes exceeds 65535")
        out += _PROP_KEY.pack(len(kb)) + kb + _PROP_VALUE.pack(len(vb)) + vb
    return bytes(out)


def record_size(m: Message) -> int:
    """The bytes ``m`` takes as a record (compare with ``max_message_bytes``)."""
    props = encode_properties(m.properties) if m.properties else b""
    return HEADER_SIZE + len(m.topic.encode()) + len(m.tags.encode()) + len(m.keys.encode()) + len(props) + len(m.body)


def check_properties(data: bytes | memoryview) -> None:
    """Raise ValueError (or struct.error) unless ``data`` is a valid property encoding.
    ASCII, the usual case, needs only its lengths walked: every length is then below
    128 and every text valid UTF-8 (no string is built); otherwise it is decoded."""
    if _COMPILED is not None and _COMPILED.props_ok(data):  # all ASCII and walks exactly: nothing to say
        return
    raw = bytes(data)
    if not raw.isascii():
        decode_properties(raw)
        return
    pos, end = 0, len(raw)
    key_len, value_len = _PROP_KEY.unpack_from, _PROP_VALUE.unpack_from
    while pos < end:
        pos += 2 + key_len(raw, pos)[0]
        pos += 4 + value_len(raw, pos)[0]
    if pos != end:
        raise ValueError("properties run past their length")


def fill_crcs(data: bytearray, starts: list[int], ends: list[int]) -> None:
    """Write each record's CRC32C (of ``data[s + CRC_START : e]``, at ``s + OFF_CRC``)
    for the records ``[s, e)`` of ``data``: the last step of encoding them."""
    if _COMPILED is not None:
        _COMPILED.fill_crcs(data, starts, ends)
        return
    view, crc, pack_into = memoryview(data), _crc32c.crc32c, _CRC.pack_into
    try:
        for s, e in zip(starts, ends):
            pack_into(data, s + OFF_CRC, crc(view[s + CRC_START : e]))
    finally:
        view.release()


_CRC = struct.Struct("<I")


def decode_properties(data: bytes | memoryview) -> dict[str, str]:
    props: dict[str, str] = {}
    pos, end = 0, len(data)
    key_len, value_len = _PROP_KEY.unpack_from, _PROP_VALUE.unpack_from
    while pos < end:
        (klen,) = key_len(data, pos)
        pos += 2
        key = str(data[pos : pos + klen], "utf-8")  # bytes or a memoryview: decoded without a copy
        pos += klen
        (vlen,) = value_len(data, pos)
        pos += 4
        props[key] = str(data[pos : pos + vlen], "utf-8")
        pos += vlen
    if pos != end:
        raise ValueError("properties run past their length")
    return props


def check_record(data: bytes | memoryview, pos: int, where: str, offset: int) -> int:
    """Validate the record at ``data[pos:]`` (size bounds, magic, CRC); return its size.

    ``where`` names the file and ``offset`` the log offset, so that the error says
    exactly which bytes are bad.
    """
    avail = len(data) - pos
    if avail < HEADER_SIZE:
        raise CorruptRecordError(where, offset, "record header", f">= {HEADER_SIZE} bytes", f"{avail} bytes")
    size: int  # struct gives Any; a local annotation costs nothing at run time
    size, magic, crc = struct.unpack_from("<III", data, pos)
    if magic != RECORD_MAGIC:
        raise CorruptRecordError(where, offset, "magic", hex(RECORD_MAGIC), hex(magic))
    if size < HEADER_SIZE or size > avail:
        raise CorruptRecordError(where, offset, "total size", f"{HEADER_SIZE}..{avail}", str(size))
    lengths = struct.unpack_from("<HHHII", data, pos + OFF_TOPIC_LEN)
    if HEADER_SIZE + sum(lengths) != size:
        raise CorruptRecordError(where, offset, "field lengths", str(size - HEADER_SIZE), str(sum(lengths)))
    actual = _crc32c.crc32c(memoryview(data)[pos + CRC_START : pos + size])
    if actual != crc:
        raise CorruptRecordError(where, offset, "crc32c", hex(crc), hex(actual))
    return size


def decode_record(data: bytes | memoryview, pos: int = 0, where: str = "<buffer>", offset: int = -1) -> Record:
    """Decode and CRC-check the record at ``data[pos:]``."""
    check_record(data, pos, where, offset if offset >= 0 else pos)
    (
        size,
        _m,
        _c,
        cl_off,
        q_off,
        qid,
        flags,
        born_ts,
        store_ts,
        born_ip,
        born_port,
        store_ip,
        store_port,
        reconsume,
        tl,
        gl,
        kl,
        pl,
        bl,
    ) = HEADER.unpack_from(data, pos)
    mv = memoryview(data)
    p = pos + HEADER_SIZE
    topic = bytes(mv[p : p + tl]).decode()
    p += tl
    tags = bytes(mv[p : p + gl]).decode()
    p += gl
    keys = bytes(mv[p : p + kl]).decode()
    p += kl
    props = decode_properties(mv[p : p + pl])
    p += pl
    body = bytes(mv[p : p + bl])
    return Record(
        topic=topic,
        queue_id=qid,
        queue_offset=q_off,
        commitlog_offset=cl_off,
        size=size,
        body=body,
        tags=tags,
        keys=keys,
        properties=props,
        flags=flags,
        born_timestamp_ms=born_ts,
        store_timestamp_ms=store_ts,
        born_host=decode_host(born_ip, born_port),
        store_host=decode_host(store_ip, store_port),
        reconsume_times=reconsume,
    )


def encode_blank(remaining: int) -> bytes:
    return BLANK.pack(remaining, BLANK_MAGIC)

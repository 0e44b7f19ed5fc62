"""The record format: round trips, CRC coverage, and the layout stated in the docstring."""

from __future__ import annotations

import ipaddress
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clmq.commitlog import encode_message
from clmq.common import HEADER_SIZE, RECORD_MAGIC, CorruptRecordError, Message, decode_record
from clmq.common._record import check_properties, decode_properties, encode_properties

text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)
hosts = st.one_of(
    st.tuples(st.ip_addresses(v=4).map(str), st.integers(0, 65535)),
    st.tuples(st.ip_addresses(v=6).map(str), st.integers(0, 65535)),
)
messages = st.builds(
    Message,
    topic=st.from_regex(r"[A-Za-z0-9_.%|-]{1,60}", fullmatch=True),
    queue_id=st.integers(0, 2**32 - 1),
    body=st.binary(max_size=3000),
    tags=text,
    keys=text,
    properties=st.dictionaries(text, text, max_size=5),
    flags=st.integers(0, 2**32 - 1),
    born_timestamp_ms=st.integers(1, 2**63 - 1),
    born_host=hosts,
    reconsume_times=st.integers(0, 2**32 - 1),
)


@given(messages, st.integers(0, 2**63), st.integers(0, 2**63), st.integers(0, 2**63), hosts)
@settings(max_examples=150, deadline=None)
def test_any_record_round_trips(
    msg: Message, cl_off: int, q_off: int, store_ts: int, store_host: tuple[str, int]
) -> None:
    data = encode_message(msg, cl_off, q_off, store_ts, store_host)
    rec = decode_record(data)
    assert rec.size == len(data)
    assert (rec.topic, rec.queue_id, rec.body, rec.tags, rec.keys) == (
        msg.topic,
        msg.queue_id,
        msg.body,
        msg.tags,
        msg.keys,
    )
    assert rec.properties == dict(msg.properties)
    assert (rec.flags, rec.born_timestamp_ms, rec.reconsume_times) == (
        msg.flags,
        msg.born_timestamp_ms,
        msg.reconsume_times,
    )
    assert (rec.commitlog_offset, rec.queue_offset, rec.store_timestamp_ms) == (cl_off, q_off, store_ts)
    assert (_same_ip(rec.born_host[0]), rec.born_host[1]) == (_same_ip(msg.born_host[0]), msg.born_host[1])
    assert (_same_ip(rec.store_host[0]), rec.store_host[1]) == (_same_ip(store_host[0]), store_host[1])


def _same_ip(ip: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """IPv4-mapped IPv6 addresses are the IPv4 address (the format stores both as IPv6)."""
    addr = ipaddress.ip_address(ip)
    mapped = getattr(addr, "ipv4_mapped", None)
    return mapped if mapped is not None else addr


@given(st.data())
@settings(max_examples=150, deadline=None)
def test_any_single_byte_change_is_detected(data: st.DataObject) -> None:
    msg = data.draw(messages)
    raw = bytearray(encode_message(msg, 10, 2, 3))
    pos = data.draw(st.integers(0, len(raw) - 1))
    raw[pos] ^= data.draw(st.integers(1, 255))
    with pytest.raises(CorruptRecordError) as info:
        decode_record(bytes(raw), 0, "seg-file", 10)
    assert info.value.file == "seg-file" and info.value.offset == 10
    assert "expected" in str(info.value)


def test_header_layout_matches_docstring() -> None:
    raw = encode_message(Message("tp", 7, b"BODY", tags="tg", keys="k"), 1000, 42, 5)
    size, magic = struct.unpack_from("<II", raw, 0)
    assert size == len(raw) == HEADER_SIZE + 2 + 2 + 1 + 0 + 4
    assert magic == RECORD_MAGIC
    assert struct.unpack_from("<QQI", raw, 12) == (1000, 42, 7)
    assert raw[HEADER_SIZE:] == b"tptgkBODY"


def test_truncated_record_is_reported_with_sizes() -> None:
    raw = encode_message(Message("tp", 0, b"x" * 50))
    with pytest.raises(CorruptRecordError, match="total size"):
        decode_record(raw[:-1], 0, "f", 0)


@given(
    st.one_of(
        st.binary(max_size=64),
        st.dictionaries(st.text(max_size=8), st.text(max_size=140), max_size=4).map(encode_properties),
        st.tuples(st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3), st.binary(max_size=4)).map(
            lambda kv: encode_properties(kv[0]) + kv[1]
        ),
    )
)
def test_the_quick_property_check_agrees_with_decoding(data: bytes) -> None:
    """check_properties (the appender's, fast for ASCII) accepts exactly what decodes."""
    try:
        decode_properties(data)
        decodes = True
    except (ValueError, struct.error):
        decodes = False
    try:
        check_properties(data)
        checks = True
    except (ValueError, struct.error):
        checks = False
    assert checks == decodes

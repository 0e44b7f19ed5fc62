"""The compiled decoder of fetched records (common/_cdecode.c) against the pure-Python
one (common/_many.py), its oracle: on random answers, valid or damaged anywhere, both
give the same records, or the compiled one declines (None) exactly where the Python one
raises; its CRC32C (hardware and table) against the crc32c package; it is built where a
C compiler is, and ``CLMQ_PURE_PYTHON=1`` turns it off."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
import sysconfig
from contextlib import contextmanager
from typing import Any, Iterator

import crc32c
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from clmq.commitlog._encoder import BatchEncoder, EncodeError
from clmq.common import (
    CorruptRecordError,
    Message,
    Record,
    _record,
    check_properties,
    encode_properties,
    fill_crcs,
    pack_messages,
)
from clmq.common._lazy import LazyRecord
from clmq.common._many import COMPILED, decode_records_many, decode_records_python
from clmq.protocol._batch import PackedMessages


def _buildable() -> bool:
    """A C compiler and Python's headers: the install builds the compiled decoder."""
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(cc) is not None and os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))


# Without a compiler there is nothing to compare (the wheel's pure-Python decoder runs
# in every other test); with one, a decoder that was not built fails these tests.
pytestmark = pytest.mark.skipif(COMPILED is None and not _buildable(), reason="no C compiler: nothing was built")

# Slot reads that bypass LazyRecord's property: the encoded properties as decoded.
_PROPS_SLOT: Any = Record.__dict__["properties"]

texts = st.text(max_size=12)
hosts = st.one_of(
    st.tuples(st.ip_addresses(v=4).map(str), st.integers(0, 65535)),
    st.tuples(st.ip_addresses(v=6).map(str), st.integers(0, 65535)),
)
messages = st.builds(
    Message,
    st.just("t"),
    st.integers(0, 2**31 - 1),
    st.binary(max_size=300),
    texts,
    texts,
    st.dictionaries(texts, texts, max_size=3),
    st.integers(0, 2**32 - 1),
    st.integers(0, 2**63 - 1),
)


def stored(groups: list[tuple[str, list[Message], tuple[str, int]]], store_host: tuple[str, int]) -> bytes:
    """Records as a broker stores (and sends) them: each group a topic, its messages and their born host."""
    encoder = BatchEncoder(1 << 30, 1 << 24, store_host)
    out = b""
    for topic, msgs, born in groups:
        packed = PackedMessages(topic, pack_messages([m for m in msgs]), born)
        batch = encoder.encode_packed([packed], [1 << 40], len(out), 7, {}, {}, 3)
        out += b"".join(bytes(g.data) for g in batch.groups)
    return out


answers = st.builds(
    stored,
    st.lists(
        st.tuples(st.sampled_from(["t", "orders", "ü"]), st.lists(messages, min_size=1, max_size=6), hosts), max_size=4
    ),
    hosts,
)


def assert_same(data: bytes) -> None:
    """Both decoders agree: the same records, or the compiled one returns None where Python raises."""
    try:
        want: list[Record] | None = decode_records_python(data, "answer")
    except CorruptRecordError:
        want = None
    assert COMPILED is not None
    got = COMPILED.decode(data)
    if want is None:
        assert got is None
        return
    assert got is not None
    assert [type(r) for r in got] == [LazyRecord] * len(want)
    assert [_PROPS_SLOT.__get__(r) for r in got] == [_PROPS_SLOT.__get__(r) for r in want]  # still encoded
    assert got == want
    assert [r.properties for r in got] == [r.properties for r in want]


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(answers)
@example(b"")
def test_valid_answers_decode_to_the_same_records(data: bytes) -> None:
    assert_same(data)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(answers.filter(bool), st.data())
def test_damage_anywhere_is_declined_where_python_reports_it(data: bytes, draw: st.DataObject) -> None:
    damaged = bytearray(data)
    how = draw.draw(st.sampled_from(["flip", "cut", "append"]))
    if how == "flip":
        for _ in range(draw.draw(st.integers(1, 3))):
            at = draw.draw(st.integers(0, len(damaged) - 1))
            damaged[at] ^= draw.draw(st.integers(1, 255))
    elif how == "cut":
        del damaged[draw.draw(st.integers(0, len(damaged) - 1)) :]
    else:
        damaged += draw.draw(st.binary(min_size=1, max_size=200))
    assert_same(bytes(damaged))
    try:
        expected = decode_records_python(bytes(damaged))
    except CorruptRecordError as e:
        with pytest.raises(CorruptRecordError, match=str(e.args[0])[:20] if e.args else ""):
            decode_records_many(bytes(damaged))  # the public function raises what Python says
    else:
        assert decode_records_many(bytes(damaged)) == expected


def test_text_that_is_not_utf8_is_declined() -> None:
    data = bytearray(stored([("t", [Message("t", 0, b"x", "ab")], ("127.0.0.1", 1))], ("127.0.0.1", 2)))
    at = bytes(data).index(b"ab", 106)
    data[at] = 0xFF  # the tag's first byte: invalid UTF-8, CRC fixed so that only the text is wrong
    data[8:12] = crc32c.crc32c(bytes(data[12:])).to_bytes(4, "little")
    assert COMPILED is not None and COMPILED.decode(bytes(data)) is None
    with pytest.raises(UnicodeDecodeError):
        decode_records_python(bytes(data))


@given(st.binary(max_size=2000))
def test_its_crc32c_is_crc32c(data: bytes) -> None:
    assert COMPILED is not None
    assert COMPILED.crc32c(data) == COMPILED.crc32c(data, True) == crc32c.crc32c(data)


def test_records_live_on_when_the_answer_is_gone() -> None:
    data = stored(
        [("t", [Message("t", 1, b"body %d" % i, properties={"k": "v"}) for i in range(50)], ("::1", 9))],
        ("10.0.0.1", 3),
    )
    assert COMPILED is not None
    records = COMPILED.decode(bytearray(data))  # any buffer; the records copy what they hold
    del data
    assert [r.body for r in records] == [b"body %d" % i for i in range(50)]
    assert records[0].born_host == ("::1", 9) and records[0].store_host == ("10.0.0.1", 3)


def test_the_compiled_decoder_is_built_and_used() -> None:
    assert COMPILED is not None, "a C compiler and Python.h are here, but clmq.common._cdecode was not built"
    data = stored([("t", [Message("t", 0, b"x")], ("127.0.0.1", 1))], ("127.0.0.1", 2))
    assert type(decode_records_many(data)[0]) is LazyRecord


def test_clmq_pure_python_turns_it_off() -> None:
    code = "from clmq.common._many import COMPILED, decode_records_many as d; print(COMPILED is None, d(b''))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={"CLMQ_PURE_PYTHON": "1"}, check=True
    )
    assert out.stdout.split() == ["True", "[]"]


property_maps = st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=4)


@given(st.one_of(property_maps.map(encode_properties), st.binary(max_size=40)))
def test_props_ok_only_passes_what_the_python_check_passes_and_passes_every_ascii_map(raw: bytes) -> None:
    assert COMPILED is not None
    try:
        check_properties_python(raw)
        valid = True
    except (ValueError, struct.error, UnicodeDecodeError):
        valid = False
    if COMPILED.props_ok(raw):
        assert valid
    elif valid:
        assert not raw.isascii()  # the only valid maps it leaves to Python: non-ASCII text
    if valid:
        check_properties(raw)  # the public check agrees either way
    else:
        with pytest.raises((ValueError, struct.error, UnicodeDecodeError)):
            check_properties(raw)


@given(st.binary(min_size=12, max_size=600), st.lists(st.integers(12, 200), max_size=6))
def test_fill_crcs_writes_what_the_python_loop_writes(data: bytes, sizes: list[int]) -> None:
    starts, ends, at = [], [], 0
    for size in sizes:
        if at + size > len(data):
            break
        starts.append(at)
        ends.append(at + size)
        at += size
    compiled, python = bytearray(data), bytearray(data)
    fill_crcs(compiled, starts, ends)
    with _compiled_off():
        fill_crcs(python, starts, ends)
    assert compiled == python
    for s, e in zip(starts, ends):
        assert int.from_bytes(compiled[s + 8 : s + 12], "little") == crc32c.crc32c(bytes(compiled[s + 12 : e]))


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(messages, min_size=1, max_size=12), st.sampled_from([2048, 4096, 1 << 20]), st.integers(0, 4000))
def test_the_broker_encodes_the_same_bytes_with_and_without_it(msgs: list[Message], segment: int, pos: int) -> None:
    # Segment rolls included: a batch that starts past the segment's room begins with a
    # group that is only a blank marker (the compiled CRC fill once failed on it).
    pos = min(pos, segment - 8)
    packed = [PackedMessages("t", pack_messages(msgs), ("10.1.2.3", 7))]

    def groups() -> list[tuple[int, bytes, list[int], bool]]:
        encoder = BatchEncoder(segment, 1 << 20, ("127.0.0.1", 9))
        try:
            batch = encoder.encode_packed(packed, [1 << 40], 0, pos, {}, {}, 3)
        except EncodeError as e:
            return [(-1, str(e).encode(), [], False)]
        return [(g.start, bytes(g.data), list(g.starts), g.sealed) for g in batch.groups]

    with_it = groups()
    with _compiled_off():
        without = groups()
    assert with_it == without


@contextmanager
def _compiled_off() -> Iterator[None]:
    """The record format's pure-Python paths (fill_crcs, check_properties)."""
    was = _record._COMPILED
    _record._COMPILED = None
    try:
        yield
    finally:
        _record._COMPILED = was


def check_properties_python(raw: bytes) -> None:
    with _compiled_off():
        check_properties(raw)

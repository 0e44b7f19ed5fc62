"""Kafka's record batch v2 (clmq.protocol.kafka._records), against kafka-python and aiokafka.

kafka-python reads and writes gzip and snappy here (python-snappy over cramjam); aiokafka
(its own record code, in Cython) all four codecs. Batches go both ways between them and
ours; Hypothesis generates records and corrupts batches, which must fail as RecordsError
with the Kafka error code a broker would answer, and nothing else.
"""

from __future__ import annotations

import struct
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiokafka.record.default_records as aiokafka_records
import cramjam
import kafka.codec
import kafka.record.default_records as kafka_records
import pytest
from crc32c import crc32c
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kafka.record.legacy_records import LegacyRecordBatchBuilder

from clmq.protocol.kafka._compression import XERIAL_HEADER, compress
from clmq.protocol.kafka._records import (
    CORRUPT_MESSAGE,
    INVALID_RECORD,
    MESSAGE_TOO_LARGE,
    UNSUPPORTED_COMPRESSION_TYPE,
    UNSUPPORTED_FOR_MESSAGE_FORMAT,
    Compression,
    KafkaRecord,
    RecordBatch,
    RecordsError,
    batch_header_info,
    build_batch,
    parse_batches,
)

Headers = list[tuple[str, bytes | None]]
Rec = tuple[int, bytes | None, bytes | None, Headers]

MiB = 1 << 20
LIMIT = 16 * MiB
CODECS = list(Compression)
_KAFKA_PYTHON_HAS = {
    Compression.NONE: True,
    Compression.GZIP: kafka.codec.has_gzip(),
    Compression.SNAPPY: kafka.codec.has_snappy(),
    Compression.LZ4: kafka.codec.has_lz4(),
    Compression.ZSTD: kafka.codec.has_zstd(),
}
KAFKA_PYTHON_CODECS = [codec for codec, present in _KAFKA_PYTHON_HAS.items() if present]
CODES = {
    CORRUPT_MESSAGE,
    INVALID_RECORD,
    MESSAGE_TOO_LARGE,
    UNSUPPORTED_COMPRESSION_TYPE,
    UNSUPPORTED_FOR_MESSAGE_FORMAT,
}
FAST = settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


# -------------------------------------------------------------------------- helpers
def as_tuples(records: Sequence[KafkaRecord]) -> list[tuple[int, int, bytes | None, bytes | None, Headers]]:
    return [(r.offset, r.timestamp, r.key, r.value, list(r.headers)) for r in records]


def oracle_read(module: Any, data: bytes) -> list[tuple[int, int, bytes | None, bytes | None, Headers]]:
    """The records of one batch as kafka-python or aiokafka reads them."""
    batch = module.DefaultRecordBatch(bytes(data))
    assert batch.validate_crc()
    return [(r.offset, r.timestamp, r.key, r.value, list(r.headers)) for r in batch]


def oracle_build(module: Any, codec: Compression, records: Sequence[Rec]) -> bytes:
    builder = module.DefaultRecordBatchBuilder(2, int(codec), 0, -1, -1, -1, 1 << 30)
    for delta, (timestamp, key, value, headers) in enumerate(records):
        assert builder.append(delta, timestamp, key, value, list(headers)) is not None
    return bytes(builder.build())


def expected(base_offset: int, records: Sequence[Rec]) -> list[tuple[int, int, bytes | None, bytes | None, Headers]]:
    return [(base_offset + i, ts, k, v, list(h)) for i, (ts, k, v, h) in enumerate(records)]


def reseal(batch: bytes | bytearray) -> bytes:
    """The batch with its length and CRC made right again: a corruption only the record checks can see."""
    out = bytearray(batch)
    struct.pack_into(">i", out, 8, len(out) - 12)
    struct.pack_into(">I", out, 17, crc32c(bytes(out[21:])))
    return bytes(out)


def raw_batch(payload: bytes, *, count: int, attributes: int = 0, last_delta: int | None = None) -> bytes:
    """A batch written from the spec around ``payload`` (records, maybe compressed), independent of build_batch."""
    last = count - 1 if last_delta is None else last_delta
    after_crc = struct.pack(">hiqqqhii", attributes, last, 1000, 1000, -1, -1, -1, count) + payload
    return struct.pack(">qiibI", 0, 49 + len(payload), -1, 2, crc32c(after_crc)) + after_crc


def zigzag(value: int) -> bytes:
    raw, out = (value << 1) ^ (value >> 63), bytearray()
    while raw >= 0x80:
        out.append((raw & 0x7F) | 0x80)
        raw >>= 7
    return bytes(out + bytes([raw]))


def raw_record(body: bytes) -> bytes:
    return zigzag(len(body)) + body


def parse_error(data: bytes, limit: int = LIMIT) -> RecordsError:
    with pytest.raises(RecordsError) as info:
        parse_batches(data, max_uncompressed_bytes=limit)
    return info.value


SAMPLE: list[Rec] = [
    (1_700_000_000_000, b"key", b"value", []),
    (1_700_000_000_005, None, b"", [("trace", b"t1"), ("trace", None), ("", b"")]),
    (1_699_999_999_000, b"", None, [("ключ", b"\x00\xff")]),
]


# ---------------------------------------------------------------------- strategies
header_names = st.sampled_from(["a", "b", "trace-id", "", "ключ"]) | st.text(
    st.characters(exclude_categories=["Cs"]), max_size=8
)
header_lists = st.lists(st.tuples(header_names, st.none() | st.binary(max_size=20)), max_size=4)
blobs = st.none() | st.binary(max_size=200)
record_lists = st.lists(
    st.tuples(st.integers(0, 1 << 50) | st.integers(0, 3), blobs, blobs, header_lists), min_size=1, max_size=12
)


# ------------------------------------------------------------------------- golden
GOLDEN = bytes.fromhex(
    "0000000000000000"  # base offset 0
    "0000003a"  # batch length 58 = 49 + one 9-byte record
    "ffffffff"  # partition leader epoch -1
    "02"  # magic 2
    "716a6189"  # crc32c of the attributes .. end
    "0000"  # attributes: no compression, CreateTime
    "00000000"  # last offset delta 0
    "00000000000003e8"  # base timestamp 1000
    "00000000000003e8"  # max timestamp 1000
    "ffffffffffffffff"  # producer id -1
    "ffff"  # producer epoch -1
    "ffffffff"  # base sequence -1
    "00000001"  # one record
    "10"  # record length 8 (zig-zag 16)
    "00"  # record attributes
    "00"  # timestamp delta 0
    "00"  # offset delta 0
    "02"  # key length 1
    "6b"  # "k"
    "02"  # value length 1
    "76"  # "v"
    "00"  # no headers
)


def test_golden_batch_is_what_the_spec_says_both_ways() -> None:
    assert crc32c(GOLDEN[21:]) == 0x716A6189
    assert build_batch(0, [(1000, b"k", b"v", [])]) == GOLDEN
    [batch] = parse_batches(GOLDEN, max_uncompressed_bytes=0)
    assert batch == RecordBatch(0, -1, 0, 0, 1000, 1000, -1, -1, -1, [KafkaRecord(0, 1000, b"k", b"v", [])])
    assert oracle_build(aiokafka_records, Compression.NONE, [(1000, b"k", b"v", [])]) == GOLDEN


# ------------------------------------------------------------------ the oracles
@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
def test_aiokafka_reads_ours_and_we_read_aiokafkas(codec: Compression) -> None:
    ours = build_batch(42, SAMPLE, compression=codec)
    assert oracle_read(aiokafka_records, ours) == expected(42, SAMPLE)
    theirs = oracle_build(aiokafka_records, codec, SAMPLE)
    [batch] = parse_batches(theirs, max_uncompressed_bytes=LIMIT)
    assert as_tuples(batch.records) == expected(0, SAMPLE)
    assert batch.compression == codec


@pytest.mark.parametrize("codec", KAFKA_PYTHON_CODECS, ids=lambda c: c.name)
def test_kafka_python_reads_ours_and_we_read_kafka_pythons(codec: Compression) -> None:
    ours = build_batch(7, SAMPLE, compression=codec)
    assert oracle_read(kafka_records, ours) == expected(7, SAMPLE)
    theirs = oracle_build(kafka_records, codec, SAMPLE)
    [batch] = parse_batches(theirs, max_uncompressed_bytes=LIMIT)
    assert as_tuples(batch.records) == expected(0, SAMPLE)


def test_kafka_python_has_at_least_gzip_and_snappy_here() -> None:
    # The other codecs need C packages (lz4, zstandard) kafka-python finds absent: aiokafka covers them.
    assert {Compression.NONE, Compression.GZIP, Compression.SNAPPY} <= set(KAFKA_PYTHON_CODECS)


@FAST
@given(records=record_lists, codec=st.sampled_from(CODECS), base=st.integers(0, 1 << 62))
def test_generated_records_round_trip_through_both_implementations(
    records: list[Rec], codec: Compression, base: int
) -> None:
    ours = build_batch(base, records, compression=codec)
    [batch] = parse_batches(ours, max_uncompressed_bytes=LIMIT)
    assert as_tuples(batch.records) == expected(base, records)
    assert batch.base_timestamp == records[0][0]
    assert batch.max_timestamp == max(r[0] for r in records)
    assert oracle_read(aiokafka_records, ours) == expected(base, records)
    [theirs] = parse_batches(oracle_build(aiokafka_records, codec, records), max_uncompressed_bytes=LIMIT)
    assert as_tuples(theirs.records) == expected(0, records)
    if codec in KAFKA_PYTHON_CODECS:
        assert oracle_read(kafka_records, ours) == expected(base, records)


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
def test_long_varints_many_records_and_large_values(codec: Compression) -> None:
    # Lengths and deltas on both sides of the 1-, 2- and 3-byte varint and of build's 16 KiB table.
    sizes = [0, 63, 64, 8191, 8192, 16383, 16384, 70_000]
    records: list[Rec] = [(i * 1_000_003 - 5_000_000, b"k" * (i % 70), bytes(sizes[i % 8]), []) for i in range(300)]
    records.append((-(1 << 62), None, b"x" * 200_000, [("h" * 100, b"v" * 9000)] * 3))
    ours = build_batch(1 << 40, records, compression=codec)
    [batch] = parse_batches(ours, max_uncompressed_bytes=LIMIT)
    assert as_tuples(batch.records) == expected(1 << 40, records)
    assert oracle_read(aiokafka_records, ours) == expected(1 << 40, records)


def test_header_fields_and_flags_reach_the_other_implementation() -> None:
    data = build_batch(
        10,
        SAMPLE,
        producer_id=99,
        producer_epoch=3,
        base_sequence=17,
        partition_leader_epoch=5,
        transactional=True,
        log_append_time=True,
    )
    theirs = aiokafka_records.DefaultRecordBatch(data)
    assert (theirs.producer_id, theirs.producer_epoch, theirs.base_sequence) == (99, 3, 17)
    assert theirs.is_transactional and theirs.timestamp_type == 1
    [batch] = parse_batches(data, max_uncompressed_bytes=LIMIT)
    assert (batch.producer_id, batch.producer_epoch, batch.base_sequence, batch.partition_leader_epoch) == (
        99,
        3,
        17,
        5,
    )
    assert batch.is_transactional and not batch.is_control and batch.timestamp_type == 1
    assert (batch.record_count, batch.last_offset_delta, batch.compression) == (3, 2, Compression.NONE)
    assert batch.max_timestamp == 1_700_000_000_005


def test_build_refuses_an_empty_batch() -> None:
    with pytest.raises(ValueError):
        build_batch(0, [])


def test_several_batches_in_one_blob_and_header_info() -> None:
    first = build_batch(0, SAMPLE)
    second = build_batch(3, SAMPLE[:1], compression=Compression.ZSTD)
    blob = first + second
    assert [b.base_offset for b in parse_batches(blob, max_uncompressed_bytes=LIMIT)] == [0, 3]
    assert batch_header_info(blob, 0) == (0, len(first))
    assert batch_header_info(blob, len(first)) == (3, len(second))
    assert batch_header_info(blob[:-1], len(first)) is None
    assert batch_header_info(blob, len(blob) - 5) is None
    assert parse_batches(b"", max_uncompressed_bytes=LIMIT) == []


# --------------------------------------------------------------- codec formats
def test_lz4_frames_are_what_the_java_client_accepts() -> None:
    frame = build_batch(0, SAMPLE * 100, compression=Compression.LZ4)[61:]
    assert frame[:4] == b"\x04\x22\x4d\x18"
    flg, bd = frame[4], frame[5]
    # Lz4BlockInputStream: version 01, independent blocks, reserved bits 0, block size code 4..7.
    assert (flg >> 6, (flg >> 5) & 1, flg & 3) == (1, 1, 0)
    assert 4 <= (bd >> 4) & 7 <= 7 and bd & 0x8F == 0


def test_snappy_is_written_xerial_and_read_xerial_or_raw() -> None:
    data = build_batch(0, SAMPLE, compression=Compression.SNAPPY)
    assert data[61:77] == XERIAL_HEADER == b"\x82SNAPPY\x00\x00\x00\x00\x01\x00\x00\x00\x01"
    records = build_batch(0, SAMPLE)[61:]
    raw = raw_batch(bytes(cramjam.snappy.compress_raw(records)), count=3, attributes=Compression.SNAPPY)
    assert as_tuples(parse_batches(raw, max_uncompressed_bytes=LIMIT)[0].records)[0][2] == b"key"


# ---------------------------------------------------------------------- faults
def valid_batches() -> list[bytes]:
    return [build_batch(5, SAMPLE, compression=codec) for codec in CODECS]


VALID = valid_batches()


@FAST
@given(which=st.integers(0, len(VALID) - 1), data=st.data())
def test_flipped_bytes_fail_as_records_errors(which: int, data: st.DataObject) -> None:
    batch = bytearray(VALID[which])
    positions = data.draw(st.lists(st.integers(0, len(batch) - 1), min_size=1, max_size=3, unique=True))
    for position in positions:
        batch[position] ^= data.draw(st.integers(1, 255))
    try:
        parse_batches(bytes(batch), max_uncompressed_bytes=LIMIT)
    except RecordsError as exc:
        assert exc.error_code in CODES
    else:  # only the fields the CRC does not cover may change unnoticed: base offset and leader epoch
        assert all(p < 8 or 12 <= p < 16 for p in positions)


@FAST
@given(which=st.integers(0, len(VALID) - 1), cut=st.integers(1, 10_000))
def test_a_truncated_blob_is_corrupt(which: int, cut: int) -> None:
    blob = VALID[which] + VALID[0]
    cut %= len(blob)
    if cut in (0, len(VALID[which])):
        return
    assert parse_error(blob[:cut]).error_code == CORRUPT_MESSAGE


@FAST
@given(which=st.integers(0, len(VALID) - 1), data=st.data())
def test_resealed_corruption_is_refused_cleanly(which: int, data: st.DataObject) -> None:
    # The CRC made right after the change: the length, record and codec checks must catch it alone.
    batch = bytearray(VALID[which])
    for _ in range(data.draw(st.integers(1, 4))):
        batch[data.draw(st.integers(21, len(batch) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(61, len(batch)))
    try:
        parse_batches(reseal(batch[:cut]), max_uncompressed_bytes=LIMIT)
    except RecordsError as exc:
        assert exc.error_code in CODES


@FAST
@given(payload=st.binary(max_size=80), count=st.integers(-2, 20), codec=st.sampled_from(CODECS))
def test_random_record_bytes_under_a_valid_crc_are_refused_cleanly(
    payload: bytes, count: int, codec: Compression
) -> None:
    try:
        parse_batches(raw_batch(payload, count=count, attributes=codec), max_uncompressed_bytes=LIMIT)
    except RecordsError as exc:
        assert exc.error_code in CODES


RECORDS = build_batch(0, SAMPLE)[61:]


@FAST
@given(codec=st.sampled_from(CODECS[1:]), data=st.data())
def test_corrupt_records_inside_a_good_compressed_stream_are_invalid_records(
    codec: Compression, data: st.DataObject
) -> None:
    # The codec's own checks pass: only the record checks on the decompressed bytes can refuse these.
    records = bytearray(RECORDS)
    for _ in range(data.draw(st.integers(1, 3))):
        records[data.draw(st.integers(0, len(records) - 1))] = data.draw(st.integers(0, 255))
    records = records[: data.draw(st.integers(0, len(records)))]
    batch = raw_batch(bytes(compress(codec, records)), count=3, attributes=codec)
    try:
        [parsed] = parse_batches(batch, max_uncompressed_bytes=LIMIT)
    except RecordsError as exc:
        assert exc.error_code == INVALID_RECORD, str(exc)
    else:
        assert parsed.record_count == 3


def test_crc_mismatch_reports_expected_and_actual() -> None:
    batch = bytearray(GOLDEN)
    batch[-2] ^= 1  # in the value
    exc = parse_error(bytes(batch))
    assert exc.error_code == CORRUPT_MESSAGE
    actual = crc32c(bytes(batch[21:]))
    assert str(exc) == f"batch at byte 0: crc32c expected 0x716a6189 (crc field), actual 0x{actual:08x}"
    exc = parse_error(GOLDEN + bytes(batch))
    assert str(exc).startswith(f"batch at byte {len(GOLDEN)}: crc32c")


def test_legacy_magic_is_unsupported_for_message_format() -> None:
    for magic in (0, 1):
        builder = LegacyRecordBatchBuilder(magic=magic, compression_type=0, batch_size=1 << 20)
        builder.append(0, timestamp=1000 if magic else None, key=b"k", value=b"v")
        exc = parse_error(bytes(builder.build()))
        assert exc.error_code == UNSUPPORTED_FOR_MESSAGE_FORMAT
        assert f"magic expected 2, actual {magic}" in str(exc)
    exc = parse_error(GOLDEN[:16] + b"\x03" + GOLDEN[17:])
    assert exc.error_code == CORRUPT_MESSAGE


def test_lengths_that_lie_are_corrupt() -> None:
    too_short = GOLDEN[:8] + struct.pack(">i", 48) + GOLDEN[12:]
    assert "batch length expected at least 49, actual 48" in str(parse_error(too_short))
    too_long = GOLDEN[:8] + struct.pack(">i", 59) + GOLDEN[12:]
    assert "batch length says 59 bytes follow, actual 58" in str(parse_error(too_long))
    assert parse_error(GOLDEN + GOLDEN[:11]).error_code == CORRUPT_MESSAGE  # a trailing partial batch
    assert "batch at byte 70: 5 trailing bytes" in str(parse_error(GOLDEN + b"\x00" * 5))


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
def test_record_counts_that_lie_are_invalid_records(codec: Compression) -> None:
    records = build_batch(0, SAMPLE)[61:]
    payload = bytes(build_batch(0, SAMPLE, compression=codec)[61:])
    for count in (2, 4):  # the count and last offset delta agree, the records do not
        exc = parse_error(raw_batch(payload, count=count, attributes=codec))
        assert exc.error_code == INVALID_RECORD, str(exc)
    exc = parse_error(raw_batch(payload, count=3, last_delta=3, attributes=codec))
    assert "record count 3 and last offset delta 3 disagree" in str(exc)
    assert parse_error(raw_batch(records, count=0)).error_code == INVALID_RECORD
    assert "record count 1000 cannot fit" in str(parse_error(raw_batch(records, count=1000)))


def test_malformed_records_under_a_valid_crc_are_invalid_records() -> None:
    good = b"\x00\x00\x00\x02k\x02v\x00"
    cases = {
        "offset delta expected 1, actual 2": raw_record(good) + raw_record(b"\x00\x00\x04\x02k\x02v\x00"),
        "negative length -2": raw_record(b"\x00\x00\x00\x03\x02v\x00"),
        "length expected 9, actual 8": raw_record(good + b"\x00"),
        "not UTF-8": raw_record(b"\x00\x00\x00\x01\x01\x02\x04\xff\xfe\x01"),
        "null or runs past": raw_record(b"\x00\x00\x00\x01\x01\x02\x01\x01"),
        "longer than 10 bytes": raw_record(b"\x00" + b"\xff" * 11 + b"\x00\x00\x01\x01\x00"),
        "header count 100": raw_record(b"\x00\x00\x00\x01\x01\xc8\x01\x00\x00"),
    }
    for message, payload in cases.items():
        count = 2 if message.startswith("offset delta") else 1
        exc = parse_error(raw_batch(payload, count=count))
        assert exc.error_code == INVALID_RECORD and message in str(exc), str(exc)


def test_unknown_codecs_are_unsupported_compression_types() -> None:
    for codec in (5, 6, 7):
        exc = parse_error(raw_batch(build_batch(0, SAMPLE)[61:], count=3, attributes=codec))
        assert exc.error_code == UNSUPPORTED_COMPRESSION_TYPE and f"codec {codec}" in str(exc)


@pytest.mark.parametrize("codec", CODECS[1:], ids=lambda c: c.name)
def test_payloads_that_do_not_decompress_are_corrupt(codec: Compression) -> None:
    exc = parse_error(raw_batch(b"\x00not compressed at all" * 3, count=1, attributes=codec))
    assert exc.error_code == CORRUPT_MESSAGE and "do not decompress" in str(exc)


def test_the_decompression_limit_is_for_the_whole_blob() -> None:
    big: list[Rec] = [(0, None, b"x" * 600_000, [])]
    one = build_batch(0, big, compression=Compression.ZSTD)
    assert len(parse_batches(one, max_uncompressed_bytes=MiB)) == 1
    exc = parse_error(one + one, limit=MiB)
    assert exc.error_code == MESSAGE_TOO_LARGE and exc.args[0].startswith(f"batch at byte {len(one)}:")


# A separate interpreter parses the bombs, so that its peak memory says what parsing them took.
BOMB_SCRIPT = """
import resource, sys
from pathlib import Path
from clmq.protocol.kafka._records import RecordsError, parse_batches
codes = []
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for path in sorted(Path(sys.argv[1]).glob("*.batch")):
    try:
        parse_batches(path.read_bytes(), max_uncompressed_bytes=1 << 20)
    except RecordsError as exc:
        codes.append(exc.error_code)
print(codes, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""


def test_decompression_bombs_are_too_large_without_the_memory(tmp_path: Path) -> None:
    zeros = bytes(100 * MiB)  # calloc'd: reading it maps the zero page, not 100 MiB
    payloads = {
        "gzip": (Compression.GZIP, cramjam.gzip.compress(zeros, level=1)),
        "zstd": (Compression.ZSTD, cramjam.zstd.compress(zeros, level=1)),
        "lz4": (Compression.LZ4, cramjam.lz4.compress(zeros)),
        "snappy-raw": (Compression.SNAPPY, cramjam.snappy.compress_raw(zeros)),
        "snappy-xerial": (Compression.SNAPPY, _xerial(zeros)),
    }
    for name, (codec, payload) in payloads.items():
        (tmp_path / f"{name}.batch").write_bytes(raw_batch(bytes(payload), count=1, attributes=codec))
    done = subprocess.run(
        [sys.executable, "-c", BOMB_SCRIPT, str(tmp_path)], capture_output=True, text=True, check=True
    )
    codes, grown_kib = done.stdout.split("]")
    assert codes + "]" == str([MESSAGE_TOO_LARGE] * 5)
    assert int(grown_kib) < 24 * 1024, f"parsing the bombs grew the peak memory by {grown_kib} KiB"


def _xerial(data: bytes) -> bytes:
    blocks = [cramjam.snappy.compress_raw(data[i : i + MiB]) for i in range(0, len(data), MiB)]
    return XERIAL_HEADER + b"".join(struct.pack(">i", len(b)) + bytes(b) for b in blocks)

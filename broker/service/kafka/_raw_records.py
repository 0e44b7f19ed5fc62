"""Stored records straight into Kafka record batches, for Fetch: the queue's records
as stored (one read per log-contiguous run, :meth:`StorageEngine.read_raw`), each
checked (magic, lengths, CRC-32C, queue and queue offset) and turned into a Kafka
record without building a :class:`Record` object (which cost more than the rest of a
fetch). Keys and tags are UTF-8 text in the store: their bytes are a Kafka key and a
``clmq.tags`` header value as they are."""

from __future__ import annotations

import os

import crc32c

from clmq.broker.store import RawRead
from clmq.commitlog import read_exactly
from clmq.common import CRC_START, HEADER, HEADER_SIZE, RECORD_MAGIC, CorruptRecordError, decode_properties
from clmq.protocol.kafka import Compression, build_batch

from ._mapping import KafkaRow, kafka_row


def span_bytes(read: RawRead) -> list[tuple[bytes, str, int]]:
    """Each span's bytes, with the file it is in and its position there."""
    out: list[tuple[bytes, str, int]] = []
    for span in read.spans:
        if span.data is not None:
            out.append((span.data, "<memory>", span.position))
            continue
        assert span.path is not None
        fd = os.open(span.path, os.O_RDONLY)
        try:
            out.append((read_exactly(fd, span.position, span.length, span.path), span.path, span.position))
        finally:
            os.close(fd)
    return out


def batches_of(
    read: RawRead, queue_id: int, first_offset: int, compression: Compression = Compression.NONE
) -> tuple[bytes, int]:
    """The records of ``read`` (queue ``queue_id`` from ``first_offset``) as Kafka
    batches (compressed with ``compression``), one per run of consecutive offsets; and
    how many records."""
    out: list[bytes] = []
    rows: list[KafkaRow] = []
    base = expected = first_offset
    count = 0
    for data, where, position in span_bytes(read):
        pos = 0
        while pos < len(data):
            offset, row, pos = _row(data, pos, where, position, queue_id)
            if rows and offset != expected:
                out.append(build_batch(base, rows, compression=compression))
                rows = []
            if not rows:
                base = offset
            rows.append(row)
            expected = offset + 1
            count += 1
    if rows:
        out.append(build_batch(base, rows, compression=compression))
    return b"".join(out), count


def _row(data: bytes, pos: int, where: str, position: int, queue_id: int) -> tuple[int, KafkaRow, int]:
    """The record at ``data[pos:]``: (queue offset, Kafka record, the next record's position)."""
    at = position + pos
    if len(data) - pos < HEADER_SIZE:
        raise CorruptRecordError(where, at, "record header", f">= {HEADER_SIZE} bytes", f"{len(data) - pos} bytes")
    (size, magic, crc, _cl, q_off, qid, _f, born, _st, _bi, _bp, _si, _sp, _r, tl, gl, kl, pl, bl) = HEADER.unpack_from(
        data, pos
    )
    if magic != RECORD_MAGIC:
        raise CorruptRecordError(where, at, "magic", hex(RECORD_MAGIC), hex(magic))
    end = pos + size
    if size != HEADER_SIZE + tl + gl + kl + pl + bl or end > len(data):
        raise CorruptRecordError(where, at, "total size", str(HEADER_SIZE + tl + gl + kl + pl + bl), str(size))
    actual = crc32c.crc32c(memoryview(data)[pos + CRC_START : end])
    if actual != crc:
        raise CorruptRecordError(where, at, "crc32c", hex(crc), hex(actual))
    if qid != queue_id:
        raise CorruptRecordError(where, at, "queue id", str(queue_id), str(qid))
    f = pos + HEADER_SIZE + tl
    if not pl and not gl:  # the usual message: no properties, no tags (kafka_row's first case, inline)
        keys = data[f : f + kl]
        return q_off, (born, keys or None, data[f + kl : end], []), end
    tags, keys = data[f : f + gl], data[f + gl : f + gl + kl]
    f += gl + kl
    props = decode_properties(data[f : f + pl]) if pl else {}
    return q_off, kafka_row(born, keys, tags, props, data[f + pl : end]), end

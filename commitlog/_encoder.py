"""Encoding a batch of messages into records, split at segment boundaries.

This is the per-message hot path, so it is one flat loop: per message a header pack
and a few list appends; the bytes are assembled by one ``b"".join`` per segment and
the CRCs are computed in a second pass over the finished buffer (they cover the
offsets, which are only known once the record's place is).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import crc32c as _crc32c

from ._record import (
    BLANK_SIZE, CRC_START, HEADER, HEADER_SIZE, MAX_KEYS_BYTES, MAX_TAGS_BYTES, MAX_TOPIC_BYTES, RECORD_MAGIC,
    Message, encode_blank, encode_host, encode_properties,
)  # fmt: skip

QueueKey = tuple[str, int]
_EMPTY: dict[str, bytes] = {"": b""}


class EncodeError(ValueError):
    """A message that cannot be encoded; ``too_large`` tells which limit it broke."""

    def __init__(self, message: str, too_large: bool = False) -> None:
        super().__init__(message)
        self.too_large = too_large


@dataclass
class Group:
    """The records of one batch that land in one segment."""

    start: int  # file position in that segment
    data: bytearray = field(default_factory=bytearray)
    starts: list[int] = field(default_factory=list)  # file positions of the records
    sealed: bool = False  # ends with a blank marker: the segment is full


@dataclass
class EncodedBatch:
    groups: list[Group]
    queue_offsets: list[int]
    commitlog_offsets: list[int]


def restore_offsets(table: dict[QueueKey, int], undo: dict[QueueKey, int]) -> None:
    """Put back the queue offsets an abandoned batch had taken (-1: the key was new)."""
    for key, old in undo.items():
        if old < 0:
            table.pop(key, None)
        else:
            table[key] = old


class BatchEncoder:
    """Turns messages into records. Keeps small caches; one per log, used under its lock."""

    def __init__(self, segment_bytes: int, max_message_bytes: int, store_host: tuple[str, int]) -> None:
        self.segment_bytes = segment_bytes
        self.max_message_bytes = max_message_bytes
        self.store_ip, self.store_port = encode_host(store_host)
        self._utf8: dict[str, bytes] = dict(_EMPTY)

    def _bytes(self, text: str) -> bytes:
        raw = self._utf8.get(text)
        if raw is None:
            if len(self._utf8) > 65536:
                self._utf8 = dict(_EMPTY)
            raw = self._utf8[text] = text.encode()
        return raw

    def encode(self, messages: Sequence[Message], seg_base: int, seg_pos: int, table: dict[QueueKey, int],
               undo: dict[QueueKey, int], store_ts: int) -> EncodedBatch:  # fmt: skip
        """Assign offsets (updating ``table``, remembering old values in ``undo``) and
        build the records. Raises :class:`EncodeError`; the caller then restores ``table``."""
        limit, room = self.max_message_bytes, self.segment_bytes - BLANK_SIZE
        pack, sip, sport, text, cache = HEADER.pack, self.store_ip, self.store_port, self._bytes, self._utf8
        groups, pieces, starts = [Group(seg_pos)], [], []
        q_offsets: list[int] = []
        cl_offsets: list[int] = []
        pos, base = seg_pos, seg_base
        for i, m in enumerate(messages):
            topic = cache.get(m.topic) or text(m.topic)
            tags = (cache.get(m.tags) or text(m.tags)) if m.tags else b""
            keys = (cache.get(m.keys) or text(m.keys)) if m.keys else b""
            props = encode_properties(m.properties) if m.properties else b""
            body = m.body
            tl, gl, kl, pl, bl = len(topic), len(tags), len(keys), len(props), len(body)
            size = HEADER_SIZE + tl + gl + kl + pl + bl
            if size > limit or tl > MAX_TOPIC_BYTES or gl > MAX_TAGS_BYTES or kl > MAX_KEYS_BYTES:
                raise _too_large(i, len(messages), size, limit, tl, gl, kl)
            if pos + size > room:  # seal this segment with a blank marker, go on in the next
                pieces.append(encode_blank(self.segment_bytes - pos))
                _close(groups[-1], pieces, starts, sealed=True)
                base += self.segment_bytes
                pos, pieces, starts = 0, [], []
                groups.append(Group(0))
            key = (m.topic, m.queue_id)
            q = table.get(key, 0)
            if key not in undo:
                undo[key] = q if key in table else -1
            table[key] = q + 1
            bip, bport = encode_host(m.born_host)
            pieces += (pack(size, RECORD_MAGIC, 0, base + pos, q, m.queue_id, m.flags, m.born_timestamp_ms or store_ts,
                            store_ts, bip, bport, sip, sport, m.reconsume_times, tl, gl, kl, pl, bl),
                       topic, tags, keys, props, body)  # fmt: skip
            starts.append(pos)
            q_offsets.append(q)
            cl_offsets.append(base + pos)
            pos += size
        _close(groups[-1], pieces, starts, sealed=False)
        return EncodedBatch(groups, q_offsets, cl_offsets)


def _close(group: Group, pieces: list[bytes], starts: list[int], sealed: bool) -> None:
    data = bytearray(b"".join(pieces))
    view, crc, rel = memoryview(data), _crc32c.crc32c, group.start
    ends = starts[1:] + [rel + len(data) - (BLANK_SIZE if sealed else 0)]
    for start, end in zip(starts, ends):
        p = start - rel
        data[p + 8 : p + 12] = crc(view[p + CRC_START : end - rel]).to_bytes(4, "little")
    view.release()
    group.data, group.starts, group.sealed = data, starts, sealed


def _too_large(i: int, n: int, size: int, limit: int, tl: int, gl: int, kl: int) -> EncodeError:
    if size > limit:
        return EncodeError(f"message {i} of {n} is {size} bytes, over max_message_bytes={limit}", too_large=True)
    return EncodeError(
        f"message {i} of {n}: field too long: topic {tl} bytes (max {MAX_TOPIC_BYTES}), tags {gl}, keys {kl} "
        f"(max {MAX_TAGS_BYTES})"
    )


def encode_message(msg: Message, commitlog_offset: int = 0, queue_offset: int = 0, store_ts: int = 0,
                   store_host: tuple[str, int] = ("0.0.0.0", 0)) -> bytes:  # fmt: skip
    """Encode one message into a standalone record (for tests and tools)."""
    encoder = BatchEncoder(1 << 62, 1 << 31, store_host)
    batch = encoder.encode([msg], commitlog_offset, 0, {(msg.topic, msg.queue_id): queue_offset}, {}, store_ts)
    return bytes(batch.groups[0].data)

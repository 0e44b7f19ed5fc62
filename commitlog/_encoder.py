"""Encoding a batch of messages into records, split at segment boundaries.

This is the per-message hot path, so each encoder is one flat loop: per message a
header pack and a few list appends; the bytes are assembled by one join per segment
and the CRCs are computed in a second pass over the finished buffer (they cover the
offsets, which are only known once the record's place is). Two inputs: message
objects (:meth:`BatchEncoder.encode`) and packed messages as producers send them
(:meth:`BatchEncoder.encode_packed`), which need no per-message objects at all.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Sequence

import crc32c as _crc32c

from ._errors import InvalidInputError
from ._packed import ITEM, ITEM_SIZE, PackedMessages, PackError, overrun_error, unpack_messages
from ._record import (
    BLANK_SIZE,
    CRC_START,
    HEADER,
    HEADER_SIZE,
    MAX_KEYS_BYTES,
    MAX_TAGS_BYTES,
    MAX_TOPIC_BYTES,
    RECORD_MAGIC,
    Message,
    decode_properties,
    encode_blank,
    encode_host,
    encode_properties,
)  # fmt: skip

QueueKey = tuple[str, int]
_EMPTY: dict[str, bytes] = {"": b""}


class EncodeError(InvalidInputError):
    """A message or batch that cannot be encoded; ``kind`` says why: ``"too_large"``
    (over ``max_message_bytes``), ``"invalid"`` (a bad field), ``"queue"`` (no such
    queue id) or ``"malformed"`` (packed bytes that do not decode)."""

    def __init__(self, message: str, kind: str = "invalid") -> None:
        super().__init__(message)
        self.kind = kind

    @property
    def too_large(self) -> bool:
        return self.kind == "too_large"


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
    batch_sizes: list[int] = field(default_factory=list)  # messages per packed input, in order


def restore_offsets(table: dict[QueueKey, int], undo: dict[QueueKey, int]) -> None:
    """Put back the queue offsets an abandoned batch had taken (-1: the key was new)."""
    for key, old in undo.items():
        if old < 0:
            table.pop(key, None)
        else:
            table[key] = old


class BatchEncoder:
    """Turns messages into records. Keeps small caches; one per log, used under its lock.

    Both encoders take the next queue offsets from ``table`` and advance them there,
    remembering each key's old value in ``undo`` (-1: new) so that a caller whose write
    fails can :func:`restore_offsets`. On :class:`EncodeError` they leave ``table`` to
    be restored the same way.
    """

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
        """Assign offsets and build the records of ``messages``."""
        out = _Layout(seg_pos, seg_base)
        limit, room = self.max_message_bytes, self.segment_bytes - BLANK_SIZE
        pack, sip, sport, text, cache = HEADER.pack, self.store_ip, self.store_port, self._bytes, self._utf8
        pieces, starts, q_offsets, cl_offsets = out.pieces, out.starts, out.q_offsets, out.cl_offsets
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
                pos, base = out.seal(pos, base, self.segment_bytes)
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
        out.batch_sizes.append(len(messages))
        return out.finish()

    def encode_packed(self, batches: Sequence[PackedMessages], queue_counts: Sequence[int], seg_base: int,
                      seg_pos: int, table: dict[QueueKey, int], undo: dict[QueueKey, int],
                      store_ts: int) -> EncodedBatch:  # fmt: skip
        """Assign offsets and build the records of packed messages, checking them as it
        goes: item bounds, ``max_message_bytes``, queue ids below ``queue_counts`` (one
        per batch), UTF-8 tags and keys, well-formed properties. A record's tail is a
        slice of the packed bytes; nothing is decoded."""
        out = _Layout(seg_pos, seg_base)
        for batch, queue_count in zip(batches, queue_counts):
            before = len(out.starts)
            nxt = self._encode_one_packed(batch, queue_count, out, table, store_ts)
            out.batch_sizes.append(len(out.starts) - before)
            for qid, value in nxt.items():  # taken only now that the whole batch checked out
                key = (batch.topic, qid)
                if key not in undo:
                    undo[key] = table.get(key, -1)
                table[key] = value
        return out.finish()

    def _encode_one_packed(self, batch: PackedMessages, queue_count: int, out: _Layout, table: dict[QueueKey, int],
                           store_ts: int) -> dict[int, int]:  # fmt: skip
        """Lay out one batch's records; returns the next queue offset per queue id."""
        topic, data = self._bytes(batch.topic), batch.data
        tl, limit, room = len(topic), self.max_message_bytes, self.segment_bytes - BLANK_SIZE
        if tl > MAX_TOPIC_BYTES or not data:
            raise EncodeError(f"topic of {tl} bytes, max {MAX_TOPIC_BYTES}" if data else "empty batch")
        pack, unpack, sip, sport = HEADER.pack, ITEM.unpack_from, self.store_ip, self.store_port
        bip, bport = encode_host(batch.born_host)
        pieces, starts, q_offsets, cl_offsets = out.pieces, out.starts, out.q_offsets, out.cl_offsets
        mv, p, end, fixed, pos, base = memoryview(data), 0, len(data), HEADER_SIZE + tl, out.pos, out.base
        texts: list[memoryview] = []  # tags and keys, checked for UTF-8 at the end
        nxt: dict[int, int] = {}  # next queue offset per queue id
        while p < end:
            if end - p < ITEM_SIZE:
                raise EncodeError(overrun_error(p, p + ITEM_SIZE, end), "malformed")
            qid, flags, born, gl, kl, pl, bl = unpack(data, p)
            t = p + ITEM_SIZE
            p = t + gl + kl + pl + bl
            size = fixed + p - t
            if p > end or size > limit or qid >= queue_count:
                raise _bad_item(batch.topic, t - ITEM_SIZE, p, end, size, limit, qid, queue_count)
            if gl or kl:
                texts.append(mv[t : t + gl + kl])
            if pl:
                _check_properties(mv[t + gl + kl : t + gl + kl + pl], t - ITEM_SIZE)
            if pos + size > room:
                pos, base = out.seal(pos, base, self.segment_bytes)
            q = nxt.get(qid)
            if q is None:
                q = table.get((batch.topic, qid), 0)
            nxt[qid] = q + 1
            pieces += (pack(size, RECORD_MAGIC, 0, base + pos, q, qid, flags, born or store_ts, store_ts, bip, bport,
                            sip, sport, 0, tl, gl, kl, pl, bl), topic, mv[t:p])  # fmt: skip
            starts.append(pos)
            q_offsets.append(q)
            cl_offsets.append(base + pos)
            pos += size
        _check_utf8(texts, batch)
        out.pos, out.base = pos, base
        return nxt


@dataclass
class _Layout:
    """Records being laid out for one append: their pieces in order, cut where a
    segment fills. ``pos`` and ``base`` are where the next record goes (kept in locals
    by the loops, which store them back)."""

    first_pos: int
    base: int
    pos: int = field(init=False)
    pieces: list[bytes | memoryview] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)  # file positions of the records
    cuts: list[tuple[int, int]] = field(default_factory=list)  # (pieces, starts) where a segment ended
    q_offsets: list[int] = field(default_factory=list)
    cl_offsets: list[int] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.pos = self.first_pos

    def seal(self, pos: int, base: int, segment_bytes: int) -> tuple[int, int]:
        """End the segment at ``pos`` with a blank marker; the next record goes to the
        next segment (returns its position and base)."""
        self.pieces.append(encode_blank(segment_bytes - pos))
        self.cuts.append((len(self.pieces), len(self.starts)))
        return 0, base + segment_bytes

    def finish(self) -> EncodedBatch:
        return EncodedBatch(_assemble(self.pieces, self.starts, self.cuts, self.first_pos), self.q_offsets,
                            self.cl_offsets, self.batch_sizes)  # fmt: skip


def _assemble(pieces: list[bytes | memoryview], starts: list[int], cuts: list[tuple[int, int]], seg_pos: int) -> list[Group]:
    """One group per segment touched: its bytes joined, then every record's CRC."""
    groups: list[Group] = []
    first_piece = first_start = 0
    for last_piece, last_start in [*cuts, (len(pieces), len(starts))]:
        sealed = len(groups) < len(cuts)
        group = Group(seg_pos if not groups else 0, bytearray().join(pieces[first_piece:last_piece]),
                      starts[first_start:last_start], sealed)  # fmt: skip
        _fill_crcs(group)
        groups.append(group)
        first_piece, first_start = last_piece, last_start
    return groups


def _fill_crcs(group: Group) -> None:
    data, rel, crc, pack_into = group.data, group.start, _crc32c.crc32c, _U32.pack_into
    view = memoryview(data)
    ends = group.starts[1:] + [rel + len(data) - (BLANK_SIZE if group.sealed else 0)]
    for start, end in zip(group.starts, ends):
        p = start - rel
        pack_into(data, p + 8, crc(view[p + CRC_START : end - rel]))
    view.release()


_U32 = struct.Struct("<I")


def _bad_item(topic: str, at: int, stop: int, end: int, size: int, limit: int, qid: int, count: int) -> EncodeError:
    if stop > end:
        return EncodeError(overrun_error(at, stop, end), "malformed")
    if size > limit:
        return EncodeError(f"message at byte {at} of the batch is {size} bytes, over max_message_bytes={limit}", "too_large")
    return EncodeError(f"queue id {qid} not in 0..{count - 1} of topic {topic!r}", "queue")


def _check_properties(raw: memoryview, at: int) -> None:
    try:
        decode_properties(raw)
    except (ValueError, struct.error) as e:
        raise EncodeError(f"undecodable message batch: properties of the message at byte {at}: {e}", "malformed") from None


def _check_utf8(texts: list[memoryview], batch: PackedMessages) -> None:
    """Tags and keys must be UTF-8. ASCII, the usual case, is checked in one call (a
    join of ASCII strings is ASCII only if each is); otherwise the batch is decoded."""
    if not texts or b"".join(texts).isascii():
        return
    try:
        unpack_messages(batch)
    except PackError as e:
        raise EncodeError(str(e), "malformed") from None


def _too_large(i: int, n: int, size: int, limit: int, tl: int, gl: int, kl: int) -> EncodeError:
    if size > limit:
        return EncodeError(f"message {i} of {n} is {size} bytes, over max_message_bytes={limit}", "too_large")
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

"""Encoding a batch of messages into records, split at segment boundaries.

This is the per-message hot path, so each encoder is one flat loop: per message a
header pack and a few list appends; the bytes are assembled by one join per segment
and the CRCs are computed in a second pass over the finished buffer (they cover the
offsets, which are only known once the record's place is). Two inputs: message
objects (:meth:`BatchEncoder.encode`) and packed messages as producers send them
(:meth:`BatchEncoder.encode_packed`), which need no per-message objects at all.
"""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from clmq.common import (
    BLANK_SIZE,
    HEADER,
    HEADER_SIZE,
    ITEM,
    ITEM_SIZE,
    MAX_KEYS_BYTES,
    MAX_TAGS_BYTES,
    MAX_TOPIC_BYTES,
    NO_HOST,
    RECORD_MAGIC,
    InvalidInputError,
    Message,
    PackedMessages,
    PackError,
    check_properties,
    encode_blank,
    encode_host,
    encode_properties,
    fill_crcs,
    overrun_error,
    unpack_messages,
)

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

    @staticmethod
    def batch_error(messages: Sequence[Message]) -> str | None:
        """Why ``messages`` cannot be encoded (a field's type or range), naming the
        message and the field; None if they can. What :meth:`encode` checks, for
        callers that must refuse a batch before any side effect (the store), except
        the range of queue ids: the caller knows the topic's queue count."""
        for i, m in enumerate(messages):
            if not plain_message(m):
                why = message_error(m, queue_range=False)
                if why is not None:
                    return f"message {i} of {len(messages)}: {why}"
        return None

    def _bytes(self, text: str) -> bytes:
        raw = self._utf8.get(text)
        if raw is None:
            if len(self._utf8) > 65536:
                self._utf8 = dict(_EMPTY)
            raw = self._utf8[text] = text.encode()
        return raw

    def encode(
        self,
        messages: Sequence[Message],
        seg_base: int,
        seg_pos: int,
        table: dict[QueueKey, int],
        undo: dict[QueueKey, int],
        store_ts: int,
    ) -> EncodedBatch:
        """Assign offsets and build the records of ``messages``. Every field's type and
        range is checked before ``table`` is touched: a bad message raises
        :class:`EncodeError` naming it and the field, and no queue offset is taken."""
        out = _Layout(seg_pos, seg_base)
        nxt: dict[QueueKey, int] = {}  # next queue offset per key: into ``table`` once all is encoded
        try:
            self._encode_all(messages, out, table, nxt, store_ts)
            batch = out.finish()
        except EncodeError:
            raise
        except Exception as e:  # a field of the wrong type or out of range: name it
            i = len(out.starts)
            why = message_error(messages[i]) if i < len(messages) else None
            raise EncodeError(f"message {i} of {len(messages)}: {why or f'{type(e).__name__}: {e}'}") from None
        for key, value in nxt.items():
            if key not in undo:
                undo[key] = table.get(key, -1)
            table[key] = value
        batch.batch_sizes.append(len(messages))
        return batch

    def _encode_all(
        self,
        messages: Sequence[Message],
        out: _Layout,
        table: dict[QueueKey, int],
        nxt: dict[QueueKey, int],
        store_ts: int,
    ) -> None:
        limit, room = self.max_message_bytes, self.segment_bytes - BLANK_SIZE
        pack, sip, sport, text, cache = HEADER.pack, self.store_ip, self.store_port, self._bytes, self._utf8
        pieces, starts, q_offsets, cl_offsets = out.pieces, out.starts, out.q_offsets, out.cl_offsets
        pos, base = out.pos, out.base
        msg_t, int_t, bytes_t, dict_t, no_host = Message, int, bytes, dict, NO_HOST  # locals: the loop's hot path
        default_ip, default_port = encode_host(NO_HOST)
        for i, m in enumerate(messages):
            qid, body, p, host = m.queue_id, m.body, m.properties, m.born_host
            flags, born, again = m.flags, m.born_timestamp_ms, m.reconsume_times
            if (
                m.__class__ is not msg_t
                or qid.__class__ is not int_t
                or body.__class__ is not bytes_t
                or flags.__class__ is not int_t
                or born.__class__ is not int_t
                or again.__class__ is not int_t
                or host is not no_host
                or p.__class__ is not dict_t
            ):
                why = message_error(m)  # not the usual kinds: look closer (a bool is no int, ...)
                if why is not None:
                    raise EncodeError(f"message {i} of {len(messages)}: {why}")
            # A str not cached yet goes through text(); anything else fails there (named by encode()).
            topic = cache.get(m.topic) or text(m.topic)
            tags = cache.get(m.tags)
            if tags is None:
                tags = text(m.tags)
            keys = cache.get(m.keys)
            if keys is None:
                keys = text(m.keys)
            props = encode_properties(p) if p else b""
            tl, gl, kl, pl, bl = len(topic), len(tags), len(keys), len(props), len(body)
            size = HEADER_SIZE + tl + gl + kl + pl + bl
            if size > limit or tl > MAX_TOPIC_BYTES or gl > MAX_TAGS_BYTES or kl > MAX_KEYS_BYTES:
                raise _too_large(i, len(messages), size, limit, tl, gl, kl)
            if pos + size > room:  # seal this segment with a blank marker, go on in the next
                pos, base = out.seal(pos, base, self.segment_bytes)
            key = (m.topic, qid)
            q = nxt.get(key)
            if q is None:
                q = table.get(key, 0)
            nxt[key] = q + 1
            bip, bport = (default_ip, default_port) if host is no_host else encode_host(host)
            pieces += (
                pack(
                    size,
                    RECORD_MAGIC,
                    0,
                    base + pos,
                    q,
                    qid,
                    flags,
                    born or store_ts,
                    store_ts,
                    bip,
                    bport,
                    sip,
                    sport,
                    again,
                    tl,
                    gl,
                    kl,
                    pl,
                    bl,
                ),
                topic,
                tags,
                keys,
                props,
                body,
            )
            starts.append(pos)
            q_offsets.append(q)
            cl_offsets.append(base + pos)
            pos += size
        out.pos, out.base = pos, base

    def encode_packed(
        self,
        batches: Sequence[PackedMessages],
        queue_counts: Sequence[int],
        seg_base: int,
        seg_pos: int,
        table: dict[QueueKey, int],
        undo: dict[QueueKey, int],
        store_ts: int,
    ) -> EncodedBatch:
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

    def _encode_one_packed(
        self, batch: PackedMessages, queue_count: int, out: _Layout, table: dict[QueueKey, int], store_ts: int
    ) -> dict[int, int]:
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
            pieces += (
                pack(
                    size,
                    RECORD_MAGIC,
                    0,
                    base + pos,
                    q,
                    qid,
                    flags,
                    born or store_ts,
                    store_ts,
                    bip,
                    bport,
                    sip,
                    sport,
                    0,
                    tl,
                    gl,
                    kl,
                    pl,
                    bl,
                ),
                topic,
                mv[t:p],
            )
            starts.append(pos)
            q_offsets.append(q)
            cl_offsets.append(base + pos)
            pos += size
        _check_utf8(texts, batch)
        out.pos, out.base = pos, base
        return nxt


MAX_U16, MAX_U32, MAX_U64 = 0xFFFF, 0xFFFF_FFFF, 0xFFFF_FFFF_FFFF_FFFF


def plain_message(m: Message) -> bool:
    """True for the usual message, checked in one expression: a :class:`Message` whose
    fields have their exact types and ranges, no properties, the default born host.
    False says nothing is wrong, only that :func:`message_error` must look closer."""
    return (
        m.__class__ is Message
        and m.topic.__class__ is str
        and m.queue_id.__class__ is int
        and m.body.__class__ is bytes
        and m.tags.__class__ is str
        and m.keys.__class__ is str
        and m.flags.__class__ is int
        and m.born_timestamp_ms.__class__ is int
        and m.reconsume_times.__class__ is int
        and m.born_host is NO_HOST
        and not m.properties
        and m.properties.__class__ is dict
        and 0 <= m.queue_id <= MAX_U32
        and 0 <= m.flags <= MAX_U32
        and 0 <= m.born_timestamp_ms <= MAX_U64
        and 0 <= m.reconsume_times <= MAX_U32
    )


def message_error(m: object, queue_range: bool = True) -> str | None:
    """What is wrong with a message's fields (type or range), naming the field; None
    if it can be encoded (sizes aside: ``max_message_bytes`` is the encoder's). Without
    ``queue_range`` a queue id's range is left to the caller (the store checks it
    against the topic: INVALID_QUEUE_ID)."""
    if not isinstance(m, Message):
        return f"is a {type(m).__name__}, not a Message"
    ints: tuple[tuple[str, object, int], ...] = (
        ("queue_id", m.queue_id, MAX_U32),
        ("flags", m.flags, MAX_U32),
        ("born_timestamp_ms", m.born_timestamp_ms, MAX_U64),
        ("reconsume_times", m.reconsume_times, MAX_U32),
    )
    for name, value, top in ints:
        if type(value) is not int:  # bool is refused too: True is no queue id
            return f"field {name!r} must be an int, got {_kind(value)}"
        if not 0 <= value <= top and (queue_range or name != "queue_id"):
            return f"field {name!r} = {value} is out of range 0..{top}"
    texts: tuple[tuple[str, object], ...] = (("topic", m.topic), ("tags", m.tags), ("keys", m.keys))
    for name, text in texts:
        if type(text) is not str:
            return f"field {name!r} must be a str, got {_kind(text)}"
    if type(m.body) not in (bytes, bytearray):
        return f"field 'body' must be bytes, got {_kind(m.body)}"
    return _properties_error(m.properties) or _host_error(m.born_host)


def _properties_error(props: object) -> str | None:
    if not isinstance(props, Mapping):
        return f"field 'properties' must be a mapping of str to str, got {_kind(props)}"
    for key, value in props.items():
        if type(key) is not str or type(value) is not str:
            return f"field 'properties' must map str to str, got {_kind(key)} -> {_kind(value)}"
        if len(key.encode("utf-8", "surrogatepass")) > MAX_U16:
            return f"field 'properties': a key of more than {MAX_U16} bytes"
    return None


def _host_error(host: object) -> str | None:
    ok = isinstance(host, tuple) and len(host) == 2 and type(host[0]) is str and type(host[1]) is int
    if not ok:
        return f"field 'born_host' must be (ip address str, port int), got {host!r:.80}"
    assert isinstance(host, tuple)
    if not 0 <= host[1] <= MAX_U16:
        return f"field 'born_host': port {host[1]} is out of range 0..{MAX_U16}"
    try:
        ipaddress.ip_address(host[0])
    except ValueError:
        return f"field 'born_host': {host[0]!r:.80} is not an IP address"
    return None


def _kind(value: object) -> str:
    return f"{type(value).__name__} {value!r:.40}"


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
        return EncodedBatch(
            _assemble(self.pieces, self.starts, self.cuts, self.first_pos),
            self.q_offsets,
            self.cl_offsets,
            self.batch_sizes,
        )


def _assemble(
    pieces: list[bytes | memoryview], starts: list[int], cuts: list[tuple[int, int]], seg_pos: int
) -> list[Group]:
    """One group per segment touched: its bytes joined, then every record's CRC."""
    groups: list[Group] = []
    first_piece = first_start = 0
    for last_piece, last_start in [*cuts, (len(pieces), len(starts))]:
        sealed = len(groups) < len(cuts)
        group = Group(
            seg_pos if not groups else 0,
            bytearray().join(pieces[first_piece:last_piece]),
            starts[first_start:last_start],
            sealed,
        )
        _fill_crcs(group)
        groups.append(group)
        first_piece, first_start = last_piece, last_start
    return groups


def _fill_crcs(group: Group) -> None:
    """Every record's CRC (compiled where built: a tenth of the per-record Python loop)."""
    rel = group.start
    if not group.starts:  # a group that is only a blank marker (the batch began past the segment's room)
        return
    starts = [s - rel for s in group.starts] if rel else group.starts
    ends = starts[1:] + [len(group.data) - (BLANK_SIZE if group.sealed else 0)]
    fill_crcs(group.data, starts, ends)


def _bad_item(topic: str, at: int, stop: int, end: int, size: int, limit: int, qid: int, count: int) -> EncodeError:
    if stop > end:
        return EncodeError(overrun_error(at, stop, end), "malformed")
    if size > limit:
        return EncodeError(
            f"message at byte {at} of the batch is {size} bytes, over max_message_bytes={limit}", "too_large"
        )
    return EncodeError(f"queue id {qid} not in 0..{count - 1} of topic {topic!r}", "queue")


def _check_properties(raw: memoryview, at: int) -> None:
    try:
        check_properties(raw)
    except (ValueError, struct.error) as e:
        raise EncodeError(
            f"undecodable message batch: properties of the message at byte {at}: {e}", "malformed"
        ) from None


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


def encode_message(
    msg: Message,
    commitlog_offset: int = 0,
    queue_offset: int = 0,
    store_ts: int = 0,
    store_host: tuple[str, int] = ("0.0.0.0", 0),
) -> bytes:
    """Encode one message into a standalone record (for tests and tools)."""
    encoder = BatchEncoder(1 << 62, 1 << 31, store_host)
    batch = encoder.encode([msg], commitlog_offset, 0, {(msg.topic, msg.queue_id): queue_offset}, {}, store_ts)
    return bytes(batch.groups[0].data)

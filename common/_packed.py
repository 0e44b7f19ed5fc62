"""Packed messages: one topic's messages laid out the way a record ends.

Per message, back to back::

    u32 queue_id, u32 flags, u64 born_timestamp_ms,
    u16 tags_length, u16 keys_length, u32 properties_length, u32 body_length,
    tags, keys, properties (the record format's encoding), body

Why this layout: the bytes after the 28-byte item header are exactly a record's tail
after its topic, so :meth:`CommitLog.append_packed` turns an item into a record with
one header pack and one slice, and no per-message objects. It is also the body of a
SEND_MESSAGE request (see ``protocol``), so a producer's batch goes from the socket
to the log without being decoded into messages and encoded again.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Sequence

from ._errors import InvalidInputError
from ._record import Host, Message, decode_properties, encode_properties

ITEM = struct.Struct("<IIQHHII")
ITEM_SIZE = ITEM.size


class PackError(InvalidInputError):
    """Packed messages that do not decode."""


@dataclass(frozen=True, slots=True)
class PackedMessages:
    """A run of packed messages for ``topic``, sent from ``born_host``."""

    topic: str
    data: bytes
    born_host: Host = ("0.0.0.0", 0)


def pack_messages(messages: Sequence[Message]) -> bytes:
    """The packed form of ``messages`` (their topics are not packed)."""
    parts: list[bytes] = []
    pack = ITEM.pack
    for m in messages:
        tags, keys = m.tags.encode(), m.keys.encode()
        props = encode_properties(m.properties) if m.properties else b""
        if len(tags) > 0xFFFF or len(keys) > 0xFFFF:
            raise PackError(f"tags or keys longer than 65535 bytes in a message for queue {m.queue_id}")
        parts.append(pack(m.queue_id, m.flags, m.born_timestamp_ms, len(tags), len(keys), len(props), len(m.body)))
        parts += (tags, keys, props, m.body)
    return b"".join(parts)


def pack_parts(
    queue_id: int, flags: int, born_timestamp_ms: int, tags: bytes, keys: bytes, props: bytes, body: bytes
) -> tuple[bytes, bytes, bytes, bytes, bytes]:
    """One packed message from its encoded parts (``props``: the record format's
    property encoding), for a caller that builds many alike (``b"".join`` them)."""
    if len(tags) > 0xFFFF or len(keys) > 0xFFFF:
        raise PackError(f"tags or keys longer than 65535 bytes in a message for queue {queue_id}")
    return (
        ITEM.pack(queue_id, flags, born_timestamp_ms, len(tags), len(keys), len(props), len(body)),
        tags,
        keys,
        props,
        body,
    )


def unpack_messages(packed: PackedMessages) -> list[Message]:
    """The messages of ``packed``; raises :class:`PackError` if it is malformed."""
    out: list[Message] = []
    body, topic, born_host = packed.data, packed.topic, packed.born_host
    pos, end = 0, len(body)
    unpack = ITEM.unpack_from
    mv = memoryview(body)
    try:
        while pos < end:
            qid, flags, born, tl, kl, pl, bl = unpack(body, pos)
            p = pos + ITEM_SIZE
            pos = p + tl + kl + pl + bl
            if pos > end:
                raise PackError(overrun_error(p - ITEM_SIZE, pos, end))
            tags = str(mv[p : p + tl], "utf-8") if tl else ""
            keys = str(mv[p + tl : p + tl + kl], "utf-8") if kl else ""
            q = p + tl + kl
            props = decode_properties(mv[q : q + pl]) if pl else {}
            out.append(Message(topic, qid, bytes(mv[q + pl : pos]), tags, keys, props, flags, born, born_host))
    except (struct.error, UnicodeDecodeError, ValueError) as e:
        if isinstance(e, PackError):
            raise
        raise PackError(f"undecodable message batch: {e}") from None
    return out


def packed_heads(data: bytes) -> list[tuple[int, bytes, bytes]]:
    """``(queue id, tags, properties)`` of each packed message, the rest not decoded: a
    check of what routes a batch costs a third of :func:`unpack_messages`. Raises
    :class:`PackError` if the batch is malformed."""
    out: list[tuple[int, bytes, bytes]] = []
    pos, end = 0, len(data)
    unpack = ITEM.unpack_from
    try:
        while pos < end:
            qid, _flags, _born, tl, kl, pl, bl = unpack(data, pos)
            p = pos + ITEM_SIZE
            pos = p + tl + kl + pl + bl
            if pos > end:
                raise PackError(overrun_error(p - ITEM_SIZE, pos, end))
            q = p + tl + kl
            out.append((qid, data[p : p + tl], data[q : q + pl]))
    except struct.error as e:
        raise PackError(f"undecodable message batch: {e}") from None
    return out


def overrun_error(start: int, stop: int, end: int) -> str:
    return f"undecodable message batch: message at byte {start} runs past the batch ({stop} > {end})"


def set_queue_id(data: bytes, queue_id: int, count: int) -> bytes:
    """``data`` (``count`` packed messages) with every queue id set to ``queue_id``
    (a producer picks the queue after packing, and may pick again on retry)."""
    out = bytearray(data)
    pos = 0
    for _ in range(count):
        _q, _f, _b, tl, kl, pl, bl = ITEM.unpack_from(out, pos)
        struct.pack_into("<I", out, pos, queue_id)
        pos += ITEM_SIZE + tl + kl + pl + bl
    return bytes(out)

"""Message batches as they travel in a SEND_MESSAGE body, and pulled records.

A batch is a compact binary body, not one msgpack object per message, so that the
broker does one ``struct`` unpack and a few slices per message. Per message::

    u32 queue_id, u32 flags, u64 born_timestamp_ms,
    u16 tags_length, u16 keys_length, u32 properties_length, u32 body_length,
    tags, keys, properties (the record format's encoding), body

The topic is a field of the request (one topic per batch). Pulled messages travel as
CommitLog records, byte for byte as stored (so the broker can use ``sendfile``), and
are decoded and CRC-checked by :func:`decode_records`.
"""

from __future__ import annotations

import struct
from typing import Sequence

from commitlog import HEADER_SIZE, Host, Message, Record, decode_properties, decode_records_many, encode_properties

_ITEM = struct.Struct("<IIQHHII")
ITEM_HEADER_SIZE = _ITEM.size


class BatchError(ValueError):
    """A batch body that does not decode."""


def encode_batch(messages: Sequence[Message]) -> bytes:
    """The SEND_MESSAGE body for ``messages`` (their topics are not encoded)."""
    parts: list[bytes] = []
    pack = _ITEM.pack
    for m in messages:
        tags, keys = m.tags.encode(), m.keys.encode()
        props = encode_properties(m.properties) if m.properties else b""
        if len(tags) > 0xFFFF or len(keys) > 0xFFFF:
            raise BatchError(f"tags or keys longer than 65535 bytes in a message for queue {m.queue_id}")
        parts.append(pack(m.queue_id, m.flags, m.born_timestamp_ms, len(tags), len(keys), len(props), len(m.body)))
        parts += (tags, keys, props, m.body)
    return b"".join(parts)


def decode_batch(body: bytes, topic: str, born_host: Host) -> list[Message]:
    """The messages of a SEND_MESSAGE body; raises :class:`BatchError` if malformed."""
    out: list[Message] = []
    pos, end = 0, len(body)
    unpack = _ITEM.unpack_from
    mv = memoryview(body)
    try:
        while pos < end:
            qid, flags, born, tl, kl, pl, bl = unpack(body, pos)
            p = pos + ITEM_HEADER_SIZE
            pos = p + tl + kl + pl + bl
            if pos > end:
                raise BatchError(f"message at byte {p - ITEM_HEADER_SIZE} runs past the batch ({pos} > {end})")
            tags = str(mv[p : p + tl], "utf-8") if tl else ""
            keys = str(mv[p + tl : p + tl + kl], "utf-8") if kl else ""
            q = p + tl + kl
            props = decode_properties(mv[q : q + pl]) if pl else {}
            out.append(Message(topic, qid, bytes(mv[q + pl : pos]), tags, keys, props, flags, born, born_host))
    except (struct.error, UnicodeDecodeError, ValueError) as e:
        if isinstance(e, BatchError):
            raise
        raise BatchError(f"undecodable message batch: {e}") from None
    return out


def decode_records(body: bytes, where: str = "pull response") -> list[Record]:
    """The records of a PULL_MESSAGE response body, each CRC-checked (vectorised)."""
    return decode_records_many(body, where)


def record_count_hint(body_length: int) -> int:
    """An upper bound on the records a body of this length can hold."""
    return body_length // HEADER_SIZE


def set_queue_id(body: bytes, queue_id: int, count: int) -> bytes:
    """The batch with every message's queue id set to ``queue_id`` (a producer picks
    the queue after encoding, and may pick again on retry)."""
    out = bytearray(body)
    pos = 0
    for _ in range(count):
        _q, _f, _b, tl, kl, pl, bl = _ITEM.unpack_from(out, pos)
        struct.pack_into("<I", out, pos, queue_id)
        pos += ITEM_HEADER_SIZE + tl + kl + pl + bl
    return bytes(out)

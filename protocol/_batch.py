"""Message batches as they travel in a SEND_MESSAGE body, and pulled records.

A batch is the commit log's packed-messages layout (``commitlog/_packed.py``), not one
msgpack object per message: the broker appends it without decoding it into messages.
Per message::

    u32 queue_id, u32 flags, u64 born_timestamp,
    u16 tags_length, u16 keys_length, u32 properties_length, u32 body_length,
    tags, keys, properties (the record format's encoding), body

The topic is a field of the request (one topic per batch). Pulled messages travel as
CommitLog records, byte for byte as stored (so the broker can use ``sendfile``), and
are decoded and CRC-checked by :func:`decode_records`.
"""

from __future__ import annotations

from typing import Sequence

from clmq import common
from clmq.common import (
    HEADER_SIZE,
    Host,
    Message,
    PackedMessages,
    PackError,
    Record,
    pack_messages,
    unpack_messages,
)
from clmq.common import set_queue_id as set_queue_id

BatchError = PackError  # a batch body that does not decode


def encode_batch(messages: Sequence[Message]) -> bytes:
    """The SEND_MESSAGE body for ``messages`` (their topics are not encoded)."""
    return pack_messages(messages)


def decode_batch(body: bytes, topic: str, born_host: Host) -> list[Message]:
    """The messages of a SEND_MESSAGE body; raises :class:`BatchError` if malformed."""
    return unpack_messages(PackedMessages(topic, body, born_host))


def decode_records(body: bytes, where: str = "pull response") -> list[Record]:
    """The records of a PULL_MESSAGE response body, each CRC-checked (vectorised)."""
    return common.decode_records_many(body, where)  # looked up when called: numpy is imported then


def record_count_hint(body_length: int) -> int:
    """An upper bound on the records a body of this length can hold."""
    return body_length // HEADER_SIZE

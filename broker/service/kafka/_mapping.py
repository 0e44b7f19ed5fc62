"""Kafka records <-> clmq messages, exactly: a record's key, value, headers and
timestamp come back from a fetch as the same bytes that were produced, and a message
produced by clmq's own client reads as a Kafka record (docs/kafka.md, "Mapping").

- value: the body; a null value (a tombstone) is an empty body with
  ``__kafka.null = 1``.
- key: ``keys`` when it is UTF-8 text (clmq's consumers see it there); otherwise, and
  for an empty key, base64 in ``__kafka.key``. A null key is neither.
- headers: plain properties, in order, when their keys are unique, their values UTF-8
  text and no key is one clmq itself uses; otherwise all of them as JSON in
  ``__kafka.headers``. A header ``clmq.tags`` also sets the record's tags, so clmq's tag
  filters select Kafka-produced messages; a clmq message with tags reads with that header.
- timestamp: the born timestamp; one that is not a positive number of ms (-1 is
  Kafka's "none") in ``__kafka.ts``.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Mapping, Sequence

from clmq.common import (
    HEADER_TAGS,
    ITEM,
    KAFKA_PROP_PREFIX,
    NO_HOST,
    PROP_KAFKA_HEADERS,
    PROP_KAFKA_KEY_B64,
    PROP_KAFKA_NULL_VALUE,
    PROP_KAFKA_TIMESTAMP,
    Host,
    Message,
    Record,
    pack_messages,
)
from clmq.protocol.kafka import KafkaRecord

Header = tuple[str, "bytes | None"]
KafkaRow = tuple[int, "bytes | None", "bytes | None", Sequence[Header]]  # timestamp, key, value, headers

# Property names clmq's own code reads: a Kafka header of such a name could change what
# the broker does with the message (a scheduled delivery, a dead letter's origin), so
# headers that use one travel in __kafka.headers instead.
_RESERVED = frozenset(
    {
        "UNIQ_KEY",
        "DELIVER_AT_MS",
        "REAL_TOPIC",
        "REAL_QID",
        "REAL_TAGS",
        "CANCEL_OF",
        "TIMER_SRC",
        "ORIGIN_TOPIC",
        "ORIGIN_QID",
        "ORIGIN_QUEUE_OFFSET",
        "ORIGIN_MSG_ID",
        "ORIGIN_ADDR",
        "DLQ_GROUP",
        "DLQ_BODY_OF",
    }
)
_MAX_KEYS_BYTES = 0xFFFF  # the record's keys field holds at most this many bytes


def to_message(
    topic: str,
    queue_id: int,
    timestamp: int,
    key: bytes | None,
    value: bytes | None,
    headers: Sequence[Header],
    born_host: Host,
) -> Message:
    """The clmq message that stores one Kafka record."""
    props: dict[str, str] = {}
    keys = ""
    if key is not None:
        text = _text(key)
        if text is not None and text and len(key) <= _MAX_KEYS_BYTES:
            keys = text
        else:
            props[PROP_KAFKA_KEY_B64] = base64.b64encode(key).decode()
    tags = _headers_to_props(headers, props)
    if value is None:
        props[PROP_KAFKA_NULL_VALUE] = "1"
    if timestamp <= 0:
        props[PROP_KAFKA_TIMESTAMP] = str(timestamp)
    return Message(
        topic,
        queue_id,
        value or b"",
        tags=tags,
        keys=keys,
        properties=props,
        born_timestamp_ms=max(timestamp, 0),
        born_host=born_host,
    )


class TooLarge(ValueError):
    """A record above the broker's max_message_bytes once stored."""


def pack_records(queue_id: int, records: Sequence[KafkaRecord], limit: int) -> bytes:
    """Kafka records as packed clmq messages (``common._packed``, the body of a produce
    request): the usual record (a positive timestamp, a value, a key that is UTF-8 text
    or none, no headers) straight into its bytes; any other through :func:`to_message`.
    ``limit``: the bytes of tags, keys, properties and body a record may have (else
    :class:`TooLarge`: one partition's oversized record must not fail the others')."""
    parts: list[bytes] = []
    pack = ITEM.pack
    for r in records:
        key, value = r.key, r.value
        if r.headers or value is None or r.timestamp <= 0 or (key is not None and not _plain_key(key)):
            m = to_message("", queue_id, r.timestamp, key, value, r.headers, NO_HOST)
            packed = pack_messages([m])
            if len(packed) - ITEM.size > limit:
                raise TooLarge(f"a record of {len(packed) - ITEM.size} bytes of key, value and headers")
            parts.append(packed)
            continue
        key = key or b""
        if len(key) + len(value) > limit:
            raise TooLarge(f"a record of {len(key) + len(value)} bytes of key and value")
        parts += (pack(queue_id, 0, r.timestamp, 0, len(key), 0, len(value)), key, value)
    return b"".join(parts)


def _plain_key(key: bytes) -> bool:
    """Whether a key is stored as it is in ``keys``: non-empty UTF-8 text that fits."""
    if not key or len(key) > _MAX_KEYS_BYTES:
        return False
    if key.isascii():
        return True
    return _text(key) is not None


def _headers_to_props(headers: Sequence[Header], props: dict[str, str]) -> str:
    """Headers into ``props`` (see the module's docstring); returns the tags they name."""
    plain: dict[str, str] = {}
    for name, value in headers:
        text = None if value is None else _text(value)
        if text is None or name in plain or name in _RESERVED or name.startswith(KAFKA_PROP_PREFIX):
            props[PROP_KAFKA_HEADERS] = json.dumps(
                [[n, None if v is None else base64.b64encode(v).decode()] for n, v in headers]
            )
            break
        plain[name] = text
    else:
        props.update(plain)
    for name, value in headers:
        if name == HEADER_TAGS and value is not None:
            return _text(value) or ""
    return ""


def _text(raw: bytes) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def to_kafka(record: Record) -> KafkaRow:
    """A stored message as a Kafka record: (timestamp, key, value, headers)."""
    return kafka_row(
        record.born_timestamp_ms, record.keys.encode(), record.tags.encode(), record.properties, record.body
    )


def kafka_row(born_ms: int, keys: bytes, tags: bytes, props: Mapping[str, str], body: bytes) -> KafkaRow:
    """A stored message's fields (keys and tags as their UTF-8 bytes) as a Kafka record."""
    if not props:  # the common case of clmq's own messages, and Kafka's without headers
        return born_ms, keys or None, body, [(HEADER_TAGS, tags)] if tags else []
    value = None if props.get(PROP_KAFKA_NULL_VALUE) == "1" else body
    return _timestamp(props, born_ms), _key(props, keys), value, _headers(props, tags)


def _timestamp(props: Mapping[str, str], born_ms: int) -> int:
    raw = props.get(PROP_KAFKA_TIMESTAMP)
    if raw is not None:
        try:
            return int(raw)
        except ValueError:
            pass
    return born_ms


def _key(props: Mapping[str, str], keys: bytes) -> bytes | None:
    raw = props.get(PROP_KAFKA_KEY_B64)
    if raw is not None:
        try:
            return base64.b64decode(raw, validate=True)
        except (binascii.Error, ValueError):
            pass
    return keys or None


def _headers(props: Mapping[str, str], tags: bytes) -> list[Header]:
    raw = props.get(PROP_KAFKA_HEADERS)
    if raw is not None:
        decoded = _json_headers(raw)
        if decoded is not None:
            return decoded
    headers: list[Header] = [(n, v.encode()) for n, v in props.items() if not n.startswith(KAFKA_PROP_PREFIX)]
    if tags and HEADER_TAGS not in props and raw is None:
        headers.append((HEADER_TAGS, tags))
    return headers


def _json_headers(raw: str) -> list[Header] | None:
    """``__kafka.headers`` decoded, or None if it is not what this module writes (a
    clmq producer may have set any property: then the properties are the headers)."""
    try:
        rows = json.loads(raw)
        return [(str(n), None if v is None else base64.b64decode(v, validate=True)) for n, v in rows]
    except (ValueError, TypeError, binascii.Error):
        return None

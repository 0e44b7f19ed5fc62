"""A single message's SEND_MESSAGE encoding, fast: ``encode_batch([message])`` costs
about 2.6 us (a loop, a property encoder, a join) where a producer submitting 150,000
messages a second has about 6 us for everything. The layout is commitlog's packed
message (``pack_messages``); it is checked against it once at import, and if they
ever differ the general encoder is used instead."""

from __future__ import annotations

import itertools
import secrets
import struct
import time
from typing import Mapping, Sequence

from clmq.common import ITEM_SIZE, Message, encode_properties
from clmq.protocol import encode_batch

from ._future import UNIQ_KEY

UNIQ_KEY_CHARS = 32  # the producer's UNIQ_KEYs: 16 hex digits of producer id, 16 of a count
_ITEM = struct.Struct("<IIQHHII")  # queue id, flags, born ms, tags, keys, properties and body lengths
_UNIQ_PREFIX = encode_properties({UNIQ_KEY: "0" * UNIQ_KEY_CHARS})[:-UNIQ_KEY_CHARS]
_MAX_SHORT = 0xFFFF


def _fast(m: Message) -> bytes:
    props = m.properties
    if len(props) == 1 and len(key := props.get(UNIQ_KEY, "")) == UNIQ_KEY_CHARS and key.isascii():
        pb = _UNIQ_PREFIX + key.encode()
    else:
        pb = encode_properties(props) if props else b""
    tb = m.tags.encode() if m.tags else b""
    kb = m.keys.encode() if m.keys else b""
    if len(tb) > _MAX_SHORT or len(kb) > _MAX_SHORT:
        return encode_batch([m])  # its error
    header = _ITEM.pack(m.queue_id, m.flags, m.born_timestamp_ms, len(tb), len(kb), len(pb), len(m.body))
    return b"".join((header, tb, kb, pb, m.body))


def _same_layout() -> bool:
    samples = [
        Message("t", 7, b"body", "tag", "k1 k2", {UNIQ_KEY: "A" * UNIQ_KEY_CHARS}, 3, 1234567890123),
        Message("t", 0, b"", "", "", {}),
        Message("t", 1, b"x", "", "", {"a": "b", UNIQ_KEY: "c"}),
    ]
    return _ITEM.size == ITEM_SIZE and all(_fast(m) == encode_batch([m]) for m in samples)


def _general(m: Message) -> bytes:
    return encode_batch([m])


_UNIQ_PROPS_BYTES = len(_UNIQ_PREFIX) + UNIQ_KEY_CHARS


def encode_plain(queue_id: int, born_ms: int, key: str, body: bytes) -> bytes:
    """:func:`encode_one` of a message with no tags, no keys and no property but its
    ``UNIQ_KEY`` ``key`` (the producer's own: ``UNIQ_KEY_CHARS`` ASCII characters),
    without the Message: most submits."""
    header = _ITEM.pack(queue_id, 0, born_ms, 0, 0, _UNIQ_PROPS_BYTES, len(body))
    return b"".join((header, _UNIQ_PREFIX, key.encode(), body))


PLAIN_OVERHEAD_BYTES = _ITEM.size + _UNIQ_PROPS_BYTES  # a plain message's encoded size less its body


def encode_plain_run(queue_id: int, born_ms: int, keys: Sequence[str], bodies: Sequence[bytes]) -> bytes:
    """:func:`encode_plain` of several messages to one queue (``keys[i]`` is body
    ``i``'s UNIQ_KEY), as one buffer: one join for the run, not one per message."""
    pack = _ITEM.pack
    prefix = _UNIQ_PREFIX
    props = _UNIQ_PROPS_BYTES
    parts: list[bytes] = []
    add = parts.extend
    for key, body in zip(keys, bodies, strict=True):
        add((pack(queue_id, 0, born_ms, 0, 0, props, len(body)), prefix, key.encode(), body))
    return b"".join(parts)


def _plain_same() -> bool:
    key = "0123456789ABCDEF" * 2
    m = Message("t", 5, b"body", "", "", {UNIQ_KEY: key}, 0, 1234567890123)
    m2 = Message("t", 5, b"", "", "", {UNIQ_KEY: key[::-1]}, 0, 1234567890123)
    run = encode_plain_run(5, 1234567890123, [key, key[::-1]], [b"body", b""])
    return encode_plain(5, 1234567890123, key, b"body") == encode_batch([m]) and run == encode_batch([m, m2])


LAYOUT_CHECKED = _same_layout()
encode_one = _fast if LAYOUT_CHECKED else _general
PLAIN_CHECKED = LAYOUT_CHECKED and _plain_same()  # else every submit uses encode_one


_HEX3 = [f"{i:03X}" for i in range(4096)]  # the last three hex digits of a key's count


class MessageIds:
    """A producer's messages with their ``UNIQ_KEY``: its random id (16 hex digits) and a
    count (16 more), unless ``unique_ids`` is off. About 1.5 us and 45 bytes per message;
    without it a retry after an unknown outcome cannot be recognised (at least once)."""

    def __init__(self, unique_ids: bool) -> None:
        self.unique_ids = unique_ids
        self.producer_id = secrets.token_hex(8)
        self._count = itertools.count()

    def message(
        self, topic: str, body: bytes, tags: str, keys: str, properties: Mapping[str, str] | None
    ) -> tuple[Message, tuple[str, ...], bool]:
        """One submit's message with its UNIQ_KEY (given, or made), the key, and whether
        :func:`encode_plain` may encode it (no tags, keys or properties but a key made here)."""
        born_ms = int(time.time() * 1000)
        if not properties:
            if not self.unique_ids:
                return Message(topic, 0, body, tags, keys, {}, 0, born_ms), (), False
            key = f"{self.producer_id}{next(self._count):016X}"
            plain = not tags and not keys and len(key) == UNIQ_KEY_CHARS
            return Message(topic, 0, body, tags, keys, {UNIQ_KEY: key}, 0, born_ms), (key,), plain
        props = dict(properties)
        uniq: tuple[str, ...] = ()
        if self.unique_ids:
            given = props.get(UNIQ_KEY)
            key = props[UNIQ_KEY] = f"{self.producer_id}{next(self._count):016X}" if given is None else given
            uniq = (key,)
        return Message(topic, 0, body, tags, keys, props, 0, born_ms), uniq, False

    def many_keys(self, count: int) -> list[str]:
        """``count`` fresh UNIQ_KEYs, in order (``submit_many``): the key of count ``n``
        is ``f"{producer_id}{n:016X}"``, made as a head (all but the last three hex
        digits) joined to each of the last three from a table: a quarter of the cost
        of formatting each key."""
        pid = self.producer_id
        first = next(self._count)
        if count > 1:  # the counter moves past the run
            self._count = itertools.count(first + count)
        keys: list[str] = []
        n, end = first, first + count
        while n < end:
            high = n >> 12
            stop = min(end, (high + 1) << 12)
            keys += map(f"{pid}{high:013X}".__add__, _HEX3[n & 0xFFF : ((stop - 1) & 0xFFF) + 1])
            n = stop
        return keys

    def identify(self, msgs: list[Message]) -> tuple[str, ...]:
        """Give every message without a ``UNIQ_KEY`` one; their keys, in order (none
        without ``unique_ids``)."""
        if not self.unique_ids:
            return ()
        for m in msgs:
            if UNIQ_KEY not in m.properties:
                key = f"{self.producer_id}{next(self._count):016X}"
                if isinstance(m.properties, dict):
                    m.properties[UNIQ_KEY] = key
                else:
                    m.properties = {**m.properties, UNIQ_KEY: key}
        return tuple([m.properties[UNIQ_KEY] for m in msgs])

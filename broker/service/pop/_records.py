"""The records POP writes into ``%POP%`` queue 0 (RocketMQ's revive log), and the
receipt handles it gives out.

- A CK record (tag ``CK``), one per queue a POP (or a CHANGE_INVISIBLE_TIME) took
  messages from: the group, the member, the queue, the queue offsets with their
  attempts, the deadline, the dead-letter limit and the queue's next offset after it.
  Its id (the *ck id*) is its own queue offset in ``%POP%`` queue 0.
- An ACK record (tag ``ACK``), one per accepted ACK_MESSAGE, CHANGE_INVISIBLE_TIME or
  dead letter: the group and the deliveries it settles, as ``[topic, queue, offset, ck]``.

Bodies are msgpack maps; a record that does not decode is skipped by a replay (logged).
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import msgpack

from clmq.common import POP_TOPIC, Message

POP_QUEUE = 0
CK_TAG, ACK_TAG = "CK", "ACK"


@dataclass(frozen=True)
class Checkpoint:
    """A CK record: deliveries of one queue made by one pop (or one change)."""

    group: str
    client_id: str
    topic: str
    queue_id: int
    offsets: list[int]
    attempts: list[int]
    deadline_ms: int
    max_reconsume_times: int
    next_offset: int  # the queue's next offset never popped, after this pop


@dataclass(frozen=True)
class Acks:
    """An ACK record: the deliveries ``(topic, queue_id, offset, ck)`` settled for ``group``."""

    group: str
    rows: list[tuple[str, int, int, int]]


def ck_message(ck: Checkpoint) -> Message:
    """The CK record to append."""
    body = msgpack.packb(
        {
            "g": ck.group,
            "c": ck.client_id,
            "t": ck.topic,
            "q": ck.queue_id,
            "o": ck.offsets,
            "a": ck.attempts,
            "d": ck.deadline_ms,
            "m": ck.max_reconsume_times,
            "n": ck.next_offset,
        }
    )
    return Message(POP_TOPIC, POP_QUEUE, body, CK_TAG)


def ack_message(acks: Acks) -> Message:
    """The ACK record to append."""
    body = msgpack.packb({"g": acks.group, "r": [list(r) for r in acks.rows]})
    return Message(POP_TOPIC, POP_QUEUE, body, ACK_TAG)


def decode_pop_record(tags: str, body: bytes) -> Checkpoint | Acks | None:
    """A ``%POP%`` record's meaning; None (or ValueError) if it is not one."""
    value: Any = msgpack.unpackb(body)
    if not isinstance(value, dict):
        return None
    if tags == CK_TAG:
        offsets, attempts = [int(o) for o in value["o"]], [int(a) for a in value["a"]]
        if len(offsets) != len(attempts):
            raise ValueError("a CK record's offsets and attempts differ in length")
        return Checkpoint(
            str(value["g"]),
            str(value["c"]),
            str(value["t"]),
            int(value["q"]),
            offsets,
            attempts,
            int(value["d"]),
            int(value["m"]),
            int(value["n"]),
        )
    if tags == ACK_TAG:
        rows = [(str(t), int(q), int(o), int(k)) for t, q, o, k in value["r"]]
        return Acks(str(value["g"]), rows)
    return None


MAX_HANDLE_CHARS = 4096  # a longer string is no handle of ours


def _parse_plain(text: str) -> Handle | None:
    parts = text[2:].split(".", 5)
    if len(parts) != 6 or not "".join(parts[:5]).isdigit():  # (ASCII: checked by the caller)
        return None
    try:  # (an empty number: int() refuses it)
        qid, offset, ck, deadline, blen = map(int, parts[:5])
    except ValueError:
        return None
    names = parts[5]
    if not 0 < blen < len(names):
        return None
    return Handle(names[:blen], names[blen:], qid, offset, ck, deadline)


def encode_handles(
    broker: str, topic: str, queue_id: int, offsets: Sequence[int], ck: int, deadline_ms: int
) -> list[str]:
    """``Handle(broker, topic, queue_id, offset, ck, deadline_ms).encode()`` for each
    offset (the common part formatted once: a pop gives out one per message)."""
    names = broker + topic
    if not (names.isascii() and names.isprintable()):
        return [Handle(broker, topic, queue_id, o, ck, deadline_ms).encode() for o in offsets]
    head, tail = f"P2{queue_id}.", f".{ck}.{deadline_ms}.{len(broker)}.{names}"
    return [f"{head}{o}{tail}" for o in offsets]


class Handle(NamedTuple):
    """What a receipt handle names (a tuple: one is made per message acknowledged)."""

    broker: str
    topic: str
    queue_id: int
    offset: int
    ck: int
    deadline_ms: int

    def encode(self) -> str:
        """The opaque ASCII string given to the client: plain ("P2", numbers first, then
        the broker's name after its length, then the topic) when both names are
        printable ASCII, else base64 ("P1")."""
        names = self.broker + self.topic
        if names.isascii() and names.isprintable():
            return f"P2{self.queue_id}.{self.offset}.{self.ck}.{self.deadline_ms}.{len(self.broker)}.{names}"
        text = f"{self.broker}\n{self.topic}\n{self.queue_id}\n{self.offset}\n{self.ck}\n{self.deadline_ms}"
        return "P1" + base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def parse_handle(text: str) -> Handle | None:
    """The handle ``text`` names; None if it is not a receipt handle."""
    if len(text) > MAX_HANDLE_CHARS or not text.isascii():
        return None
    if text.startswith("P2"):
        return _parse_plain(text)
    if not text.startswith("P1"):
        return None
    raw = text[2:]
    try:
        parts = base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)).decode().split("\n")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None
    if len(parts) != 6 or not all(p.isascii() and p.isdigit() for p in parts[2:]):
        return None
    return Handle(parts[0], parts[1], int(parts[2]), int(parts[3]), int(parts[4]), int(parts[5]))

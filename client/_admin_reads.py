"""The admin client's reads of messages and its changes to consumer groups: a queue
read without a group, a message by id or by key, offsets reset, a group deleted."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from commitlog import Record
from protocol import ErrorCode, RequestCode, decode_records
from protocol.transport import RpcClient, RpcError

KEY_SCAN_CHUNK_MESSAGES = 256  # one PULL_MESSAGE of a key lookup's scan


class _Calls(Protocol):
    rpc: RpcClient
    timeout_ms: int

    async def _call(self, addr: str, code: int, fields: dict[str, Any] | None = None) -> dict[str, Any]: ...
    async def leaders(self) -> list[dict[str, Any]]: ...


@dataclass
class KeyLookup:
    """What :meth:`Admin.messages_by_key` found: the messages, how many it read, and
    whether it read every message in the time range (``complete``) or stopped at its
    ``max_scan_messages`` (older messages then were not searched)."""

    records: list[Record]
    scanned: int
    complete: bool


def parse_msg_id(msg_id: str) -> tuple[str, int]:
    """``host:port@HEXOFFSET`` (what a send returns) -> (broker address, CommitLog offset)."""
    addr, sep, hexoff = msg_id.rpartition("@")
    try:
        if not sep or ":" not in addr:
            raise ValueError
        return addr, int(hexoff, 16)
    except ValueError:
        raise ValueError(f"message id {msg_id!r} is not host:port@HEXOFFSET (as a send returns it)") from None


async def pull(admin: _Calls, addr: str, topic: str, queue_id: int, offset: int, max_messages: int) -> tuple[list[Record], int]:
    """One PULL_MESSAGE without a group: the records and the next offset."""
    fields = {"topic": topic, "queue_id": queue_id, "offset": offset, "max_messages": max_messages, "max_wait_ms": 0}
    reply = await admin.rpc.request(addr, RequestCode.PULL_MESSAGE, fields, timeout_ms=admin.timeout_ms)
    return decode_records(reply.body), int(reply.fields["next_offset"])


async def topic_leaders(admin: _Calls, topic: str, broker_name: str | None = None) -> list[dict[str, Any]]:
    """The group leaders that have ``topic`` (only ``broker_name``'s if given), each
    with its queues' offsets (``queues``)."""
    found = []
    for b in await admin.leaders():
        if broker_name is not None and b["broker_name"] != broker_name:
            continue
        try:
            info = await admin._call(b["addr"], RequestCode.DESCRIBE_TOPIC, {"topic": topic})
        except RpcError as e:
            if e.code == ErrorCode.TOPIC_NOT_FOUND:
                continue
            raise
        found.append({**b, "queues": info["queues"]})
    return found


async def scan_for_key(admin: _Calls, topic: str, key: str, *, max_messages: int, max_scan_messages: int,
                       since_ms: int | None, until_ms: int | None) -> KeyLookup:  # fmt: skip
    """Read each queue's newest messages (from ``since_ms`` if given) for ``key``."""
    leaders = await topic_leaders(admin, topic)
    queues = [(b["addr"], q) for b in leaders for q in b["queues"]]
    budget = max_scan_messages // max(1, len(queues))
    out: list[Record] = []
    scanned, complete = 0, True
    for addr, q in queues:
        required = q["min_offset"]
        if since_ms is not None:
            found = await admin._call(addr, RequestCode.SEARCH_OFFSET,
                                      {"topic": topic, "queue_id": q["queue_id"], "timestamp_ms": since_ms})  # fmt: skip
            required = max(required, int(found["offset"]))
        start = max(required, q["max_offset"] - budget)  # the newest messages within the budget
        complete = complete and start == required
        offset = start
        while offset < q["max_offset"]:
            records, offset = await pull(admin, addr, topic, q["queue_id"], offset, KEY_SCAN_CHUNK_MESSAGES)
            if not records:
                break
            scanned += len(records)
            out += [r for r in records if key in r.keys.split() and (until_ms is None or r.store_timestamp_ms <= until_ms)]
    out.sort(key=lambda r: r.store_timestamp_ms, reverse=True)
    return KeyLookup(out[:max_messages], scanned, complete)

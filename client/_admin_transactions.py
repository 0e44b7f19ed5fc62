"""Transactions seen by the admin client: the half messages pending on every broker
group's leader (LIST_TRANSACTIONS, merged), and one half message by its id with its
state (``clmq transaction list|show``, docs/transactions.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from clmq.common import PROP_REAL_QID, PROP_REAL_TAGS, PROP_REAL_TOPIC, PROP_TRAN_GROUP, PROP_TRAN_HALF, Record
from clmq.protocol import ErrorCode, RequestCode, decode_records
from clmq.protocol.transport import RpcError

from ._admin_calls import AdminCalls
from ._msg_id import format_msg_id, parse_msg_id

LIST_MAX_PENDING = 1000  # pending half messages asked of each leader by list_transactions (the broker may clamp)
SHOW_MAX_PENDING = 100_000  # transaction_by_id looks its half message up among this many pending ones
SHOW_INDEX_MAX_RESULTS = 16  # transaction_by_id asks the key index for this many messages of the UNIQ_KEY


@dataclass(frozen=True)
class PendingTransaction:
    """A half message not ended yet, as its broker group's leader lists it."""

    broker_name: str
    addr: str
    commitlog_offset: int
    group: str
    topic: str  # the real topic
    queue_id: int  # the real queue
    keys: str
    uniq_key: str
    stored_ms: int
    checks: int  # check-backs asked so far
    last_check_ms: int  # 0: never checked

    @property
    def msg_id(self) -> str:
        return format_msg_id(self.addr, self.commitlog_offset)


@dataclass(frozen=True)
class TransactionList:
    """:meth:`Admin.list_transactions`: pending half messages (oldest first per broker),
    and per broker its counts since start (``total`` pending, ``committed``,
    ``rolled_back``, ``checks``; ``listed``: how many of its pending ones are here)."""

    pending: list[PendingTransaction] = field(default_factory=list)
    brokers: list[dict[str, Any]] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(int(b["total"]) for b in self.brokers)


@dataclass(frozen=True)
class TransactionView:
    """One half message (``clmq transaction show``): the record as stored, where it goes,
    and its ``state``: "pending" (with its checks), "committed" (``committed_msg_id``:
    the message in its real queue, when the key index found it), or "ended" (committed
    or rolled back: nothing pending there, the committed copy not found)."""

    msg_id: str
    record: Record
    state: str
    pending: PendingTransaction | None = None
    committed_msg_id: str = ""

    @property
    def group(self) -> str:
        return self.record.properties.get(PROP_TRAN_GROUP, "")

    @property
    def topic(self) -> str:
        return self.record.properties.get(PROP_REAL_TOPIC, "")

    @property
    def queue_id(self) -> int:
        return int(self.record.properties.get(PROP_REAL_QID, "-1") or -1)

    @property
    def tags(self) -> str:
        return self.record.properties.get(PROP_REAL_TAGS, "")


async def list_transactions(
    calls: AdminCalls, group: str | None, max_messages: int = LIST_MAX_PENDING
) -> TransactionList:
    """LIST_TRANSACTIONS on every group's leader (of ``group`` only, if given), merged."""
    out = TransactionList()
    for b in await calls.leaders():
        asked: dict[str, Any] = {"max_messages": max_messages}
        if group:
            asked["group"] = group
        f = await calls.call(b["addr"], RequestCode.LIST_TRANSACTIONS, asked)
        rows = [_pending(b, p) for p in f.get("pending") or ()]
        out.pending.extend(rows)
        counts = {k: int(f.get(k, 0)) for k in ("total", "committed", "rolled_back", "checks")}
        out.brokers.append({"broker_name": b["broker_name"], "addr": b["addr"], **counts, "listed": len(rows)})
    return out


def _pending(broker: dict[str, Any], p: dict[str, Any]) -> PendingTransaction:
    return PendingTransaction(
        str(broker["broker_name"]),
        str(broker["addr"]),
        int(p["commitlog_offset"]),
        str(p.get("group", "")),
        str(p.get("topic", "")),
        int(p.get("queue_id", -1)),
        str(p.get("keys", "")),
        str(p.get("uniq_key", "")),
        int(p.get("stored_ms", 0)),
        int(p.get("checks", 0)),
        int(p.get("last_check_ms", 0)),
    )


async def transaction_by_id(calls: AdminCalls, msg_id: str) -> TransactionView | None:
    """The half message ``msg_id`` names and its state; None if that broker has no
    message there. ValueError for a message that is not a half message."""
    addr, offset = parse_msg_id(msg_id)
    try:
        reply = await calls.rpc.request(
            addr, RequestCode.GET_MESSAGE, {"commitlog_offset": offset}, timeout_ms=calls.timeout_ms
        )
    except RpcError as e:
        if e.code == ErrorCode.NOT_FOUND:
            return None
        raise
    record = decode_records(reply.body, f"message {msg_id}")[0]
    group = record.properties.get(PROP_TRAN_GROUP)
    if group is None:
        raise ValueError(f"message {msg_id} is not a half message (topic {record.topic!r}, no {PROP_TRAN_GROUP})")
    f = await calls.call(addr, RequestCode.LIST_TRANSACTIONS, {"group": group, "max_messages": SHOW_MAX_PENDING})
    broker = {"broker_name": "", "addr": addr}
    for p in f.get("pending") or ():
        if int(p["commitlog_offset"]) == offset:
            return TransactionView(msg_id, record, "pending", _pending(broker, p))
    committed = await _committed_copy(calls, addr, record)
    return TransactionView(msg_id, record, "committed" if committed else "ended", None, committed)


async def _committed_copy(calls: AdminCalls, addr: str, half: Record) -> str:
    """The id of the committed copy of ``half`` (a message of its real topic with its
    UNIQ_KEY and TRAN_HALF naming it), found through the key index; "" if none was (or
    the broker has no index)."""
    uniq, topic = half.properties.get("UNIQ_KEY", ""), half.properties.get(PROP_REAL_TOPIC, "")
    if not uniq or not topic:
        return ""
    asked = {"topic": topic, "key": uniq, "max_results": SHOW_INDEX_MAX_RESULTS}
    try:
        reply = await calls.rpc.request(addr, RequestCode.QUERY_INDEX, asked, timeout_ms=calls.timeout_ms)
    except RpcError:
        return ""  # no index (partition mode, disabled), or nothing there
    for r in decode_records(reply.body, f"QUERY_INDEX answer from {addr}") if reply.body else ():
        if r.properties.get(PROP_TRAN_HALF) == str(half.commitlog_offset):
            return format_msg_id(addr, r.commitlog_offset)
    return ""

"""The admin client: topics, groups, users and ACLs across the brokers a name server knows."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Iterable, Sequence

import trio

from clmq.common import Record, is_system_topic
from clmq.protocol import ErrorCode, RequestCode, decode_records
from clmq.protocol.auth import DEFAULT_ITERATIONS, AclBinding, AclFilter
from clmq.protocol.transport import ClientSecurity, ConnectionFailed, RpcClient, RpcError, background_nursery

from . import _admin_groups, _admin_security
from ._admin_calls import AdminCalls
from ._admin_index import KeyIndexQueries
from ._admin_reads import (
    CancelResult,
    DeadLetter,
    KeyLookup,
    ResendResult,
    dead_letter_counts,
    describe_topic,
    pull,
    read_dead_letters,
    resend_dead_letters,
    scan_for_key,
    topic_leaders,
)
from ._admin_security import DEFAULT_MECHANISMS
from ._admin_spread import spread_topic
from ._admin_trace import TRACE_MAX_EVENTS, MessageTrace, trace_lookup
from ._admin_transactions import TransactionList, TransactionView, list_transactions, transaction_by_id
from ._arguments import resolve_addrs, resolve_security
from ._msg_id import parse_msg_id

CANCEL_BUSY_RETRY_S = 10  # a cancel waits this long at most for a broker's timer to start
DEFAULT_MAX_KEY_SCAN_MESSAGES = 100_000  # a key lookup reads at most this many messages (no key index yet)


class Admin(KeyIndexQueries):
    """Use :func:`open_admin` (trio) or :class:`client.BlockingAdmin`."""

    def __init__(
        self,
        rpc: RpcClient,
        namesrv_addrs: str | Sequence[str] | None,
        broker_addrs: str | Sequence[str] | None = None,
        timeout_ms: int = 5000,
    ) -> None:
        namesrv, brokers = resolve_addrs(namesrv_addrs, broker_addrs)  # a string or a list, or $CLMQ_NAMESRV
        self.rpc = rpc
        self.calls = AdminCalls(rpc, namesrv, brokers, timeout_ms)

    async def brokers(self) -> list[dict[str, Any]]:
        """Every broker: from any name server that answers, else the given broker addresses."""
        return await self.calls.brokers()

    async def leaders(self) -> list[dict[str, Any]]:
        """Every group's leader (a broker without replication is its own group's leader):
        the brokers that take writes and answer for their group."""
        return await self.calls.leaders()

    async def replica_status(self, addr: str) -> dict[str, Any]:
        """One broker's replication state (REPLICA_STATUS): role, epoch, log end, and a
        leader's view of its followers (lag in bytes and ms, in sync)."""
        return await self.calls.call(addr, RequestCode.REPLICA_STATUS)

    async def promote(self, addr: str, *, force: bool = False) -> int:
        """Make the follower at ``addr`` its group's leader; returns the new epoch.
        Refused (NOT_IN_SYNC) for a follower not known in sync unless ``force``."""
        return int((await self.calls.call(addr, RequestCode.PROMOTE, {"force": force}))["epoch"])

    async def create_topic(self, topic: str, queue_count: int, on: list[str] | None = None) -> list[str]:
        """Create (or grow) ``topic`` on the brokers ``on`` (default: every group's
        leader; followers copy it)."""
        addrs = on or [b["addr"] for b in await self.leaders()]
        if not addrs:
            raise ConnectionFailed("no broker is registered with the name servers yet")
        for addr in addrs:
            await self.calls.call(addr, RequestCode.CREATE_TOPIC, {"topic": topic, "queue_count": queue_count})
        return addrs

    async def delete_topic(self, topic: str) -> list[str]:
        """Delete ``topic`` on every broker that has it; returns their addresses."""
        done = []
        for b in await self.leaders():
            try:
                await self.calls.call(b["addr"], RequestCode.DELETE_TOPIC, {"topic": topic})
                done.append(b["addr"])
            except RpcError:
                pass
        return done

    async def list_topics(self, *, include_system: bool = False) -> dict[str, dict[str, int]]:
        """topic -> {broker name: queue count}; system topics (``%TIMER%``,
        ``%RETRY%group``, ``%DLQ%group``) only with ``include_system``."""
        out: dict[str, dict[str, int]] = {}
        for b in await self.leaders():
            asked = {"include_system": True} if include_system else None
            topics = (await self.calls.call(b["addr"], RequestCode.LIST_TOPICS, asked))["topics"]
            for name, count in topics.items():
                out.setdefault(name, {})[b["broker_name"]] = count
        return dict(sorted(out.items()))

    async def describe_topic(self, topic: str) -> list[dict[str, Any]]:
        """Per queue of ``topic`` on every group leader that has it: broker_name, addr,
        queue_id, min/max offset, size_bytes."""
        return await describe_topic(self.calls, topic)

    async def list_groups(self, *, include_system: bool = False) -> list[str]:
        """Every group with committed offsets or members; the reserved ``%...`` groups
        (``%DLQ_RESENT%group``: dead letters resent) only with ``include_system``."""
        groups: set[str] = set()
        for b in await self.leaders():
            groups |= set((await self.calls.call(b["addr"], RequestCode.LIST_GROUPS))["groups"])
        return sorted(g for g in groups if include_system or not is_system_topic(g))

    async def describe_group(self, group: str) -> dict[str, Any]:
        """Per queue: committed offset, max offset and lag (``%RETRY%group`` included
        once the group committed there); the members; and per broker (``retries``)
        and in all, the retry backlog (messages of ``%RETRY%group`` not consumed yet)
        and the dead letters (messages ``%DLQ%group`` holds); ``pop``: per broker whose
        leader has POP state for the group, DESCRIBE_GROUP's ``pop`` part with its
        ``broker_name`` (queues with next/settled offsets, lag, in-flight and
        redelivering counts; members; counts of pops, acks, expired acks,
        redeliveries and dead letters), empty for a group that never popped."""
        return await _admin_groups.describe_group(self.calls, group)

    async def cancel_message(self, msg_id: str) -> CancelResult:
        """Cancel a scheduled message by the id its send returned (``host:port@HEXOFFSET``):
        state "cancelled", "already_cancelled", "too_late" (delivered, or due within the
        broker's ``timer_cancel_margin_ms``) or "not_found". ValueError for a malformed id."""
        addr, offset = parse_msg_id(msg_id)
        with trio.move_on_after(CANCEL_BUSY_RETRY_S):  # SYSTEM_BUSY: the broker's timer is starting
            while True:
                try:
                    got = await self.calls.call(addr, RequestCode.CANCEL_MESSAGE, {"commitlog_offset": offset})
                    return CancelResult(str(got["state"]), int(got.get("deliver_at_ms", 0)))
                except RpcError as e:
                    if e.code == ErrorCode.NOT_FOUND:
                        return CancelResult("not_found", 0)
                    if e.code != ErrorCode.SYSTEM_BUSY:
                        raise
                await trio.sleep(0.05)
        raise RpcError(addr, ErrorCode.SYSTEM_BUSY, f"the broker's timer did not start within {CANCEL_BUSY_RETRY_S} s")

    async def dead_letters(self, group: str, *, max_messages: int = 100, start: int = 0) -> list[DeadLetter]:
        """Up to ``max_messages`` of ``group``'s dead letters (``%DLQ%group`` queue 0,
        from offset ``start``) on every broker that has them, each with its broker.
        The origin topic, queue and offset are properties (``DeadLetter.origin_*``)."""
        if max_messages < 1 or start < 0:
            raise ValueError("max_messages must be at least 1 and start not negative")
        return await read_dead_letters(self.calls, group, max_messages, start)

    async def dead_letter_counts(self, group: str | None = None) -> list[dict[str, Any]]:
        """Groups with dead letters (only ``group`` if given), one row per group and
        broker: group, broker_name, addr, dead_letters, not_resent, min/max_offset."""
        return await dead_letter_counts(self.calls, group)

    async def resend_dead_letters(
        self, group: str, *, offsets: list[int] | None = None, resend_all: bool = False
    ) -> ResendResult:
        """Send ``group``'s dead letters again, as fresh messages (reconsume count 0;
        body, tags, keys and the user's properties, without ``ORIGIN_*``/``DLQ_GROUP``),
        to their origin topic (the origin queue when it still exists): the group
        consumes them again. Only those past each broker's resend mark (the committed
        offset of the reserved group ``%DLQ_RESENT%group`` on the DLQ), which then moves
        past the last one resent: a second call resends nothing new. ``offsets``: only
        these DLQ offsets; ``resend_all``: ignore the mark."""
        return await resend_dead_letters(self.calls, group, None if offsets is None else set(offsets), resend_all)

    async def group_members(self, group: str) -> list[dict[str, Any]]:
        """The group's connected members (client_id, mode, topics) and the queues each
        reads now (``queues``: [[topic, broker_name, queue_id], ...]), computed as the
        members compute them (:func:`allocate_averagely`; broadcasting: every queue)."""
        return await _admin_groups.group_members(self.calls, group)

    async def delete_group(self, group: str) -> list[str]:
        """Forget ``group``'s committed offsets on every broker that has some; the names
        of those brokers (empty: no broker knows the group). RpcError GROUP_ACTIVE while
        members are connected."""
        return await _admin_groups.delete_group(self.calls, group)

    async def reset_offsets(
        self,
        group: str,
        topic: str,
        *,
        to: str | int = "earliest",
        timestamp_ms: int | None = None,
        queue_ids: list[int] | None = None,
        dry_run: bool = False,
        force: bool = False,
    ) -> list[dict[str, Any]]:
        """Set ``group``'s committed offsets of ``topic`` (its queues ``queue_ids``, or
        all) to ``to`` ("earliest", "latest" or an exact offset, clamped to what the
        queue holds), or to the first message stored at or after ``timestamp_ms``.
        Rows: broker_name, topic, queue_id, before (-1: none), after. Refused
        (ValueError) while the group has members connected unless ``force`` (they
        would overwrite the reset with their next commit); ``dry_run`` changes nothing."""
        if not force and await self.group_members(group):
            raise ValueError(f"group {group!r} has members connected: stop them first (or force)")
        return await _admin_groups.reset_offsets(self.calls, group, topic, to, timestamp_ms, queue_ids, dry_run)

    async def read_queue(
        self, topic: str, queue_id: int, offset: int, max_messages: int = 32, broker_name: str | None = None
    ) -> list[Record]:
        """Up to ``max_messages`` of one queue from ``offset``, without a consumer group
        (nothing is committed). ValueError for a topic or queue that does not exist."""
        for b in await topic_leaders(self.calls, topic, broker_name):
            if any(q["queue_id"] == queue_id for q in b["queues"]):
                return (await pull(self.calls, b["addr"], topic, queue_id, offset, max_messages))[0]
        raise ValueError(f"topic {topic!r} has no queue {queue_id}" + (f" on {broker_name}" if broker_name else ""))

    async def list_transactions(self, group: str | None = None) -> TransactionList:
        """Pending half messages on every group's leader (of producer ``group`` only), merged."""
        return await list_transactions(self.calls, group)

    async def transaction(self, msg_id: str) -> TransactionView | None:
        """The half message ``msg_id`` names and its state (None: no message there)."""
        return await transaction_by_id(self.calls, msg_id)

    async def message_by_id(self, msg_id: str) -> Record | None:
        """The message a send's id names (``host:port@HEXOFFSET``); None if that broker
        has no message there (retention removed it, or the id is made up)."""
        addr, offset = parse_msg_id(msg_id)
        try:
            reply = await self.rpc.request(
                addr, RequestCode.GET_MESSAGE, {"commitlog_offset": offset}, timeout_ms=self.calls.timeout_ms
            )
        except RpcError as e:
            if e.code == ErrorCode.NOT_FOUND:
                return None
            raise
        return decode_records(reply.body, f"message {msg_id}")[0]

    async def messages_by_key(
        self,
        topic: str,
        key: str,
        *,
        max_messages: int = 32,
        since_ms: int | None = None,
        until_ms: int | None = None,
        max_scan_messages: int = DEFAULT_MAX_KEY_SCAN_MESSAGES,
    ) -> KeyLookup:
        """Messages of ``topic`` carrying ``key`` among their keys, newest first, by a
        bounded scan (for brokers without a key index; :meth:`find_by_key` uses the
        index): each queue's newest messages are read (from ``since_ms`` if given), at
        most ``max_scan_messages`` in all; the result says if that cut it short."""
        if max_scan_messages < 1 or max_messages < 1:
            raise ValueError("max_scan_messages and max_messages must be at least 1")
        return await scan_for_key(
            self.calls,
            topic,
            key,
            max_messages=max_messages,
            max_scan_messages=max_scan_messages,
            since_ms=since_ms,
            until_ms=until_ms,
        )

    async def trace(
        self,
        msg_id: str | None = None,
        *,
        key: str | None = None,
        topic: str | None = None,
        since_ms: int | None = None,
        until_ms: int | None = None,
        max_events: int = TRACE_MAX_EVENTS,
    ) -> MessageTrace:
        """The life of message ``msg_id`` (or of the messages of ``topic`` carrying
        ``key``) as a timeline of the trace events recorded in ``%TRACE%`` (docs/traces.md);
        records older than the brokers' ``trace_retention_ms`` are left out."""
        return await trace_lookup(self, msg_id, key, topic, since_ms, until_ms, max_events)

    async def spread_topic(
        self, topic: str, queues: int | None, *, groups: Sequence[str] | str | None = None, grow: bool = False
    ) -> dict[str, int]:
        """Create (or with ``grow``, grow) ``topic`` to ``queues`` in total, spread over the
        broker groups ``groups`` (names or ``"all"``); each group's queue count after.
        ValueError for a shrink, an unknown group or (``grow``) a missing topic (``_admin_spread``)."""
        return await spread_topic(self.calls, topic, queues, groups, grow)

    async def broker_info(self, addr: str) -> dict[str, Any]:
        """One broker's BROKER_INFO: name, role, store and connection figures."""
        return await self.calls.call(addr, RequestCode.BROKER_INFO)

    # ------------------------------------------------------------ users and ACLs
    # Each broker group's leader keeps its own copy (followers copy it): a change goes
    # to every leader (see ``_admin_security``: idempotent, run it again after a failure).
    async def add_user(
        self,
        user: str,
        password: str,
        *,
        mechanisms: Sequence[str] = DEFAULT_MECHANISMS,
        iterations: int = DEFAULT_ITERATIONS,
    ) -> list[str]:
        """Add ``user``, or set its password (its credentials replaced), on every group's
        leader; the broker names. The credential is salted here: the password never
        travels. ValueError for a bad name, mechanism, iteration count or empty password."""
        return await _admin_security.add_user(self.calls, user, password, mechanisms, iterations)

    async def delete_user(self, user: str) -> list[str]:
        """Delete ``user`` on every leader that has it; their broker names (empty: none had it)."""
        return await _admin_security.delete_user(self.calls, user)

    async def list_users(self) -> dict[str, list[str]]:
        """user -> its SCRAM mechanisms, over every group's leader."""
        return _admin_security.merge_users(await self.users_by_broker())

    async def users_by_broker(self) -> dict[str, dict[str, list[str]]]:
        """broker name -> (user -> mechanisms), as each group's leader has them."""
        return await _admin_security.users_by_broker(self.calls)

    async def create_acls(self, bindings: Iterable[AclBinding]) -> list[str]:
        """Add ``bindings`` (present ones stay as they are) on every leader; the broker names."""
        return await _admin_security.create_acls(self.calls, bindings)

    async def describe_acls(self, match: AclFilter | None = None) -> list[AclBinding]:
        """The bindings ``match`` selects (None: all), over every group's leader."""
        return _admin_security.merge_acls(await self.acls_by_broker(match))

    async def acls_by_broker(self, match: AclFilter | None = None) -> dict[str, list[AclBinding]]:
        """broker name -> the bindings ``match`` selects, as each group's leader has them."""
        return await _admin_security.acls_by_broker(self.calls, match)

    async def delete_acls(self, match: AclFilter | None = None) -> list[AclBinding]:
        """Remove the bindings ``match`` selects on every leader (None or an empty
        filter: every binding); those removed."""
        return await _admin_security.delete_acls(self.calls, match)


@asynccontextmanager
async def open_admin(
    namesrv_addrs: str | Sequence[str] | None = None,
    *,
    broker_addrs: str | Sequence[str] | None = None,
    security: ClientSecurity | None = None,
) -> AsyncIterator[Admin]:
    """An admin client for trio code: ``async with open_admin("127.0.0.1:9876") as admin:``.
    Addresses are a string (``"h1:9876,h2:9876"``) or a list; with neither, ``$CLMQ_NAMESRV``.
    ``security``: TLS and a login (None: from ``$CLMQ_TLS_*``, ``$CLMQ_USER``, ``$CLMQ_PASSWORD``)."""
    namesrv, brokers = resolve_addrs(namesrv_addrs, broker_addrs)  # errors here, before anything starts
    resolved = resolve_security(security)
    async with background_nursery() as nursery:
        rpc = RpcClient(nursery, security=resolved)
        try:
            yield Admin(rpc, namesrv, brokers)
        finally:
            await rpc.aclose()
            nursery.cancel_scope.cancel()

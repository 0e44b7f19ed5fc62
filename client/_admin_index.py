"""The admin client's look-up by key through the brokers' key indexes (QUERY_INDEX):
every group leader asked, the answers merged newest first."""

from __future__ import annotations

from dataclasses import dataclass

from clmq.common import Record
from clmq.protocol import ErrorCode, RequestCode, decode_records
from clmq.protocol.transport import RpcError

from ._admin_calls import AdminCalls

DEFAULT_MAX_KEY_RESULTS = 1000  # Admin.find_by_key's default bound on the messages returned


@dataclass
class IndexLookup:
    """What :meth:`Admin.find_by_key` found: records newest first, and whether more
    matched than ``max_results`` (on some broker, or all brokers together);
    ``index_lag_bytes``: log bytes the brokers' indexes did not hold when asked,
    summed (0 unless a broker's index writes fail, or failed and left more than its
    ``index_query_catch_up_bytes`` unindexed: messages there may be missing)."""

    records: list[Record]
    truncated: bool
    index_lag_bytes: int = 0


async def find_by_key(
    calls: AdminCalls,
    topic: str,
    key: str,
    *,
    since_ms: int | None = None,
    until_ms: int | None = None,
    max_results: int = DEFAULT_MAX_KEY_RESULTS,
) -> IndexLookup:
    """Ask every group leader's key index for ``topic``'s messages with ``key`` (one of
    their keys, or their UNIQ_KEY) stored in ``[since_ms, until_ms]``; merged newest first.

    RpcError REQUEST_NOT_SUPPORTED when a broker has no key index (partition-per-file
    mode, or ``index_enabled`` off): the caller may fall back to a bounded scan."""
    if max_results < 1:
        raise ValueError(f"max_results must be at least 1, got {max_results}")
    fields: dict[str, object] = {"topic": topic, "key": key, "max_results": max_results}
    if since_ms is not None:
        fields["since_ms"] = since_ms
    if until_ms is not None:
        fields["until_ms"] = until_ms
    records: list[Record] = []
    truncated = False
    lag = 0
    for b in await calls.leaders():
        try:
            reply = await calls.rpc.request(b["addr"], RequestCode.QUERY_INDEX, fields, timeout_ms=calls.timeout_ms)
        except RpcError as e:
            if e.code == ErrorCode.TOPIC_NOT_FOUND:
                continue
            raise
        records += decode_records(reply.body, f"QUERY_INDEX answer of {b['addr']}")
        truncated = truncated or bool(reply.fields.get("truncated"))
        lag += int(reply.fields.get("index_lag_bytes") or 0)  # absent from brokers before it was added
    records.sort(key=lambda r: (r.store_timestamp_ms, r.commitlog_offset), reverse=True)
    return IndexLookup(records[:max_results], truncated or len(records) > max_results, lag)


class KeyIndexQueries:
    """:class:`Admin`'s look-up by key (a base class: it needs only ``self.calls``)."""

    calls: AdminCalls

    async def find_by_key(
        self,
        topic: str,
        key: str,
        *,
        since_ms: int | None = None,
        until_ms: int | None = None,
        max_results: int = DEFAULT_MAX_KEY_RESULTS,
    ) -> IndexLookup:
        """Messages of ``topic`` (system topics such as ``%TRACE%`` too) with ``key``
        among their keys (split on whitespace) or as their UNIQ_KEY, stored in
        ``[since_ms, until_ms]`` (ms since the epoch, both ends included), newest
        first, at most ``max_results`` (``truncated`` says more matched), from every
        broker group's key index over its whole retained log.

        RpcError REQUEST_NOT_SUPPORTED from a broker without a key index
        (partition-per-file mode, ``index_enabled`` off)."""
        return await find_by_key(self.calls, topic, key, since_ms=since_ms, until_ms=until_ms, max_results=max_results)

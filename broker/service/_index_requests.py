"""QUERY_INDEX: messages by key or UNIQ_KEY through the store's key index (see
``protocol/_codes.py`` for the contract and docs/operations.md "The key index")."""

from __future__ import annotations

from clmq.broker.store import KeyMatches, Store
from clmq.protocol import ErrorCode, Frame
from clmq.protocol.transport import Peer, Reply, RequestError, need

from ._context import BrokerContext
from ._read_threads import ReadThreads


def index_fields(store: object) -> dict[str, int | str]:
    """BROKER_INFO's view of the key index: files, entries, the log offset indexed up
    to, index writes that failed and the newest such error (-1 each and "" without
    one: partition-per-file, ``index_enabled`` off)."""
    index = store.key_index if isinstance(store, Store) else None
    if index is None:
        return {"index_files": -1, "index_entries": -1, "index_end_offset": -1, "index_failures": -1, "index_error": ""}
    return {
        "index_files": len(index.files),
        "index_entries": index.entry_count,
        "index_end_offset": index.end_offset,
        "index_failures": index.failures,
        "index_error": index.last_failure,
    }


class IndexRequests:
    """QUERY_INDEX, read in the pull-read threads (index look-ups and record reads touch the disk)."""

    def __init__(self, ctx: BrokerContext, readers: ReadThreads) -> None:
        self.ctx = ctx
        self.readers = readers

    async def query_index(self, frame: Frame, peer: Peer) -> Reply:
        """Matches newest first (``[[commitlog_offset, store_ms], ...]``), ``truncated``,
        and the records as the body, in the same order."""
        f = frame.fields
        topic, key = need(f, "topic", str), need(f, "key", str)
        limit = self.ctx.config.index_query_max_results
        max_results = min(int(f.get("max_results") or limit), limit)
        store = self.ctx.store
        if not isinstance(store, Store):
            raise RequestError(
                ErrorCode.REQUEST_NOT_SUPPORTED,
                f"the key index exists in commitlog mode only: this broker runs {self.ctx.config.storage_mode}",
            )
        since, until = f.get("since_ms"), f.get("until_ms")

        def run() -> tuple[KeyMatches | None, bytes]:
            found = store.find_by_key(topic, key, since_ms=since, until_ms=until, max_results=max_results)
            if found is None:
                return None, b""
            raw = [(r, store.log.read_bytes(r.commitlog_offset, r.size)) for r in found.records]
            found.records = [r for r, b in raw if b]  # retention may remove one meanwhile
            return found, b"".join(b for _, b in raw if b)

        found, body = await self.readers.in_thread(run)
        if found is None:
            raise RequestError(
                ErrorCode.REQUEST_NOT_SUPPORTED, f"broker {self.ctx.config.broker_name} runs with index_enabled off"
            )
        matches = [[r.commitlog_offset, r.store_timestamp_ms] for r in found.records]
        fields = {"matches": matches, "truncated": found.truncated, "index_lag_bytes": found.index_lag_bytes}
        return Reply(fields, body=body)

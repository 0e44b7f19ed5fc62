"""The native requests of POP consumption: POP_MESSAGE, ACK_MESSAGE and
CHANGE_INVISIBLE_TIME (their fields are checked before a handler runs; the wire
contract is in ``protocol/_codes.py``)."""

from __future__ import annotations

from clmq.broker.store import Span, Store
from clmq.protocol import ErrorCode, Frame, RequestCode
from clmq.protocol.transport import Handler, Peer, Reply, RequestError, need

from .._fetch import optional
from ._base import Delivery
from ._reads import INLINE_MAX_BYTES, read_inline, read_spans
from ._service import PopService


class PopRequests:
    """The handlers, bound to the broker's :class:`PopService`."""

    def __init__(self, service: PopService) -> None:
        self.service = service

    def handlers(self) -> dict[int, Handler]:
        """The request codes and their handlers (for ``Handlers.table``)."""
        return {
            RequestCode.POP_MESSAGE: self.pop_message,
            RequestCode.ACK_MESSAGE: self.ack_message,
            RequestCode.CHANGE_INVISIBLE_TIME: self.change_invisible_time,
        }

    async def pop_message(self, frame: Frame, peer: Peer) -> Reply:
        """POP_MESSAGE: the deliveries' handles, attempts and deadline; the records as stored."""
        f = frame.fields
        s = self.service
        got = await s.pop(
            need(f, "group", str),
            need(f, "client_id", str),
            need(f, "topic", str),
            max_messages=optional(f, "max_messages", 32),
            invisible_time_ms=need(f, "invisible_time_ms", int),
            queue_ids=f.get("queue_ids"),
            tags=f.get("tags"),
            orderly=bool(f.get("orderly", False)),
            max_wait_ms=optional(f, "max_wait_ms", 0),
            max_bytes=f.get("max_bytes"),
            start_from=f.get("start_from") or "earliest",
            max_reconsume_times=f.get("max_reconsume_times"),
        )
        store = s.store
        assert store is not None
        spans, sent = await s.readers.in_thread(_spans, store, got)
        if sent:
            s.ctx.traffic.add_out(sent[0].topic, len(sent), sum(sp.length for sp in spans))
        return Reply(
            {
                "handles": [d.handle for d in sent],
                "attempts": [d.attempt for d in sent],
                "deadline_ms": sent[0].deadline_ms if sent else 0,
                "count": len(sent),
            },
            spans=spans,
        )

    async def ack_message(self, frame: Frame, peer: Peer) -> Reply:
        """ACK_MESSAGE: one status per handle."""
        results = await self.service.ack(need(frame.fields, "group", str), self._handles(frame))
        return Reply({"results": results})

    async def change_invisible_time(self, frame: Frame, peer: Peer) -> Reply:
        """CHANGE_INVISIBLE_TIME: [status, new handle or ""] per handle."""
        f = frame.fields
        out = await self.service.change_invisible_time(
            need(f, "group", str), self._handles(frame), need(f, "invisible_time_ms", int)
        )
        return Reply({"results": [list(row) for row in out]})

    def _handles(self, frame: Frame) -> list[str]:
        """The request's handles; MALFORMED_REQUEST over ``pop_max_handles_per_request``
        (one request's ACK record stays well under a record's size limit)."""
        handles: list[str] = need(frame.fields, "handles", list)
        limit = self.service.config.pop_max_handles_per_request
        if len(handles) > limit:
            raise RequestError(
                ErrorCode.MALFORMED_REQUEST,
                f"{len(handles)} handles in one request: over pop_max_handles_per_request={limit}",
            )
        return handles


def _spans(store: Store, got: list[Delivery]) -> tuple[list[Span], list[Delivery]]:
    """The records of the deliveries as stored, per queue in offset order (one that
    cannot be read is left out: it comes back after its deadline). Up to
    ``INLINE_MAX_BYTES`` they are read here and go out as one buffer (a handful of
    file spans cost an open, a sendfile and a close each on the event loop); more go
    out as file spans."""
    by_queue: dict[int, list[Delivery]] = {}
    for d in got:
        by_queue.setdefault(d.queue_id, []).append(d)
    inline = sum(d.size for d in got) <= INLINE_MAX_BYTES
    spans: list[Span] = []
    parts: list[bytes] = []
    sent: list[Delivery] = []
    for qid, ds in by_queue.items():
        ds.sort(key=lambda d: d.queue_offset)
        if inline:
            where = [(d.queue_offset, d.commitlog_offset, d.size) for d in ds]
            for d, data in zip(ds, read_inline(store, ds[0].topic, qid, where)):
                if data is not None:
                    parts.append(data)
                    sent.append(d)
            continue
        for d, found in zip(ds, read_spans(store, ds[0].topic, qid, [d.queue_offset for d in ds])):
            if found is not None:
                spans += found
                sent.append(d)
    if parts:
        body = b"".join(parts)
        spans.append(Span(None, 0, len(body), body))
    return spans, sent

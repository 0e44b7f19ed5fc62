"""A consumer's requests to brokers: each within ``request_timeout_ms``, and those
for a group's leader (commits, send-backs) following the leader when it moves."""

from __future__ import annotations

from typing import Any

import trio

from clmq.protocol import ErrorCode, Frame
from clmq.protocol.transport import ConnectionFailed, RpcClient, RpcError

from .._routes import MessageQueue, NoRouteError, Routes
from ._state import ConsumerState

NET_ERRORS = (ConnectionFailed, RpcError, trio.TooSlowError, NoRouteError)


class Requests:
    """The consumer's way to its brokers (its client, its routes)."""

    def __init__(self, rpc: RpcClient, routes: Routes, state: ConsumerState) -> None:
        self.rpc = rpc
        self.routes = routes
        self.state = state

    async def request(self, addr: str, code: int, fields: dict[str, Any], timeout_ms: float | None = None) -> Frame:
        timeout_ms = timeout_ms or self.state.options.request_timeout_ms
        return await self.rpc.request(addr, code, fields, timeout_ms=timeout_ms)

    async def to_leader(self, mq: MessageQueue, addr: str, code: int, fields: dict[str, Any]) -> Frame:
        """A request to ``mq``'s group leader at ``addr``; a dead or demoted leader (the
        connection fails, NOT_LEADER) is followed to the leader fresh routes name, for
        up to ``retry_budget_ms``. Raises the last failure (one of ``NET_ERRORS``)."""
        deadline = trio.current_time() + self.state.options.retry_budget_ms / 1000
        delay = 0.05
        while True:
            try:
                return await self.request(addr, code, fields)
            except NET_ERRORS as e:
                if not _leader_moved(e) or trio.current_time() + delay > deadline:
                    raise
            await trio.sleep(delay)
            delay = min(delay * 2, 0.5)
            addr = await self._leader_now(mq, addr)

    async def _leader_now(self, mq: MessageQueue, addr: str) -> str:
        """The address of ``mq``'s group leader as fresh routes say (``addr`` if unknown)."""
        routes = self.routes
        try:
            mqs = await routes.queues(mq.topic, refresh=True)
        except NET_ERRORS:
            return addr
        self.state.rebalance_soon()  # move the group's queues to its new leader
        return next(
            (
                m.addr
                for m in mqs
                if (m.broker_name, m.queue_id) == (mq.broker_name, mq.queue_id) and m.addr not in routes.leaderless
            ),
            addr,
        )


def _leader_moved(e: BaseException) -> bool:
    """A failure after which the group may have a new leader (retry there)."""
    if isinstance(e, RpcError):
        return e.code in (ErrorCode.NOT_LEADER, ErrorCode.SHUTTING_DOWN)
    return isinstance(e, (ConnectionFailed, trio.TooSlowError))

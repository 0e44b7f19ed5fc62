"""A consumer's place in its group: heartbeats to the brokers of its topics, its share
of the group's queues, and requests that follow a group's leader when it moves.

- The share: every member splits the group's queues alike (:func:`allocate_averagely`
  over sorted members and queues), again every ``rebalance_interval_ms``, and at once
  when a group's leader may have moved (:meth:`Membership.rebalance_soon`). What the
  share means for the queues read (taken, moved, released; orderly: locked first) is
  the consumer's part (``apply_share``).
- A topic without a route keeps the queues of it that the member has: a name server
  that does not answer for a while must not make every member drop its queues.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import trio

from clmq.protocol import ErrorCode, Frame, RequestCode
from clmq.protocol.transport import ConnectionFailed, RpcError

from .._routes import MessageQueue, NoRouteError, Routes
from ._allocate import allocate_averagely
from ._options import ConsumerOptions, TagFilter

log = logging.getLogger("clmq.consumer")

NET_ERRORS = (ConnectionFailed, RpcError, trio.TooSlowError, NoRouteError)


class MembershipHost(Protocol):
    """What membership needs of its consumer."""

    options: ConsumerOptions
    group: str
    client_id: str
    routes: Routes
    filters: dict[str, TagFilter]  # the subscribed topics (the group's retry topic among them)
    retry_topic: str | None

    async def request(self, addr: str, code: int, fields: dict[str, Any], timeout_ms: float | None = None) -> Frame: ...
    def current(self) -> set[MessageQueue]: ...  # the queues it reads or (orderly) wants
    async def apply_share(self, wanted: set[MessageQueue]) -> None: ...


class Membership:
    """Use :meth:`rebalance_loop` as a task; :meth:`heartbeat` every heartbeat interval."""

    def __init__(self, host: MembershipHost) -> None:
        self.c = host
        self._soon = trio.Event()

    def rebalance_soon(self) -> None:
        """Rebalance now, not at the next interval (a group's leader may have moved)."""
        self._soon.set()

    async def broker_addrs(self) -> list[str]:
        """The brokers of the subscribed topics (the retry topic lives on the same ones)."""
        addrs: set[str] = set()
        for topic in self.c.filters:
            if topic == self.c.retry_topic:
                continue
            try:
                addrs |= {mq.addr for mq in await self.c.routes.queues(topic)}
            except NET_ERRORS:
                pass
        return sorted(addrs)

    async def heartbeat(self) -> None:
        c = self.c
        groups = [{"group": c.group, "mode": c.options.mode, "topics": sorted(c.filters)}]
        for addr in await self.broker_addrs():
            try:
                await c.request(addr, RequestCode.HEARTBEAT, {"client_id": c.client_id, "groups": groups})
            except NET_ERRORS as e:
                log.debug("heartbeat to %s failed: %s", addr, e)

    async def rebalance_loop(self) -> None:
        while True:
            with trio.move_on_after(self.c.options.rebalance_interval_ms / 1000):
                await self._soon.wait()
            self._soon = trio.Event()
            await self.rebalance()

    async def rebalance(self) -> None:
        """Work out this member's share of every subscribed topic's queues, and apply it."""
        c = self.c
        wanted: set[MessageQueue] = set()
        for topic in c.filters:
            try:
                mqs = await c.routes.queues(topic, refresh=True)
            except NET_ERRORS as e:
                if topic == c.retry_topic and isinstance(e, NoRouteError) and not e.unreachable:
                    continue  # no message of this group failed yet: the broker creates it at the first send-back
                log.warning("consumer %s: no route for %s: %s", c.client_id, topic, e)
                wanted |= {mq for mq in c.current() if mq.topic == topic}  # keep what we have
                continue
            wanted |= set(await self._my_share(mqs))
        await c.apply_share(wanted)

    async def _my_share(self, mqs: list[MessageQueue]) -> list[MessageQueue]:
        c = self.c
        if c.options.mode == "broadcasting" or not mqs:
            return mqs
        members: list[str] = []
        for addr in sorted({mq.addr for mq in mqs}):  # any broker that answers (one may be down)
            try:
                reply = await c.request(addr, RequestCode.GET_GROUP_MEMBERS, {"group": c.group})
            except NET_ERRORS:
                continue
            members = list(reply.fields["members"])
            break
        if c.client_id not in members:
            members.append(c.client_id)
        return allocate_averagely(mqs, members, c.client_id)

    async def to_leader(self, mq: MessageQueue, addr: str, code: int, fields: dict[str, Any]) -> Frame:
        """A request to ``mq``'s group leader at ``addr``; a dead or demoted leader (the
        connection fails, NOT_LEADER) is followed to the leader fresh routes name, for
        up to ``retry_budget_ms``. Raises the last failure (one of ``NET_ERRORS``)."""
        deadline = trio.current_time() + self.c.options.retry_budget_ms / 1000
        delay = 0.05
        while True:
            try:
                return await self.c.request(addr, code, fields)
            except NET_ERRORS as e:
                if not _leader_moved(e) or trio.current_time() + delay > deadline:
                    raise
            await trio.sleep(delay)
            delay = min(delay * 2, 0.5)
            addr = await self._leader_now(mq, addr)

    async def _leader_now(self, mq: MessageQueue, addr: str) -> str:
        """The address of ``mq``'s group leader as fresh routes say (``addr`` if unknown)."""
        routes = self.c.routes
        try:
            mqs = await routes.queues(mq.topic, refresh=True)
        except NET_ERRORS:
            return addr
        self.rebalance_soon()  # move the group's queues to its new leader
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

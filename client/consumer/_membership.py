"""A consumer's place in its group: heartbeats to the brokers of its topics and its
share of the group's queues (requests that follow a group's leader: ``_requests``).

- The share: every member splits the group's queues alike (:func:`allocate_averagely`
  over sorted members and queues), again every ``rebalance_interval_ms``, and at once
  when a group's leader may have moved (:meth:`Membership.rebalance_soon`). What the
  share means for the queues read (taken, moved, released; orderly: locked first) is
  the consumer's part (``apply_share``).
- A topic without a route keeps the queues of it that the member has: a name server
  that does not answer for a while must not make every member drop its queues. So
  does a topic whose brokers do not list the group's members (none answers): taking
  the whole topic alone would read the other members' queues twice.
"""

from __future__ import annotations

import logging
from typing import Awaitable, Callable

import trio

from clmq.protocol import RequestCode

from .._routes import MessageQueue, NoRouteError, Routes
from ._allocate import allocate_averagely
from ._requests import NET_ERRORS, Requests
from ._state import ConsumerState

log = logging.getLogger("clmq.consumer")


class Membership:
    """Use :meth:`rebalance_loop` as a task; :meth:`heartbeat` every heartbeat interval.
    ``current()``: the queues the consumer reads or (orderly) wants; ``apply_share``:
    make the consumer read a share (both the consumer's, passed in)."""

    def __init__(
        self,
        state: ConsumerState,
        requests: Requests,
        routes: Routes,
        *,
        current: Callable[[], set[MessageQueue]],
        apply_share: Callable[[set[MessageQueue]], Awaitable[None]],
    ) -> None:
        self.state = state
        self.requests = requests
        self.routes = routes
        self.current = current
        self.apply_share = apply_share

    def rebalance_soon(self) -> None:
        """Rebalance now, not at the next interval (a group's leader may have moved)."""
        self.state.rebalance_soon()

    async def broker_addrs(self) -> list[str]:
        """The brokers of the subscribed topics (the retry topic lives on the same ones)."""
        addrs: set[str] = set()
        for topic in self.state.filters:
            if topic == self.state.retry_topic:
                continue
            try:
                addrs |= {mq.addr for mq in await self.routes.queues(topic)}
            except NET_ERRORS:
                pass
        return sorted(addrs)

    async def heartbeat(self) -> None:
        s = self.state
        groups = [{"group": s.group, "mode": s.options.mode, "topics": sorted(s.filters)}]
        for addr in await self.broker_addrs():
            try:
                await self.requests.request(addr, RequestCode.HEARTBEAT, {"client_id": s.client_id, "groups": groups})
            except NET_ERRORS as e:
                log.debug("heartbeat to %s failed: %s", addr, e)

    async def rebalance_loop(self) -> None:
        s = self.state
        while True:
            with trio.move_on_after(s.options.rebalance_interval_ms / 1000):
                await s.rebalance_wanted.wait()
            s.rebalance_wanted = trio.Event()
            await self.rebalance()

    async def rebalance(self) -> None:
        """Work out this member's share of every subscribed topic's queues, and apply it."""
        s = self.state
        wanted: set[MessageQueue] = set()
        for topic in s.filters:
            try:
                mqs = await self.routes.queues(topic, refresh=True)
            except NET_ERRORS as e:
                if isinstance(e, NoRouteError) and e.refused:
                    raise  # a login or ACL refusal: the consumer stops, saying why (retrying would not help)
                if topic == s.retry_topic and isinstance(e, NoRouteError) and not e.unreachable:
                    continue  # no message of this group failed yet: the broker creates it at the first send-back
                log.warning("consumer %s: no route for %s: %s", s.client_id, topic, e)
                wanted |= {mq for mq in self.current() if mq.topic == topic}  # keep what we have
                continue
            wanted |= set(await self._my_share(mqs))
        await self.apply_share(wanted)

    async def _my_share(self, mqs: list[MessageQueue]) -> list[MessageQueue]:
        s = self.state
        if s.options.mode == "broadcasting" or not mqs:
            return mqs
        members: list[str] | None = None
        for addr in sorted({mq.addr for mq in mqs}):  # any broker that answers (one may be down)
            try:
                reply = await self.requests.request(addr, RequestCode.GET_GROUP_MEMBERS, {"group": s.group})
            except NET_ERRORS:
                continue
            members = list(reply.fields["members"])
            break
        if members is None:  # alone by default would take the other members' queues: read them twice
            topic = mqs[0].topic
            log.warning(
                "consumer %s: cannot list the members of group %s; keeping its share of %s", s.client_id, s.group, topic
            )
            return [mq for mq in self.current() if mq.topic == topic]
        if s.client_id not in members:
            members.append(s.client_id)
        return allocate_averagely(mqs, members, s.client_id)

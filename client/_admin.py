"""The admin client: topics and groups across the brokers a name server knows."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import trio

from protocol import RequestCode
from protocol.transport import ConnectionFailed, RpcClient, RpcError, background_nursery


class Admin:
    """Use :func:`open_admin` (trio) or :class:`client.BlockingAdmin`."""

    def __init__(self, rpc: RpcClient, namesrv_addrs: list[str], broker_addrs: list[str] | None = None,
                 timeout_ms: int = 5000) -> None:  # fmt: skip
        if not namesrv_addrs and not broker_addrs:
            raise ValueError("give name server addresses or broker addresses")
        self.rpc, self.namesrv_addrs, self.broker_addrs, self.timeout_ms = rpc, namesrv_addrs, broker_addrs or [], timeout_ms

    async def _call(self, addr: str, code: int, fields: dict[str, Any] | None = None) -> dict[str, Any]:
        return (await self.rpc.request(addr, code, fields, timeout_ms=self.timeout_ms)).fields

    async def brokers(self) -> list[dict[str, Any]]:
        """Every broker: from any name server that answers, else the given broker addresses."""
        errors = []
        for ns in self.namesrv_addrs:
            try:
                return list((await self._call(ns, RequestCode.GET_CLUSTER))["brokers"])
            except (ConnectionFailed, RpcError, trio.TooSlowError) as e:
                errors.append(f"{ns}: {e or 'timed out'}")
        if self.namesrv_addrs and not self.broker_addrs:
            raise ConnectionFailed(f"no name server answered: {'; '.join(errors)}")
        return [await self._call(a, RequestCode.BROKER_INFO) for a in self.broker_addrs]

    async def leaders(self) -> list[dict[str, Any]]:
        """Every group's leader (a broker without replication is its own group's leader):
        the brokers that take writes and answer for their group."""
        return [b for b in await self.brokers() if b.get("role", "leader") != "follower"]

    async def replica_status(self, addr: str) -> dict[str, Any]:
        """One broker's replication state (REPLICA_STATUS): role, epoch, log end, and a
        leader's view of its followers (lag in bytes and ms, in sync)."""
        return await self._call(addr, RequestCode.REPLICA_STATUS)

    async def promote(self, addr: str, *, force: bool = False) -> int:
        """Make the follower at ``addr`` its group's leader; returns the new epoch.
        Refused (NOT_IN_SYNC) for a follower not known in sync unless ``force``."""
        return int((await self._call(addr, RequestCode.PROMOTE, {"force": force}))["epoch"])

    async def create_topic(self, topic: str, queue_count: int, on: list[str] | None = None) -> list[str]:
        """Create (or grow) ``topic`` on the brokers ``on`` (default: every group's
        leader; followers copy it)."""
        addrs = on or [b["addr"] for b in await self.leaders()]
        if not addrs:
            raise ConnectionFailed("no broker is registered with the name servers yet")
        for addr in addrs:
            await self._call(addr, RequestCode.CREATE_TOPIC, {"topic": topic, "queue_count": queue_count})
        return addrs

    async def delete_topic(self, topic: str) -> list[str]:
        """Delete ``topic`` on every broker that has it; returns their addresses."""
        done = []
        for b in await self.leaders():
            try:
                await self._call(b["addr"], RequestCode.DELETE_TOPIC, {"topic": topic})
                done.append(b["addr"])
            except RpcError:
                pass
        return done

    async def list_topics(self) -> dict[str, dict[str, int]]:
        """topic -> {broker name: queue count}."""
        out: dict[str, dict[str, int]] = {}
        for b in await self.leaders():
            topics = (await self._call(b["addr"], RequestCode.LIST_TOPICS))["topics"]
            for name, count in topics.items():
                out.setdefault(name, {})[b["broker_name"]] = count
        return dict(sorted(out.items()))

    async def describe_topic(self, topic: str) -> list[dict[str, Any]]:
        rows = []
        for b in await self.leaders():
            try:
                info = await self._call(b["addr"], RequestCode.DESCRIBE_TOPIC, {"topic": topic})
            except RpcError:
                continue
            rows += [{"broker_name": b["broker_name"], "addr": b["addr"], **q} for q in info["queues"]]
        return rows

    async def list_groups(self) -> list[str]:
        groups: set[str] = set()
        for b in await self.leaders():
            groups |= set((await self._call(b["addr"], RequestCode.LIST_GROUPS))["groups"])
        return sorted(groups)

    async def describe_group(self, group: str) -> dict[str, Any]:
        """Per queue: committed offset, max offset and lag; and the members."""
        queues, members = [], {}
        for b in await self.leaders():
            info = await self._call(b["addr"], RequestCode.DESCRIBE_GROUP, {"group": group})
            queues += [{"broker_name": b["broker_name"], **q} for q in info["queues"]]
            members.update({m["client_id"]: m for m in info["members"]})
        return {"group": group, "queues": queues, "members": sorted(members.values(), key=lambda m: m["client_id"]),
                "lag": sum(q["lag"] for q in queues)}  # fmt: skip


@asynccontextmanager
async def open_admin(namesrv_addrs: list[str] | None = None, *, broker_addrs: list[str] | None = None) -> AsyncIterator[Admin]:
    async with background_nursery() as nursery:
        rpc = RpcClient(nursery)
        try:
            yield Admin(rpc, namesrv_addrs or [], broker_addrs)
        finally:
            await rpc.aclose()
            nursery.cancel_scope.cancel()

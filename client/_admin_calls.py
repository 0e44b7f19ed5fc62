"""The admin client's way to the cluster: its connections, the name servers or brokers
it was given, its timeout, and the brokers they name. :class:`Admin` and its helpers
(``_admin_reads``, ``_admin_groups``) share it."""

from __future__ import annotations

from typing import Any

import trio

from clmq.protocol import ErrorCode, RequestCode
from clmq.protocol.transport import AuthenticationFailed, ConnectionFailed, RpcClient, RpcError

# A name server that answers these refuses this client: asking the next one would not help.
_REFUSED = (ErrorCode.AUTHENTICATION_REQUIRED, ErrorCode.NOT_AUTHORIZED)


class AdminCalls:
    """Requests to the cluster's brokers and name servers, each within ``timeout_ms``."""

    def __init__(self, rpc: RpcClient, namesrv_addrs: list[str], broker_addrs: list[str], timeout_ms: int) -> None:
        self.rpc = rpc
        self.namesrv_addrs = namesrv_addrs
        self.broker_addrs = broker_addrs
        self.timeout_ms = timeout_ms

    async def call(self, addr: str, code: int, fields: dict[str, Any] | None = None) -> dict[str, Any]:
        """The answer's fields (RpcError for an error answer)."""
        return (await self.rpc.request(addr, code, fields, timeout_ms=self.timeout_ms)).fields

    async def brokers(self) -> list[dict[str, Any]]:
        """Every broker: from any name server that answers, else the given broker addresses."""
        errors = []
        for ns in self.namesrv_addrs:
            try:
                return list((await self.call(ns, RequestCode.GET_CLUSTER))["brokers"])
            except AuthenticationFailed:
                raise  # the name server answered: the login is wrong, and would be at the next one
            except RpcError as e:
                if e.code in _REFUSED:
                    raise
                errors.append(f"{ns}: {e}")
            except (ConnectionFailed, trio.TooSlowError) as e:
                errors.append(f"{ns}: {e or 'timed out'}")
        if self.namesrv_addrs and not self.broker_addrs:
            raise ConnectionFailed(f"no name server answered: {'; '.join(errors)}")
        return [await self.call(a, RequestCode.BROKER_INFO) for a in self.broker_addrs]

    async def leaders(self) -> list[dict[str, Any]]:
        """Every group's leader (a broker without replication is its own group's leader):
        the brokers that take writes and answer for their group."""
        return [b for b in await self.brokers() if b.get("role", "leader") != "follower"]

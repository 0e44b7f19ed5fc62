"""Who may see a dashboard that listens beyond loopback: a viewer logs in with HTTP
Basic, and the dashboard checks those credentials by logging in to the cluster with
them (a SCRAM login to a group's leader, then BROKER_INFO, which needs DESCRIBE on
the cluster): the cluster's users and ACLs decide, the dashboard keeps none. A login
that worked is remembered for a minute (keyed by a keyed hash of the credentials,
never the password; bounded), so a page's many requests cost one login. A refusal is
logged with the viewer's address, counted, and answered no sooner than a second.

The page's data still comes through the dashboard's own client security (its
``--user`` / ``CLMQ_USER``); the viewer's login only opens the door."""

from __future__ import annotations

import collections
import hashlib
import hmac
import logging
import secrets

import trio

from clmq.client import Admin
from clmq.protocol import ErrorCode, RequestCode
from clmq.protocol.auth import ScramClient
from clmq.protocol.transport import (
    AuthenticationFailed,
    ClientSecurity,
    ConnectionFailed,
    RpcClient,
    RpcError,
    TlsSettings,
    background_nursery,
)

from ._dashboard_app import NET_ERRORS

log = logging.getLogger("clmq.dashboard")

LOGIN_CACHE_S = 60.0  # a login that worked is not checked again for this long
LOGIN_CACHE_ENTRIES = 1024  # at most this many remembered (the oldest forgotten first)
FAILURE_DELAY_S = 1.0  # a refusal is answered no sooner (the brokers' auth_failure_delay_ms default)
CHECK_TIMEOUT_MS = 5000


class ClusterLogin:
    """The dashboard's ``login`` (see :func:`serve_http`): viewers' credentials checked
    against the cluster ``admin`` reaches, through ``tls`` (the dashboard's own)."""

    def __init__(self, admin: Admin, tls: TlsSettings | None) -> None:
        self.admin, self.tls = admin, tls
        self._key = secrets.token_bytes(32)  # the cache's keys mean nothing outside this process
        self._cache: collections.OrderedDict[bytes, float] = collections.OrderedDict()  # key -> valid until
        self.failures = 0
        self.succeeded = 0

    async def checks_logins(self) -> bool:
        """Whether the cluster's brokers check logins (their AUTHENTICATE starts an
        exchange; a broker without ``auth_enabled`` answers that it has none).
        ConnectionFailed if no broker answers."""
        errors = []
        for addr in await self._leaders():
            async with background_nursery() as nursery:
                rpc = RpcClient(nursery, security=ClientSecurity(self.tls))
                try:
                    first = ScramClient("SCRAM-SHA-256", "dashboard-probe", "-").first()
                    reply = await rpc.request(
                        addr,
                        RequestCode.AUTHENTICATE,
                        {"mechanism": "SCRAM-SHA-256", "data": first},
                        timeout_ms=CHECK_TIMEOUT_MS,
                        check=False,
                    )
                except (ConnectionFailed, trio.TooSlowError) as e:
                    errors.append(str(e) or type(e).__name__)
                    continue
                finally:
                    await rpc.aclose()  # the exchange is left unfinished: no failed login is counted
            return reply.error_code == 0
        raise ConnectionFailed("no broker answered: " + "; ".join(errors))

    async def __call__(self, user: str, password: str, host: str) -> bool:
        key = hmac.new(self._key, f"{user}\0{password}".encode(), hashlib.sha256).digest()
        now = trio.current_time()
        until = self._cache.get(key)
        if until is not None and until > now:
            return True
        ok, why = await self._check(user, password)
        if ok:
            self.succeeded += 1
            self._cache[key] = trio.current_time() + LOGIN_CACHE_S
            self._cache.move_to_end(key)
            while len(self._cache) > LOGIN_CACHE_ENTRIES:
                self._cache.popitem(last=False)
            return True
        self._cache.pop(key, None)
        self.failures += 1
        log.warning("dashboard: refused login from %s (user %r): %s", host, user[:64], why)
        await trio.sleep_until(now + FAILURE_DELAY_S)
        return False

    async def _check(self, user: str, password: str) -> tuple[bool, str]:
        """(whether ``user`` logs in to the cluster and may DESCRIBE it, why not)."""
        if not password:
            return False, "no password"
        try:
            leaders = await self._leaders()
        except NET_ERRORS as e:
            return False, f"cannot check it: {e or type(e).__name__}"
        why = "no broker to check it with"
        for addr in leaders:
            async with background_nursery() as nursery:
                rpc = RpcClient(nursery, security=ClientSecurity(self.tls, user, password))
                try:
                    await rpc.request(addr, RequestCode.BROKER_INFO, timeout_ms=CHECK_TIMEOUT_MS)
                    return True, ""
                except AuthenticationFailed:
                    return False, "wrong user or password"
                except RpcError as e:
                    if e.code == ErrorCode.NOT_AUTHORIZED:
                        return False, "may not DESCRIBE the cluster"
                    why = f"cannot check it: {e}"
                except NET_ERRORS as e:
                    why = f"cannot check it: {e or type(e).__name__}"
                finally:
                    await rpc.aclose()
        return False, why

    async def _leaders(self) -> list[str]:
        return [b["addr"] for b in await self.admin.leaders()]

"""One ZooKeeper session (a kazoo client) driven from trio, and the leader's lease.

kazoo runs its own threads. Nothing here blocks the event loop: requests use kazoo's
``*_async`` calls, whose completion callback (on a kazoo thread) hands the result to
trio through the trio token; state changes and watches do the same.

The lease: ZooKeeper expires a session no sooner than ``session timeout`` after it
last heard from the client. A request sent at ``t0`` and answered proves the server
heard from this session after ``t0``, so the session (and every ephemeral node of it:
the leadership) lives at least until ``t0 + timeout`` by the server's clock. The
leader acknowledges writes only until ``t0 + LEASE_FRACTION * timeout`` of its last
answered request (renewed every ``timeout / RENEWALS_PER_TIMEOUT``), on its own
monotonic clock, which keeps counting while the process is stopped (SIGSTOP): a
leader that wakes up after its session expired finds its lease over before it can
answer anyone. The remaining quarter of the timeout covers clock-rate differences
and the time between the check and the answer leaving the socket.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import trio
from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import KazooException
from kazoo.retry import KazooRetry
from kazoo.security import make_digest_acl

log = logging.getLogger("clmq.coordination")

LEASE_FRACTION = 0.75
RENEWALS_PER_TIMEOUT = 6
REQUEST_TIMEOUT_S = 5.0  # one ZooKeeper request; kazoo keeps the request queued past it


class ZkSession:
    """A kazoo client that reconnects forever; its state as a string for status."""

    def __init__(self, hosts: str, session_timeout_ms: int, token: trio.lowlevel.TrioToken, auth: str = "") -> None:
        retry = KazooRetry(max_tries=-1, delay=0.05, backoff=2, max_delay=0.5)
        secured: dict[str, Any] = {}
        if auth:  # "user:password": digest auth; the nodes this session creates are its alone
            user, _, password = auth.partition(":")
            secured = {
                "auth_data": [("digest", auth)],
                "default_acl": [make_digest_acl(user, password, all=True)],
            }
        self.client = KazooClient(hosts=hosts, timeout=session_timeout_ms / 1000, connection_retry=retry, **secured)
        self.timeout_ms = session_timeout_ms
        self.state = "CLOSED"  # CONNECTED, SUSPENDED, LOST or CLOSED (kazoo's states)
        self.lease_until = 0.0  # monotonic seconds
        self.lease_session: int | None = None  # the session the lease belongs to
        self.changed = trio.Event()  # set on every state change and watch event
        self._token = token
        self._closed = False
        self.client.add_listener(self._listener)

    # --------------------------------------------------------- kazoo's threads
    def _listener(self, state: str) -> bool:
        self._soon(self._on_state, state)
        return False  # keep listening

    def watch(self, _event: Any = None) -> None:
        """A kazoo watch callback: wakes whoever waits on :attr:`changed`."""
        self._soon(self.poke)

    def _soon(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            self._token.run_sync_soon(fn, *args)
        except trio.RunFinishedError:
            pass

    # -------------------------------------------------------------- event loop
    def _on_state(self, state: str) -> None:
        if state != KazooState.CONNECTED:
            self.lease_until = 0.0  # SUSPENDED: the server may expire the session; LOST: it did
        if state != self.state:
            level = logging.INFO if state == KazooState.CONNECTED else logging.WARNING
            log.log(level, "ZooKeeper session %s (was %s)", state, self.state)
        self.state = str(state)
        self.poke()

    def poke(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    @property
    def connected(self) -> bool:
        return bool(self.state == KazooState.CONNECTED)

    def session_id(self) -> int | None:
        """The session's id, kept while the connection is down (SUSPENDED: the session
        may still live); None once it expired (LOST) or before the first connection.
        kazoo's ``client_id`` is None whenever disconnected, which would make a leader
        whose ZooKeeper merely restarted believe it lost its session."""
        sid = getattr(self.client, "_session_id", None)
        return int(sid) if sid else None

    def start(self) -> None:
        """Begin connecting (in kazoo's threads; CONNECTED arrives as a state change)."""
        self.client.start_async()

    async def close(self) -> None:
        """End the session (its ephemeral nodes go at once) and kazoo's threads; once."""
        self.lease_until = 0.0
        if self._closed:
            return
        self._closed = True
        await trio.to_thread.run_sync(self._stop)
        self.state = "CLOSED"

    def _stop(self) -> None:
        try:
            self.client.stop()
        finally:
            self.client.close()

    async def call(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run one of kazoo's ``*_async`` methods; its result, or its exception."""
        result = method(*args, **kwargs)
        done = trio.Event()
        result.rawlink(lambda _r: self._soon(done.set))
        with trio.fail_after(REQUEST_TIMEOUT_S):
            await done.wait()
        return result.get_nowait()

    # -------------------------------------------------------------------- lease
    def lease_s(self) -> float:
        negotiated = getattr(self.client, "_session_timeout", self.timeout_ms) or self.timeout_ms
        return min(self.timeout_ms, negotiated) / 1000 * LEASE_FRACTION

    def note_contact(self, t0: float, session: int | None) -> None:
        """A request sent at ``t0`` (monotonic) on ``session`` was answered."""
        if session is not None and session == self.session_id() and self.connected:
            self.lease_until = max(self.lease_until if self.lease_session == session else 0.0, t0 + self.lease_s())
            self.lease_session = session

    def lease_left_s(self, session: int | None) -> float:
        if session is None or session != self.lease_session:
            return 0.0
        return max(0.0, self.lease_until - time.monotonic())

    async def renew_lease(self) -> None:
        """Forever: a round trip every ``timeout / RENEWALS_PER_TIMEOUT`` while connected."""
        period = self.timeout_ms / 1000 / RENEWALS_PER_TIMEOUT
        while True:
            if self.connected:
                t0, session = time.monotonic(), self.session_id()
                try:
                    await self.call(self.client.exists_async, "/")
                    self.note_contact(t0, session)
                except (KazooException, trio.TooSlowError):
                    pass  # no answer, no renewal: the lease runs out by itself
            await trio.sleep(period)

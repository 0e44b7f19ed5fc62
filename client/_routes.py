"""Topic routes from the name servers: which brokers hold a topic, with how many
queues, and whether each is healthy. Any name server that answers will do; routes
are cached and refreshed.

A broker whose store failed stays in the routes, marked unhealthy (:attr:`Routes.failures`):
producers skip its queues, consumers still read what it acknowledged.

Brokers sharing a broker name form a replication group. A :class:`MessageQueue` names
the group's leader (the address that takes writes and commits); the group's followers
(:meth:`Routes.followers`) may serve reads. A group whose leader is gone is routed by
the name server to a follower, marked unhealthy ("no leader"): producers skip it,
consumers keep reading from it."""

from __future__ import annotations

import time
from typing import Any, NamedTuple, Sequence

import crc32c
import trio

from clmq.common import ClientError
from clmq.protocol import ErrorCode, RequestCode
from clmq.protocol.transport import AuthenticationFailed, ConnectionFailed, RpcClient, RpcError

from ._arguments import resolve_addrs


class MessageQueue(NamedTuple):
    """One queue of a topic on one broker, ordered by topic, broker name, queue id.

    A named tuple, not a frozen dataclass: a consumer of 10,000 queues keeps them in
    dicts and sets and sorts them, and a tuple hashes, compares and orders in C where a
    dataclass runs Python (17 hashes per queue at a consumer's start).
    """

    topic: str
    broker_name: str
    queue_id: int
    addr: str


# A name server's refusals of a login or by its ACLs: final, not a name server that is down.
REFUSED = frozenset({ErrorCode.AUTHENTICATION_REQUIRED, ErrorCode.AUTHENTICATION_FAILED, ErrorCode.NOT_AUTHORIZED})


class NoRouteError(ClientError):
    """No name server knows a broker for the topic (or none answered: ``unreachable``,
    worth another try; or a name server refused this client's login or its ACLs refuse
    the topic: ``refused``, final)."""

    def __init__(self, text: str, *, unreachable: bool = False, refused: bool = False) -> None:
        super().__init__(text)
        self.unreachable = unreachable
        self.refused = refused


class Routes:
    """A client's view of topic routes: asked of the name servers (or, with only broker
    addresses, of the brokers themselves), cached for ``refresh_interval_ms``."""

    def __init__(
        self,
        rpc: RpcClient,
        namesrv_addrs: str | Sequence[str] | None,
        *,
        broker_addrs: str | Sequence[str] | None = None,
        refresh_interval_ms: int = 30_000,
        timeout_ms: int = 3000,
        namesrv_retry_ms: int = 10_000,
    ) -> None:
        self.rpc = rpc
        # a string or a list each; neither given: $CLMQ_NAMESRV (ValueError if unset)
        self.namesrv_addrs, self.broker_addrs = resolve_addrs(namesrv_addrs, broker_addrs)
        self.refresh_interval_ms = refresh_interval_ms
        self.timeout_ms = timeout_ms
        # per topic: when fetched, its brokers as (name, address, queue count), its queues
        self._cache: dict[str, tuple[float, list[tuple[str, str, int]], list[MessageQueue]]] = {}
        self._next_ns = 0
        # A name server that failed to answer is asked again only after namesrv_retry_ms
        # (or when every other one fails too): not on every route look-up.
        self.namesrv_retry_ms = namesrv_retry_ms
        self._ns_down: dict[str, float] = {}  # address -> not asked until (monotonic s)
        # Unhealthy brokers as the last route answers said: address -> "name at address: why".
        # Not part of a queue's identity: a consumer keeps its queues when health changes.
        self.failures: dict[str, str] = {}
        # Per group (broker name): its followers' addresses as the last route answer said
        # (absent from older name servers: none). They serve reads, never writes.
        self._followers: dict[str, list[str]] = {}
        # Addresses routed only for reads: their group has no leader (routes say leader: false).
        self.leaderless: set[str] = set()

    async def queues(self, topic: str, *, refresh: bool = False) -> list[MessageQueue]:
        """The topic's queues on every broker, sorted (broker name, queue id)."""
        cached = self._cache.get(topic)
        if cached and not refresh and time.monotonic() - cached[0] < self.refresh_interval_ms / 1000:
            return cached[2]
        brokers = await self._fetch(topic)
        for b in brokers:  # absent (an older name server): healthy
            if b.get("healthy", True):
                self.failures.pop(b["addr"], None)
            else:
                self.failures[b["addr"]] = f"{b['broker_name']} at {b['addr']}: {b.get('failure') or 'unhealthy'}"
            self._followers[b["broker_name"]] = [f["addr"] for f in b.get("followers") or () if f.get("addr")]
            if b.get("leader", True):
                self.leaderless.discard(b["addr"])
            else:
                self.leaderless.add(b["addr"])
        shape = [(b["broker_name"], b["addr"], b["queue_count"]) for b in brokers]
        if cached and cached[1] == shape:  # unchanged: keep the objects (10,000 cost milliseconds)
            mqs = cached[2]
        else:
            mqs = sorted(MessageQueue(topic, name, q, addr) for name, addr, count in shape for q in range(count))
        self._cache[topic] = (time.monotonic(), shape, mqs)
        return mqs

    def followers(self, broker_name: str) -> list[str]:
        """The addresses of the group's followers, as the last route answer for any
        topic it serves said (empty: none, or not known yet). Reads only: a follower
        answers NOT_LEADER to produce and commits."""
        return list(self._followers.get(broker_name, ()))

    def forget(self, topic: str) -> None:
        self._cache.pop(topic, None)

    async def _fetch(self, topic: str) -> list[dict[str, Any]]:
        if not self.namesrv_addrs:
            return await self._from_brokers(topic)
        errors = []
        for ns in self._namesrv_order():
            try:
                reply = await self.rpc.request(ns, RequestCode.GET_ROUTE, {"topic": topic}, timeout_ms=self.timeout_ms)
            except RpcError as e:
                if e.code == ErrorCode.NOT_FOUND:
                    raise NoRouteError(f"topic {topic!r}: {e.text}") from None
                if e.code in REFUSED:  # asking again, or another name server, will not change it
                    raise NoRouteError(f"topic {topic!r}: {e}", refused=True) from None
                errors.append(str(e))
            except AuthenticationFailed as e:
                raise NoRouteError(f"topic {topic!r}: {e}", refused=True) from None
            except (ConnectionFailed, trio.TooSlowError) as e:
                errors.append(f"{ns}: {e or 'timed out'}")
            else:
                self._ns_down.pop(ns, None)
                self._next_ns = self.namesrv_addrs.index(ns)
                return list(reply.fields["brokers"])
            self._ns_down[ns] = time.monotonic() + self.namesrv_retry_ms / 1000
        raise NoRouteError(f"no name server answered for topic {topic!r}: {'; '.join(errors)}", unreachable=True)

    def _namesrv_order(self) -> list[str]:
        """The name servers to ask, in turn: the last one that answered first, those
        that failed recently last (asked only if every other one fails)."""
        n, now = len(self.namesrv_addrs), time.monotonic()
        turn = [self.namesrv_addrs[(self._next_ns + i) % n] for i in range(n)]
        return sorted(turn, key=lambda ns: self._ns_down.get(ns, 0.0) > now)  # stable: keeps the turn

    async def _from_brokers(self, topic: str) -> list[dict[str, Any]]:
        found, failed = [], []
        for addr in self.broker_addrs:
            try:
                info = await self.rpc.request(addr, RequestCode.BROKER_INFO, timeout_ms=self.timeout_ms)
                every = {"include_system": True}  # a system topic (%TRACE%) is written by clients too
                topics = await self.rpc.request(addr, RequestCode.LIST_TOPICS, every, timeout_ms=self.timeout_ms)
            except (ConnectionFailed, RpcError, trio.TooSlowError) as e:
                failed.append(f"{addr}: {e or 'timed out'}")
                continue
            count = topics.fields["topics"].get(topic)
            if count:
                f = info.fields
                found.append(
                    {
                        "broker_name": f["broker_name"],
                        "addr": addr,
                        "queue_count": count,
                        "healthy": f.get("healthy", True),
                        "failure": f.get("failure", ""),
                    }
                )
        if not found and len(failed) == len(self.broker_addrs):  # no answer at all: the topic may well exist
            raise NoRouteError(f"no broker answered for topic {topic!r}: {'; '.join(failed)}", unreachable=True)
        if not found:
            raise NoRouteError(f"no reachable broker of {self.broker_addrs} has topic {topic!r}")
        return found


class ReadRouter:
    """Where a consumer pulls a group's queues from: its leader, or one of its followers
    (RocketMQ's slave read). Commits, heartbeats and offset look-ups always go to the
    leader (:attr:`MessageQueue.addr`); only pulls move.

    A group is read from a follower when ``read_from_followers`` is set, or for
    ``hold_ms`` after its leader hinted so (``suggest_follower``: this consumer is far
    behind, and old data costs the leader disk reads its producers wait behind). A
    follower that fails a pull (unreachable, an error, or it does not hold what was
    asked) is avoided for ``failure_backoff_ms``: meanwhile the leader serves. Which
    follower: the same one for every pull of this consumer (chosen by its client id), so
    that its reads stay on one broker's page cache.
    """

    def __init__(self, routes: Routes, *, always: bool, hold_ms: int, failure_backoff_ms: int, seed: str) -> None:
        self.routes = routes
        self.always = always
        self.hold_ms = hold_ms
        self.failure_backoff_ms = failure_backoff_ms
        self._seed = crc32c.crc32c(seed.encode())
        self._hinted: dict[str, float] = {}  # broker name -> read from a follower until (monotonic s)
        self._failed: dict[str, float] = {}  # follower address -> avoid until (monotonic s)

    def target(self, mq: MessageQueue) -> str:
        """The address to pull ``mq``'s group from now."""
        now = time.monotonic()
        if not self.always and self._hinted.get(mq.broker_name, 0.0) <= now:
            return mq.addr
        usable = [a for a in self.routes.followers(mq.broker_name) if a != mq.addr and self._failed.get(a, 0.0) <= now]
        return usable[self._seed % len(usable)] if usable else mq.addr

    def hinted(self, broker_name: str) -> bool:
        """The leader suggested reading ``broker_name``'s queues from a follower: do for
        ``hold_ms`` (True if that starts or extends a hold and there is a follower)."""
        if self.hold_ms <= 0 or not self.routes.followers(broker_name):
            return False
        self._hinted[broker_name] = time.monotonic() + self.hold_ms / 1000
        return True

    def reading_from_follower(self, broker_name: str) -> bool:
        """Whether pulls of the group go to a follower now (if it has a usable one)."""
        return self.always or self._hinted.get(broker_name, 0.0) > time.monotonic()

    def failed(self, addr: str) -> None:
        """A follower failed a pull: read from the leader for ``failure_backoff_ms``."""
        self._failed[addr] = time.monotonic() + self.failure_backoff_ms / 1000

"""The name server's state: which broker serves which topics, kept fresh by the
brokers' periodic registrations. Plain data, no I/O (the service drives it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class BrokerEntry:
    cluster: str
    broker_name: str
    addr: str
    topics: dict[str, int] = field(default_factory=dict)  # name -> queue count
    last_seen_ms: float = 0.0
    healthy: bool = True  # False: its store failed; producers skip it, consumers still read it
    failure: str = ""  # why not healthy


class RouteTable:
    """Brokers by address; a broker missing its registrations for ``expiry_ms`` is dropped."""

    def __init__(self, expiry_ms: int) -> None:
        self.expiry_ms = expiry_ms
        self._brokers: dict[str, BrokerEntry] = {}

    def register(self, cluster: str, broker_name: str, addr: str, topics: dict[str, int], now_ms: float,
                 healthy: bool = True, failure: str = "") -> bool:  # fmt: skip
        """Record a registration; True if the broker is new or its topics changed."""
        old = self._brokers.get(addr)
        self._brokers[addr] = BrokerEntry(cluster, broker_name, addr, dict(topics), now_ms, healthy, failure)
        return old is None or old.topics != topics

    def health(self, addr: str) -> bool | None:
        """Whether the broker at ``addr`` said it is healthy (None: not registered)."""
        entry = self._brokers.get(addr)
        return None if entry is None else entry.healthy

    def unregister(self, addr: str) -> bool:
        return self._brokers.pop(addr, None) is not None

    def expire(self, now_ms: float) -> list[str]:
        """Drop brokers not heard from within ``expiry_ms``; returns their addresses."""
        gone = [a for a, b in self._brokers.items() if now_ms - b.last_seen_ms > self.expiry_ms]
        for addr in gone:
            del self._brokers[addr]
        return gone

    def route(self, topic: str) -> list[dict[str, Any]]:
        """Every live broker serving ``topic``, sorted by broker name then address, each
        marked ``healthy`` (and ``failure``: why not). An unhealthy broker stays in the
        route: producers skip it, but consumers still read what it acknowledged."""
        found = [b for b in self._brokers.values() if topic in b.topics]
        return [{"broker_name": b.broker_name, "addr": b.addr, "queue_count": b.topics[topic], "healthy": b.healthy,
                 "failure": b.failure} for b in sorted(found, key=lambda b: (b.broker_name, b.addr))]  # fmt: skip

    def cluster(self, now_ms: float) -> list[dict[str, Any]]:
        """Every registered broker, healthy or not (``healthy``, ``failure``)."""
        return [{"cluster": b.cluster, "broker_name": b.broker_name, "addr": b.addr, "topics": b.topics,
                 "age_ms": int(now_ms - b.last_seen_ms), "healthy": b.healthy, "failure": b.failure}
                for b in sorted(self._brokers.values(), key=lambda b: (b.broker_name, b.addr))]  # fmt: skip

"""The name server's state: which broker serves which topics, kept fresh by the
brokers' periodic registrations. Plain data, no I/O (the service drives it).

Brokers that share a broker name form a group (replication). Each group's leader is
the broker claiming leadership with the highest epoch; on a tie, the one that claimed
it first keeps it. The name server remembers each group's leader and epoch after the
leader stops registering, so that an old leader coming back with an older (or equal)
epoch is told to follow instead of being routed to."""

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
    broker_id: int = 0
    role: str = "leader"  # as the name server sees it: a stale claim of leadership is recorded as "follower"
    epoch: int = -1
    kafka_addr: str = ""  # host:port of its Kafka listener ("": none)


class RouteTable:
    """Brokers by address; a broker missing its registrations for ``expiry_ms`` is dropped."""

    def __init__(self, expiry_ms: int) -> None:
        self.expiry_ms = expiry_ms
        self._brokers: dict[str, BrokerEntry] = {}
        self._leaders: dict[str, tuple[int, str]] = {}  # broker name -> (epoch, address) of its leader

    def register(
        self,
        cluster: str,
        broker_name: str,
        addr: str,
        topics: dict[str, int],
        now_ms: float,
        healthy: bool = True,
        failure: str = "",
        *,
        broker_id: int = 0,
        role: str = "leader",
        epoch: int = -1,
        kafka_addr: str = "",
    ) -> bool:
        """Record a registration; True if the broker is new or its topics or role changed."""
        old = self._brokers.get(addr)
        if role == "leader" and not self._claim(broker_name, epoch, addr):
            role = "follower"
        entry = BrokerEntry(
            cluster, broker_name, addr, dict(topics), now_ms, healthy, failure, broker_id, role, epoch, kafka_addr
        )
        self._brokers[addr] = entry
        if role == "leader":  # the group's one leader now: an older leader's entry (dead, or not yet told) follows
            for other in self._brokers.values():
                if other.broker_name == broker_name and other.addr != addr and other.role == "leader":
                    other.role = "follower"
        return old is None or old.topics != topics or old.role != role

    def _claim(self, broker_name: str, epoch: int, addr: str) -> bool:
        """A broker claims leadership of its group with ``epoch``: granted if the epoch is
        the highest known (ties: the first claimer keeps it)."""
        known = self._leaders.get(broker_name)
        if known is None or epoch > known[0] or (epoch == known[0] and addr == known[1]):
            self._leaders[broker_name] = (epoch, addr)
            return True
        return False

    def leader_of(self, broker_name: str) -> tuple[str, int]:
        """The group's leader: (address, epoch), or ("", -1) if none ever claimed it."""
        epoch, addr = self._leaders.get(broker_name, (-1, ""))
        return addr, epoch

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
        """Each group serving ``topic``: its live leader, sorted by broker name, marked
        ``healthy`` (and ``failure``: why not), with its live ``followers`` (they may serve
        reads). An unhealthy broker stays in the route: producers skip it, but consumers
        still read what it acknowledged. A group whose leader is gone is routed to a
        follower, marked unhealthy ("no leader"): reads go on, writes wait for a leader."""
        groups: dict[str, list[BrokerEntry]] = {}
        for b in self._brokers.values():
            if topic in b.topics:
                groups.setdefault(b.broker_name, []).append(b)
        return [self._group_route(topic, name, members) for name, members in sorted(groups.items())]

    def _group_route(self, topic: str, name: str, members: list[BrokerEntry]) -> dict[str, Any]:
        members = sorted(members, key=lambda b: b.addr)
        leaders = [b for b in members if b.role == "leader"]
        head = leaders[0] if leaders else members[0]
        healthy, failure = head.healthy, head.failure
        if not leaders:
            healthy, failure = False, f"group {name} has no leader (reads only, from a follower)"
        followers = [{"addr": b.addr, "broker_id": b.broker_id} for b in members if b is not head]
        return {
            "broker_name": name,
            "addr": head.addr,
            "queue_count": head.topics[topic],
            "healthy": healthy,
            "failure": failure,
            "epoch": head.epoch,
            "leader": bool(leaders),
            "followers": followers,
        }

    def cluster(self, now_ms: float) -> list[dict[str, Any]]:
        """Every registered broker, healthy or not (``healthy``, ``failure``)."""
        return [
            {
                "cluster": b.cluster,
                "broker_name": b.broker_name,
                "addr": b.addr,
                "topics": b.topics,
                "age_ms": int(now_ms - b.last_seen_ms),
                "healthy": b.healthy,
                "failure": b.failure,
                "broker_id": b.broker_id,
                "role": b.role,
                "epoch": b.epoch,
                "kafka_addr": b.kafka_addr,
            }
            for b in sorted(self._brokers.values(), key=lambda b: (b.broker_name, b.addr))
        ]

"""Consumer-group membership, from client heartbeats, with expiry. Plain data: the
service calls :meth:`expire` periodically."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Member:
    client_id: str
    mode: str  # "clustering" or "broadcasting"
    topics: list[str] = field(default_factory=list)
    last_seen_ms: float = 0.0


class ConsumerGroups:
    def __init__(self, expiry_ms: int) -> None:
        self.expiry_ms = expiry_ms
        self._groups: dict[str, dict[str, Member]] = {}

    def heartbeat(self, client_id: str, group: str, mode: str, topics: list[str], now_ms: float) -> bool:
        """Record a member's heartbeat; True if it joined (or changed subscriptions)."""
        members = self._groups.setdefault(group, {})
        old = members.get(client_id)
        members[client_id] = Member(client_id, mode, list(topics), now_ms)
        return old is None or old.topics != list(topics)

    def leave(self, client_id: str) -> list[str]:
        """Remove a client from every group; returns the groups it left."""
        left = [g for g, members in self._groups.items() if members.pop(client_id, None) is not None]
        self._drop_empty()
        return left

    def groups_of(self, client_id: str) -> list[str]:
        """The groups ``client_id`` is a member of."""
        return sorted(g for g, members in self._groups.items() if client_id in members)

    def expire(self, now_ms: float) -> list[tuple[str, str]]:
        """Drop members silent for longer than ``expiry_ms``; returns (group, client id)."""
        gone = [
            (g, c) for g, ms in self._groups.items() for c, m in ms.items() if now_ms - m.last_seen_ms > self.expiry_ms
        ]
        for g, c in gone:
            del self._groups[g][c]
        self._drop_empty()
        return gone

    def _drop_empty(self) -> None:
        for g in [g for g, ms in self._groups.items() if not ms]:
            del self._groups[g]

    def members(self, group: str) -> list[Member]:
        return sorted(self._groups.get(group, {}).values(), key=lambda m: m.client_id)

    def groups(self) -> list[str]:
        return sorted(self._groups)

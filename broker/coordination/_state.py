"""What ZooKeeper holds for a broker group, as plain data (no kazoo here).

Layout, under the connect string's chroot:

- ``/clmq/groups/<broker_name>/state``: the group's :class:`GroupState` as JSON,
  written only by versioned compare-and-set (``set(path, data, version)``), so two
  brokers that read the same version cannot both write after it;
- ``/clmq/groups/<broker_name>/members/<broker_id>``: one ephemeral node per live
  broker, ``{"addr": "host:port"}``; it vanishes when the broker's session ends.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from clmq.common import ClmqError

ROOT = "/clmq"


class CoordinationError(ClmqError):
    """ZooKeeper holds something this broker cannot read (a damaged state node)."""


def group_path(chroot: str, broker_name: str) -> str:
    return f"{chroot}{ROOT}/groups/{broker_name}"


@dataclass(frozen=True)
class GroupState:
    """A group's leader (-1: none), its epoch (every leader's is higher than every
    earlier one) and its in-sync set (the replicas an election may choose).

    Invariant: the leader, when there is one, is in the in-sync set."""

    leader: int
    epoch: int
    isr: tuple[int, ...]

    def __post_init__(self) -> None:
        assert self.leader == -1 or self.leader in self.isr, self
        assert self.epoch >= -1, self

    def encode(self) -> bytes:
        return json.dumps({"leader": self.leader, "epoch": self.epoch, "isr": sorted(self.isr)}).encode()

    @classmethod
    def decode(cls, data: bytes, path: str) -> GroupState:
        """Parse a state node; :class:`CoordinationError` names the path and the content."""
        try:
            v = json.loads(data)
            leader, epoch, isr = v["leader"], v["epoch"], v["isr"]
            if not (type(leader) is int and type(epoch) is int and isinstance(isr, list)):
                raise TypeError("leader and epoch must be integers, isr a list")
            if not all(type(i) is int and i >= 0 for i in isr) or (leader != -1 and leader not in isr):
                raise ValueError("isr must list broker ids and include the leader")
            return cls(leader, epoch, tuple(sorted(set(isr))))
        except (ValueError, TypeError, KeyError) as e:
            raise CoordinationError(
                f"ZooKeeper node {path} holds {data[:200]!r}, not a group state "
                f'{{"leader": id, "epoch": n, "isr": [ids]}}: {e}'
            ) from None

    def with_isr(self, isr: set[int]) -> GroupState:
        return GroupState(self.leader, self.epoch, tuple(sorted(isr | ({self.leader} - {-1}))))


def encode_member(addr: str) -> bytes:
    return json.dumps({"addr": addr}).encode()


def decode_member(data: bytes) -> str:
    """A member node's address ("" if unreadable: that member is treated as unknown)."""
    try:
        addr = json.loads(data).get("addr", "")
        return addr if isinstance(addr, str) else ""
    except (ValueError, AttributeError):
        return ""


def split_connect(connect: str) -> tuple[str, str]:
    """``"h1:p1,h2:p2/some/root"`` -> ``("h1:p1,h2:p2", "/some/root")`` (chroot "" if none)."""
    hosts, slash, chroot = connect.partition("/")
    chroot = ("/" + chroot.strip("/")) if slash and chroot.strip("/") else ""
    if not hosts or any(not h.rpartition(":")[2].isdigit() for h in hosts.split(",")):
        raise ValueError(f"zookeeper must be 'host:port[,host:port...][/chroot]', got {connect!r}")
    return hosts, chroot

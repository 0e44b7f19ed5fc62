"""One broker's place in its group, as data: what the role switches (:class:`Roles`)
write, and what the checks before writes (:class:`WriteChecks`) and the replication
requests (:class:`ReplicaRequests`) read. The parts share this object instead of
calling through :class:`Replica`."""

from __future__ import annotations

from dataclasses import dataclass, field

import trio

from clmq.broker.store import Store
from clmq.protocol.transport import RpcClient

from ._config import ReplicationConfig
from ._epochs import LeaderEpochs
from ._follower import Follower
from ._leader import Leader
from ._ports import CoordinatorPort


@dataclass(eq=False)
class ReplicaState:
    """Who this broker is in its group now. ``leader`` is set while it leads (one
    term), ``follower`` while it follows; ``role`` says which even between the two (a
    switch under way: writes are held or refused, never unchecked)."""

    config: ReplicationConfig
    store: Store | None  # None: a partition-per-file store, never replicated
    epochs: LeaderEpochs
    role: str
    leader: Leader | None = None
    follower: Follower | None = None
    leader_hint: str = ""  # the group's leader as the name servers (or ZooKeeper) said
    coordinator: CoordinatorPort | None = None  # ZooKeeper mode: set by the coordinator before the role loop
    rpc: RpcClient | None = None  # the broker's client, once the role loop runs
    # ZooKeeper mode: (epoch, ZooKeeper's in-sync set) of a term to start once the
    # follower's tasks have stopped, and the event set when it has started.
    pending_lead: tuple[int, tuple[int, ...]] | None = None
    lead_started: trio.Event = field(default_factory=trio.Event)
    handing_over: bool = False  # a graceful hand-over is under way: new writes are held, then refused
    handover_done: trio.Event | None = None
    streaming: bool = False  # followers joined: the log's appends are worth telling the leader about

    @property
    def epoch(self) -> int:
        return self.leader.epoch if self.leader else self.epochs.latest

    def min_leader_epoch(self) -> int:
        """The group's epoch as ZooKeeper last said (-1: manual mode)."""
        return self.coordinator.min_leader_epoch() if self.coordinator is not None else -1

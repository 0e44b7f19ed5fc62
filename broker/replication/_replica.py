"""One broker's place in its group: leader or follower, and the switches between them
(manual mode: promotion by an operator, demotion when the name servers know a newer
leader; ZooKeeper mode: whatever the coordinator decides, see ``clmq.broker.coordination``).

:class:`Replica` is what the broker's service holds; it is made of parts that share
one :class:`ReplicaState`:

- :class:`Roles` (``_roles``): the switches and the role's tasks;
- :class:`WriteChecks` (``_write_checks``): the checks before and after every write;
- :class:`ReplicaRequests` (``_replica_requests``): REPLICA_JOIN/FETCH/METADATA,
  PROMOTE, TRANSFER_LEADERSHIP, REPLICA_STATUS.

The role at the first start is the ``role`` setting; the role of the last switch is
kept in ``replica-role`` in the data directory and wins over the setting at later
starts. In ZooKeeper mode a broker starts as a follower and leads only when
ZooKeeper's state names it (the epoch comes from there).
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

import trio

from clmq.broker.store import StorageEngine, Store
from clmq.protocol import ErrorCode
from clmq.protocol.transport import Handler, RpcClient

from ._config import ReplicationConfig
from ._epochs import LeaderEpochs
from ._follower import Follower
from ._leader import Leader
from ._ports import CoordinatorPort, MetadataPort
from ._replica_requests import ReplicaRequests, replica_status
from ._replica_state import ReplicaState
from ._roles import ROLE_FILE, Roles, initial_role
from ._write_checks import WriteChecks


class Replica:
    """A broker's replication: its state, its role switches (``roles``), the checks
    around writes (``checks``) and its requests (``requests``)."""

    def __init__(
        self,
        config: ReplicationConfig,
        store: StorageEngine,
        metadata: MetadataPort,
        token: trio.lowlevel.TrioToken,
        register_now: Callable[[], None],
        writes_idle: Callable[[], Awaitable[None]],
        addr: Callable[[], str] = lambda: "",
    ) -> None:
        self.config = config
        self.store = store if isinstance(store, Store) else None
        role = initial_role(config, store)  # refuses a follower without a log first
        self.epochs = LeaderEpochs.load(store.directory)
        self.state = ReplicaState(config, self.store, self.epochs, role)
        self.roles = Roles(
            self.state, metadata, token, register_now, writes_idle, addr, role_file=store.directory / ROLE_FILE
        )
        self.checks = WriteChecks(self.state)
        self.requests = ReplicaRequests(self.state, self.roles, writes_idle)

    # -------------------------------------------------------- what others read
    @property
    def role(self) -> str:
        return self.state.role

    @property
    def epoch(self) -> int:
        return self.state.epoch

    @property
    def leader(self) -> Leader | None:
        return self.state.leader

    @property
    def follower(self) -> Follower | None:
        return self.state.follower

    @property
    def leader_hint(self) -> str:
        """The group's leader as the name servers (or ZooKeeper) said ("": unknown)."""
        return self.state.leader_hint

    @leader_hint.setter
    def leader_hint(self, addr: str) -> None:
        self.state.leader_hint = addr

    @property
    def coordinator(self) -> CoordinatorPort | None:
        """ZooKeeper mode: the coordinator, which sets itself here before :meth:`role_loop`."""
        return self.state.coordinator

    @coordinator.setter
    def coordinator(self, coordinator: CoordinatorPort) -> None:
        self.state.coordinator = coordinator

    def status(self) -> dict[str, Any]:
        """REPLICA_STATUS (see :func:`replica_status`)."""
        return replica_status(self.state)

    def handlers(self) -> dict[int, Handler]:
        """The replication requests' handlers (:class:`ReplicaRequests`)."""
        return self.requests.handlers()

    # ------------------------------------------------------------------ roles
    async def role_loop(self, rpc: RpcClient) -> None:
        """The role's background tasks, restarted whenever the role switches."""
        await self.roles.role_loop(rpc)

    def stopping(self) -> None:
        """See :meth:`Roles.stopping`."""
        self.roles.stopping()

    def group_leader(self, addr: str, epoch: int, own_addr: str) -> None:
        """See :meth:`Roles.group_leader`."""
        self.roles.group_leader(addr, epoch, own_addr)

    async def become_leader(self, epoch: int, recorded_isr: tuple[int, ...]) -> None:
        """See :meth:`Roles.become_leader`."""
        await self.roles.become_leader(epoch, recorded_isr)

    def become_follower(self, addr: str, epoch: int) -> None:
        """See :meth:`Roles.become_follower`."""
        self.roles.become_follower(addr, epoch)

    # ------------------------------------------------------- the broker's checks
    def check_writable(self) -> None:
        """See :meth:`WriteChecks.check_writable`."""
        self.checks.check_writable()

    def check_sync_write(self, topic: str, sync: bool | None = None) -> None:
        """See :meth:`WriteChecks.check_sync_write`."""
        self.checks.check_sync_write(topic, sync)

    def acks_at_once(self, topic: str) -> bool:
        """See :meth:`WriteChecks.acks_at_once`."""
        return self.checks.acks_at_once(topic)

    async def wait_held(self, topic: str, end: int, sync: bool | None = None) -> tuple[ErrorCode, str] | None:
        """See :meth:`WriteChecks.wait_held`."""
        return await self.checks.wait_held(topic, end, sync)

    async def wait_topics(self, topic: str) -> tuple[ErrorCode, str] | None:
        """See :meth:`WriteChecks.wait_topics`."""
        return await self.checks.wait_topics(topic)

    async def writes_settled(self) -> None:
        """See :meth:`WriteChecks.writes_settled`."""
        await self.checks.writes_settled()

"""The switches between leading and following (manual mode: promotion by an operator,
demotion when the name servers know a newer leader; ZooKeeper mode: whatever the
coordinator decides), and the role's background tasks, restarted at every switch.

The role of the last switch is kept in ``replica-role`` in the data directory and wins
over the ``role`` setting at later starts. Every start as leader begins a new term (a
new epoch): a leader that lost an unflushed tail in a crash and wrote new bytes at the
same offsets must not look like the term its followers copied from.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Awaitable, Callable

import trio

from clmq.broker.store import MetadataSource, StorageEngine, Store, load_json, write_json
from clmq.common import ConfigError
from clmq.protocol import ErrorCode
from clmq.protocol.transport import RequestError, RpcClient

from ._config import ReplicationConfig
from ._follower import Follower
from ._leader import Leader
from ._ports import MetadataPort
from ._replica_state import ReplicaState

log = logging.getLogger("clmq.replication")

ROLE_FILE = "replica-role"
QUIESCE_S = 5.0  # a demoted leader waits at most this long for appends under way before cutting its log


def initial_role(config: ReplicationConfig, store: StorageEngine) -> str:
    """The role to start in: the last switch's (``replica-role``), else the setting; a
    follower in ZooKeeper mode until ZooKeeper names this broker."""
    saved = load_json(store.directory / ROLE_FILE)
    ok = saved.source in (MetadataSource.CURRENT, MetadataSource.PREVIOUS)
    role = saved.value["role"] if ok else config.role
    if config.coordinated:
        role = "follower"
    if not isinstance(store, Store) and role == "follower":
        raise ConfigError("replication needs storage_mode = commitlog (a partition-per-file store has no log to copy)")
    return str(role)


class Roles:
    """Switches the replica's role (writing its :class:`ReplicaState`) and runs the
    role's tasks (:meth:`role_loop`)."""

    def __init__(
        self,
        state: ReplicaState,
        metadata: MetadataPort,
        token: trio.lowlevel.TrioToken,
        register_now: Callable[[], None],
        writes_idle: Callable[[], Awaitable[None]],
        addr: Callable[[], str],
        role_file: Path,
    ) -> None:
        self.state = state
        self.role_file = role_file
        self.metadata = metadata
        self.register_now = register_now  # the name servers hear of a new role at once
        self.writes_idle = writes_idle
        self.addr = addr  # where this broker listens (a follower tells its leader)
        self._token = token
        self._switched = trio.Event()
        if state.store is not None:
            state.store.log.add_append_listener(self._appended)
        if state.role == "leader":
            self._lead(state.epochs.latest + 1)

    def _lead(self, epoch: int, recorded_isr: tuple[int, ...] = ()) -> None:
        s = self.state
        if s.store is None:
            return
        log_ = s.store.log
        s.epochs.start(epoch, log_.write_offset if s.epochs.entries else log_.min_offset, s.config.broker_id)
        s.leader = Leader(s.config, s.store, s.epochs, self.metadata, s.coordinator, recorded_isr)
        log.info(
            "%s: broker %d leads the group, epoch %d, from offset %d",
            s.config.broker_name,
            s.config.broker_id,
            epoch,
            log_.write_offset,
        )

    def _save_role(self) -> None:
        write_json(self.role_file, {"role": self.state.role})

    async def role_loop(self, rpc: RpcClient) -> None:
        """The role's background tasks, restarted whenever the role switches."""
        s = self.state
        s.rpc = rpc
        while True:
            self._switched = trio.Event()
            async with trio.open_nursery() as nursery:
                if s.leader is not None:
                    nursery.start_soon(s.leader.watch_lag)
                elif s.role == "follower" and s.store is not None:
                    s.follower = Follower(
                        s.config,
                        s.store,
                        s.epochs,
                        self.metadata,
                        rpc,
                        lambda: s.leader_hint,
                        self.addr,
                        s.min_leader_epoch,
                    )
                    nursery.start_soon(self._follow, s.follower)
                await self._switched.wait()
                nursery.cancel_scope.cancel()
            # Every task of the old role has ended (a follower's raw append in a worker
            # thread included): a new term may start at the log's end.
            if s.pending_lead is not None:
                (epoch, isr), s.pending_lead = s.pending_lead, None
                s.role, s.follower = "leader", None
                self._save_role()
                self._lead(epoch, isr)
                s.lead_started.set()
                self.register_now()

    async def _follow(self, follower: Follower) -> None:
        with trio.move_on_after(QUIESCE_S):  # a demoted leader: appends already accepted finish first
            await self.writes_idle()
        await follower.follow_loop()

    def _appended(self) -> None:
        """From the appending thread: wake the leader's long-polled fetches."""
        if self.state.streaming:
            try:
                self._token.run_sync_soon(self._log_grew)
            except trio.RunFinishedError:
                pass

    def _log_grew(self) -> None:
        if self.state.leader is not None:
            self.state.leader.log_grew()

    def promote(self, force: bool) -> int:
        """Make this follower the leader with a new epoch (PROMOTE)."""
        s = self.state
        f = s.follower
        if s.role == "leader":
            return s.epoch
        if not force and (f is None or not f.promotable()):
            why = f.error if f is not None and f.error else "the leader has not said it is in sync"
            raise RequestError(
                ErrorCode.NOT_IN_SYNC,
                f"broker {s.config.broker_id} is not known to be in sync "
                f"({why}); promote with force to accept losing data",
            )
        epoch = max(s.epochs.latest, f.leader_epoch if f else -1) + 1
        if f is not None:
            f.stop()  # its fetch loop must not append or report once this log leads (until cancelled)
        s.role, s.follower = "leader", None
        self._save_role()
        self._lead(epoch)
        self._switched.set()
        self.register_now()
        return epoch

    def stopping(self) -> None:
        """The broker stops: it refuses fetches from now on, so its followers must not
        leave the in-sync set for lagging (sync writes under way then time out instead
        of being acknowledged by the leader alone)."""
        if self.state.leader is not None:
            self.state.leader.isr.frozen = True

    # ------------------------------------------------------------ ZooKeeper mode
    async def become_leader(self, epoch: int, recorded_isr: tuple[int, ...]) -> None:
        """The coordinator won (or was handed) the group with ``epoch``: lead once the
        follower's tasks have stopped. ``recorded_isr``: ZooKeeper's in-sync set."""
        s = self.state
        if s.leader is not None and s.leader.epoch == epoch:
            return
        s.lead_started = started = trio.Event()
        s.pending_lead = (epoch, recorded_isr)
        s.role, s.leader = "follower", None  # until the switch: writes are held or refused, never unchecked
        self._switched.set()
        await started.wait()

    def become_follower(self, addr: str, epoch: int) -> None:
        """ZooKeeper names another leader (``addr``, "" if unknown) for ``epoch``."""
        s = self.state
        changed = addr != s.leader_hint
        s.leader_hint = addr
        if s.leader is not None:
            self._step_down(f"ZooKeeper names {addr or 'no broker'} the leader, epoch {epoch}")
        elif changed and s.follower is not None and s.follower.connected:
            self._switched.set()  # following an old leader: start again with the new one

    def group_leader(self, addr: str, epoch: int, own_addr: str) -> None:
        """The name servers' view of the group's leader (after each registration; in
        ZooKeeper mode only ZooKeeper's word counts)."""
        s = self.state
        if not addr or addr == own_addr or s.config.coordinated:
            return
        s.leader_hint = addr
        if s.leader is not None and epoch >= s.leader.epoch:
            self._step_down(f"{addr} leads with epoch {epoch}")

    def _step_down(self, why: str) -> None:
        """Stop leading: another broker leads the group (``why``)."""
        s = self.state
        assert s.leader is not None
        log.warning(
            "%s: broker %d steps down: %s (this broker's epoch %d)",
            s.config.broker_name,
            s.config.broker_id,
            why,
            s.leader.epoch,
        )
        s.role, s.leader = "follower", None
        self._save_role()
        self._switched.set()
        self.register_now()

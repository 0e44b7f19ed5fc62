"""One broker's place in its group: leader or follower, and the switches between them
(manual mode: promotion by an operator, demotion when the name servers know a newer
leader; ZooKeeper mode: whatever the coordinator decides, see ``clmq.broker.coordination``).

The role at the first start is the ``role`` setting; the role of the last switch is
kept in ``replica-role`` in the data directory and wins over the setting at later
starts. Every start as leader begins a new term (a new epoch): a leader that lost an
unflushed tail in a crash and wrote new bytes at the same offsets must not look like
the term its followers copied from. In ZooKeeper mode a broker starts as a follower
and leads only when ZooKeeper's state names it (the epoch comes from there).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Awaitable, Callable

import trio

from clmq.broker.store import MetadataSource, StorageEngine, Store, load_json, write_json
from clmq.common import ConfigError
from clmq.protocol import ErrorCode, Frame, RequestCode
from clmq.protocol.transport import Handler, Peer, Reply, RequestError, RpcClient

from ._config import ReplicationConfig
from ._epochs import LeaderEpochs
from ._follower import Follower
from ._leader import Leader
from ._ports import CoordinatorPort, MetadataPort

log = logging.getLogger("clmq.replication")

ROLE_FILE = "replica-role"
QUIESCE_S = 5.0  # a demoted leader waits at most this long for appends under way before cutting its log


class Replica:
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
        self.metadata = metadata
        self.register_now = register_now
        self.writes_idle = writes_idle
        self.addr = addr  # where this broker listens (a follower tells its leader)
        self.store = store if isinstance(store, Store) else None
        self._role_file = store.directory / ROLE_FILE
        saved = load_json(self._role_file)
        self.role = (
            saved.value["role"] if saved.source in (MetadataSource.CURRENT, MetadataSource.PREVIOUS) else config.role
        )
        if config.coordinated:
            self.role = "follower"  # until ZooKeeper names this broker
        if self.store is None and self.role == "follower":
            raise ConfigError(
                "replication needs storage_mode = commitlog (a partition-per-file store has no log to copy)"
            )
        self.epochs = LeaderEpochs.load(store.directory)
        self.leader: Leader | None = None
        self.follower: Follower | None = None
        self.leader_hint = ""  # the group's leader as the name servers (or ZooKeeper) said
        self.coordinator: CoordinatorPort | None = None  # ZooKeeper mode: set by the service before role_loop()
        self._pending_lead: tuple[int, tuple[int, ...]] | None = None  # (epoch, ZooKeeper's in-sync set)
        self._lead_started = trio.Event()
        self._handing_over = False  # a graceful hand-over is under way: new writes are held, then refused
        self._handover_done: trio.Event | None = None
        self._token = token
        self._switched = trio.Event()
        self._rpc: RpcClient | None = None
        self._streaming = False  # followers joined: the log's appends are worth telling the leader about
        if self.store is not None:
            self.store.log.add_append_listener(self._appended)
        if self.role == "leader":
            self._lead(self.epochs.latest + 1)

    # ------------------------------------------------------------------ roles
    def _lead(self, epoch: int, recorded_isr: tuple[int, ...] = ()) -> None:
        if self.store is None:
            return
        log_ = self.store.log
        self.epochs.start(epoch, log_.write_offset if self.epochs.entries else log_.min_offset, self.config.broker_id)
        self.leader = Leader(self.config, self.store, self.epochs, self.metadata, self.coordinator, recorded_isr)
        log.info(
            "%s: broker %d leads the group, epoch %d, from offset %d",
            self.config.broker_name,
            self.config.broker_id,
            epoch,
            log_.write_offset,
        )

    def _save_role(self) -> None:
        write_json(self._role_file, {"role": self.role})

    @property
    def epoch(self) -> int:
        return self.leader.epoch if self.leader else self.epochs.latest

    async def role_loop(self, rpc: RpcClient) -> None:
        """The role's background tasks, restarted whenever the role switches."""
        self._rpc = rpc
        while True:
            self._switched = trio.Event()
            async with trio.open_nursery() as nursery:
                if self.leader is not None:
                    nursery.start_soon(self.leader.watch_lag)
                elif self.role == "follower" and self.store is not None:
                    self.follower = Follower(
                        self.config,
                        self.store,
                        self.epochs,
                        self.metadata,
                        rpc,
                        lambda: self.leader_hint,
                        self.addr,
                        self._min_leader_epoch,
                    )
                    nursery.start_soon(self._follow, self.follower)
                await self._switched.wait()
                nursery.cancel_scope.cancel()
            # Every task of the old role has ended (a follower's raw append in a worker
            # thread included): a new term may start at the log's end.
            if self._pending_lead is not None:
                (epoch, isr), self._pending_lead = self._pending_lead, None
                self.role, self.follower = "leader", None
                self._save_role()
                self._lead(epoch, isr)
                self._lead_started.set()
                self.register_now()

    def _min_leader_epoch(self) -> int:
        return self.coordinator.min_leader_epoch() if self.coordinator is not None else -1

    async def _follow(self, follower: Follower) -> None:
        with trio.move_on_after(QUIESCE_S):  # a demoted leader: appends already accepted finish first
            await self.writes_idle()
        await follower.follow_loop()

    def _appended(self) -> None:
        """From the appending thread: wake the leader's long-polled fetches."""
        if self._streaming:
            try:
                self._token.run_sync_soon(self._log_grew)
            except trio.RunFinishedError:
                pass

    def _log_grew(self) -> None:
        if self.leader is not None:
            self.leader.log_grew()

    def promote(self, force: bool) -> int:
        """Make this follower the leader with a new epoch (PROMOTE)."""
        f = self.follower
        if self.role == "leader":
            return self.epoch
        if not force and (f is None or not f.promotable()):
            why = f.error if f is not None and f.error else "the leader has not said it is in sync"
            raise RequestError(
                ErrorCode.NOT_IN_SYNC,
                f"broker {self.config.broker_id} is not known to be in sync "
                f"({why}); promote with force to accept losing data",
            )
        epoch = max(self.epochs.latest, f.leader_epoch if f else -1) + 1
        self.role, self.follower = "leader", None
        self._save_role()
        self._lead(epoch)
        self._switched.set()
        self.register_now()
        return epoch

    def stopping(self) -> None:
        """The broker stops: it refuses fetches from now on, so its followers must not
        leave the in-sync set for lagging (sync writes under way then time out instead
        of being acknowledged by the leader alone)."""
        if self.leader is not None:
            self.leader.isr.frozen = True

    # ------------------------------------------------------------ ZooKeeper mode
    async def become_leader(self, epoch: int, recorded_isr: tuple[int, ...]) -> None:
        """The coordinator won (or was handed) the group with ``epoch``: lead once the
        follower's tasks have stopped. ``recorded_isr``: ZooKeeper's in-sync set."""
        if self.leader is not None and self.leader.epoch == epoch:
            return
        self._lead_started = started = trio.Event()
        self._pending_lead = (epoch, recorded_isr)
        self.role, self.leader = "follower", None  # until the switch: writes are held or refused, never unchecked
        self._switched.set()
        await started.wait()

    def become_follower(self, addr: str, epoch: int) -> None:
        """ZooKeeper names another leader (``addr``, "" if unknown) for ``epoch``."""
        changed = addr != self.leader_hint
        self.leader_hint = addr
        if self.leader is not None:
            log.warning(
                "%s: broker %d steps down: ZooKeeper names %s the leader, epoch %d (this broker's epoch %d)",
                self.config.broker_name,
                self.config.broker_id,
                addr or "no broker",
                epoch,
                self.leader.epoch,
            )
            self.role, self.leader = "follower", None
            self._save_role()
            self._switched.set()
            self.register_now()
        elif changed and self.follower is not None and self.follower.connected:
            self._switched.set()  # following an old leader: start again with the new one

    def group_leader(self, addr: str, epoch: int, own_addr: str) -> None:
        """The name servers' view of the group's leader (after each registration; in
        ZooKeeper mode only ZooKeeper's word counts)."""
        if not addr or addr == own_addr or self.config.coordinated:
            return
        self.leader_hint = addr
        if self.leader is not None and epoch >= self.leader.epoch:
            log.warning(
                "%s: broker %d steps down: %s leads with epoch %d (this broker's epoch %d)",
                self.config.broker_name,
                self.config.broker_id,
                addr,
                epoch,
                self.leader.epoch,
            )
            self.role, self.leader = "follower", None
            self._save_role()
            self._switched.set()
            self.register_now()

    # ------------------------------------------------------- the broker's checks
    def check_writable(self) -> None:
        """Produce, commits and topic changes: only on the leader (in ZooKeeper mode,
        only while its lease holds and no hand-over is under way)."""
        if self.role != "leader":
            raise RequestError(
                ErrorCode.NOT_LEADER,
                f"broker {self.config.broker_name}/{self.config.broker_id} is a "
                f"follower; the leader is {self.leader_hint or 'unknown'}",
            )
        if self._handing_over:
            raise RequestError(ErrorCode.NOT_LEADER, "handing the group over to a follower; retry")
        why = self.coordinator.may_ack() if self.coordinator is not None else None
        if why is not None:
            raise RequestError(ErrorCode.NOT_LEADER, why)

    def check_sync_write(self, topic: str) -> None:
        self.check_writable()
        if self.leader is not None:  # None: a partition-per-file store, never replicated
            self.leader.check_sync_write(topic)

    def acks_at_once(self, topic: str) -> bool:
        """Whether a write to ``topic`` stored now may be acknowledged without waiting:
        :meth:`wait_held` would answer None at once (a store not replicated, or async
        acks with the lease held). False whenever it might wait or refuse."""
        leader = self.leader
        if leader is None:
            return self.role == "leader"
        if leader.config.ack_mode_of(topic) == "sync" or not leader.first_ack_logged:
            return False
        return self.coordinator is None or self.coordinator.may_ack() is None

    async def wait_held(self, topic: str, end: int) -> tuple[ErrorCode, str] | None:
        """After a write: None once it may be acknowledged, else the error to answer.
        In ZooKeeper mode the lease is checked last, just before the answer: a leader
        paused past its session (SIGSTOP) must not acknowledge when it wakes up."""
        leader = self.leader
        if leader is None:
            if self.role == "leader":  # a store that is not replicated
                return None
            return ErrorCode.NOT_LEADER, "this broker stepped down before the write was replicated; retry"
        problem = await leader.wait_held(topic, end)
        if problem is not None:
            return problem
        why = self.coordinator.may_ack() if self.coordinator is not None else None
        if why is not None or self.leader is not leader:
            return ErrorCode.NOT_LEADER, f"stored, not acknowledged: {why or 'stepped down'}; retry"
        if not leader.first_ack_logged:
            leader.first_ack_logged = True
            log.info(
                "%s: broker %d acknowledged its first write of epoch %d",
                self.config.broker_name,
                self.config.broker_id,
                leader.epoch,
            )
        return None

    # -------------------------------------------------------------- requests
    def handlers(self) -> dict[int, Handler]:
        return {
            RequestCode.REPLICA_JOIN: self._on_leader("join"),
            RequestCode.REPLICA_FETCH: self._on_leader("fetch"),
            RequestCode.REPLICA_METADATA: self._on_leader("metadata_request"),
            RequestCode.PROMOTE: self._promote_request,
            RequestCode.REPLICA_STATUS: self._status_request,
            RequestCode.TRANSFER_LEADERSHIP: self._transfer_request,
        }

    def _on_leader(self, name: str) -> Callable[[Frame, Peer], Awaitable[Reply]]:
        async def handle(frame: Frame, peer: Peer) -> Reply:
            leader = self.leader
            if leader is None:
                if self.store is None:
                    raise RequestError(ErrorCode.REQUEST_NOT_SUPPORTED, "replication needs storage_mode = commitlog")
                raise RequestError(
                    ErrorCode.NOT_LEADER, f"not the leader; the leader is {self.leader_hint or 'unknown'}"
                )
            self._streaming = True
            reply: Reply = await getattr(leader, name)(frame, peer)
            return reply

        return handle

    async def _promote_request(self, frame: Frame, peer: Peer) -> Reply:
        force = bool(frame.fields.get("force", False))
        if self.coordinator is not None:
            return Reply({"epoch": await self._ask_hand_over(force), "role": "leader"})
        epoch = self.promote(force)  # on the loop: it switches trio tasks
        return Reply({"epoch": epoch, "role": self.role})

    async def _ask_hand_over(self, force: bool) -> int:
        """ZooKeeper mode, PROMOTE of this follower: ask the leader to hand over."""
        if force:
            raise RequestError(
                ErrorCode.REQUEST_NOT_SUPPORTED,
                "promote with force is for manual mode; with ZooKeeper set unclean_leader_election instead",
            )
        if self.role == "leader":
            return self.epoch
        if not self.leader_hint or self._rpc is None:
            raise RequestError(ErrorCode.NOT_LEADER, "no leader known to hand over from")
        timeout_ms = self.config.leader_transfer_timeout_ms
        reply = await self._rpc.request(
            self.leader_hint,
            RequestCode.TRANSFER_LEADERSHIP,
            {"broker_id": self.config.broker_id, "timeout_ms": timeout_ms},
            timeout_ms=timeout_ms + 5000,
            check=False,
        )
        if reply.error_code:
            raise RequestError(ErrorCode(reply.error_code), f"{self.leader_hint}: {reply.error_text}")
        epoch: int = reply.fields["epoch"]
        return epoch

    async def _transfer_request(self, frame: Frame, peer: Peer) -> Reply:
        f = frame.fields
        timeout_ms = f.get("timeout_ms") or self.config.leader_transfer_timeout_ms
        return Reply({"epoch": await self.hand_over(f["broker_id"], timeout_ms)})

    async def hand_over(self, broker_id: int, timeout_ms: int) -> int:
        """Graceful leader change: refuse new writes, let those under way finish, wait
        until follower ``broker_id`` holds the whole log, then switch in ZooKeeper."""
        leader, coordinator = self.leader, self.coordinator
        if leader is None or coordinator is None:
            raise RequestError(
                ErrorCode.NOT_LEADER if coordinator else ErrorCode.REQUEST_NOT_SUPPORTED,
                "not a leader in ZooKeeper mode",
            )
        self._handing_over, self._handover_done = True, trio.Event()
        try:
            with trio.move_on_after(timeout_ms / 1000) as scope:
                await self.writes_idle()
                await leader.wait_caught_up(broker_id)
            if scope.cancelled_caught:
                raise RequestError(
                    ErrorCode.TIMEOUT,
                    f"broker {broker_id} did not catch up within {timeout_ms} ms; this broker stays the leader",
                )
            return await coordinator.hand_over(broker_id)
        finally:
            self._handing_over = False
            self._handover_done.set()
            self._handover_done = None

    async def writes_settled(self) -> None:
        """Before a write: wait out a graceful hand-over under way, or this broker's own
        switch to leading. New writes are held rather than refused meanwhile, so that the
        old leader's NOT_LEADER names the new leader and the new leader takes them once
        it leads (refused at once, they were retried with a growing backoff)."""
        done = self._handover_done
        if done is not None:
            with trio.move_on_after(self.config.leader_transfer_timeout_ms / 1000):
                await done.wait()
        if self._pending_lead is not None:  # named leader, switching from follower: milliseconds
            with trio.move_on_after(self.config.leader_transfer_timeout_ms / 1000):
                await self._lead_started.wait()

    async def _status_request(self, frame: Frame, peer: Peer) -> Reply:
        return Reply(self.status())

    def status(self) -> dict[str, Any]:
        c, f = self.config, self.follower
        log_ = self.store.log if self.store else None
        out: dict[str, Any] = {
            "role": self.role,
            "broker_name": c.broker_name,
            "broker_id": c.broker_id,
            "epoch": self.epoch,
            "end_offset": log_.write_offset if log_ else 0,
            "confirmed_offset": log_.confirmed_offset if log_ else 0,
            "durable_offset": log_.durable_offset if log_ else 0,
            "replicas": [],
            "leader_addr": "",
            "in_sync": self.leader is not None,
            "lag_bytes": 0,
            "lag_ms": 0,
            "error": "",
            "coordination": self.coordinator.status() if self.coordinator else {"mode": "manual"},
        }
        if self.leader is not None:
            out["replicas"] = self.leader.replicas()
        elif f is not None and log_ is not None:
            out.update(
                leader_addr=f.leader_addr,
                in_sync=f.in_sync,
                was_in_sync=f.was_in_sync,
                lag_bytes=max(0, f.leader_end - log_.write_offset),
                lag_ms=int(time.monotonic() * 1000 - f.last_reply_ms) if f.last_reply_ms else -1,
                error=f.error,
            )
        return out

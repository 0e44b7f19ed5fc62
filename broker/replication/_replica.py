"""One broker's place in its group: leader or follower, and the switches between them
(manual promotion; demotion when the name servers know a newer leader).

The role at the first start is the ``role`` setting; the role of the last switch is
kept in ``replica-role`` in the data directory and wins over the setting at later
starts. Every start as leader begins a new term (a new epoch): a leader that lost an
unflushed tail in a crash and wrote new bytes at the same offsets must not look like
the term its followers copied from.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Awaitable, Callable

import trio

from broker.store import MetadataSource, StorageEngine, Store, load_json, write_json
from commitlog import ConfigError
from protocol import ErrorCode, Frame, RequestCode
from protocol.transport import Handler, Peer, Reply, RequestError, RpcClient

from ._config import ReplicationConfig
from ._epochs import LeaderEpochs
from ._follower import Follower
from ._leader import Leader
from ._ports import MetadataPort

log = logging.getLogger("clmq.replication")

ROLE_FILE = "replica-role"
QUIESCE_S = 5.0  # a demoted leader waits at most this long for appends under way before cutting its log


class Replica:
    def __init__(self, config: ReplicationConfig, store: StorageEngine, metadata: MetadataPort,
                 token: trio.lowlevel.TrioToken, register_now: Callable[[], None],
                 writes_idle: Callable[[], Awaitable[None]], addr: Callable[[], str] = lambda: "") -> None:  # fmt: skip
        self.config = config
        self.metadata = metadata
        self.register_now = register_now
        self.writes_idle = writes_idle
        self.addr = addr  # where this broker listens (a follower tells its leader)
        self.store = store if isinstance(store, Store) else None
        self._role_file = store.directory / ROLE_FILE
        saved = load_json(self._role_file)
        self.role = saved.value["role"] if saved.source in (MetadataSource.CURRENT, MetadataSource.PREVIOUS) else config.role
        if self.store is None and self.role == "follower":
            raise ConfigError("replication needs storage_mode = commitlog (a partition-per-file store has no log to copy)")
        self.epochs = LeaderEpochs.load(store.directory)
        self.leader: Leader | None = None
        self.follower: Follower | None = None
        self.leader_hint = ""  # the group's leader as the name servers said
        self._token = token
        self._switched = trio.Event()
        self._rpc: RpcClient | None = None
        self._streaming = False  # followers joined: the log's appends are worth telling the leader about
        if self.store is not None:
            self.store.log.add_append_listener(self._appended)
        if self.role == "leader":
            self._lead(self.epochs.latest + 1)

    # ------------------------------------------------------------------ roles
    def _lead(self, epoch: int) -> None:
        if self.store is None:
            return
        log_ = self.store.log
        self.epochs.start(epoch, log_.write_offset if self.epochs.entries else log_.min_offset, self.config.broker_id)
        self.leader = Leader(self.config, self.store, self.epochs, self.metadata)
        log.info("%s: broker %d leads the group, epoch %d, from offset %d", self.config.broker_name,
                 self.config.broker_id, epoch, log_.write_offset)  # fmt: skip

    def _save_role(self) -> None:
        write_json(self._role_file, {"role": self.role})

    @property
    def epoch(self) -> int:
        return self.leader.epoch if self.leader else self.epochs.latest

    async def run(self, rpc: RpcClient) -> None:
        """The role's background tasks, restarted whenever the role switches."""
        self._rpc = rpc
        while True:
            self._switched = trio.Event()
            async with trio.open_nursery() as nursery:
                if self.leader is not None:
                    nursery.start_soon(self.leader.watch_lag)
                elif self.role == "follower" and self.store is not None:
                    self.follower = Follower(self.config, self.store, self.epochs, self.metadata, rpc,
                                             lambda: self.leader_hint, self.addr)  # fmt: skip
                    nursery.start_soon(self._follow, self.follower)
                await self._switched.wait()
                nursery.cancel_scope.cancel()

    async def _follow(self, follower: Follower) -> None:
        with trio.move_on_after(QUIESCE_S):  # a demoted leader: appends already accepted finish first
            await self.writes_idle()
        await follower.run()

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
            raise RequestError(ErrorCode.NOT_IN_SYNC, f"broker {self.config.broker_id} is not known to be in sync "
                                                      f"({why}); promote with force to accept losing data")  # fmt: skip
        epoch = max(self.epochs.latest, f.leader_epoch if f else -1) + 1
        self.role, self.follower = "leader", None
        self._save_role()
        self._lead(epoch)
        self._switched.set()
        self.register_now()
        return epoch

    def group_leader(self, addr: str, epoch: int, own_addr: str) -> None:
        """The name servers' view of the group's leader (after each registration)."""
        if not addr or addr == own_addr:
            return
        self.leader_hint = addr
        if self.leader is not None and epoch >= self.leader.epoch:
            log.warning("%s: broker %d steps down: %s leads with epoch %d (this broker's epoch %d)",
                        self.config.broker_name, self.config.broker_id, addr, epoch, self.leader.epoch)  # fmt: skip
            self.role, self.leader = "follower", None
            self._save_role()
            self._switched.set()
            self.register_now()

    # ------------------------------------------------------- the broker's checks
    def check_writable(self) -> None:
        """Produce, commits and topic changes: only on the leader."""
        if self.role != "leader":
            raise RequestError(ErrorCode.NOT_LEADER, f"broker {self.config.broker_name}/{self.config.broker_id} is a "
                                                     f"follower; the leader is {self.leader_hint or 'unknown'}")  # fmt: skip

    def check_sync_write(self, topic: str) -> None:
        self.check_writable()
        if self.leader is not None:  # None: a partition-per-file store, never replicated
            self.leader.check_sync_write(topic)

    async def wait_held(self, topic: str, end: int) -> tuple[ErrorCode, str] | None:
        leader = self.leader
        if leader is None:
            if self.role == "leader":  # a store that is not replicated
                return None
            return ErrorCode.NOT_LEADER, "this broker stepped down before the write was replicated; retry"
        return await leader.wait_held(topic, end)

    # -------------------------------------------------------------- requests
    def handlers(self) -> dict[int, Handler]:
        return {RequestCode.REPLICA_JOIN: self._on_leader("join"), RequestCode.REPLICA_FETCH: self._on_leader("fetch"),
                RequestCode.REPLICA_METADATA: self._on_leader("metadata_request"),
                RequestCode.PROMOTE: self._promote_request, RequestCode.REPLICA_STATUS: self._status_request}  # fmt: skip

    def _on_leader(self, name: str) -> Callable[[Frame, Peer], Awaitable[Reply]]:
        async def handle(frame: Frame, peer: Peer) -> Reply:
            leader = self.leader
            if leader is None:
                if self.store is None:
                    raise RequestError(ErrorCode.REQUEST_NOT_SUPPORTED, "replication needs storage_mode = commitlog")
                raise RequestError(ErrorCode.NOT_LEADER, f"not the leader; the leader is {self.leader_hint or 'unknown'}")
            self._streaming = True
            reply: Reply = await getattr(leader, name)(frame, peer)
            return reply

        return handle

    async def _promote_request(self, frame: Frame, peer: Peer) -> Reply:
        epoch = self.promote(bool(frame.fields.get("force", False)))  # on the loop: it switches trio tasks
        return Reply({"epoch": epoch, "role": self.role})

    async def _status_request(self, frame: Frame, peer: Peer) -> Reply:
        return Reply(self.status())

    def status(self) -> dict[str, Any]:
        c, f = self.config, self.follower
        log_ = self.store.log if self.store else None
        out: dict[str, Any] = {"role": self.role, "broker_name": c.broker_name, "broker_id": c.broker_id,
                               "epoch": self.epoch, "end_offset": log_.write_offset if log_ else 0,
                               "confirmed_offset": log_.confirmed_offset if log_ else 0,
                               "durable_offset": log_.durable_offset if log_ else 0, "replicas": [],
                               "leader_addr": "", "in_sync": self.leader is not None, "lag_bytes": 0, "lag_ms": 0,
                               "error": ""}  # fmt: skip
        if self.leader is not None:
            out["replicas"] = self.leader.replicas()
        elif f is not None and log_ is not None:
            out.update(leader_addr=f.leader_addr, in_sync=f.in_sync, was_in_sync=f.was_in_sync,
                       lag_bytes=max(0, f.leader_end - log_.write_offset),
                       lag_ms=int(time.monotonic() * 1000 - f.last_reply_ms) if f.last_reply_ms else -1,
                       error=f.error)  # fmt: skip
        return out

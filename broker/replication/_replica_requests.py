"""The replication requests a broker serves: the leader's side of the stream
(REPLICA_JOIN, REPLICA_FETCH, REPLICA_METADATA: served by the current :class:`Leader`),
PROMOTE, TRANSFER_LEADERSHIP (a graceful hand-over in ZooKeeper mode) and
REPLICA_STATUS."""

from __future__ import annotations

import time
from typing import Any, Awaitable, Callable

import trio

from clmq.protocol import ErrorCode, Frame, RequestCode
from clmq.protocol.transport import Handler, Peer, Reply, RequestError

from ._replica_state import ReplicaState
from ._roles import Roles


class ReplicaRequests:
    """The handlers of the replica's requests, reading its state; a promotion asks
    ``roles`` for the switch."""

    def __init__(self, state: ReplicaState, roles: Roles, writes_idle: Callable[[], Awaitable[None]]) -> None:
        self.state = state
        self.roles = roles
        self.writes_idle = writes_idle  # a hand-over lets the writes under way finish first

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
            s = self.state
            leader = s.leader
            if leader is None:
                if s.store is None:
                    raise RequestError(ErrorCode.REQUEST_NOT_SUPPORTED, "replication needs storage_mode = commitlog")
                raise RequestError(ErrorCode.NOT_LEADER, f"not the leader; the leader is {s.leader_hint or 'unknown'}")
            s.streaming = True
            reply: Reply = await getattr(leader, name)(frame, peer)
            return reply

        return handle

    async def _promote_request(self, frame: Frame, peer: Peer) -> Reply:
        force = bool(frame.fields.get("force", False))
        if self.state.coordinator is not None:
            return Reply({"epoch": await self._ask_hand_over(force), "role": "leader"})
        epoch = self.roles.promote(force)  # on the loop: it switches trio tasks
        return Reply({"epoch": epoch, "role": self.state.role})

    async def _ask_hand_over(self, force: bool) -> int:
        """ZooKeeper mode, PROMOTE of this follower: ask the leader to hand over."""
        s = self.state
        if force:
            raise RequestError(
                ErrorCode.REQUEST_NOT_SUPPORTED,
                "promote with force is for manual mode; with ZooKeeper set unclean_leader_election instead",
            )
        if s.role == "leader":
            return s.epoch
        if not s.leader_hint or s.rpc is None:
            raise RequestError(ErrorCode.NOT_LEADER, "no leader known to hand over from")
        timeout_ms = s.config.leader_transfer_timeout_ms
        reply = await s.rpc.request(
            s.leader_hint,
            RequestCode.TRANSFER_LEADERSHIP,
            {"broker_id": s.config.broker_id, "timeout_ms": timeout_ms},
            timeout_ms=timeout_ms + 5000,
            check=False,
        )
        if reply.error_code:
            raise RequestError(ErrorCode(reply.error_code), f"{s.leader_hint}: {reply.error_text}")
        epoch: int = reply.fields["epoch"]
        return epoch

    async def _transfer_request(self, frame: Frame, peer: Peer) -> Reply:
        f = frame.fields
        timeout_ms = f.get("timeout_ms") or self.state.config.leader_transfer_timeout_ms
        return Reply({"epoch": await self.hand_over(f["broker_id"], timeout_ms)})

    async def hand_over(self, broker_id: int, timeout_ms: int) -> int:
        """Graceful leader change: refuse new writes, let those under way finish, wait
        until follower ``broker_id`` holds the whole log, then switch in ZooKeeper."""
        s = self.state
        leader, coordinator = s.leader, s.coordinator
        if leader is None or coordinator is None:
            raise RequestError(
                ErrorCode.NOT_LEADER if coordinator else ErrorCode.REQUEST_NOT_SUPPORTED,
                "not a leader in ZooKeeper mode",
            )
        s.handing_over, s.handover_done = True, trio.Event()
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
            s.handing_over = False
            s.handover_done.set()
            s.handover_done = None

    async def _status_request(self, frame: Frame, peer: Peer) -> Reply:
        return Reply(replica_status(self.state))


def replica_status(s: ReplicaState) -> dict[str, Any]:
    """REPLICA_STATUS: the role, the log's offsets, a leader's followers or a
    follower's view of its leader, and the coordination's state."""
    c, f = s.config, s.follower
    log_ = s.store.log if s.store else None
    out: dict[str, Any] = {
        "role": s.role,
        "broker_name": c.broker_name,
        "broker_id": c.broker_id,
        "epoch": s.epoch,
        "end_offset": log_.write_offset if log_ else 0,
        "confirmed_offset": log_.confirmed_offset if log_ else 0,
        "durable_offset": log_.durable_offset if log_ else 0,
        "replicas": [],
        "leader_addr": "",
        "in_sync": s.leader is not None,
        "lag_bytes": 0,
        "lag_ms": 0,
        "error": "",
        "coordination": s.coordinator.status() if s.coordinator else {"mode": "manual"},
    }
    if s.leader is not None:
        out["replicas"] = s.leader.replicas()
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

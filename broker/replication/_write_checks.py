"""What the broker asks of replication around every write: may this broker take it
(the leader, its ZooKeeper lease held, no hand-over under way), and once stored, may
it be acknowledged (held by the in-sync replicas the topic's ack mode asks for)."""

from __future__ import annotations

import logging

import trio

from clmq.protocol import ErrorCode
from clmq.protocol.transport import RequestError

from ._replica_state import ReplicaState

log = logging.getLogger("clmq.replication")

STEPPED_DOWN = "this broker stepped down during the topic change; retry"


class WriteChecks:
    """The checks before and after a write, reading the replica's state."""

    def __init__(self, state: ReplicaState) -> None:
        self.state = state

    def check_writable(self) -> None:
        """Produce, commits and topic changes: only on the leader (in ZooKeeper mode,
        only while its lease holds and no hand-over is under way)."""
        s = self.state
        if s.role != "leader":
            raise RequestError(
                ErrorCode.NOT_LEADER,
                f"broker {s.config.broker_name}/{s.config.broker_id} is a "
                f"follower; the leader is {s.leader_hint or 'unknown'}",
            )
        if s.handing_over:
            raise RequestError(ErrorCode.NOT_LEADER, "handing the group over to a follower; retry")
        why = s.coordinator.may_ack() if s.coordinator is not None else None
        if why is not None:
            raise RequestError(ErrorCode.NOT_LEADER, why)

    def check_sync_write(self, topic: str, sync: bool | None = None) -> None:
        """Before a write: :meth:`check_writable`, then enough replicas in sync if the
        write waits for them (``sync``: as the writer asked; None: the topic's ack mode)."""
        self.check_writable()
        if self.state.leader is not None:  # None: a partition-per-file store, never replicated
            self.state.leader.check_sync_write(topic, sync)

    def acks_at_once(self, topic: str) -> bool:
        """Whether a write to ``topic`` stored now may be acknowledged without waiting:
        :meth:`wait_held` would answer None at once (a store not replicated, or async
        acks with the lease held). False whenever it might wait or refuse."""
        s = self.state
        leader = s.leader
        if leader is None:
            return s.role == "leader"
        if leader.config.ack_mode_of(topic) == "sync" or not leader.first_ack_logged:
            return False
        return s.coordinator is None or s.coordinator.may_ack() is None

    async def wait_held(self, topic: str, end: int, sync: bool | None = None) -> tuple[ErrorCode, str] | None:
        """After a write: None once it may be acknowledged, else the error to answer.
        In ZooKeeper mode the lease is checked last, just before the answer: a leader
        paused past its session (SIGSTOP) must not acknowledge when it wakes up."""
        s = self.state
        leader = s.leader
        if leader is None:
            if s.role == "leader":  # a store that is not replicated
                return None
            return ErrorCode.NOT_LEADER, "this broker stepped down before the write was replicated; retry"
        problem = await leader.wait_held(topic, end, sync)
        if problem is not None:
            return problem
        why = s.coordinator.may_ack() if s.coordinator is not None else None
        if why is not None or s.leader is not leader:
            return ErrorCode.NOT_LEADER, f"stored, not acknowledged: {why or 'stepped down'}; retry"
        if not leader.first_ack_logged:
            leader.first_ack_logged = True
            log.info(
                "%s: broker %d acknowledged its first write of epoch %d",
                s.config.broker_name,
                s.config.broker_id,
                leader.epoch,
            )
        return None

    async def wait_topics(self, topic: str) -> tuple[ErrorCode, str] | None:
        """After a topic change: None once it may be acknowledged (every in-sync
        follower holds it, see :meth:`Leader.wait_topics`; the ZooKeeper lease held),
        else the error to answer."""
        s = self.state
        leader = s.leader
        if leader is None:  # a store that is not replicated, or a leader that stepped down
            return None if s.role == "leader" else (ErrorCode.NOT_LEADER, STEPPED_DOWN)
        problem = await leader.wait_topics(topic)
        why = s.coordinator.may_ack() if s.coordinator is not None else None
        if s.leader is not leader or why is not None:
            return ErrorCode.NOT_LEADER, why or STEPPED_DOWN
        return problem

    async def writes_settled(self) -> None:
        """Before a write: wait out a graceful hand-over under way, or this broker's own
        switch to leading. New writes are held rather than refused meanwhile, so that the
        old leader's NOT_LEADER names the new leader and the new leader takes them once
        it leads (refused at once, they were retried with a growing backoff)."""
        s = self.state
        done = s.handover_done
        if done is not None:
            with trio.move_on_after(s.config.leader_transfer_timeout_ms / 1000):
                await done.wait()
        if s.pending_lead is not None:  # named leader, switching from follower: milliseconds
            with trio.move_on_after(s.config.leader_transfer_timeout_ms / 1000):
                await s.lead_started.wait()

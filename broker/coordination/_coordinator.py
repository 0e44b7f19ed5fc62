"""Per-group leader election through ZooKeeper (one coordinator per broker).

The scheme (docs/replication.md, "Automatic failover"): there is no controller. Each
broker of a group keeps an ephemeral member node and watches the group's state node
and the members. Whenever something changes it reads both and decides:

- the state names a live leader other than itself: follow it;
- the state names no leader, or a leader whose member node is gone: if this broker is
  in the state's in-sync set, try to become leader by compare-and-set on the version
  it read (the first writer wins; the others see the new state and follow). The new
  epoch is higher than the state's and than every epoch this broker knows; the new
  in-sync set is this broker plus the live members of the old one (the dead leader
  and dead followers leave it: they come back through the leader once caught up).
  A broker out of the in-sync set is elected only with ``unclean_leader_election``
  and only when no in-sync replica is alive, with a warning about lost data;
- the state names this broker: lead (a hand-over, or an election it won before a
  restart, has a higher epoch than any it knows) — unless it is this broker's own
  earlier term (it restarted or lost its session): then it may not hold what its
  followers acknowledged, so it clears the leader and lets the live in-sync replicas
  elect, taking the group again with a new epoch only when it is alone.

The leader writes every change of the in-sync set here before the change lets it
acknowledge more (shrink) and after its followers hold everything confirmed (grow):
see ``clmq.broker.replication._insync``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import trio
from kazoo.exceptions import KazooException

from clmq.broker.replication import Replica
from clmq.protocol import ErrorCode
from clmq.protocol.transport import RequestError

from ._session import ZkSession
from ._state import CoordinationError, GroupState, group_path, split_connect
from ._view import GroupView, SayOnce

log = logging.getLogger("clmq.coordination")

RECHECK_S = 0.5  # a round even without a watch event (watches are re-set each round)
LEAD_START_TIMEOUT_S = 10.0  # the replica's follower tasks must stop within this to start leading


@dataclass(frozen=True)
class CoordinationConfig:
    zookeeper: str  # "host:port[,host:port...][/chroot]"
    session_timeout_ms: int = 2000
    unclean_leader_election: bool = False
    auth: str = ""  # "user:password": ZooKeeper digest auth, clmq's nodes readable and writable by it alone


class GroupCoordinator:
    """Decides this broker's role from ZooKeeper; implements the replica's CoordinatorPort."""

    def __init__(
        self, config: CoordinationConfig, replica: Replica, addr: Callable[[], str], token: trio.lowlevel.TrioToken
    ) -> None:
        hosts, chroot = split_connect(config.zookeeper)
        self.config = config
        self.replica = replica
        self.addr = addr
        self.me = replica.config.broker_id
        self.name = replica.config.broker_name
        self.session = ZkSession(hosts, config.session_timeout_ms, token, config.auth)
        self._say = SayOnce(self.name, self.me)
        self.view = GroupView(self.session, group_path(chroot, self.name), self.me, addr, self._say)
        self.leading_session: int | None = None  # the session this broker leads in
        self._stepped_aside = -1  # the epoch of its own earlier term this broker gave up
        replica.coordinator = self

    @property
    def state(self) -> GroupState | None:
        """The group's state in ZooKeeper, as last read or written."""
        return self.view.state

    @property
    def members(self) -> dict[int, str]:
        """The group's live brokers: id -> address."""
        return self.view.members

    async def coordinate(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Until cancelled; the session is closed on the way out (its member node goes
        at once, so the rest of the group elects without waiting for the timeout)."""
        try:
            async with trio.open_nursery() as nursery:
                self.session.start()
                nursery.start_soon(self.session.renew_lease)
                task_status.started()
                await self._loop()
        finally:
            with trio.CancelScope(shield=True):
                self.leading_session = None
                await self.session.close()

    async def resign(self) -> None:
        """A graceful stop: stop leading and end the session now, so that the group
        elects at once instead of after the session timeout."""
        self.leading_session = None
        if self.replica.leader is not None:
            self.replica.become_follower("", self.min_leader_epoch())
        await self.session.close()

    async def _loop(self) -> None:
        while True:
            changed = self.session.changed
            if self.session.connected:
                try:
                    await self._round()
                except (KazooException, trio.TooSlowError, CoordinationError) as e:
                    self._say(f"ZooKeeper: {type(e).__name__}: {e}", logging.WARNING)
            elif self.replica.leader is not None and self.session.state == "LOST":
                self.replica.become_follower("", self.min_leader_epoch())  # the session, and the leadership, are gone
            with trio.move_on_after(RECHECK_S):
                await changed.wait()

    async def _round(self) -> None:
        session = self.session.session_id()
        if self.replica.leader is not None and session != self.leading_session:
            self.replica.become_follower("", self.min_leader_epoch())
        if not await self.view.ensure_member(session):
            return
        await self.view.read_state(self.replica.epochs.latest + 1)
        await self.view.read_members()
        await self._decide(session)

    # ----------------------------------------------------------------- deciding
    async def _decide(self, session: int | None) -> None:
        s, r = self.state, self.replica
        assert s is not None
        if s.leader == self.me:
            if r.leader is not None and r.leader.epoch == s.epoch and self.leading_session == session:
                return self._say(f"leading, epoch {s.epoch}, in-sync set {list(s.isr)}", logging.INFO)
            if s.epoch > r.epochs.latest:  # handed over to this broker, or won before a restart
                return await self._lead(s, session)
            return await self._own_old_term(s, session)
        if s.leader != -1 and s.leader in self.members:
            r.become_follower(self.members[s.leader], s.epoch)
            return self._say(f"following broker {s.leader} at {self.members[s.leader]}, epoch {s.epoch}", logging.INFO)
        r.become_follower("", s.epoch)
        await self._maybe_elect(s, session)

    async def _own_old_term(self, s: GroupState, session: int | None) -> None:
        """The state names this broker for a term of an earlier session."""
        self.replica.become_follower("", s.epoch)
        others = set(self.members) & set(s.isr) - {self.me}
        if not others:
            return await self._elect(s, session, unclean=False)
        self._stepped_aside = s.epoch
        log.warning(
            "%s: broker %d restarted (or lost its session) as the leader of epoch %d; in-sync replicas %s "
            "are alive and may hold more: letting them elect",
            self.name,
            self.me,
            s.epoch,
            sorted(others),
        )
        await self.view.cas(GroupState(-1, s.epoch, s.isr))

    async def _maybe_elect(self, s: GroupState, session: int | None) -> None:
        alive_isr = set(self.members) & set(s.isr)
        if self.me in s.isr:
            if self._stepped_aside == s.epoch and alive_isr - {self.me}:
                return self._say(f"leaving the election to {sorted(alive_isr - {self.me})}", logging.INFO)
            return await self._elect(s, session, unclean=False)
        if alive_isr:
            return self._say(f"not in the in-sync set {list(s.isr)}: following whoever they elect", logging.INFO)
        if not self.config.unclean_leader_election:
            return self._say(
                f"no replica of the in-sync set {list(s.isr)} is alive and this broker is not in it: "
                "the group has no leader until one comes back (unclean_leader_election = false)",
                logging.WARNING,
            )
        await self._elect(s, session, unclean=True)

    async def _elect(self, s: GroupState, session: int | None, *, unclean: bool) -> None:
        epoch = max(s.epoch, self.replica.epochs.latest) + 1
        isr = {self.me} if unclean else (set(self.members) & set(s.isr)) - {s.leader} | {self.me}
        new = GroupState(self.me, epoch, tuple(sorted(isr)))
        if not await self.view.cas(new):
            return  # another broker won: the next round follows it
        if unclean:
            log.warning(
                "%s: UNCLEAN election: broker %d (not in the in-sync set %s) leads with epoch %d; messages "
                "acknowledged by the old in-sync replicas may be lost",
                self.name,
                self.me,
                list(s.isr),
                epoch,
            )
        else:
            log.info("%s: broker %d elected leader, epoch %d, in-sync set %s", self.name, self.me, epoch, sorted(isr))
        await self._lead(new, session)

    async def _lead(self, s: GroupState, session: int | None) -> None:
        t0 = time.monotonic()  # a round trip first: the lease starts with leading, not at the next renewal
        await self.session.call(self.session.client.exists_async, "/")
        self.session.note_contact(t0, session)
        self.leading_session = session
        self._stepped_aside = -1
        with trio.fail_after(LEAD_START_TIMEOUT_S):
            await self.replica.become_leader(s.epoch, s.isr)
        self.replica.leader_hint = self.addr()

    # ----------------------------------------------------------------- writing
    async def _change_isr(self, change: Callable[[set[int]], set[int]]) -> bool:
        for _ in range(3):
            s, leader = self.state, self.replica.leader
            if s is None or leader is None or s.leader != self.me or s.epoch != leader.epoch:
                return False
            new = s.with_isr(change(set(s.isr)))
            try:
                if new == s or await self.view.cas(new):
                    if new != s:
                        log.info("%s: in-sync set in ZooKeeper: %s -> %s", self.name, list(s.isr), list(new.isr))
                    return True
                await self.view.read_state(self.replica.epochs.latest + 1)
            except (KazooException, trio.TooSlowError, CoordinationError):
                return False
        return False

    # ----------------------------------------------------- the replica's port
    def may_ack(self) -> str | None:
        left = self.session.lease_left_s(self.leading_session)
        if left > 0:
            return None
        return (
            f"broker {self.me} has no ZooKeeper lease (session {self.session.state}): it may no longer lead "
            f"{self.name}; not acknowledged"
        )

    def min_leader_epoch(self) -> int:
        return self.state.epoch if self.state is not None else -1

    async def shrink(self, broker_ids: list[int]) -> bool:
        return await self._change_isr(lambda isr: isr - set(broker_ids))

    async def expand(self, broker_ids: list[int]) -> bool:
        return await self._change_isr(lambda isr: isr | set(broker_ids))

    async def hand_over(self, broker_id: int) -> int:
        s = self.state
        if s is None or s.leader != self.me or self.replica.leader is None:
            raise RequestError(ErrorCode.NOT_LEADER, f"broker {self.me} does not lead {self.name}")
        if broker_id not in s.isr or broker_id not in self.members:
            raise RequestError(
                ErrorCode.NOT_IN_SYNC,
                f"broker {broker_id} is not a live member of the in-sync set {list(s.isr)} in ZooKeeper",
            )
        new = GroupState(broker_id, s.epoch + 1, s.isr)
        if not await self.view.cas(new):
            raise RequestError(
                ErrorCode.SYSTEM_BUSY, "the group's state changed in ZooKeeper during the hand-over; retry"
            )
        log.info("%s: broker %d handed the group over to broker %d, epoch %d", self.name, self.me, broker_id, new.epoch)
        self.leading_session = None
        self.replica.become_follower(self.members[broker_id], new.epoch)
        return new.epoch

    def status(self) -> dict[str, Any]:
        s = self.state
        return {
            "mode": "zookeeper",
            "session": self.session.state,
            "leader": s.leader if s else -1,
            "epoch": s.epoch if s else -1,
            "isr": list(s.isr) if s else [],
            "members": {str(k): v for k, v in sorted(self.members.items())},
            "lease_ms_left": int(self.session.lease_left_s(self.leading_session) * 1000),
        }

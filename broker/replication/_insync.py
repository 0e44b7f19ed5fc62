"""The leader's view of its followers: what each holds, who is in sync, and the
confirmed offset. Plain data and arithmetic, no I/O (the leader drives it).

Rules (Kafka's ISR, in a commit-log's offsets):
- A follower's report of its log end acknowledges every byte below it; its *hold* is
  that end, or its fsynced offset when ``replica_ack = "flushed"``.
- A follower is *caught up* at the moment it has everything the leader had: when it
  reports at least the end that the leader's previous answer to it reached (and that
  answer carried everything up to the leader's end), and while its fetch waits at the
  leader's end for new bytes (parked); never while it lacks the leader's topics. It
  is in sync while it was caught
  up within ``replica_lag_max_ms``: it joins the set once caught up, and leaves it
  when it has not been caught up for longer.
- Topics are copied beside the log (REPLICA_METADATA): each fetch says which of the
  leader's topics versions the follower holds. A topic change is acknowledged once
  every in-sync follower holds it (:meth:`lacking_topics`), and a follower enters
  ZooKeeper's set only holding the leader's topics: a replica an election may choose
  has every acknowledged topic.
- The confirmed offset is the least hold in the in-sync set (the leader's own end
  included) and never goes backwards: nothing past it is handed to consumers, so
  nothing a consumer saw is missing from an in-sync replica. (A follower that joins
  holding less than the confirmed offset holds it back until it has caught up: a sync
  write is acknowledged only once the confirmed offset passes its end.)

Coordinated (ZooKeeper) mode adds one rule: the in-sync set recorded in ZooKeeper is
the set elections choose from, so every replica in it must hold every acknowledged
write. Locally the set may be larger than ZooKeeper's, never smaller: a follower joins
here first and is written to ZooKeeper afterwards; it leaves ZooKeeper's set first and
only then stops being waited for here (:meth:`lagging` proposes, :meth:`leave`
applies). The replicas of ZooKeeper's set start a term in sync (:meth:`seed`), and a
new session of an in-sync follower stays in sync until ZooKeeper says otherwise.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger("clmq.replication")


@dataclass
class FollowerState:
    broker_id: int
    host: str
    session: int
    joined_ms: float
    acked: int = -1  # the follower's log end as last reported (-1: no fetch yet)
    flushed: int = -1  # how far it says its log is fsynced
    last_fetch_ms: float = 0.0
    caught_up_ms: float = -1.0  # when it last had everything the leader had (-1: never)
    reply_end: int = -1  # the leader's end that the last answer reached (-1: it did not reach the end)
    reply_ms: float = 0.0
    in_sync: bool = False
    parked: bool = False  # a fetch of it waits at the leader's end: it holds everything the leader has
    # The leader's topics version this follower holds (copied in this session); -1: none
    # yet; None: a follower of an older version that does not say (not waited for).
    topics_version: int | None = -1

    def holds_topics(self, version: int) -> bool:
        return self.topics_version is None or self.topics_version >= version

    def hold(self, flushed: bool) -> int:
        return self.flushed if flushed else self.acked


class InSyncSet:
    def __init__(
        self, broker_name: str, lag_max_ms: int, count_flushed: bool, confirmed: int, coordinated: bool = False
    ) -> None:
        self.broker_name = broker_name
        self.coordinated = coordinated
        self.frozen = False  # set when the leader stops: nobody leaves the set any more
        self.lag_max_ms = lag_max_ms
        self.count_flushed = count_flushed
        self.followers: dict[int, FollowerState] = {}
        self.confirmed = confirmed

    def size(self) -> int:
        """Replicas in sync, the leader included."""
        return 1 + sum(1 for f in self.followers.values() if f.in_sync)

    def seed(self, broker_ids: list[int], now_ms: float) -> None:
        """Coordinated mode, at a term's start: the followers of ZooKeeper's in-sync set
        are in sync (waited for) before they join, until they lag too long."""
        for i in broker_ids:
            self.followers[i] = FollowerState(i, "", -1, now_ms, caught_up_ms=now_ms, in_sync=True)

    def join(self, state: FollowerState) -> None:
        """A (re)joining follower: a new session starts out of sync (coordinated mode: an
        in-sync follower stays in sync, its hold unknown until it fetches)."""
        old = self.followers.get(state.broker_id)
        if old is not None and old.in_sync:
            if self.coordinated:
                state.in_sync, state.caught_up_ms = True, old.caught_up_ms
            else:
                log.warning(
                    "%s: replica %d re-joined (new session): out of the in-sync set until caught up",
                    self.broker_name,
                    state.broker_id,
                )
        self.followers[state.broker_id] = state

    def drop(self, broker_id: int) -> None:
        """Forget a follower's session (coordinated mode: an in-sync follower stays
        waited for, its hold unknown, until it leaves ZooKeeper's set)."""
        old = self.followers.pop(broker_id, None)
        if self.coordinated and old is not None and old.in_sync:
            self.followers[broker_id] = FollowerState(
                broker_id, old.host, -1, old.joined_ms, caught_up_ms=old.caught_up_ms, in_sync=True
            )

    def report(
        self, f: FollowerState, offset: int, flushed: int, leader_end: int, now_ms: float, topics: bool = True
    ) -> None:
        """A fetch from ``f``: ``offset`` (its end) and ``flushed`` (validated by the
        caller); ``topics``: it holds the leader's topics (else it is not caught up: a
        follower that cannot copy them leaves the set, and topic changes stop waiting)."""
        assert f.acked <= offset <= leader_end and flushed <= offset, (f.acked, offset, flushed, leader_end)
        f.acked, f.flushed, f.last_fetch_ms = offset, flushed, now_ms
        if topics and offset >= leader_end:
            f.caught_up_ms = now_ms
        elif topics and 0 <= f.reply_end <= offset:
            f.caught_up_ms = max(f.caught_up_ms, f.reply_ms)
        if not f.in_sync and self._lag_ok(f, now_ms):
            f.in_sync = True
            log.info(
                "%s: replica %d at %s joined the in-sync set (holds %d)",
                self.broker_name,
                f.broker_id,
                f.host,
                f.hold(self.count_flushed),
            )

    def answered(self, f: FollowerState, reached: int, leader_end: int, now_ms: float) -> None:
        """The leader answered ``f`` with bytes up to ``reached`` while its end was ``leader_end``."""
        f.reply_end = reached if reached >= leader_end else -1
        f.reply_ms = now_ms

    def expire(self, now_ms: float) -> list[FollowerState]:
        """Followers that have not been caught up for ``lag_max_ms`` leave the set."""
        left = self.lagging(now_ms)
        for f in left:
            self.leave(f, now_ms)
        return left

    def lagging(self, now_ms: float) -> list[FollowerState]:
        """In-sync followers not caught up for ``lag_max_ms`` (due to leave the set);
        none once :attr:`frozen` (a stopping leader refuses fetches: its followers must
        not leave for that, or it would acknowledge alone what they never got)."""
        if self.frozen:
            return []
        return [f for f in self.followers.values() if f.in_sync and not self._lag_ok(f, now_ms)]

    def leave(self, f: FollowerState, now_ms: float) -> None:
        f.in_sync = False
        log.warning(
            "%s: replica %d at %s left the in-sync set: not caught up for %d ms (replica_lag_max_ms=%d), "
            "%d bytes behind",
            self.broker_name,
            f.broker_id,
            f.host or "(not joined)",
            now_ms - f.caught_up_ms,
            self.lag_max_ms,
            max(0, self.confirmed - f.acked),
        )

    def ready_to_record(self, recorded: set[int], topics_version: int) -> list[int]:
        """In-sync followers not yet in ZooKeeper's set (``recorded``) that hold every
        confirmed byte and the leader's topics (``topics_version``): safe to add there
        (an election may then choose them)."""
        return [
            f.broker_id
            for f in self.followers.values()
            if f.in_sync
            and f.broker_id not in recorded
            and f.acked >= 0
            and f.hold(self.count_flushed) >= self.confirmed
            and f.holds_topics(topics_version)
        ]

    def lacking_topics(self, topics_version: int) -> list[int]:
        """In-sync followers that do not hold the leader's topics at ``topics_version`` yet
        (a topic change waits for them: elections choose among them)."""
        return [f.broker_id for f in self.followers.values() if f.in_sync and not f.holds_topics(topics_version)]

    def recompute(self, leader_end: int) -> int:
        """The confirmed offset now (never lower than before, never past the leader's end)."""
        holds = [f.hold(self.count_flushed) for f in self.followers.values() if f.in_sync]
        self.confirmed = min(leader_end, max(self.confirmed, min([leader_end, *holds])))
        return self.confirmed

    def followers_in_sync(self) -> bool:
        return any(f.in_sync for f in self.followers.values())

    def park(self, f: FollowerState) -> None:
        """A fetch of ``f`` waits at the leader's end for new bytes: caught up meanwhile
        (``replica_fetch_wait_ms`` may exceed ``replica_lag_max_ms``)."""
        f.parked = True

    def unpark(self, f: FollowerState, now_ms: float) -> None:
        """The parked fetch is answered: the follower was caught up until now."""
        f.parked = False
        f.caught_up_ms = max(f.caught_up_ms, now_ms)

    def _lag_ok(self, f: FollowerState, now_ms: float) -> bool:
        return f.parked or (f.caught_up_ms >= 0 and now_ms - f.caught_up_ms <= self.lag_max_ms)

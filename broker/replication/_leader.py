"""The leader's side of the stream: followers join, then fetch the log's raw bytes
from where their own logs end, in large chunks sent with ``sendfile``; every fetch
acknowledges what the follower holds. The leader does no per-record work: a chunk may
end inside a record (the follower asks again from its end).

Every report is checked: the session and epoch must be current, the offset within the
leader's log and never behind the follower's previous report, the flushed offset not
past it. A follower that lies is answered REPLICA_REFUSED, forgotten and disconnected.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any

import trio

from clmq.broker.store import Span, Store
from clmq.protocol import ErrorCode, Frame
from clmq.protocol.transport import Peer, Reply, RequestError

from ._config import ReplicationConfig
from ._epochs import LeaderEpochs
from ._insync import FollowerState, InSyncSet
from ._ports import CoordinatorPort, MetadataPort

log = logging.getLogger("clmq.replication")

MAX_FETCH_WAIT_MS = 30_000


def now_ms() -> float:
    return time.monotonic() * 1000


class Leader:
    """One leadership term: the followers' sessions, the in-sync set, sync-write waits."""

    def __init__(
        self,
        config: ReplicationConfig,
        store: Store,
        epochs: LeaderEpochs,
        metadata: MetadataPort,
        coordinator: CoordinatorPort | None = None,
        recorded_isr: tuple[int, ...] = (),
    ) -> None:
        self.config = config
        # ZooKeeper mode: the in-sync set ZooKeeper records (this leader included) and the
        # coordinator that writes it; the local set is never smaller (see _insync).
        self.coordinator = coordinator
        self.recorded_isr = {*recorded_isr, config.broker_id}
        self.first_ack_logged = False
        self.store = store
        self.log = store.log
        self.epochs = epochs
        self.epoch = epochs.latest
        self.metadata = metadata
        self.isr = InSyncSet(
            config.broker_name,
            config.replica_lag_max_ms,
            config.replica_ack == "flushed",
            self.log.write_offset,
            coordinated=coordinator is not None,
        )
        if coordinator is not None:
            self.isr.seed(sorted(self.recorded_isr - {config.broker_id}), now_ms())
        self._sessions = itertools.count(int(time.time() * 1000) % 1_000_000_000)
        self._grew = trio.Event()  # set when the log grows: long-polled fetches answer
        self._changed = trio.Event()  # set when the confirmed offset or the in-sync set changes
        self._throttle = CatchUpThrottle(config.replica_catchup_bytes_per_s)
        self._told: int | None = None  # what the log was last told its confirmed offset is
        self.log.set_confirmed_offset(None)  # alone in the in-sync set: consumers see the whole log

    # ------------------------------------------------------------ from the log
    def log_grew(self) -> None:
        """On the event loop, after appends: wake long-polled fetches (and sync writes
        waiting while the leader is the only replica in sync)."""
        self._answer_fetches()
        self._publish()

    # ---------------------------------------------------------- the in-sync set
    def _publish(self) -> None:
        """Recompute the confirmed offset, tell the log (consumers) and the waiters."""
        confirmed = self.isr.recompute(self.log.write_offset)
        target = confirmed if self.isr.followers_in_sync() else None
        if target != self._told:  # only on a change: telling the log wakes its append listeners
            self._told = target
            self.log.set_confirmed_offset(target)
        self._changed.set()
        self._changed = trio.Event()

    async def watch_lag(self) -> None:
        """Forever: followers not caught up for ``replica_lag_max_ms`` leave the in-sync
        set (ZooKeeper mode: ZooKeeper's set first; followers that caught up join it)."""
        period = max(0.01, min(0.1, self.config.replica_lag_max_ms / 4000))
        while True:
            await trio.sleep(period)
            if self.coordinator is not None:
                await self._record_isr(self.coordinator)
            elif self.isr.expire(now_ms()):
                self._publish()

    async def _record_isr(self, coordinator: CoordinatorPort) -> None:
        """Shrink ZooKeeper's set before the local one (acks stop waiting for a replica
        only once no election can choose it); grow the local one before ZooKeeper's."""
        lagging = [f.broker_id for f in self.isr.lagging(now_ms())]
        if lagging and await coordinator.shrink(lagging):
            self.recorded_isr -= set(lagging)
            for i in lagging:
                f = self.isr.followers.get(i)
                if f is not None and f.in_sync:
                    self.isr.leave(f, now_ms())
            self._publish()
        ready = self.isr.ready_to_record(self.recorded_isr, self.metadata.topics_version())
        if ready and await coordinator.expand(ready):
            self.recorded_isr |= set(ready)

    def _answer_fetches(self) -> None:
        """Answer long-polled fetches at once: each follower's next fetch reports what it
        holds (and sees a new metadata version), instead of after ``replica_fetch_wait_ms``
        of waiting for bytes that will not come."""
        self._grew.set()
        self._grew = trio.Event()

    async def wait_caught_up(self, broker_id: int) -> None:
        """Until follower ``broker_id`` holds the whole log and the leader's topics (a
        graceful hand-over; the caller has stopped new writes)."""
        self._answer_fetches()
        while True:
            changed = self._changed
            f = self.isr.followers.get(broker_id)
            if (
                f is not None
                and f.in_sync
                and f.hold(self.isr.count_flushed) >= self.log.write_offset
                and f.holds_topics(self.metadata.topics_version())
            ):
                return
            await changed.wait()

    async def wait_topics(self, topic: str) -> tuple[ErrorCode, str] | None:
        """After a topic change (``topic`` created, grown or deleted): wait until every
        in-sync follower holds the leader's topics, whatever the ack mode (a replica an
        election may choose must know every acknowledged topic, or the group loses it).
        As in Kafka, ``min_insync_replicas`` is for writes, not topic changes. An error
        code and text if not within ``replication_timeout_ms``."""
        version = self.metadata.topics_version()
        lacking = self.isr.lacking_topics(version)
        if not lacking:  # nothing pending: no fetch to wake
            return None
        self._answer_fetches()
        with trio.move_on_after(self.config.replication_timeout_ms / 1000):
            while lacking:
                changed = self._changed
                await changed.wait()
                lacking = self.isr.lacking_topics(version)
            return None
        return ErrorCode.REPLICATION_TIMEOUT, (
            f"topic {topic!r} changed on the leader, not copied by in-sync "
            f"{', '.join(f'replica {i}' for i in lacking)} within replication_timeout_ms="
            f"{self.config.replication_timeout_ms}; retry"
        )

    # -------------------------------------------------------------- sync writes
    def is_sync(self, topic: str, sync: bool | None) -> bool:
        """Whether a write waits for the in-sync replicas: as the writer asked (a Kafka
        producer's acks), else as the topic's ack mode says."""
        return self.config.ack_mode_of(topic) == "sync" if sync is None else sync

    def check_sync_write(self, topic: str, sync: bool | None = None) -> None:
        """Before appending a sync write: refuse it while too few replicas are in sync."""
        if self.is_sync(topic, sync) and self.isr.size() < self.config.min_insync_replicas:
            raise RequestError(ErrorCode.NOT_ENOUGH_REPLICAS, self._too_few("nothing was written"))

    async def wait_held(self, topic: str, end: int, sync: bool | None = None) -> tuple[ErrorCode, str] | None:
        """After appending a sync write ending at ``end``: wait (never under the append
        lock) until every in-sync replica holds it and they are at least
        ``min_insync_replicas``. An error code and text if not in time, or if the set shrinks."""
        if not self.is_sync(topic, sync):
            return None
        with trio.move_on_after(self.config.replication_timeout_ms / 1000):
            while True:
                changed = self._changed
                if self.isr.size() < self.config.min_insync_replicas:
                    return ErrorCode.REPLICATION_TIMEOUT, self._too_few("stored on the leader only")
                if not self.isr.followers_in_sync():  # alone: the leader holds it
                    return None
                # held, and its topic too (a change still being copied would be lost with it)
                if self.isr.confirmed >= end and not self.isr.lacking_topics(self.metadata.topics_version()):
                    return None
                await changed.wait()
        return ErrorCode.REPLICATION_TIMEOUT, (
            f"stored on the leader, not held by the in-sync replicas within replication_timeout_ms="
            f"{self.config.replication_timeout_ms} (confirmed {self.isr.confirmed}, needed {end}); retry"
        )

    def _too_few(self, what: str) -> str:
        return (
            f"{self.isr.size()} replicas in sync, min_insync_replicas={self.config.min_insync_replicas}: {what}; "
            "retry once followers catch up"
        )

    # ---------------------------------------------------------------- requests
    async def join(self, frame: Frame, peer: Peer) -> Reply:
        f = frame.fields
        self._check_member(f["broker_name"], f["broker_id"], f["segment_bytes"], peer)
        state = FollowerState(
            f["broker_id"], f.get("addr") or f"{peer.host}:{peer.port}", next(self._sessions), now_ms()
        )
        self.isr.join(state)
        self._publish()
        log.info(
            "%s: replica %d joined from %s (its log ends at %d, epoch %d)",
            self.config.broker_name,
            state.broker_id,
            state.host,
            f["end_offset"],
            f["epoch"],
        )
        return Reply(
            {
                "session": state.session,
                "epoch": self.epoch,
                "epochs": [list(e) for e in self.epochs.entries],
                "end_offset": self.log.write_offset,
                "min_offset": self.log.min_offset,
                "confirmed_offset": self.isr.confirmed,
                "ack_durability": self.config.replica_ack,
            }
        )

    def _check_member(self, name: str, broker_id: int, segment_bytes: int, peer: Peer) -> None:
        why = not_a_member(self.config, self.log.config.segment_bytes, name, broker_id, segment_bytes)
        if why:
            log.warning("%s: refused replication from %s:%d: %s", self.config.broker_name, peer.host, peer.port, why)
            raise RequestError(ErrorCode.REPLICA_REFUSED, why, close=True)

    def _session(self, f: dict[str, Any]) -> FollowerState:
        state = self.isr.followers.get(f["broker_id"])
        if state is None or state.session != f["session"]:
            raise RequestError(
                ErrorCode.REPLICA_REFUSED,
                f"no replication session {f['session']} for broker id {f['broker_id']}: join first",
                close=True,
            )
        return state

    def _refuse(self, state: FollowerState, why: str) -> RequestError:
        log.warning(
            "%s: replica %d at %s lied (%s): session dropped", self.config.broker_name, state.broker_id, state.host, why
        )
        self.isr.drop(state.broker_id)
        self._publish()
        return RequestError(ErrorCode.REPLICA_REFUSED, why, close=True)

    async def fetch(self, frame: Frame, peer: Peer) -> Reply:
        f = frame.fields
        state = self._session(f)
        if f["epoch"] != self.epoch:
            raise RequestError(
                ErrorCode.STALE_EPOCH, f"epoch {f['epoch']} is not the leader's {self.epoch}: join again"
            )
        offset, flushed, end = f["offset"], f["flushed"], self.log.write_offset
        why = report_problem(state, f, end, self.metadata.topics_version())
        if why is not None:
            raise self._refuse(state, why)
        state.topics_version = f.get("topics_version")  # absent: a follower of an older version
        if offset < self.log.min_offset:
            return Reply(
                {"min_offset": self.log.min_offset},
                error_code=ErrorCode.OFFSET_OUT_OF_RANGE,
                error_text=f"offset {offset} is below the leader's log start {self.log.min_offset}",
            )
        holds_topics = state.holds_topics(self.metadata.topics_version())
        self.isr.report(state, offset, flushed, end, now_ms(), holds_topics)
        self._publish()
        # Parked at the end only holding the leader's topics: one that lacks them has a
        # topic change to copy, which a topic change's answer may be waiting for.
        if offset >= end and holds_topics:
            self.isr.park(state)
            try:
                with trio.move_on_after(min(f["max_wait_ms"], MAX_FETCH_WAIT_MS) / 1000):
                    await self._grew.wait()
            finally:
                self.isr.unpark(state, now_ms())
        return await self._answer(state, offset, f["max_bytes"])

    async def _answer(self, state: FollowerState, offset: int, max_bytes: int) -> Reply:
        end = self.log.write_offset
        span = self._span(offset, min(max_bytes, end - offset)) if end > offset else None
        length = span.length if span else 0
        if length and not state.in_sync and end - offset > self.config.replica_fetch_max_bytes:
            # Catching up, out of the in-sync set: throttled (Kafka's KIP-73). Never a follower
            # in sync: sync acks wait for it, and a burst must not make it fall out.
            await self._throttle.wait(state.broker_id, length)
        self.isr.answered(state, offset + length, end, now_ms())
        fields = {
            "epoch": self.epoch,
            "offset": offset,
            "length": length,
            "end_offset": end,
            "min_offset": self.log.min_offset,
            "confirmed_offset": self.isr.confirmed,
            "in_sync": state.in_sync,
            "metadata_version": self.metadata.version(),
            "topics_version": self.metadata.topics_version(),
        }
        return Reply(fields, spans=[span] if span else [])

    def _span(self, offset: int, n: int) -> Span | None:
        for base, size, path in self.log.segments():
            if base <= offset < base + size:
                return Span(str(path), offset - base, min(n, base + size - offset))
        return None

    async def metadata_request(self, frame: Frame, peer: Peer) -> Reply:
        """Topics, offsets and subscriptions; with ``queue_ends_before`` (a follower
        whose log starts empty there), also ``queue_ends``: the queues without a record
        from there on, with their next offsets (:meth:`Store.queue_ends_before`)."""
        self._session(frame.fields)
        fields = {"version": self.metadata.version(), **self.metadata.snapshot()}
        before = frame.fields.get("queue_ends_before")
        if isinstance(before, int):
            ends = await trio.to_thread.run_sync(self.store.queue_ends_before, before)
            fields["queue_ends"] = [list(end) for end in ends]
        return Reply(fields)

    # ------------------------------------------------------------------ status
    def replicas(self) -> list[dict[str, Any]]:
        """REPLICA_STATUS's rows of the followers (see :func:`replica_row`)."""
        end, now = self.log.write_offset, now_ms()
        return [replica_row(f, end, now) for f in sorted(self.isr.followers.values(), key=lambda f: f.broker_id)]


def report_problem(state: FollowerState, f: dict[str, Any], end: int, topics_version: int) -> str | None:
    """Why a fetch's report cannot be true (None: it can): past the leader's log end,
    behind the follower's previous report, flushed past its offset, or a topics version
    the leader never had."""
    offset, flushed, topics = f["offset"], f["flushed"], f.get("topics_version")
    if offset > end:
        return f"offset {offset} is past the leader's end {end}"
    if offset < state.acked:
        return f"offset {offset} is behind its previous report {state.acked}"
    if flushed > offset:
        return f"flushed offset {flushed} is past its offset {offset}"
    if topics is not None and topics > topics_version:
        return f"topics version {topics} is past the leader's {topics_version}"
    return None


def replica_row(f: FollowerState, end: int, now: float) -> dict[str, Any]:
    """A follower as REPLICA_STATUS shows it to an operator."""
    return {
        "broker_id": f.broker_id,
        "addr": f.host,
        "acked_offset": f.acked,
        "flushed_offset": f.flushed,
        "lag_bytes": max(0, end - f.acked) if f.acked >= 0 else end,
        "lag_ms": _lag_ms(f, end, now),
        "in_sync": f.in_sync,
    }


def not_a_member(config: ReplicationConfig, segment_bytes: int, name: str, broker_id: int, theirs: int) -> str:
    """Why a broker joining (``name``, ``broker_id``, its segment size ``theirs``) may
    not replicate from this leader (whose segments are ``segment_bytes``); "" if it may."""
    if name != config.broker_name:
        return f"broker name {name!r} is not this group's ({config.broker_name!r})"
    if broker_id == config.broker_id:
        return f"broker id {broker_id} is the leader's own"
    if config.replica_ids and broker_id not in config.replica_ids:
        return f"broker id {broker_id} is not in replica_ids {list(config.replica_ids)}"
    if theirs != segment_bytes:
        return f"segment_bytes {theirs} differs from the leader's {segment_bytes}"
    return ""


class CatchUpThrottle:
    """A token bucket of ``bytes_per_s`` per follower catching up (one second deep;
    0: unlimited), Kafka's KIP-73."""

    def __init__(self, bytes_per_s: int) -> None:
        self.rate = bytes_per_s
        self._buckets: dict[int, tuple[float, float]] = {}  # follower -> (tokens, at)

    async def wait(self, broker_id: int, n: int) -> None:
        """Take ``n`` bytes from ``broker_id``'s bucket, waiting while it is in debt."""
        rate = self.rate
        if rate <= 0:
            return
        tokens, at = self._buckets.get(broker_id, (float(rate), time.monotonic()))
        now = time.monotonic()
        tokens = min(float(rate), tokens + (now - at) * rate) - n
        self._buckets[broker_id] = (tokens, now)
        if tokens < 0:
            await trio.sleep(-tokens / rate)


def _lag_ms(f: FollowerState, end: int, now: float) -> int:
    """How long since the follower last had everything (0: it has it now; -1: never)."""
    if f.acked >= end:
        return 0
    return int(now - f.caught_up_ms) if f.caught_up_ms >= 0 else -1

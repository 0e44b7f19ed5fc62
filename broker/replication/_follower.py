"""The follower's side of the stream: one connection to the leader; join, cut the log
back to where it agrees with the leader's (epochs), then fetch from the log's end
forever, appending the leader's bytes at the same offsets.

Every record is checked (CRC, offset) by :meth:`CommitLog.append_raw` before it is
written; the follower's own dispatcher builds its consume queues, up to the confirmed
offset the leader reports (so reads from a follower never show more than the in-sync
replicas hold). Topics and consumer offsets are copied when the leader's metadata
version changes, at most every ``replica_metadata_interval_ms``.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import trio

from clmq.broker.store import Store
from clmq.commitlog import whole_prefix
from clmq.common import ClmqError, CorruptRecordError
from clmq.protocol import ErrorCode, RequestCode
from clmq.protocol.transport import ConnectionFailed, RpcClient, RpcError

from ._config import ReplicationConfig
from ._epochs import Entry, LeaderEpochs, divergence
from ._ports import MetadataPort

log = logging.getLogger("clmq.replication")

REQUEST_SLACK_MS = 5000  # a fetch's answer may take its wait plus this long
NOT_LEADER_RETRY_S = 0.02


class Rejoin(Exception):
    """The leader asked for a new session (a new epoch, or a log start past ours)."""


class Follower:
    def __init__(
        self,
        config: ReplicationConfig,
        store: Store,
        epochs: LeaderEpochs,
        metadata: MetadataPort,
        rpc: RpcClient,
        leader_hint: Callable[[], str],
        addr: Callable[[], str] = lambda: "",
        min_leader_epoch: Callable[[], int] = lambda: -1,
    ) -> None:
        self.min_leader_epoch = min_leader_epoch  # ZooKeeper's epoch: a leader with an older one is refused
        self.config = config
        self.store = store
        self.log = store.log
        self.epochs = epochs
        self.metadata = metadata
        self.rpc = rpc
        self.leader_hint = leader_hint  # the leader's address as the name servers last said ("" : unknown)
        self.addr = addr  # where this follower listens (its leader shows it in REPLICA_STATUS)
        self.leader_addr = ""
        self.leader_epoch = -1
        self.in_sync = False  # as the leader last said, while connected
        # The leader's last word before the connection was lost: in sync, and the
        # confirmed offset it reported. A leader that died leaves its followers with this.
        self.was_in_sync = False
        self.last_confirmed = 0
        self.connected = False
        self.leader_end = 0
        self.confirmed = 0
        self.last_reply_ms = 0.0
        self.error = ""
        self._leader_terms: list[Entry] = []
        self._metadata_version = -1
        self._topics_version: int | None = -1
        self._leader_topics_version: int | None = -1  # the topics version of the leader's last answer
        self._metadata_at = 0.0
        self._flush_each = False
        self._stopped = False  # this broker leads now: append and report nothing more
        # Consumers of a follower see only what the leader confirmed: until it says, what
        # was dispatched before (confirmed when it was) and nothing more.
        self._told = min(self.log.write_offset, store.dispatcher.dispatched_offset)
        self.log.set_confirmed_offset(self._told)

    async def follow_loop(self) -> None:
        """Forever: follow the leader; on any failure, say so (once per kind) and retry.
        A leader named by ZooKeeper that answers NOT_LEADER is about to lead (its switch
        takes milliseconds): asked again soon, every 20 ms doubling up to
        ``replica_retry_ms``, since sync writes of the new term wait for this follower."""
        soon_s = NOT_LEADER_RETRY_S
        while True:
            addr = self.leader_hint() or self.config.leader_addr
            wait_s = self.config.replica_retry_ms / 1000
            if addr:
                try:
                    await self._follow(addr)
                except Rejoin as e:
                    log.info("%s: rejoining leader %s: %s", self.config.broker_name, addr, e)
                    continue
                except (ConnectionFailed, RpcError, trio.TooSlowError, ClmqError, OSError) as e:
                    self._failed(addr, e)  # e.g. a damaged chunk, a store that failed: said, then retried
                    if isinstance(e, RpcError) and e.code == ErrorCode.NOT_LEADER and self.config.coordinated:
                        wait_s, soon_s = min(wait_s, soon_s), soon_s * 2
                    else:
                        soon_s = NOT_LEADER_RETRY_S
            elif self.error != "no leader known":
                self.error = "no leader known"
                if self.config.coordinated:
                    log.info("%s: follower waiting for ZooKeeper to name a leader", self.config.broker_name)
                else:
                    log.warning(
                        "%s: follower without a leader: set leader_addr or name servers", self.config.broker_name
                    )
            self.connected = False
            await trio.sleep(wait_s)

    def promotable(self) -> bool:
        """Whether this follower holds everything its leader may have acknowledged: in
        sync now, or in sync at the leader's last answer and holding the confirmed
        offset that answer carried (every sync-acknowledged byte is below it), and
        holding the topics that answer named (every acknowledged topic change)."""
        holds_topics = self._topics_version == self._leader_topics_version  # those of the leader's last answer
        return holds_topics and (self.in_sync or (self.was_in_sync and self.log.write_offset >= self.last_confirmed))

    def _failed(self, addr: str, e: BaseException) -> None:
        text = f"{addr}: {e or type(e).__name__}"
        if text != self.error:
            log.warning("%s: replication from %s failed: %s", self.config.broker_name, addr, text)
        self.error = text
        self.in_sync = False

    async def _follow(self, addr: str) -> None:
        c = self.config
        fields = {
            "broker_name": c.broker_name,
            "broker_id": c.broker_id,
            "epoch": self.epochs.latest,
            "end_offset": self.log.write_offset,
            "segment_bytes": self.log.config.segment_bytes,
            "addr": self.addr(),
        }
        joined = await self.rpc.request(addr, RequestCode.REPLICA_JOIN, fields, timeout_ms=REQUEST_SLACK_MS)
        j = joined.fields
        if j["epoch"] < self.min_leader_epoch():
            raise RpcError(
                addr,
                ErrorCode.STALE_EPOCH,
                f"leader's epoch {j['epoch']} is older than the group's "
                f"{self.min_leader_epoch()} in ZooKeeper: not following it",
            )
        self.leader_addr, self.leader_epoch, self.connected, self.error = addr, j["epoch"], True, ""
        # Metadata versions are the leader's counters: a new session copies afresh.
        self._metadata_version, self._topics_version = -1, -1
        self._flush_each = j["ack_durability"] == "flushed"
        self._leader_terms = [(int(e), int(s), int(b)) for e, s, b in j["epochs"]]
        cut = await trio.to_thread.run_sync(self._reconcile, j["end_offset"], j["min_offset"])
        if self.log.write_offset == self.log.min_offset > 0:  # new, or restarted (maybe before a crash)
            await self._continue_queues(addr, j["session"])
        if cut:
            self.metadata.after_truncation()
        log.info(
            "%s: following leader %s (epoch %d) from offset %d",
            c.broker_name,
            addr,
            self.leader_epoch,
            self.log.write_offset,
        )
        await self._fetch_loop(addr, j["session"])

    def _reconcile(self, leader_end: int, leader_min: int) -> bool:
        """Cut the log to where it agrees with the leader's (a worker thread); True if cut."""
        own_end = self.log.write_offset
        point = divergence(self.epochs.entries, own_end, self._leader_terms, leader_end)
        cut = point < own_end
        if cut:
            log.warning(
                "%s: cutting the log from %d to %d: bytes there were written in a term the leader (epoch %d) "
                "does not share",
                self.config.broker_name,
                own_end,
                point,
                self.leader_epoch,
            )
            self.store.truncate(point)
            self.epochs.truncate(point)
        if self.log.write_offset < leader_min or (self.log.write_offset == 0 and leader_min > self.log.min_offset):
            log.warning(
                "%s: the leader's log starts at %d, past this log's end %d: starting an empty log there",
                self.config.broker_name,
                leader_min,
                self.log.write_offset,
            )
            self.store.restart_at(leader_min)
            cut = True
        self.epochs.adopt(self._leader_terms, self.log.write_offset)
        return cut

    async def _continue_queues(self, addr: str, session: int) -> None:
        """This log starts empty past 0: queues whose records the leader's retention
        removed would be numbered from 0 again here (below offsets consumers committed).
        Asks the leader where they continue and continues them there, durably; again at
        every join while the log holds no record (a crash may have come in between)."""
        base = self.log.min_offset
        fields = {"broker_id": self.config.broker_id, "session": session, "queue_ends_before": base}
        reply = await self.rpc.request(addr, RequestCode.REPLICA_METADATA, fields, timeout_ms=REQUEST_SLACK_MS)
        ends = [(str(t), int(q), int(n)) for t, q, n in reply.fields.get("queue_ends") or []]
        moved = await trio.to_thread.run_sync(self.store.continue_queues, ends)
        if moved:
            log.info(
                "%s: %d queue(s) continue where the leader's do (their records are gone)",
                self.config.broker_name,
                moved,
            )

    async def _fetch_loop(self, addr: str, session: int) -> None:
        c = self.config
        max_bytes = c.replica_fetch_max_bytes
        while True:
            fields = {
                "broker_id": c.broker_id,
                "session": session,
                "epoch": self.leader_epoch,
                "offset": self.log.write_offset,
                "flushed": min(self.log.durable_offset, self.log.write_offset),
                "max_bytes": max_bytes,
                "max_wait_ms": c.replica_fetch_wait_ms,
                # which of this leader's topics versions this follower holds: topic changes wait for it
                "topics_version": -1 if self._topics_version is None else self._topics_version,
            }
            reply = await self.rpc.request(
                addr,
                RequestCode.REPLICA_FETCH,
                fields,
                timeout_ms=c.replica_fetch_wait_ms + REQUEST_SLACK_MS,
                check=False,
            )
            if reply.error_code in (ErrorCode.STALE_EPOCH, ErrorCode.OFFSET_OUT_OF_RANGE):
                raise Rejoin(reply.error_text)
            if reply.error_code:
                raise RpcError(addr, reply.error_code, reply.error_text)
            if self._stopped:
                await trio.sleep_forever()  # promoted: the role's switch cancels this task
            f = reply.fields
            needed = await self._append(fields["offset"], reply.body) if reply.body else 0
            max_bytes = max(c.replica_fetch_max_bytes, needed)
            self._note(f)
            if f["min_offset"] > self.log.min_offset:  # the leader's retention removed segments: so does this log
                await trio.to_thread.run_sync(self.log.delete_before, f["min_offset"])
            if f["metadata_version"] != self._metadata_version:
                urgent = f.get("topics_version") != self._topics_version
                await self._copy_metadata(addr, session, f["metadata_version"], urgent)
                if self._metadata_version == f["metadata_version"]:
                    self._topics_version = f.get("topics_version")

    def stop(self) -> None:
        """This broker was promoted while the fetch loop still runs (it is cancelled
        soon after): from now on it appends nothing and reports nothing to the old
        leader, which would otherwise count a write of the new term as held, and set
        the new leader's confirmed offset from a stale answer."""
        self._stopped = True

    async def _append(self, offset: int, body: bytes) -> int:
        """Append a chunk in a worker thread. (Appending small chunks on the event loop
        was tried in issue 34 and taken back: a CI run then saw a new follower's
        consume queue skip records it had copied; the cause was not found in time.)"""
        return await trio.to_thread.run_sync(self._take, offset, body)

    def _take(self, offset: int, body: bytes) -> int:
        """Append the whole records of a chunk (a worker thread); returns the size of a
        record cut at its end (0: none)."""
        n, needed, _sealed = whole_prefix(body, self.log.config.max_message_bytes)
        if n:
            result = self.log.append_raw(offset, body[:n] if n < len(body) else body)
            if not result.ok:
                raise CorruptRecordError(
                    f"replication from {self.leader_addr}",
                    offset,
                    "raw append",
                    "OK",
                    f"{result.status.name}: {result.error}",
                )
            if self._flush_each:  # the leader counts only fsynced bytes as held
                self.store.flush()
            self.epochs.catch_up(self._leader_terms, self.log.write_offset)
        return needed

    def _note(self, f: dict[str, Any]) -> None:
        self.leader_end, self.in_sync, self.last_reply_ms = f["end_offset"], bool(f["in_sync"]), time.monotonic() * 1000
        self.was_in_sync, self.last_confirmed = self.in_sync, f["confirmed_offset"]
        self.confirmed = min(f["confirmed_offset"], self.log.write_offset)
        self._leader_topics_version = f.get("topics_version")
        if self.confirmed != self._told:
            self._told = self.confirmed
            self.log.set_confirmed_offset(self.confirmed)

    async def _copy_metadata(self, addr: str, session: int, version: int, urgent: bool) -> None:
        """Copy topics, offsets and subscriptions: at once after a topic change, else at
        most every ``replica_metadata_interval_ms`` (offsets change with every commit)."""
        now = time.monotonic()
        if not urgent and now - self._metadata_at < self.config.replica_metadata_interval_ms / 1000:
            return
        self._metadata_at = now
        reply = await self.rpc.request(
            addr, RequestCode.REPLICA_METADATA, {"broker_id": self.config.broker_id, "session": session}
        )
        await trio.to_thread.run_sync(self.metadata.apply, reply.fields)
        self._metadata_version = version

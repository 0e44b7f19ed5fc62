"""ShareFetch (78) and ShareAcknowledge (79): Kafka share groups (KIP-932) over the
broker's POP state (``clmq.broker.service.pop``).

A ShareFetch first applies the acknowledgements it carries (``_share_acks``), then
pops, for each topic of the member's share session, up to ``max_records`` messages of
the session's partitions (``PopService.pop`` with the member id as the client id and
``kafka_share_record_lock_duration_ms`` as the invisible time; it waits up to the
request's ``max_wait_ms``, cut to ``kafka_max_fetch_wait_ms``, when nothing is visible).
The messages are sent as Kafka record batches (the Fetch mapping: ``batches_of``), one
per run of consecutive offsets, with AcquiredRecords ranges whose delivery count is the
POP attempt (1 first, 2 after a RELEASE or a lock that ran out, ...). A message whose
attempts pass the group's max_reconsume_times goes to ``%DLQ%group`` instead (the POP
service's rule). The partitions of a share session are this broker's queues: another
broker's partition is answered NOT_LEADER_OR_FOLLOWER, as Fetch does. POP errors
become the Kafka codes the Java client retries (``_share_errors``).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

from clmq.broker.store import GetStatus, StorageEngine
from clmq.common import CorruptRecordError
from clmq.protocol.kafka import Compression, ErrorCode, KafkaRequest
from clmq.protocol.transport import RequestError

from .._context import BrokerContext
from .._read_threads import ReadThreads
from ._cluster import ClusterView
from ._fetch import KafkaFetch
from ._listener import Peer
from ._metadata import topic_id
from ._raw_records import batches_of
from ._share_acks import AckOutcome, apply_acks
from ._share_errors import ack_error, fetch_error
from ._share_members import ShareGroups
from ._share_sessions import DeliveryLike, PopLike, ShareSession, ShareSessions, prune_held, release_held

log = logging.getLogger("clmq.broker.kafka")


class KafkaShare:
    """Share groups on this broker: the coordinator's membership, sessions, fetches, acks."""

    def __init__(
        self,
        ctx: BrokerContext,
        fetch: KafkaFetch,
        readers: ReadThreads,
        topic_name: Callable[[Any], str | None],
        pop_service: Callable[[], PopLike | None],
    ) -> None:
        cfg = ctx.config
        self.ctx = ctx
        self.fetcher, self.views = fetch, fetch.views
        self._readers = readers
        self.topic_name = topic_name
        self.pop_service = pop_service
        self.lock_ms = cfg.kafka_share_record_lock_duration_ms
        self.sessions = ShareSessions(cfg.kafka_share_max_sessions, cfg.kafka_share_session_timeout_ms)
        self._leaving: list[tuple[str, str]] = []
        self.groups = ShareGroups(
            cfg.kafka_share_heartbeat_interval_ms,
            cfg.kafka_share_session_timeout_ms,
            cfg.cluster,
            lambda group, member: self._leaving.append((group, member)),
        )

    # ------------------------------------------------------------ membership
    async def heartbeat(self, req: KafkaRequest, peer: Peer) -> dict[str, Any]:
        """ShareGroupHeartbeat (on the group's coordinator: the service checks that)."""
        view = await self.views.current()
        if any(t not in view.topics for t in req.body.get("subscribed_topic_names") or ()):
            view = await self.views.current(fresh=True)  # a topic just created: not yet in the cached view
        answer = self.groups.heartbeat(req.body, view)
        await self._release_leavers()
        return answer

    async def _release_leavers(self) -> None:
        """The sessions of members that left (or fell silent) closed, their records released."""
        pop = self.pop_service()
        while self._leaving:
            group, member = self._leaving.pop()
            session = self.sessions.close(group, member)
            if session is not None and pop is not None:
                await release_held(pop, session)

    # ------------------------------------------------------------ ShareFetch
    async def share_fetch(self, req: KafkaRequest, peer: Peer) -> dict[str, Any]:
        """Acknowledgements applied, then records popped for the member's session."""
        b = req.body
        pop = self.pop_service()
        if pop is None:
            return self._top(ErrorCode.COORDINATOR_LOAD_IN_PROGRESS, "the broker's POP service is not running")
        entered = self.sessions.enter(
            str(b.get("group_id") or ""), str(b.get("member_id") or ""), b["share_session_epoch"], opening=True
        )
        if isinstance(entered, int):
            return self._top(entered, "share session")
        session, view = entered, await self.views.current()
        rows = await self._acknowledge(pop, session, view, b.get("topics", []), add=b["share_session_epoch"] != -1)
        for t in b.get("forgotten_topics_data", []):
            name = self.topic_name(t["topic_id"])
            session.partitions.difference_update((name, p) for p in t["partitions"] if name is not None)
        if b["share_session_epoch"] == -1:
            self.sessions.close(session.group, session.member)
            await release_held(pop, session)
        elif not b.get("is_renew_ack", False):  # v2 (KIP-1222): a fetch carrying RENEWs acquires nothing new
            if pop.running:  # a state not loaded yet knows no delivery: nothing is forgotten
                prune_held(pop, session)  # records whose lock ran out and went elsewhere: forgotten
            await self._fetch(pop, session, view, b, rows)
        return {**self._top(ErrorCode.NONE, None), "responses": _by_topic(rows)}

    async def _acknowledge(
        self, pop: PopLike, session: ShareSession, view: ClusterView, topics: list[dict[str, Any]], *, add: bool
    ) -> dict[tuple[Any, int], dict[str, Any]]:
        """Each named partition's row, its acknowledgements applied; named partitions join
        the session (``add``)."""
        rows: dict[tuple[Any, int], dict[str, Any]] = {}
        for t in topics:
            tid, name = t["topic_id"], self.topic_name(t["topic_id"])
            for p in t.get("partitions", []):
                index = p["partition_index"]
                row = rows[(tid, index)] = _row(index, self.views.me.node_id)
                queue_id, error = (
                    (-1, ErrorCode.UNKNOWN_TOPIC_ID) if name is None else self.fetcher.local_queue(view, name, index)
                )
                if error or name is None:
                    row["error_code"] = error
                    continue
                if add:
                    session.partitions.add((name, index))
                batches = p.get("acknowledgement_batches") or []
                if batches:
                    limits = (self.ctx.config.pop_max_inflight_per_queue, self.lock_ms)
                    try:
                        outcome = await apply_acks(pop, session, name, queue_id, batches, limits)
                    except RequestError as e:  # the POP state moved (not leader, starting): nothing of it known applied
                        outcome = AckOutcome(ack_error(e.code.name), e.text)
                    _ack_into(row, outcome)
        return rows

    async def _fetch(
        self,
        pop: PopLike,
        session: ShareSession,
        view: ClusterView,
        b: dict[str, Any],
        rows: dict[tuple[Any, int], dict[str, Any]],
    ) -> None:
        """Records of the session's partitions into ``rows`` (waiting once when none is visible)."""
        cfg = self.ctx.config
        by_topic: dict[str, dict[int, int]] = {}  # topic -> queue id -> partition index
        for name, index in sorted(session.partitions):
            queue_id, error = self.fetcher.local_queue(view, name, index)
            if error:
                rows.setdefault((topic_id(cfg.cluster, name), index), _row(index, self.views.me.node_id))[
                    "error_code"
                ] = error
            else:
                by_topic.setdefault(name, {})[queue_id] = index
        budget = max(1, min(b.get("max_records", cfg.pop_max_messages), cfg.pop_max_messages))
        wait_ms = min(max(b.get("max_wait_ms", 0), 0), cfg.kafka_max_fetch_wait_ms)
        got = 0
        for name, queues in by_topic.items():
            if got >= budget:
                break
            waiting = wait_ms if len(by_topic) == 1 else 0
            got += await self._pop_topic(pop, session, name, queues, (budget - got, waiting, b.get("max_bytes")), rows)
        if not got and wait_ms and len(by_topic) > 1:  # several topics: one wait, on the first
            name, queues = next(iter(by_topic.items()))
            await self._pop_topic(pop, session, name, queues, (budget, wait_ms, b.get("max_bytes")), rows)

    async def _pop_topic(
        self,
        pop: PopLike,
        session: ShareSession,
        name: str,
        queues: dict[int, int],
        ask: tuple[int, int, int | None],
        rows: dict[tuple[Any, int], dict[str, Any]],
    ) -> int:
        """One topic's POP for the member into ``rows``; how many records it gave."""
        cfg = self.ctx.config
        tid = topic_id(cfg.cluster, name)
        max_messages, wait_ms, max_bytes = ask
        try:
            got = await pop.pop(
                session.group, session.member, name, max_messages=max_messages, invisible_time_ms=self.lock_ms,
                queue_ids=sorted(queues), max_wait_ms=wait_ms, max_bytes=max_bytes,
            )  # fmt: skip
        except RequestError as e:
            code = fetch_error(e.code.name)
            for index in queues.values():
                row = rows.setdefault((tid, index), _row(index, self.views.me.node_id))
                row["error_code"], row["error_message"] = code, e.text
            return 0
        if not got:
            return 0
        built = await self._readers.in_thread(_records_of, self.ctx.store, self.fetcher.compression, got)
        for queue_id, (records, acquired) in built.items():
            row = rows.setdefault((tid, queues[queue_id]), _row(queues[queue_id], self.views.me.node_id))
            row["records"], row["acquired_records"] = records, acquired
        for d in got:
            session.held[(d.topic, d.queue_id, d.queue_offset)] = d.handle
        return len(got)

    # ------------------------------------------------------------ ShareAcknowledge
    async def share_acknowledge(self, req: KafkaRequest, peer: Peer) -> dict[str, Any]:
        """Acknowledgements outside a fetch (commitSync, close: epoch -1 closes the session)."""
        b = req.body
        pop = self.pop_service()
        if pop is None:
            return self._top(ErrorCode.COORDINATOR_LOAD_IN_PROGRESS, "the broker's POP service is not running")
        epoch = b["share_session_epoch"]
        entered = self.sessions.enter(str(b.get("group_id") or ""), str(b.get("member_id") or ""), epoch, opening=False)
        if isinstance(entered, int):
            return self._top(entered, "share session")
        rows = await self._acknowledge(pop, entered, await self.views.current(), b.get("topics", []), add=False)
        if epoch == -1:
            self.sessions.close(entered.group, entered.member)
            await release_held(pop, entered)
        answer = {**self._top(ErrorCode.NONE, None), "responses": _by_topic(rows)}
        for t in answer["responses"]:
            for p in t["partitions"]:
                if p["error_code"] == 0:
                    p["error_code"], p["error_message"] = p["acknowledge_error_code"], p["acknowledge_error_message"]
        return answer

    def _top(self, code: int, message: str | None) -> dict[str, Any]:
        return {
            "throttle_time_ms": 0,
            "error_code": code,
            "error_message": message if code else None,
            "acquisition_lock_timeout_ms": self.lock_ms,
            "responses": [],
            "node_endpoints": [],
        }


def _row(index: int, node_id: int) -> dict[str, Any]:
    return {
        "partition_index": index,
        "error_code": 0,
        "error_message": None,
        "acknowledge_error_code": 0,
        "acknowledge_error_message": None,
        "current_leader": {"leader_id": node_id, "leader_epoch": -1},
        "records": b"",
        "acquired_records": [],
    }


def _ack_into(row: dict[str, Any], outcome: AckOutcome) -> None:
    row["acknowledge_error_code"], row["acknowledge_error_message"] = outcome.code, outcome.message


def _by_topic(rows: dict[tuple[Any, int], dict[str, Any]]) -> list[dict[str, Any]]:
    topics: dict[Any, list[dict[str, Any]]] = {}
    for (tid, _), row in rows.items():
        topics.setdefault(tid, []).append(row)
    return [{"topic_id": tid, "partitions": parts} for tid, parts in topics.items()]


def _records_of(
    store: StorageEngine, compression: Compression, got: Sequence[DeliveryLike]
) -> dict[int, tuple[bytes, list[dict[str, int]]]]:
    """Per queue: the delivered messages as record batches (one per run of consecutive
    offsets) and their AcquiredRecords (one per run of equal delivery counts). A run
    that cannot be read (damaged, gone to retention) is left out: its records come back
    when their lock runs out, and a damaged one is logged."""
    by_queue: dict[int, list[DeliveryLike]] = {}
    for d in sorted(got, key=lambda d: (d.queue_id, d.queue_offset)):
        by_queue.setdefault(d.queue_id, []).append(d)
    out: dict[int, tuple[bytes, list[dict[str, int]]]] = {}
    for queue_id, ds in by_queue.items():
        parts: list[bytes] = []
        acquired: list[dict[str, int]] = []
        for run in _runs(ds, lambda a, b: b.queue_offset == a.queue_offset + 1):
            parts.append(_read_run(store, compression, run))
        for run in _runs(ds, lambda a, b: b.queue_offset == a.queue_offset + 1 and b.attempt == a.attempt):
            acquired.append(
                {
                    "first_offset": run[0].queue_offset,
                    "last_offset": run[-1].queue_offset,
                    "delivery_count": run[0].attempt,
                }
            )
        out[queue_id] = (b"".join(parts), acquired)
    return out


def _runs(ds: list[DeliveryLike], joined: Callable[[DeliveryLike, DeliveryLike], bool]) -> list[list[DeliveryLike]]:
    runs: list[list[DeliveryLike]] = []
    for d in ds:
        if runs and joined(runs[-1][-1], d):
            runs[-1].append(d)
        else:
            runs.append([d])
    return runs


def _read_run(store: StorageEngine, compression: Compression, run: list[DeliveryLike]) -> bytes:
    first = run[0]
    read = store.read_raw(first.topic, first.queue_id, first.queue_offset, len(run))
    if read.status is not GetStatus.FOUND:
        return b""
    try:
        return batches_of(read, first.queue_id, first.queue_offset, compression)[0]
    except (CorruptRecordError, OSError) as e:
        log.warning("kafka share fetch of %s queue %d at %d: %s", first.topic, first.queue_id, first.queue_offset, e)
        return b""

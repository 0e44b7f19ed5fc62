"""Produce: Kafka record batches into the same append lane as clmq's own producers.

Each partition's batches are checked at the door (CRC, format, sizes: nothing of a bad
batch is written), their records become clmq messages (``_mapping``), and the lot
goes into the append lane as one request, so its messages get consecutive offsets
in the partition's queue: the batch's base offset is the first message's queue offset.
acks=0 answers nothing; acks=1 answers once the leader stored it (and fsynced it,
under sync flush); acks=-1 (all) also waits until the in-sync replicas hold it, as a
topic with sync acks does, whatever the topic's own ack mode (and is refused with
NOT_ENOUGH_REPLICAS, nothing written, while fewer than ``min_insync_replicas`` are in
sync).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import trio

from clmq.broker.store import PutStatus
from clmq.common import HEADER_SIZE, PROP_KAFKA_PRODUCER, record_size
from clmq.protocol import encode_batch
from clmq.protocol.kafka import ErrorCode, KafkaRecord, KafkaRequest, RecordBatch, RecordsError, parse_batches
from clmq.protocol.transport import RequestError

from .._append import BusyError, PendingPut
from .._context import BrokerContext
from ._cluster import ClusterView, ClusterViews
from ._listener import Peer
from ._mapping import TooLarge, pack_records, to_message
from ._produce_wait import WRITE_ERRORS, AckedEnds, acknowledged
from ._sequences import MAX_SEQUENCE, Accepted, BatchMeta, Duplicate, Refused, Sequences, producer_property

log = logging.getLogger("clmq.broker.kafka")

KAFKA_STORAGE_ERROR = 56
_PUT_ERRORS = {
    PutStatus.MESSAGE_TOO_LARGE: ErrorCode.MESSAGE_TOO_LARGE,
    PutStatus.INVALID_MESSAGE: ErrorCode.INVALID_RECORD,
    PutStatus.INVALID_TOPIC: ErrorCode.INVALID_TOPIC_EXCEPTION,
    PutStatus.UNKNOWN_TOPIC: ErrorCode.UNKNOWN_TOPIC_OR_PARTITION,
    PutStatus.INVALID_QUEUE_ID: ErrorCode.UNKNOWN_TOPIC_OR_PARTITION,
    PutStatus.MALFORMED_BATCH: ErrorCode.CORRUPT_MESSAGE,
    PutStatus.DISK_FULL: KAFKA_STORAGE_ERROR,
    PutStatus.IO_ERROR: KAFKA_STORAGE_ERROR,
    PutStatus.STORE_CLOSED: ErrorCode.NOT_LEADER_OR_FOLLOWER,
    PutStatus.FLUSH_DISK_TIMEOUT: ErrorCode.REQUEST_TIMED_OUT,
    PutStatus.STORE_FAILED: KAFKA_STORAGE_ERROR,
}


@dataclass
class _Part:
    """One partition of a produce request, on its way to an answer."""

    topic: str
    index: int
    queue_id: int = -1
    error: int = 0
    text: str | None = None
    put: PendingPut | None = None  # the topic's one put of the request (every partition's messages)
    packed: bytes = b""  # this partition's messages, packed (until the put is made)
    count: int = 0  # how many
    first: int = 0  # the first one's index among the put's messages
    duplicate: BatchMeta | None = None
    metas: list[tuple[int, BatchMeta]] | None = None  # (producer id, batch) of idempotent batches
    base_offset: int = -1


def _result(part: _Part) -> dict[str, Any]:
    return {
        "index": part.index,
        "error_code": part.error,
        "base_offset": part.base_offset if not part.error else -1,
        "log_append_time_ms": -1,
        "log_start_offset": -1,
        "record_errors": [],
        "error_message": part.text,
    }


class KafkaProduce:
    """Produce requests of every Kafka connection of this broker."""

    def __init__(self, ctx: BrokerContext, views: ClusterViews, sequences: Sequences) -> None:
        self.ctx = ctx
        self.views = views
        self.sequences = sequences
        self.max_uncompressed_bytes = ctx.config.max_frame_bytes
        self.acked = AckedEnds()  # what ListOffsets and Fetch answer as the queues' ends

    async def produce(self, req: KafkaRequest, peer: Peer) -> dict[str, Any] | None:
        body = req.body
        acks = body.get("acks", -1)
        parts: list[_Part] = []
        assert peer.turn is not None
        async with peer.turn:  # appended in the order this connection sent its requests
            await self.ctx.replica.writes_settled()
            view = await self.views.current()
            for topic in body.get("topic_data", []):
                of_topic = [_Part(topic["name"], pd["index"]) for pd in topic.get("partition_data", [])]
                for part, pd in zip(of_topic, topic.get("partition_data", [])):
                    await self._start(part, pd.get("records"), view, peer, acks, body.get("transactional_id"))
                self._submit(of_topic, peer)
                parts += of_topic
        if acks == 0:
            return None  # Kafka sends no answer at acks=0 (the client does not read one)
        puts: dict[int, list[_Part]] = {}
        async with trio.open_nursery() as nursery:
            for part in parts:
                if part.duplicate is not None:
                    nursery.start_soon(self._duplicate, part)
                elif part.put is not None:
                    puts.setdefault(id(part.put), []).append(part)
            for group in puts.values():
                nursery.start_soon(self._finish, group, acks)
        by_topic: dict[str, list[dict[str, Any]]] = {}
        for part in parts:
            by_topic.setdefault(part.topic, []).append(_result(part))
        return {
            "responses": [{"name": t, "partition_responses": r} for t, r in by_topic.items()],
            "throttle_time_ms": 0,
        }

    async def _start(
        self, part: _Part, records: bytes | None, view: ClusterView, peer: Peer, acks: int, txn: str | None
    ) -> None:
        """The checks, then the part into the append lane (or its error set)."""
        try:
            if acks not in (0, 1, -1):
                raise _Refuse(ErrorCode.INVALID_REQUIRED_ACKS, f"acks must be 0, 1 or -1, got {acks}")
            if txn is not None:
                raise _Refuse(ErrorCode.TRANSACTIONAL_ID_AUTHORIZATION_FAILED, "transactions are not supported")
            part.queue_id = self._local_queue(view, part.topic, part.index)
            batches = self._parse(records)
            self._check_write(part.topic, acks)
            part.packed = await self._messages(part, batches, peer)
            part.count = sum(len(b.records) for b in batches)
        except _Refuse as e:
            part.error, part.text = e.code, e.text
            self._forget(part)

    def _submit(self, parts: list[_Part], peer: Peer) -> None:
        """One topic's partitions into the append lane as one put (one request's messages
        of many queues are appended together, their queue offsets in order)."""
        going = [p for p in parts if p.packed and not p.error and p.duplicate is None]
        if not going:
            return
        at = 0
        for part in going:
            part.first, at = at, at + part.count
        try:
            put = self.ctx.lane.submit(going[0].topic, b"".join(p.packed for p in going), (peer.host, peer.port))
        except BusyError as e:
            for part in going:
                part.error, part.text = ErrorCode.REQUEST_TIMED_OUT, str(e)
                self._forget(part)
            return
        for part in going:
            part.put, part.packed = put, b""

    def _local_queue(self, view: ClusterView, topic: str, index: int) -> int:
        homes = view.topics.get(topic)
        if homes is None:
            raise _Refuse(ErrorCode.UNKNOWN_TOPIC_OR_PARTITION, f"topic {topic!r} does not exist")
        if not 0 <= index < len(homes):
            raise _Refuse(ErrorCode.UNKNOWN_TOPIC_OR_PARTITION, f"topic {topic!r} has {len(homes)} partitions")
        home = homes[index]
        if home.group != self.ctx.config.broker_name or self.ctx.replica.role != "leader":
            self.views.invalidate()
            raise _Refuse(ErrorCode.NOT_LEADER_OR_FOLLOWER, "this broker does not lead that partition")
        return home.queue_id

    def _parse(self, records: bytes | None) -> list[RecordBatch]:
        if not records:
            raise _Refuse(ErrorCode.CORRUPT_MESSAGE, "no records")
        try:
            batches = parse_batches(records, max_uncompressed_bytes=self.max_uncompressed_bytes)
        except RecordsError as e:
            raise _Refuse(e.error_code, str(e)) from None
        for batch in batches:
            if batch.is_transactional or batch.is_control:
                raise _Refuse(ErrorCode.INVALID_RECORD, "transactional batches are not supported")
        return batches

    def _check_write(self, topic: str, acks: int) -> None:
        try:
            self.ctx.replica.check_sync_write(topic, sync=acks == -1)
        except RequestError as e:
            raise _Refuse(WRITE_ERRORS.get(e.code, ErrorCode.UNKNOWN_SERVER_ERROR), e.text) from None

    async def _messages(self, part: _Part, batches: list[RecordBatch], peer: Peer) -> bytes:
        """The packed messages to append (the body of a produce request); the idempotent
        batches checked (a duplicate: nothing)."""
        out: list[bytes] = []
        host = (peer.host, peer.port)
        limit = self.ctx.config.max_message_bytes - HEADER_SIZE - len(part.topic.encode())
        try:
            for batch in batches:
                records = batch.records
                if batch.producer_id < 0 or not records:
                    out.append(pack_records(part.queue_id, records, limit))
                    continue
                meta = await self._sequence(part, batch)
                if meta is None:
                    return b""
                first = to_message(part.topic, part.queue_id, *_fields(records[0]), host)
                seq = producer_property(batch.producer_id, batch.producer_epoch, meta.first_seq, meta.last_seq)
                first.properties = {**first.properties, PROP_KAFKA_PRODUCER: seq}
                if record_size(first) > self.ctx.config.max_message_bytes:
                    raise TooLarge(f"a record of {record_size(first)} bytes stored")
                out += (encode_batch([first]), pack_records(part.queue_id, records[1:], limit))
        except TooLarge as e:
            raise _Refuse(ErrorCode.MESSAGE_TOO_LARGE, f"{e}: above max_message_bytes") from None
        except ValueError as e:  # e.g. a header name of more than 65535 bytes
            raise _Refuse(ErrorCode.INVALID_RECORD, str(e)) from None
        return b"".join(out)

    async def _sequence(self, part: _Part, batch: RecordBatch) -> BatchMeta | None:
        check = await self.sequences.check(
            batch.producer_id,
            batch.producer_epoch,
            part.topic,
            part.queue_id,
            batch.base_sequence,
            len(batch.records),
        )
        if isinstance(check, Refused):
            raise _Refuse(check.error_code, check.text)
        if isinstance(check, Duplicate):
            part.duplicate = check.meta
            return None
        assert isinstance(check, Accepted)
        part.metas = [*(part.metas or []), (batch.producer_id, check.meta)]
        return check.meta

    def _forget(self, part: _Part) -> None:
        for pid, meta in part.metas or []:
            self.sequences.failed(pid, part.topic, part.queue_id, meta)
        part.metas = None

    async def _duplicate(self, part: _Part) -> None:
        """A retried batch: answered with where it was first stored (once it is)."""
        assert part.duplicate is not None
        await part.duplicate.done.wait()
        if not part.duplicate.ok:
            part.error, part.text = ErrorCode.OUT_OF_ORDER_SEQUENCE_NUMBER, "the first try of this batch failed"
        part.base_offset = part.duplicate.base_offset

    async def _finish(self, parts: list[_Part], acks: int) -> None:
        """One put's partitions: their offsets once appended, then durable, held by the
        replicas (acks=-1) and visible in their queues."""
        put = parts[0].put
        assert put is not None
        await put.done.wait()
        result = put.result
        assert result is not None
        if not result.ok:
            for part in parts:
                part.error, part.text = _PUT_ERRORS.get(result.status, ErrorCode.UNKNOWN_SERVER_ERROR), result.error
                self._forget(part)
            return
        offsets = result.queue_offsets
        self.ctx.traffic.add_in(put.topic, len(offsets), len(put.body))  # the broker's metrics count them
        for part in parts:
            part.base_offset = offsets[part.first]
            self._stored(part, offsets[part.first : part.first + part.count])
        problem = await acknowledged(self.ctx, put.topic, result.end_offset, acks)
        if problem is not None:
            for part in parts:
                part.error, part.text = problem
            return
        for p in parts:
            self.acked.record((put.topic, p.queue_id), offsets[p.first + p.count - 1] + 1)

    def _stored(self, part: _Part, offsets: list[int]) -> None:
        """The idempotent batches' offsets, for duplicates of them."""
        at = 0
        for _pid, meta in part.metas or []:
            meta.base_offset, meta.ok = offsets[at], True
            meta.done.set()
            at += (meta.last_seq - meta.first_seq) % (MAX_SEQUENCE + 1) + 1


def _fields(r: KafkaRecord) -> tuple[int, bytes | None, bytes | None, list[tuple[str, bytes | None]]]:
    return r.timestamp, r.key, r.value, r.headers


class _Refuse(Exception):
    def __init__(self, code: int, text: str) -> None:
        super().__init__(text)
        self.code, self.text = code, text

"""A damaged record fails the reads of its queue only: a multi-queue pull serves every
other queue, the single-queue pull answers CORRUPT_DATA naming the file and offset, and
a consumer keeps consuming the other queues while it reports (and does not skip) the
damaged one. Real brokers, real files: the broker is stopped, a record's header is
damaged in its segment file while the broker runs (a clean open would refuse the
store: it checks every record's CRC up to the checkpoint), as a disk that corrupts
what it holds does."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import trio

from clmq.client import RpcClient, open_consumer
from clmq.common import OFF_QUEUE_OFFSET, Message
from clmq.protocol import ErrorCode, FetchResult, PullStatus, RequestCode, encode_batch
from tests.service_helpers import FAST_CONSUMER, Cluster
from tests.waiting import await_until

QUEUES = 4
PER_QUEUE = 6
DAMAGED_QUEUE = 1
# The damaged queue's last record: a read of a run of records checks the run's ends
# (the store's design), and the records before the damage must still be served.
DAMAGED_OFFSET = PER_QUEUE - 1


def flip_byte(path: Path, pos: int) -> None:
    """Invert the byte at ``pos`` in place (through the page cache the broker reads)."""
    with open(path, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)
        f.seek(pos)
        f.write(bytes([byte[0] ^ 0xFF]))


async def damaged_cluster(nursery: trio.Nursery, root: Path) -> tuple[Cluster, str]:
    """A broker with topic "t" whose record (DAMAGED_QUEUE, DAMAGED_OFFSET) has a wrong
    queue offset in its header; returns the cluster and the damaged segment's name."""
    c = Cluster(nursery, root)
    await c.start_nameserver()
    broker = await c.start_broker("broker-a")
    await c.create_topic("t", QUEUES)
    damaged_at = -1
    async with trio.open_nursery() as n:
        rpc = RpcClient(n)
        for q in [DAMAGED_QUEUE] + [q for q in range(QUEUES) if q != DAMAGED_QUEUE]:  # not the log's last record
            batch = [Message("t", q, b"q%d-m%d" % (q, i)) for i in range(PER_QUEUE)]
            reply = await rpc.request(broker.addr, RequestCode.SEND_MESSAGE, {"topic": "t"}, encode_batch(batch))
            if q == DAMAGED_QUEUE:
                damaged_at = reply.fields["commitlog_offsets"][DAMAGED_OFFSET]

        async def dispatched() -> bool:  # damage after the queue entries are made: reads must catch it
            for q in range(QUEUES):
                reply = await rpc.request(broker.addr, RequestCode.QUERY_OFFSETS, {"topic": "t", "queue_id": q})
                if reply.fields["max_offset"] < PER_QUEUE:
                    return False
            return True

        await await_until(dispatched, 10, "every queue entry to be dispatched")
        await rpc.aclose()
    segments = sorted((root / "broker-a" / "commitlog").glob("*.log"))
    segment = [s for s in segments if int(s.stem) <= damaged_at][-1]
    flip_byte(segment, damaged_at - int(segment.stem) + OFF_QUEUE_OFFSET)  # the header check of every read path fails
    return c, segment.name


async def test_a_damaged_record_fails_only_its_queue_of_a_multi_queue_pull(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    c, segment = await damaged_cluster(nursery, tmp_path)
    addr = c.brokers["broker-a"].addr
    async with trio.open_nursery() as n:
        rpc = RpcClient(n)
        asks = [["t", q, 0, None] for q in range(QUEUES)]
        reply = await rpc.request(addr, RequestCode.PULL_MESSAGES, {"queues": asks, "max_per_queue": 100})
        rows = [FetchResult.from_wire(r) for r in reply.fields["results"]]
        for q, row in enumerate(rows):
            if q != DAMAGED_QUEUE:
                assert (row.status, row.message_count, row.next_offset) == (PullStatus.FOUND, PER_QUEUE, PER_QUEUE)
        # The records before the damage are served; then the queue stops at the damaged one.
        assert rows[DAMAGED_QUEUE].status is PullStatus.FOUND and 0 < rows[DAMAGED_QUEUE].next_offset <= DAMAGED_OFFSET
        again = await rpc.request(
            addr, RequestCode.PULL_MESSAGES, {"queues": [["t", DAMAGED_QUEUE, DAMAGED_OFFSET, None]]}
        )
        (row,) = [FetchResult.from_wire(r) for r in again.fields["results"]]
        assert row.status is PullStatus.CORRUPT and row.next_offset == DAMAGED_OFFSET and row.message_count == 0
        assert segment in row.error and "queue" in row.error
        # The single-queue pull: a specific error naming the file, not SYSTEM_ERROR.
        single = await rpc.request(
            addr,
            RequestCode.PULL_MESSAGE,
            {"topic": "t", "queue_id": DAMAGED_QUEUE, "offset": DAMAGED_OFFSET},
            check=False,
        )
        assert single.error_code == ErrorCode.CORRUPT_DATA and segment in single.error_text
        await rpc.aclose()


async def test_a_consumer_reports_a_damaged_queue_and_consumes_the_others(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    c, segment = await damaged_cluster(nursery, tmp_path)
    want = {
        b"q%d-m%d" % (q, i) for q in range(QUEUES) for i in range(PER_QUEUE) if q != DAMAGED_QUEUE or i < DAMAGED_OFFSET
    }
    got: list[bytes] = []
    with caplog.at_level(logging.ERROR, logger="clmq.consumer"):
        async with open_consumer(c.ns, "g", {"t": "*"}, damaged_queue_retry_ms=300, **FAST_CONSUMER) as consumer:
            with trio.fail_after(15):
                while set(got) != want:
                    got += [r.body for r in await consumer.receive()]

            def reported() -> bool:
                return any(mq.queue_id == DAMAGED_QUEUE for mq in consumer.errors)

            await await_until(reported, 10, "the consumer to report the damaged queue")
            ((mq, error),) = consumer.errors.items()
            assert error.queue == mq and error.offset == DAMAGED_OFFSET and segment in str(error)
            # Asked again (each answer replaces the error), twice, with one ERROR line for the queue and offset.
            for _ in range(2):
                seen = consumer.errors[mq]

                def asked_again(seen: object = seen) -> bool:
                    return consumer.errors.get(mq) is not seen

                await await_until(asked_again, 10, "the consumer to ask the damaged queue again")
            assert len(got) == len(want)  # nothing past the damage was skipped to
    lines = [r for r in caplog.records if r.name == "clmq.consumer" and r.levelno == logging.ERROR]
    assert len(lines) == 1 and segment in lines[0].getMessage() and "offset 5" in lines[0].getMessage()

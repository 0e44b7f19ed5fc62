"""Kafka clients through a ZooKeeper failover (docs/kafka.md, "Replication and
failover"): three brokers of one group with Kafka listeners, sync acks with
``min_insync_replicas = 2``; an idempotent librdkafka producer with acks=all keeps
producing while the leader is SIGKILLed. It is told NOT_LEADER_OR_FOLLOWER, refreshes
its metadata, follows the new leader, and every message it was told was acknowledged is
there exactly once afterwards (its retries of batches the old leader had replicated are
recognised as duplicates by their sequence numbers, read back from the log)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.failover_procs import FailoverGroup
from tests.kafka_procs import in_thread
from tests.replica_procs import free_port, open_group
from tests.waiting import await_until

ck = pytest.importorskip("confluent_kafka")
from confluent_kafka.admin import AdminClient, NewTopic  # noqa: E402

TOPIC = "orders"
PARTITIONS = 4


class Producing(threading.Thread):
    """Produces numbered messages until stopped; records which were acknowledged."""

    def __init__(self, bootstrap: str) -> None:
        super().__init__(daemon=True)
        self.bootstrap = bootstrap
        self.stop = threading.Event()
        self.acked: list[int] = []
        self.failed: list[tuple[int, str]] = []
        self.errors_seen: Counter[str] = Counter()
        self.sent = 0

    def run(self) -> None:
        producer = ck.Producer(
            {
                "bootstrap.servers": self.bootstrap,
                "acks": "all",
                "enable.idempotence": True,
                "linger.ms": 2,
                "message.timeout.ms": 60000,
                "topic.metadata.refresh.interval.ms": 1000,
                "error_cb": lambda err: self.errors_seen.update([err.name()]),
            }
        )

        def report(err: Any, msg: Any) -> None:
            n = int(msg.value())
            if err is None:
                self.acked.append(n)
            else:
                self.failed.append((n, err.name()))

        while not self.stop.is_set():
            producer.produce(TOPIC, value=b"%d" % self.sent, key=b"k%d" % (self.sent % 50), on_delivery=report)
            self.sent += 1
            producer.poll(0.001)
        producer.flush(90)


def read_everything(bootstrap: str, count_at_least: int) -> list[int]:
    consumer = ck.Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"check-{time.time_ns()}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    consumer.subscribe([TOPIC])
    got: list[int] = []
    idle_until = time.monotonic() + 60
    while time.monotonic() < idle_until:
        batch = consumer.consume(5000, 1.0)
        for m in batch:
            assert not m.error(), m.error()
            got.append(int(m.value()))
        if len(got) >= count_at_least and not batch:
            break
    consumer.close()
    return got


@pytest.mark.slow
async def test_acks_all_through_a_leader_killed_loses_and_duplicates_nothing(tmp_path: Path, zk_connect: str) -> None:
    async with open_group(tmp_path) as g:
        fg = FailoverGroup(g, zk_connect)
        ports = {f"g{i}": free_port() for i in range(3)}
        settings = {"kafka_group_initial_rebalance_delay_ms": 0}
        async with trio.open_nursery() as nursery:
            for i in range(3):
                key = f"g{i}"
                nursery.start_soon(
                    lambda k=key, n=i: fg.start_broker(k, n, kafka_listen_port=ports[k], **settings)  # type: ignore[misc]
                )
        leader = await fg.wait_leader()
        bootstrap = ",".join(f"127.0.0.1:{p}" for p in ports.values())
        admin = AdminClient({"bootstrap.servers": f"127.0.0.1:{ports[leader]}"})
        await in_thread(lambda: admin.create_topics([NewTopic(TOPIC, PARTITIONS, 3)])[TOPIC].result(10))
        await fg.wait_settled(leader)
        producing = Producing(bootstrap)
        producing.start()
        await await_until(lambda: len(producing.acked) >= 2000, 30, "acknowledgements before the kill")
        await fg.kill(leader)
        acked_at_kill = len(producing.acked)
        new = await fg.wait_leader(exclude=frozenset({leader}))
        await await_until(lambda: len(producing.acked) >= acked_at_kill + 2000, 60, "acknowledgements after the kill")
        producing.stop.set()
        await in_thread(producing.join, 120)
        assert not producing.failed, producing.failed[:5]
        got = await in_thread(read_everything, f"127.0.0.1:{ports[new]}", len(producing.acked))
        counts = Counter(got)
        missing = sorted(set(producing.acked) - set(counts))
        twice = sorted(n for n, c in counts.items() if c > 1)
        assert not missing, f"{len(missing)} acknowledged messages lost, e.g. {missing[:10]}"
        assert not twice, f"{len(twice)} messages stored twice, e.g. {twice[:10]}"
        assert len(producing.acked) > acked_at_kill, "nothing acknowledged after the failover"

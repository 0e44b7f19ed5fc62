"""A queue's bytes (DESCRIBE_TOPIC's size_bytes): the sizes of the records it still
holds, summed from its index; None past the entry cap."""

from __future__ import annotations

from pathlib import Path

from clmq.broker.store import Store, StoreConfig
from tests.conftest import msgs


def test_a_queues_bytes_are_its_records_sizes_and_none_past_the_cap(tmp_path: Path) -> None:
    with Store.open(StoreConfig(tmp_path)).start() as store:
        store.create_topic("t", 3)
        assert store.put_batch(msgs("t", 300, 3, size=500)).ok
        store.catch_up()
        for q in range(3):
            records = store.get("t", q, 0, 1000).messages
            assert store.queue_bytes("t", q, 1_000_000) == sum(r.size for r in records) > 100 * 500
            assert store.queue_bytes("t", q, 99) is None  # 100 messages: over the cap
        assert store.queue_bytes("t", 0, 100) is not None

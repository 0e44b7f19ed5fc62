"""The key index's memory in a running broker: its active file's slot table (4 B a
slot), not a cost per indexed message.

Indexing once decoded each record's properties in Python when UNIQ_KEY was not the
only one (scheduled, transactional, user properties): transient objects per record
in the dispatcher thread that left glibc's per-thread arenas fragmented, ~190 B of
anonymous memory per message in a broker that held a million scheduled messages.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from clmq.client import Message, open_admin, open_producer
from clmq.commitlog._encoder import BatchEncoder
from clmq.common import decode_record, walk_records
from clmq.consumequeue import UNIQ_KEY, chunk_keys, key_hash
from tests.crash_broker import launch, reap, wait_ready
from tests.waiting import await_until

SLOTS = 262_144  # the index's hash slots here: a 1 MiB slot table (its fixed cost)
MESSAGES = 500_000
PER_BATCH = 2000
SENDERS = 4
# What the index may add beyond its slot table: the dispatcher's round temporaries held in
# glibc's arenas, a fixed and noisy amount (measured 0-12 MB at both 300,000 and 1,000,000
# messages); the per-record decoding this test guards against added ~150 B per message.
INDEX_ALLOWANCE_BYTES = 24 * 2**20


def _config(root: Path, index_enabled: bool) -> Path:
    root.mkdir()
    conf = root / "broker.toml"
    conf.write_text(
        f'[broker]\nbroker_name = "mem"\nlisten_port = 0\ndata_dir = "{root / "data"}"\n'
        f"index_enabled = {str(index_enabled).lower()}\nindex_hash_slots = {SLOTS}\n"
    )
    return conf


def _rss_anon_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/<pid>/status")


def _batch(start: int) -> list[Message]:
    """Messages with a key and user properties: the producer adds UNIQ_KEY among them."""
    props = {"colour": "red", "source": "keyindex-memory"}
    return [Message("t", 0, b"%09d" % i, keys=f"k{i}", properties=props) for i in range(start, start + PER_BATCH)]


async def _all_dispatched(addr: str) -> bool:
    """Every stored message is in its queue (and, with the index, indexed: same rounds)."""
    async with open_admin(None, broker_addrs=[addr]) as admin:
        info = await admin.broker_info(addr)
    return int(info["dispatch_lag_bytes"]) == 0


async def _grown_bytes(root: Path, index_enabled: bool) -> int:
    """RssAnon growth of a broker process while it stores (and, with the
    index, indexes) MESSAGES messages, measured once the first batch is dispatched."""
    conf, log = _config(root, index_enabled), root / "broker.log"
    proc = await launch(conf, log)
    try:
        addr = await wait_ready(proc, log)
        async with open_admin(None, broker_addrs=[addr]) as admin:
            await admin.create_topic("t", 4)
        async with open_producer(None, broker_addrs=[addr]) as producer:
            await producer.send_batch("t", _batch(0))  # the queues' and the index's first pages exist
            await await_until(lambda: _all_dispatched(addr), 10, "the first batch dispatched")
            before = _rss_anon_bytes(proc.pid)

            async def sender(k: int) -> None:
                for start in range((k + 1) * PER_BATCH, MESSAGES + PER_BATCH, SENDERS * PER_BATCH):
                    await producer.send_batch("t", _batch(start))

            async with trio.open_nursery() as nursery:
                for k in range(SENDERS):
                    nursery.start_soon(sender, k)
        await await_until(lambda: _all_dispatched(addr), 60, "every message dispatched")
        grown = _rss_anon_bytes(proc.pid) - before
        print(f"index_enabled={index_enabled}: {grown / MESSAGES:.1f} B per message")  # shown with -s / on failure
        return grown
    finally:
        await reap(proc)


@pytest.mark.slow
async def test_indexing_costs_the_slot_table_not_memory_per_message(tmp_path: Path) -> None:
    """The same 500,000 messages (a key each; UNIQ_KEY among other properties) through
    two real broker processes, with and without the key index: with it, anonymous
    memory grows by at most the slot table and a fixed allowance more (the old
    per-record decoding: ~75 MB more)."""
    without = await _grown_bytes(tmp_path / "without", index_enabled=False)
    with_index = await _grown_bytes(tmp_path / "with", index_enabled=True)
    extra = with_index - without
    assert extra <= 4 * SLOTS + INDEX_ALLOWANCE_BYTES, (
        f"with the key index the broker grew {with_index / 2**20:.1f} MiB, without {without / 2**20:.1f} MiB "
        f"({extra / MESSAGES:.1f} B per message more)"
    )


_names = st.sampled_from(["colour", "UNIQ", "UNIQ_KEX", "__DELIVER_AT", "z", "κ"])
_values = st.text(max_size=12)
_props = st.lists(st.tuples(_names, _values), max_size=5).flatmap(
    lambda others: st.tuples(st.integers(0, len(others)), st.one_of(st.none(), _values)).map(
        lambda at_uniq: _with_uniq(dict(others), *at_uniq)
    )
)


def _with_uniq(others: dict[str, str], at: int, uniq: str | None) -> dict[str, str]:
    """``others`` with UNIQ_KEY (if any) inserted as the ``at``-th property."""
    items = list(others.items())
    if uniq is not None:
        items.insert(min(at, len(items)), (UNIQ_KEY, uniq))
    return dict(items)


@given(st.lists(st.tuples(st.sampled_from(["t", "%TIMER%"]), st.sampled_from(["", "k1", "a b"]), _props), max_size=60))
@settings(max_examples=60, deadline=None)
def test_uniq_key_is_indexed_wherever_it_sits_among_the_properties(
    records: list[tuple[str, str, dict[str, str]]],
) -> None:
    """The column-wise walk of the properties indexes what decoding each record says:
    its keys, then its UNIQ_KEY if not empty, first, last, alone or among others."""
    batch = [Message(t, 0, b"body", keys=k, properties=p) for t, k, p in records]
    data = bytes(BatchEncoder(1 << 30, 1 << 20, ("1.2.3.4", 5)).encode(batch, 4096, 0, {}, {}, 77).groups[0].data)
    walk = walk_records(data)
    hashes, positions, times = chunk_keys(memoryview(data), walk)
    expected = []
    for start in walk.starts.tolist():
        r = decode_record(data, start)
        names = r.keys.split() + ([r.properties[UNIQ_KEY]] if r.properties.get(UNIQ_KEY) else [])
        expected += [(key_hash(r.topic, n), start, r.store_timestamp_ms) for n in names]
    assert list(zip(hashes.tolist(), positions.tolist(), times.tolist())) == expected

"""The key index against a full scan of the log: random keys, unique ids and time
ranges (Hypothesis), tiny slot tables (every chain a mix of keys) and small files (many
files per store); after an abandoned store (a crash), a truncation by replication,
retention; the index files' own chains against brute force; a SIGKILLed broker."""

from __future__ import annotations

import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clmq.broker.store import Store, StoreConfig, check_store, repair_store
from clmq.client import open_admin, open_producer
from clmq.commitlog import CommitLogConfig
from clmq.common import Message, Record
from clmq.consumequeue import IndexSettings, KeyIndex, key_hash
from tests.crash_broker import broker_config, reap, start_broker

KEYS = ["a", "b", "order-1", "order-22", "zz", "κλειδί", "x" * 40, "0001", "1002", "5050"]
TOPICS = ["t1", "t2", "%TRACE%"]


def store_config(root: Path, slots: int = 3, per_file: int = 7, segment_bytes: int = 16 * 1024) -> StoreConfig:
    log = CommitLogConfig(segment_bytes=segment_bytes, max_message_bytes=4096)
    return StoreConfig(root, log, auto_create_topics=True, index_hash_slots=slots, index_max_entries_per_file=per_file)


def message_strategy() -> st.SearchStrategy[Message]:
    keys = st.lists(st.sampled_from(KEYS), max_size=3).map(" ".join)
    spaced = st.sampled_from(["", "  a ", "\tb\torder-1", "a a"])  # odd whitespace, repeats
    props = st.one_of(
        st.just({}),
        st.sampled_from(KEYS).map(lambda k: {"UNIQ_KEY": k}),
        st.sampled_from(KEYS).map(lambda k: {"colour": "red", "UNIQ_KEY": k, "z": ""}),
        st.just({"UNIQ_KEY": ""}),
    )
    return st.builds(
        lambda t, q, k, p: Message(t, q, b"body", keys=k, properties=p),
        st.sampled_from(TOPICS),
        st.integers(0, 1),
        st.one_of(keys, spaced),
        props,
    )


def scan(store: Store, topic: str, key: str, since: int | None = None, until: int | None = None) -> list[int]:
    """The truth: every record of the log with the key, newest first (offsets)."""
    hits = [
        r
        for r in store.log.iter_records(store.log.min_offset, store.log.write_offset)
        if r.topic == topic
        and (key in r.keys.split() or r.properties.get("UNIQ_KEY") == key)
        and (since is None or r.store_timestamp_ms >= since)
        and (until is None or r.store_timestamp_ms <= until)
    ]
    hits.sort(key=lambda r: (r.store_timestamp_ms, r.commitlog_offset), reverse=True)
    return [r.commitlog_offset for r in hits]


def found(store: Store, topic: str, key: str, since: int | None = None, until: int | None = None) -> list[int]:
    got = store.find_by_key(topic, key, since_ms=since, until_ms=until, max_results=10_000)
    assert got is not None and not got.truncated
    return [r.commitlog_offset for r in got.records]


def put_all(store: Store, batches: list[list[Message]]) -> list[Record]:
    for batch in batches:
        store.put_batch(batch)
    store.catch_up()
    return list(store.log.iter_records(store.log.min_offset, store.log.write_offset))


def agree(store: Store, records: list[Record], rnd: random.Random) -> None:
    """Every key of every topic, and random time ranges, as the full scan says."""
    times = sorted({r.store_timestamp_ms for r in records}) or [0]
    for topic in TOPICS:
        for key in KEYS:
            assert found(store, topic, key) == scan(store, topic, key), (topic, key)
            since, until = sorted(rnd.choices(times, k=2))
            assert found(store, topic, key, since, until) == scan(store, topic, key, since, until), (topic, key)


def uniform_batch() -> st.SearchStrategy[list[Message]]:
    """Records laid out alike (same size, key and UNIQ_KEY at the same place): the
    index reads such runs as strided views; a key with a space or no UNIQ_KEY too."""
    return st.builds(
        lambda t, k, uniq, n, base: [
            Message(t, 0, b"body", keys=k, properties={"UNIQ_KEY": f"{base + i:04d}"} if uniq else {}) for i in range(n)
        ],
        st.sampled_from(TOPICS),
        st.sampled_from(["a", "zz", "order-1", "a b", ""]),
        st.booleans(),
        st.integers(32, 90),
        st.sampled_from([0, 1000, 5000]),
    )


batches_strategy = st.lists(
    st.one_of(st.lists(message_strategy(), min_size=1, max_size=40), uniform_batch()), min_size=1, max_size=6
)


@pytest.mark.slow
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches=batches_strategy, more=batches_strategy, slots=st.sampled_from([1, 3, 64]), seed=st.integers(0, 99))
def test_index_agrees_with_a_full_scan_through_crashes(
    batches: list[list[Message]], more: list[list[Message]], slots: int, seed: int
) -> None:
    rnd = random.Random(seed)
    with tempfile.TemporaryDirectory() as d:
        config = store_config(Path(d), slots=slots, per_file=rnd.choice([5, 13, 1000]))
        store = Store.open(config)
        records = put_all(store, batches)
        agree(store, records, rnd)
        if rnd.random() < 0.5:
            store.checkpoint()  # the index persisted: the crash below loses only what came after
        store.abandon()  # a crash: no checkpoint, no close
        store = Store.open(config)
        try:
            assert store.open_stats["unclean"]
            records = put_all(store, more)
            agree(store, records, rnd)
            offsets = [r.commitlog_offset for r in records]
            assert all(len(set(found(store, t, k))) == len(found(store, t, k)) for t in TOPICS for k in KEYS)
            assert set().union(*(found(store, t, k) for t in TOPICS for k in KEYS)) <= set(offsets)
        finally:
            store.close()


@pytest.mark.slow
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches=batches_strategy, after=batches_strategy, cut=st.floats(0, 1), seed=st.integers(0, 99))
def test_truncation_forgets_entries_past_the_cut(
    batches: list[list[Message]], after: list[list[Message]], cut: float, seed: int
) -> None:
    """A follower cut back to its leader: old entries past the cut never come back,
    even when new records with other keys take their offsets; a reopen agrees too."""
    rnd = random.Random(seed)
    with tempfile.TemporaryDirectory() as d:
        config = store_config(Path(d), slots=3, per_file=6)
        store = Store.open(config)
        try:
            records = put_all(store, batches)
            at = records[int(cut * (len(records) - 1))].commitlog_offset
            store.truncate(at)
            assert store.log.write_offset == at
            records = put_all(store, after)
            agree(store, records, rnd)
            store.close()
            store = Store.open(config)
            agree(store, records, rnd)
        finally:
            store.close()


def test_retention_deletes_index_files_whose_messages_are_gone(tmp_path: Path) -> None:
    config = store_config(tmp_path, slots=5, per_file=20)
    store = Store.open(config)
    try:
        for i in range(40):
            store.put_batch([Message("t1", 0, b"x" * 500, keys=f"k{i % 4}") for _ in range(10)])
        store.catch_up()
        store.checkpoint()
        before = len(list((tmp_path / "index").glob("*.idx")))
        assert before > 5
        assert store.apply_retention(now=4e9) > 0  # far in the future: every segment but the active one expires
        store.apply_retention(now=4e9)  # closes what the last pass retired
        after = sorted((tmp_path / "index").glob("*.idx"))
        assert 1 <= len(after) < before
        records = list(store.log.iter_records(store.log.min_offset, store.log.write_offset))
        agree(store, records, random.Random(1))
        assert all(int(p.stem) >= 0 for p in after)
    finally:
        store.close()


@settings(max_examples=30, deadline=None)
@given(
    entries=st.lists(st.tuples(st.sampled_from(KEYS), st.integers(0, 5)), min_size=1, max_size=300),
    slots=st.integers(1, 17),
    per_file=st.integers(1, 50),
    window=st.tuples(st.integers(0, 400), st.integers(0, 400)),
)
def test_index_files_chain_every_entry_of_its_key(
    entries: list[tuple[str, int]], slots: int, per_file: int, window: tuple[int, int]
) -> None:
    """KeyIndex alone, with store times many seconds apart: the candidates of a key in a
    time range are exactly its entries in that range (by the second), newest first."""
    with tempfile.TemporaryDirectory() as d:
        index = KeyIndex(Path(d), IndexSettings(slots, per_file))
        times = np.cumsum([gap for _, gap in entries]) * 1000 + 1_700_000_000_000
        hashes = np.array([key_hash("t", k) for k, _ in entries], dtype=np.uint32)
        offsets = np.arange(len(entries), dtype=np.int64) * 100
        index.add(hashes, offsets, times)
        since, until = min(window) * 1000 + 1_700_000_000_000, max(window) * 1000 + 1_700_000_000_000
        for key in set(KEYS):
            want = [
                int(offsets[i])
                for i in reversed(range(len(entries)))
                if entries[i][0] == key or hashes[i] == key_hash("t", key)
            ]
            assert [c.offset for c in index.candidates("t", key)] == want
            ranged = [o for o in want if since // 1000 <= times[o // 100] // 1000 <= until // 1000]
            assert [c.offset for c in index.candidates("t", key, since, until)] == ranged
        index.persist()
        index.close()
        again = KeyIndex(Path(d), IndexSettings(slots, per_file))
        assert again.end_offset == int(offsets[-1]) + 1 and again.entry_count == len(entries)
        again.close()


async def test_a_sigkilled_broker_reopens_with_an_index_that_agrees_with_the_log(tmp_path: Path) -> None:
    conf = broker_config(tmp_path, "commitlog")
    conf.write_text(conf.read_text() + "index_hash_slots = 11\nindex_max_entries_per_file = 50\n")
    log = tmp_path / "broker.log"
    rnd = random.Random(7)
    for _round in range(2):
        broker = await start_broker(conf, log)
        try:
            if _round == 0:
                async with open_admin(broker_addrs=broker.addr) as admin:
                    await admin.create_topic("t1", 2)
            async with open_producer(broker_addrs=broker.addr) as p:
                for i in range(60):
                    await p.send("t1", f"m{i}".encode(), keys=rnd.choice(KEYS))
        finally:
            await reap(broker.proc)  # SIGKILL: no close, no checkpoint after the last sends
    store = Store.open(store_config(tmp_path / "data", slots=11, per_file=50, segment_bytes=256 * 1024))
    try:
        assert store.open_stats["unclean"]
        records = list(store.log.iter_records(store.log.min_offset, store.log.write_offset))
        assert len([r for r in records if r.topic == "t1"]) == 120
        agree(store, records, rnd)
    finally:
        store.close()


def _closed_store_with_index(root: Path) -> list[Record]:
    store = Store.open(store_config(root, slots=5, per_file=31))
    try:
        rnd = random.Random(3)
        for i in range(12):
            store.put_batch(
                [
                    Message(
                        rnd.choice(TOPICS),
                        0,
                        b"b",
                        keys=" ".join(rnd.sample(KEYS, 2)),
                        properties={"UNIQ_KEY": f"u{i}-{j}"},
                    )
                    for j in range(8)
                ]
            )
        store.catch_up()
        return list(store.log.iter_records(store.log.min_offset, store.log.write_offset))
    finally:
        store.close()


@pytest.mark.slow
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(which=st.integers(0, 100), where=st.floats(0, 1), junk=st.binary(min_size=1, max_size=24))
def test_check_names_damaged_index_files_and_repair_rebuilds_them(which: int, where: float, junk: bytes) -> None:
    with tempfile.TemporaryDirectory() as d:
        root = Path(d) / "store"
        records = _closed_store_with_index(root)
        config = store_config(root, slots=5, per_file=31)
        assert check_store(config).index_problems == []
        files = sorted((root / "index").glob("*.idx"))
        victim = files[which % len(files)]
        raw = bytearray(victim.read_bytes())
        pos = int(where * (len(raw) - 1))
        raw[pos : pos + len(junk)] = junk
        victim.write_bytes(bytes(raw))
        report = check_store(config)
        named = {p.file for p in report.index_problems}
        assert named <= {str(victim)}  # only the damaged file is named ...
        for p in report.index_problems:
            assert "expected" in p.reason or "magic or CRC32C" in p.reason  # ... with what was expected and found
        unrepaired = Path(d) / "copy"
        shutil.copytree(root, unrepaired)
        store = Store.open(store_config(unrepaired, slots=5, per_file=31))  # never a wrong answer (candidates checked)
        try:
            for topic in TOPICS:
                for key in KEYS:
                    assert set(found(store, topic, key)) <= set(scan(store, topic, key))
        finally:
            store.close()
        if named:
            assert repair_store(config).repaired
            store = Store.open(config)  # rebuilt from the log: exact again
            try:
                agree(store, records, random.Random(0))
            finally:
                store.close()
            assert check_store(config).index_problems == []

"""The Spark connector against a real local SparkSession (shared by the test session):
rows equal to the store's own reader, selections, narrow schemas, corruption, network
mode against running brokers, streaming, export."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from datetime import UTC
from pathlib import Path
from typing import Any, Iterator

import pytest

from clmq.broker.store import Store, StoreConfig
from clmq.client import BlockingAdmin, BlockingProducer
from clmq.commitlog import CommitLogConfig, now_ms
from clmq.common import Message, Record
from clmq.spark_connector._layout import LayoutError, local_layout
from clmq.spark_connector._local import LocalStore
from clmq.spark_connector._options import OptionError, parse_options
from clmq.spark_connector._plan import choose_index_path, index_pieces, plan, scan_splits, select
from tests.service_helpers import cluster_in_thread
from tests.waiting import wait_until

ALL_COLUMNS = [
    "topic",
    "queue_id",
    "queue_offset",
    "commitlog_offset",
    "tags",
    "keys",
    "properties",
    "body",
    "born_timestamp",
    "store_timestamp",
    "born_host",
    "store_host",
    "reconsume_times",
]


def fill(
    path: Path, segment_bytes: int, n: int = 3000, seed: int = 1, batches: int = 6, boundary_bytes: int = 4096
) -> Store:
    """A store with varied records (sizes, tags, keys, properties, hosts) over 2 topics."""
    cfg = StoreConfig(
        path,
        CommitLogConfig(
            segment_bytes=segment_bytes,
            max_message_bytes=16 * 1024,
            boundary_interval_bytes=boundary_bytes,
            store_host=("10.0.0.9", 10911),
        ),
    )
    store = Store.open(cfg).start()
    store.create_topic("orders", 4)
    store.create_topic("audit", 3)
    rng = random.Random(seed)
    msgs = []
    for i in range(n):
        topic = "orders" if i % 3 else "audit"
        props = {"k": str(i), "ü": "v" * (i % 5)} if i % 7 == 0 else {}
        msgs.append(
            Message(
                topic,
                i % (4 if topic == "orders" else 3),
                os.urandom(rng.randrange(0, 3000)),
                tags=["", "TagA", "TagB"][i % 3],
                keys=f"key-{i}" if i % 2 else "",
                properties=props,
                born_host=("192.168.1.%d" % (i % 4), 5000 + i % 3),
                reconsume_times=i % 2,
            )
        )
    per = -(-n // batches)
    for b in range(batches):  # each batch in a millisecond of its own: distinct store timestamps
        res = store.put_batch(msgs[b * per : (b + 1) * per])
        assert res.ok
        wait_until(
            lambda res=res: now_ms() > res.store_timestamp_ms, 1, f"the store's clock to pass batch {b}'s timestamp"
        )
    store.catch_up()
    store.flush()  # a local reader sees what the checkpoint calls durable (async flush: only once flushed)
    store.checkpoint()
    return store


def store_rows(store: Store) -> list[tuple]:
    """Every record, as the store's own reader returns it, in commit-log order."""
    out: list[Record] = []
    for topic, count in store.topics.all().items():
        for q in range(count):
            offset = store.min_offset(topic, q)
            while True:
                got = store.get(topic, q, offset, 500)
                out += got.messages
                if not got.messages:
                    break
                offset = got.next_offset
    return sorted((as_tuple(r) for r in out), key=lambda t: t[3])


def as_tuple(r: Record) -> tuple:
    host = lambda h: f"{h[0]}:{h[1]}"  # noqa: E731
    return (
        r.topic,
        r.queue_id,
        r.queue_offset,
        r.commitlog_offset,
        r.tags,
        r.keys,
        r.properties,
        r.body,
        r.born_timestamp_ms,
        r.store_timestamp_ms,
        host(r.born_host),
        host(r.store_host),
        r.reconsume_times,
    )


def spark_rows(df: Any) -> list[tuple]:
    rows = []
    for r in df.collect():
        d = r.asDict()
        rows.append(
            tuple(
                _ms(d[c])
                if c.endswith("timestamp")
                else (dict(d[c]) if c == "properties" else (bytes(d[c]) if c == "body" else d[c]))
                for c in ALL_COLUMNS
            )
        )
    return sorted(rows, key=lambda t: t[3])


def _ms(ts: Any) -> int:

    return round(ts.replace(tzinfo=UTC).timestamp() * 1000) if ts.tzinfo is None else round(ts.timestamp() * 1000)


@pytest.fixture(scope="module")
def filled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, list[tuple]]]:
    path = tmp_path_factory.mktemp("spark") / "store"
    store = fill(path, 64 * 1024)
    rows = store_rows(store)
    store.close()
    yield path, rows


# ------------------------------------------------------------------ the reader
@pytest.mark.parametrize("segment_bytes", [64 * 1024, 1024 * 1024])
@pytest.mark.parametrize("split_bytes", [20_000, 150_000, 1 << 30])  # 20,000: cuts fall mid-record
def test_rows_equal_the_store_reader(spark: Any, tmp_path: Path, segment_bytes: int, split_bytes: int) -> None:
    # boundaries only every 64 KiB: small splits start between them and walk to their start
    store = fill(tmp_path / "s", segment_bytes, n=1500, seed=segment_bytes, boundary_bytes=64 * 1024)
    expected = store_rows(store)
    store.close()
    if split_bytes == 20_000:
        starts = {r[3] for r in expected}
        assert any(s.start not in starts for s in scan_splits(local_layout(tmp_path / "s"), False, split_bytes))
    df = spark.read.format("clmq").options(maxSplitBytes=split_bytes, minSplitBytes=1).load(str(tmp_path / "s"))
    assert spark_rows(df) == expected
    assert len(expected) == 1500


def test_splits_fall_mid_record_and_every_record_has_one_owner(filled: tuple[Path, list[tuple]]) -> None:
    path, rows = filled
    layout = local_layout(path)
    splits = scan_splits(layout, False, 777)
    starts = {r[3] for r in rows}
    assert any(s.start not in starts and s.start != s.seg_base for s in splits), "no split starts mid-record"
    owners = {o: sum(s.start <= o < s.end for s in splits) for o in starts}
    assert set(owners.values()) == {1}
    assert all(s.resync <= s.start and (s.resync in starts or s.resync == s.seg_base) for s in splits)


def test_selections_by_topic_queue_offsets_and_timestamps(spark: Any, filled: tuple[Path, list[tuple]]) -> None:
    path, rows = filled
    read = lambda **o: spark_rows(spark.read.format("clmq").options(**o).load(str(path)))  # noqa: E731
    assert read(topics="audit") == [r for r in rows if r[0] == "audit"]
    assert read(topicPattern="ord.*", queues="1,3") == [r for r in rows if r[0] == "orders" and r[1] in (1, 3)]
    assert read(queues='{"orders": [2]}', topics="orders") == [r for r in rows if r[0] == "orders" and r[1] == 2]
    start = {"orders": {"0": 10, "1": -2}, "audit": {"0": 5}}
    end = {"orders": {"0": 20}}
    got = read(startingOffsets=json.dumps(start), endingOffsets=json.dumps(end))
    lo = {("orders", 0): 10, ("audit", 0): 5}
    assert got == [
        r for r in rows if r[2] >= lo.get((r[0], r[1]), 0) and (r[2] < 20 if (r[0], r[1]) == ("orders", 0) else True)
    ]
    stamps = sorted({r[9] for r in rows})
    assert len(stamps) >= 3
    t1, t2 = stamps[1], stamps[-1]
    got = read(startingTimestamp=str(t1), endingTimestamp=str(t2))
    assert got == [r for r in rows if t1 <= r[9] < t2] and got


def test_index_path_returns_what_the_scan_returns_and_is_chosen_for_few_queues(
    spark: Any, filled: tuple[Path, list[tuple]]
) -> None:
    path, rows = filled
    want = [r for r in rows if r[0] == "orders" and r[1] == 1 and r[2] >= 3]
    for read_path in ("index", "scan", "auto"):
        df = (
            spark.read.format("clmq")
            .options(topics="orders", queues="1", startingOffsets='{"orders": {"1": 3}}', readPath=read_path)
            .load(str(path))
        )
        assert spark_rows(df) == want, read_path
    src = LocalStore(path)
    narrow = parse_options({"path": str(path), "topics": "orders", "queues": "1"})
    sel = select(narrow, [src])
    assert choose_index_path(narrow, src, sel, index_pieces(src, sel))  # 1 of 7 queues: through its index
    wide = parse_options({"path": str(path)})
    sel = select(wide, [src])
    assert not choose_index_path(wide, src, sel, None)
    assert all(type(s).__name__ == "ScanSplit" for s in plan(wide, [src], False).splits)


def test_a_narrower_schema_builds_only_its_columns(spark: Any, filled: tuple[Path, list[tuple]]) -> None:
    path, rows = filled
    df = spark.read.format("clmq").schema("body binary, queue_offset bigint, topic string").load(str(path))
    assert df.columns == ["body", "queue_offset", "topic"]
    got = sorted((bytes(r.body), r.queue_offset, r.topic) for r in df.collect())
    assert got == sorted((r[7], r[2], r[0]) for r in rows)
    with pytest.raises(Exception, match="must be bigint, not string"):
        spark.read.format("clmq").schema("queue_offset string").load(str(path)).collect()


def test_bad_options_and_locations_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(OptionError, match="unknown option"):
        parse_options({"path": "x", "startOffsets": "earliest"})
    with pytest.raises(OptionError, match="exactly one of"):
        parse_options({})
    with pytest.raises(OptionError, match="startingOffsets"):
        parse_options({"path": "x", "startingOffsets": "{nope"})
    with pytest.raises(LayoutError, match="no such directory"):
        local_layout(tmp_path / "missing")
    (tmp_path / "ppf" / "partitions").mkdir(parents=True)
    with pytest.raises(LayoutError, match="partition-per-file"):
        local_layout(tmp_path / "ppf")


def _flip_body_byte(path: Path, rows: list[tuple], pick: int) -> tuple[int, str]:
    """Damage one record's body on disk; returns its offset and segment file."""
    layout = local_layout(path)
    target = next(r for r in rows[pick:] if len(r[7]) > 10)
    seg = layout.segment_at(target[3])
    name = path / "commitlog" / f"{seg.base:020d}.log"
    with open(name, "r+b") as f:
        pos = target[3] - seg.base + 106 + len(target[0]) + len(target[4].encode()) + len(target[5].encode()) + 3
        f.seek(pos)
        byte = f.read(1)
        f.seek(pos)
        f.write(bytes([byte[0] ^ 0xFF]))
    return target[3], str(name)


def test_a_corrupt_record_fails_the_query_or_is_skipped_and_counted(spark: Any, tmp_path: Path) -> None:
    store = fill(tmp_path / "s", 64 * 1024, n=800)
    rows = store_rows(store)
    store.close()
    offset, segment = _flip_body_byte(tmp_path / "s", rows, 400)
    df = spark.read.format("clmq").options(maxSplitBytes=5000, minSplitBytes=1).load(str(tmp_path / "s"))
    with pytest.raises(Exception) as err:
        df.collect()
    text = str(err.value)
    assert "crc32c" in text and segment in text and f"offset {offset}" in text
    log_dir = tmp_path / "corrupt"
    skipping = (
        spark.read.format("clmq").options(onCorrupt="skip", corruptRecordsLog=str(log_dir)).load(str(tmp_path / "s"))
    )
    assert spark_rows(skipping) == [r for r in rows if r[3] != offset]
    from clmq.spark_connector import read_corrupt_log

    report = read_corrupt_log(str(log_dir))
    assert report["records"] == 1 and report["regions"][0]["offset"] == offset


def test_damaged_header_is_skipped_to_the_next_boundary(spark: Any, tmp_path: Path) -> None:
    store = fill(tmp_path / "s", 1 << 20, n=600)
    rows = store_rows(store)
    store.close()
    target = rows[300]
    seg = local_layout(tmp_path / "s").segment_at(target[3])
    with open(tmp_path / "s" / "commitlog" / f"{seg.base:020d}.log", "r+b") as f:
        f.seek(target[3] - seg.base + 4)  # the magic: the walk cannot go on from here
        f.write(b"\0\0\0\0")
    log_dir = tmp_path / "corrupt"
    got = spark_rows(
        spark.read.format("clmq").options(onCorrupt="skip", corruptRecordsLog=str(log_dir)).load(str(tmp_path / "s"))
    )
    boundary = min(b for b in seg.boundaries if b > target[3])
    assert got == [r for r in rows if not target[3] <= r[3] < boundary]
    assert from_log(log_dir) == 1
    with pytest.raises(Exception, match="magic"):
        spark.read.format("clmq").load(str(tmp_path / "s")).collect()


def from_log(directory: Path) -> int:
    from clmq.spark_connector import read_corrupt_log

    return read_corrupt_log(str(directory))["records"]


# ----------------------------------------------------------------- network mode
def test_network_mode_reads_a_running_broker(spark: Any, tmp_path: Path) -> None:
    with cluster_in_thread(tmp_path) as c:
        with BlockingAdmin(c.ns) as admin:
            admin.create_topic("net", 3)
        with BlockingProducer(c.ns) as p:
            for i in range(40):
                p.send_batch("net", [b"n%d-%d" % (i, j) for j in range(25)])
        store = c.brokers["broker-a"].store
        # what the broker serves to readers: durable and dispatched
        assert store.wait_durable(store.end_offset, 10), "the broker's store did not fsync what it acknowledged"
        store.catch_up()
        expected = [r for r in store_rows(store) if r[0] == "net"]
        assert len(expected) == 1000
        for extra in ({}, {"readPath": "index"}, {"maxSplitBytes": "3000", "minSplitBytes": "1"}):
            df = spark.read.format("clmq").options(nameserver=c.ns[0], topics="net", **extra).load()
            assert spark_rows(df) == expected, extra
        by_broker = (
            spark.read.format("clmq").options(broker=c.brokers["broker-a"].addr, queues="2", topics="net").load()
        )
        assert spark_rows(by_broker) == [r for r in expected if r[1] == 2]


# -------------------------------------------------------------------- streaming
def test_an_available_now_stream_collects_every_message_exactly_once(spark: Any, tmp_path: Path) -> None:
    store = fill(tmp_path / "s", 64 * 1024, n=1200)
    first = store_rows(store)
    out, cp = tmp_path / "out", tmp_path / "cp"

    def run_stream(**opts: str) -> int:
        q = (
            spark.readStream.format("clmq")
            .options(**opts)
            .load(str(tmp_path / "s"))
            .writeStream.format("parquet")
            .option("checkpointLocation", str(cp))
            .option("path", str(out))
            .trigger(availableNow=True)
            .start()
        )
        q.awaitTermination(120)
        return len([p for p in q.recentProgress if p["numInputRows"]])

    batches = run_stream(maxRowsPerTrigger="250")
    assert batches >= 5  # the limit cut the stream into micro-batches
    got = spark_rows(spark.read.parquet(str(out)))
    assert got == first
    more = [Message("orders", i % 4, b"later-%d" % i) for i in range(300)]
    assert store.put_batch(more).ok
    store.catch_up()
    store.flush()  # a local reader sees what the checkpoint calls durable (async flush: only once flushed)
    store.checkpoint()
    run_stream(maxBytesPerTrigger="20000")  # the same query goes on where it stopped
    again = spark_rows(spark.read.parquet(str(out)))
    store_now = store_rows(store)
    store.close()
    assert again == store_now and len(again) == 1500


# ------------------------------------------------------------------------ export
def test_export_function_writes_every_row(spark: Any, filled: tuple[Path, list[tuple]], tmp_path: Path) -> None:
    from clmq.spark_connector import export

    path, rows = filled
    summary = export(spark, {"path": str(path), "topics": "orders"}, "parquet", str(tmp_path / "o"))
    want = [r for r in rows if r[0] == "orders"]
    assert summary.rows == len(want) and summary.body_bytes == sum(len(r[7]) for r in want)
    assert spark_rows(spark.read.parquet(str(tmp_path / "o"))) == want


@pytest.mark.slow
def test_clmq_export_command_json_and_csv(filled: tuple[Path, list[tuple]], tmp_path: Path) -> None:
    path, rows = filled
    env = {**os.environ, "COLUMNS": "200", "PYSPARK_PYTHON": sys.executable}
    base = [sys.executable, "-m", "clmq", "export", "--data-dir", str(path), "--master", "local[2]"]
    out = subprocess.run(
        [*base, "--format", "json", "--topics", "audit", "--output", str(tmp_path / "j")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    audit = [r for r in rows if r[0] == "audit"]
    assert f"exported {len(audit):,} rows" in out.stdout
    lines = [
        json.loads(line) for f in sorted((tmp_path / "j").glob("part-*.json")) for line in f.read_text().splitlines()
    ]
    assert sorted(x["commitlog_offset"] for x in lines) == [r[3] for r in audit]
    bad = subprocess.run(
        [*base, "--output", str(tmp_path / "x"), "--topics", "nope"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    # (Spark's own log lines on stderr may quote the worker's traceback; clmq's verdict is the last line)
    assert bad.returncode == 2 and bad.stderr.splitlines()[-1].startswith("error: OptionError: topic(s) nope not found")


def test_every_record_is_checked_for_crc_lengths_and_its_own_offset(tmp_path: Path) -> None:
    import numpy as np

    from clmq.common import walk_records
    from clmq.spark_connector._scan import check_crcs, headers_at

    store = fill(tmp_path / "s", 1 << 20, n=200)
    store.close()
    data = bytearray((tmp_path / "s" / "commitlog" / f"{0:020d}.log").read_bytes())
    walk = walk_records(bytes(data))
    starts = walk.starts
    h = headers_at(np.frombuffer(bytes(data), np.uint8), starts)
    assert len(starts) == 200 and not len(check_crcs(bytes(data), starts, h, 0))
    assert len(check_crcs(bytes(data), starts, h, 8)) == 200  # every record says where it lies: not there
    data[int(starts[17]) + 106] ^= 1  # the first byte of its topic
    assert check_crcs(bytes(data), starts, h, 0).tolist() == [17]

"""The reader's options with the semantics of Spark's Kafka source: selections that
restrict to exactly what they name, offsets and timestamps per queue, failOnDataLoss,
split bounds and the index path's planning. Planning is plain Python (no Spark), so
most cases run against ``plan``/``select`` directly; a few read through Spark."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clmq.broker.store import Store, StoreConfig
from clmq.commitlog import CommitLogConfig, now_ms
from clmq.common import Message, walk_records
from clmq.spark_connector import explain
from clmq.spark_connector._local import LocalStore
from clmq.spark_connector._options import OptionError, parse_options
from clmq.spark_connector._plan import IndexSplit, ScanSplit, plan
from clmq.spark_connector._select import DataLossError, resolve_topics, select
from tests.waiting import wait_until

TOPICS = {"orders": 4, "audit": 3, "t1000": 8}


def build(
    path: Path,
    per_queue: int = 40,
    segment_bytes: int = 64 << 10,
    retention_bytes: int | None = None,
    body: int = 200,
    cq_entries_per_file: int = 300_000,
) -> list[tuple[str, int, int, int]]:
    """A store with every queue of TOPICS holding ``per_queue`` messages, written in
    rounds (every queue once per round, so queues interleave in the log), each round
    in a millisecond of its own. Returns (topic, queue, queue offset, store ms) rows."""
    cfg = StoreConfig(
        path,
        CommitLogConfig(
            segment_bytes=segment_bytes,
            retention_bytes=retention_bytes,
            max_message_bytes=8192,
            boundary_interval_bytes=4096,
        ),
        cq_entries_per_file=cq_entries_per_file,
    )
    rows = []
    with Store.open(cfg).start() as store:
        for t, n in TOPICS.items():
            store.create_topic(t, n)
        for r in range(per_queue):
            batch = [
                Message(t, q, bytes([r % 256]) * body, keys=f"{t}-{q}-{r}") for t, n in TOPICS.items() for q in range(n)
            ]
            res = store.put_batch(batch)
            assert res.ok
            rows += [(m.topic, m.queue_id, r, res.store_timestamp_ms) for m in batch]
            wait_until(lambda res=res: now_ms() > res.store_timestamp_ms, 1, "the clock to pass a round")
        store.catch_up()
        store.flush()
        if retention_bytes is not None:
            store.apply_retention()
        store.checkpoint()
    return rows


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[tuple[str, int, int, int]]]:
    path = tmp_path_factory.mktemp("opts") / "store"
    return path, build(path)


def selected(path: Path, **options: str) -> Any:
    opts = parse_options({"path": str(path), **options})
    src = LocalStore(path)
    try:
        return select(opts, [src])
    finally:
        src.close()


def planned(path: Path, **options: str) -> Any:
    opts = parse_options({"path": str(path), **options})
    src = LocalStore(path)
    try:
        return plan(opts, [src], False)
    finally:
        src.close()


# ------------------------------------------------------------------ selection
def test_queues_json_alone_selects_exactly_the_topics_and_queues_it_names(built: tuple[Path, list]) -> None:
    path, _rows = built
    sel = selected(path, queues='{"t1000": [5, 6]}')
    assert sel.topics == ("t1000",) and sel.queues == {"t1000": (5, 6)}
    both = selected(path, queues='{"t1000": [5], "audit": [0, 2]}')
    assert set(both.topics) == {"t1000", "audit"} and both.queues == {"t1000": (5,), "audit": (0, 2)}
    # with topics given as well, a topic the JSON does not name is read whole (documented)
    wider = selected(path, topics="orders,t1000", queues='{"t1000": [1]}')
    assert wider.queues == {"orders": (0, 1, 2, 3), "t1000": (1,)}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"queues": '{"nope": [0]}'}, "topic.*nope.*not found"),
        ({"topics": "nope"}, "topic.*nope.*not found"),
        ({"queues": '{"orders": [4]}'}, r"queue id\(s\) \[4\] not in 0..3 of topic 'orders'"),
        ({"queues": "7"}, r"queue id\(s\) \[7\]"),
        ({"topics": "audit", "queues": '{"orders": [0]}'}, "queues names topic.*orders.*do not select"),
        ({"topics": "audit", "startingOffsets": '{"orders": {"0": 1}}'}, "startingOffsets names topic 'orders'"),
        ({"queues": "0", "endingOffsets": '{"orders": {"2": 1}}'}, r"endingOffsets names queue\(s\) \[2\]"),
        ({"startingOffsetsByTimestamp": '{"zzz": {"0": 1}}'}, "startingOffsetsByTimestamp names topic 'zzz'"),
        (
            {"startingOffsets": '{"orders": {"0": 30}}', "endingOffsets": '{"orders": {"0": 10}}'},
            "orders/0: the end offset 10 is before the start offset 30",
        ),
    ],
)
def test_a_selection_naming_what_is_not_there_is_an_error_naming_it(
    built: tuple[Path, list], options: dict[str, str], message: str
) -> None:
    with pytest.raises(OptionError, match=message):
        selected(built[0], **options)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"startingOffsets": '{"orders": {"0": -3}}'}, "-2 .earliest. / -1 .latest."),
        ({"startingOffsets": '{"orders": {"0": 1.5}}'}, "startingOffsets"),
        ({"startingOffsets": '{"orders": {"0": true}}'}, "startingOffsets"),
        ({"startingOffsets": '{"orders": [1]}'}, "startingOffsets"),
        ({"endingOffsets": '{"orders": {"-1": 4}}'}, "queue ids are 0 or more"),
        ({"queues": '{"orders": [-1]}'}, "queue ids are 0 or more"),
        ({"queues": '{"orders": 1}'}, "option queues"),
        ({"startingOffsetsByTimestamp": '{"orders": {"0": "soon"}}'}, "ms since the epoch"),
        ({"startingOffsets": "latest", "startingTimestamp": "5"}, "startingOffsets and startingTimestamp exclude"),
        ({"endingTimestamp": "5", "endingOffsetsByTimestamp": '{"orders": {"0": 5}}'}, "exclude each other"),
        ({"failOnDataLoss": "maybe"}, "failOnDataLoss='maybe': expected true or false"),
        ({"indexPathFraction": "2"}, "between 0 and 1"),
        ({"maxPartitions": "0"}, "maxPartitions=0: must be at least 1"),
        ({"minPartitions": "9", "maxPartitions": "4"}, "minPartitions=9 is above maxPartitions=4"),
        ({"minSplitBytes": "4096", "maxSplitBytes": "1000"}, "minSplitBytes=4096 is above maxSplitBytes=1000"),
        ({"maxRowsPerTrigger": "5", "maxOffsetsPerTrigger": "5"}, "not both"),
        ({"maxOffsetsPerTrigger": "-5"}, "maxOffsetsPerTrigger=-5: must be at least 1"),
    ],
)
def test_malformed_values_are_errors_naming_the_option(options: dict[str, str], message: str) -> None:
    with pytest.raises(OptionError, match=message):
        parse_options({"path": "x", **options})


OPTION_NAMES = [
    "queues",
    "startingOffsets",
    "endingOffsets",
    "startingTimestamp",
    "startingOffsetsByTimestamp",
    "failOnDataLoss",
    "maxSplitBytes",
    "minSplitBytes",
    "minPartitions",
    "maxPartitions",
    "readPath",
    "indexPathFraction",
    "maxOffsetsPerTrigger",
    "maxBytesPerTrigger",
    "onCorrupt",
    "timeoutMs",
]
JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 10**12) | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(OPTION_NAMES), value=st.one_of(st.text(max_size=12), JSONISH.map(json.dumps)))
def test_any_value_of_any_option_parses_or_is_an_option_error(name: str, value: str) -> None:
    try:
        parse_options({"path": "x", name: value})
    except OptionError as e:
        assert name.lower() in str(e).lower() or "exclude" in str(e) or "above" in str(e)


# ------------------------------------------------------------- offsets and loss
def test_offsets_per_queue_by_number_and_by_timestamp(built: tuple[Path, list]) -> None:
    path, rows = built
    sel = selected(
        path,
        topics="orders",
        startingOffsets='{"orders": {"1": 10, "2": -1}}',
        endingOffsets='{"orders": {"1": 25, "3": -2}}',
    )
    key = f"{path}|orders/"
    assert sel.ranges[key + "1"] == (10, 25) and sel.ranges[key + "2"] == (40, 40) and sel.ranges[key + "3"] == (0, 0)
    assert key + "0" not in sel.ranges  # not named: the whole queue
    stamps = sorted({r[3] for r in rows})
    by_ts = selected(
        path,
        topics="audit",
        startingOffsetsByTimestamp=json.dumps({"audit": {"2": stamps[7]}}),
        endingOffsetsByTimestamp=json.dumps({"audit": {"2": stamps[20]}}),
    )
    assert by_ts.ranges == {f"{path}|audit/2": (7, 20)}


def test_offsets_not_yet_written_fail_or_are_clamped_with_a_warning(
    built: tuple[Path, list], caplog: pytest.LogCaptureFixture
) -> None:
    path, _rows = built
    with pytest.raises(
        DataLossError,
        match=r"queue orders/1: end 99 is outside the queue's \[0, 40\): offsets \[40, 99\) are not yet written",
    ):
        selected(path, topics="orders", endingOffsets='{"orders": {"1": 99}}')
    with caplog.at_level(logging.WARNING, "clmq.spark"):
        sel = selected(path, topics="orders", startingOffsets='{"orders": {"1": 50}}', failOnDataLoss="false")
    assert sel.ranges[f"{path}|orders/1"] == (40, 40)
    assert "not yet written" in caplog.text and "failOnDataLoss=false" in caplog.text


def test_offsets_lost_to_retention_fail_or_are_clamped(tmp_path: Path) -> None:
    path = tmp_path / "store"
    build(path, per_queue=60, segment_bytes=32 << 10, retention_bytes=64 << 10)
    src = LocalStore(path)
    qmin = src.bounds("orders", 0)[0]
    src.close()
    assert qmin > 0, "retention deleted nothing: the test needs a store with a trimmed head"
    with pytest.raises(
        DataLossError, match=rf"orders/0: start 0 is outside .*offsets \[0, {qmin}\) are no longer retained"
    ):
        selected(path, topics="orders", startingOffsets='{"orders": {"0": 0}}')
    sel = selected(path, topics="orders", startingOffsets='{"orders": {"0": 0}}', failOnDataLoss="false")
    assert sel.ranges[f"{path}|orders/0"][0] == qmin
    # earliest is never data loss: it is what the queue holds
    assert (
        selected(path, topics="orders", startingOffsets='{"orders": {"0": -2}}').ranges[f"{path}|orders/0"][0] == qmin
    )


# -------------------------------------------------------------------- planning
def test_a_tiny_max_split_is_raised_to_the_minimum_with_a_note(built: tuple[Path, list]) -> None:
    path, _rows = built
    p = planned(path, maxSplitBytes="1000")
    log_bytes = sum(s.end - s.start for s in p.splits if isinstance(s, ScanSplit))
    assert len(p.splits) <= 2 + log_bytes // (1 << 20) + len({s.seg_base for s in p.splits})
    assert any("maxSplitBytes=1000 raised to minSplitBytes=1048576" in n for n in p.notes)
    assert "maxSplitBytes=1000 raised" in explain({"path": str(path), "maxSplitBytes": "1000"})


def test_max_partitions_bounds_the_number_of_tasks(built: tuple[Path, list]) -> None:
    path, _rows = built
    free = planned(path, maxSplitBytes="2000", minSplitBytes="1")
    assert len(free.splits) > 60 and not free.notes
    bounded = planned(path, maxSplitBytes="2000", minSplitBytes="1", maxPartitions="60")
    assert len(bounded.splits) <= 60
    assert any(f"{len(free.splits):,} tasks would exceed maxPartitions=60" in n for n in bounded.notes)


def test_min_partitions_gives_at_least_that_many_tasks_while_splits_stay_above_the_minimum(
    built: tuple[Path, list],
) -> None:
    path, _rows = built
    assert len(planned(path, minPartitions="7", minSplitBytes="1").splits) >= 7
    assert len(planned(path, minPartitions="7").splits) < 7  # the store is under 7 MiB: 1 MiB splits at least


def test_index_path_packs_many_queues_into_few_tasks_and_says_why(built: tuple[Path, list]) -> None:
    path, _rows = built
    p = planned(path, readPath="index", minPartitions="3", minSplitBytes="1")
    assert all(isinstance(s, IndexSplit) for s in p.splits)
    assert 3 <= len(p.splits) <= 6, [len(s.pieces) for s in p.splits]
    pieces = [piece for s in p.splits for piece in s.pieces]
    assert sum(hi - lo for _t, _q, lo, hi in pieces) == 40 * sum(TOPICS.values())
    assert "index path (readPath=index): 15 queue(s)" in p.describe()
    auto = planned(path, queues='{"t1000": [5]}')
    assert "index path (the selection is 6.7% of the messages, under indexPathFraction=0.25)" in auto.describe()
    wide = planned(path, topics="t1000,orders")
    assert "scan path (the selection is 80.0% of the messages, at least indexPathFraction=0.25)" in wide.describe()


# ------------------------------------------------------------- through Spark
def keyset(df: Any) -> list[tuple[str, int, int]]:
    return sorted(
        (r.topic, r.queue_id, r.queue_offset) for r in df.select("topic", "queue_id", "queue_offset").collect()
    )


def test_through_spark_index_reads_of_every_queue_equal_the_scan(spark: Any, built: tuple[Path, list]) -> None:
    path, rows = built
    read = spark.read.format("clmq")
    scan = read.options(readPath="scan").load(str(path)).collect()
    index = read.options(readPath="index", minPartitions="4", minSplitBytes="1").load(str(path)).collect()
    assert sorted(index) == sorted(scan) and len(scan) == len(rows)
    two = read.options(queues='{"t1000": [5, 6]}').load(str(path))
    assert keyset(two) == sorted((t, q, o) for t, q, o, _ms in rows if t == "t1000" and q in (5, 6))


def test_through_spark_errors_name_the_queue(spark: Any, built: tuple[Path, list]) -> None:
    path, _rows = built
    with pytest.raises(Exception, match=r"orders/2: end 77 is outside"):
        spark.read.format("clmq").options(topics="orders", endingOffsets='{"orders": {"2": 77}}').load(
            str(path)
        ).count()
    lenient = (
        spark.read.format("clmq")
        .options(topics="orders", endingOffsets='{"orders": {"2": 77}}', failOnDataLoss="false")
        .load(str(path))
    )
    assert lenient.count() == 4 * 40


def test_body_length_column_needs_no_body_and_an_empty_selection_reads_nothing(
    spark: Any, built: tuple[Path, list]
) -> None:
    path, _rows = built
    full = spark.read.format("clmq").load(str(path)).selectExpr("queue_offset", "commitlog_offset", "length(body) AS n")
    narrow = (
        spark.read.format("clmq")
        .schema("queue_offset bigint, commitlog_offset bigint, body_length int")
        .load(str(path))
    )
    assert sorted(narrow.collect()) == sorted(full.collect())
    assert spark.read.format("clmq").options(startingOffsets="latest").load(str(path)).count() == 0
    assert "body_length" not in spark.read.format("clmq").load(str(path)).columns  # not in the default schema


def test_a_reader_in_the_checkpoint_rotation_window_or_beside_a_damaged_checkpoint_uses_the_previous(
    built: tuple[Path, list], tmp_path: Path
) -> None:
    """The store replaces its checkpoint by renaming the current one to ``.prev`` and
    then moving the new one in: a reader between the two renames finds no checkpoint."""
    import shutil

    from clmq.spark_connector import local_layout

    path = tmp_path / "copy"
    shutil.copytree(built[0], path)
    before = local_layout(path)
    (path / "checkpoint").rename(path / "checkpoint.prev")  # the window between the renames
    assert local_layout(path).end_offset == before.end_offset
    shutil.copy(path / "checkpoint.prev", path / "checkpoint")
    raw = (path / "checkpoint").read_bytes()
    (path / "checkpoint").write_bytes(raw.replace(b'"log_durable":', b'"log_durable": 1'))  # fails its checksum
    assert local_layout(path).end_offset == before.end_offset


@pytest.mark.slow
def test_bench_spark_measures_every_workload_against_parquet(tmp_path: Path) -> None:
    from tests.cli_helpers import clmq

    out = clmq(
        "bench",
        "spark",
        "--messages",
        "3000",
        "--sizes",
        "200",
        "--runs",
        "1",
        "--export-runs",
        "1",
        "--index-queues",
        "40",
        "--out-dir",
        str(tmp_path / "r"),
        cwd=tmp_path,
        timeout_s=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (result_path,) = (tmp_path / "r").glob("spark-*.json")
    result = json.loads(result_path.read_text())
    (size,) = result["sizes"]
    assert set(size["cases"]) == {
        "clmq_full",
        "clmq_full_no_crc",
        "arrow_replay_full",
        "parquet_full",
        "clmq_narrow",
        "clmq_narrow_no_crc",
        "clmq_narrow_default_schema",
        "parquet_narrow",
        "clmq_export",
        "parquet_copy",
    }
    assert all(c["rows_per_s"] > 0 and c["cpu_us_per_row"] > 0 for c in size["cases"].values())
    assert all(v is not None and v > 0 for v in size["ratios"].values())
    assert size["parse_ns_per_row"]["crc32c"] > 0 and "column body" in size["parse_ns_per_row"]
    assert result["index"]["queues"] == 40 and result["index"]["index_over_scan"] > 0
    assert result_path.with_suffix(".png").stat().st_size > 10_000
    assert "full scan clmq / Parquet" in out.stdout and "index / scan over every queue" in out.stdout


@pytest.mark.parametrize("read_path", ["scan", "index"])
def test_records_deleted_between_planning_and_reading_fail_the_task_or_are_left_out(
    tmp_path: Path, read_path: str, caplog: pytest.LogCaptureFixture
) -> None:
    from clmq.spark_connector._arrow import COLUMNS
    from clmq.spark_connector._tasks import read_spec, read_split

    path = tmp_path / "store"
    rows = build(path, per_queue=30, segment_bytes=32 << 10)
    first = sorted((path / "commitlog").glob("*.log"))[0]
    lenient_rows = None
    for fail in ("true", "false"):
        options = {"path": str(path), "readPath": read_path, "minSplitBytes": "1", "failOnDataLoss": fail}
        opts = parse_options(options)
        src = LocalStore(path)
        p = plan(opts, [src], False)
        src.close()
        if fail == "true":
            saved = first.read_bytes()
            first.unlink()  # what retention does to the oldest segment while tasks are queued
        spec = read_spec(opts, p.selection)
        if fail == "true":
            with pytest.raises(DataLossError, match=r"deleted|is gone"):
                for s in p.splits:
                    list(read_split(s, spec, list(COLUMNS), 1000))
            first.write_bytes(saved)
            continue
        first.unlink()
        with caplog.at_level(logging.WARNING, "clmq.spark"):
            lenient_rows = sum(b.num_rows for s in p.splits for b in read_split(s, spec, list(COLUMNS), 1000))
        assert "failOnDataLoss=false" in caplog.text
    first.write_bytes(saved)
    in_first = len(walk_records(saved).starts)  # every record of the deleted segment, no other
    assert lenient_rows == len(rows) - in_first, "the records of the segments still there are all read"


def test_a_queue_file_deleted_after_planning_is_data_loss_not_a_shorter_read(tmp_path: Path) -> None:
    """Retention deletes whole consume-queue files: the entries of a piece then start
    past the offset it was planned from."""
    from clmq.spark_connector._arrow import COLUMNS
    from clmq.spark_connector._tasks import read_spec, read_split

    path = tmp_path / "store"
    rows = build(path, per_queue=30, cq_entries_per_file=10)
    results = {}
    for fail in ("true", "false"):
        opts = parse_options({"path": str(path), "readPath": "index", "failOnDataLoss": fail})
        src = LocalStore(path)
        p = plan(opts, [src], False)
        src.close()
        head = path / "consumequeue" / "orders" / "0" / f"{0:020d}"
        saved = head.read_bytes()
        head.unlink()
        spec = read_spec(opts, p.selection)
        try:
            results[fail] = sum(b.num_rows for s in p.splits for b in read_split(s, spec, list(COLUMNS), 1000))
        except DataLossError as e:
            results[fail] = str(e)
        head.write_bytes(saved)
    assert "10 record(s) of queue orders/0 in [0, 30) were deleted" in str(results["true"])
    assert results["false"] == len(rows) - 10


def test_timestamps_skip_holes_in_a_queue(tmp_path: Path) -> None:
    from clmq.spark_connector._layout import LocalQueueIndex, local_layout

    path = tmp_path / "store"
    build(path, per_queue=10)
    cq = path / "consumequeue" / "orders" / "1" / f"{0:020d}"
    raw = bytearray(cq.read_bytes())
    raw[20:40] = bytes(20)  # entry 1: a hole (recovery leaves these where it lost an entry)
    cq.write_bytes(bytes(raw))
    index = LocalQueueIndex(path, local_layout(path))
    assert index.offset_for_timestamp("orders", 1, 0) == 0
    assert index.offset_for_timestamp("orders", 1, 1 << 62) == 10


def test_an_end_offset_the_broker_has_not_flushed_yet_is_waited_for_not_read_short(spark: Any, tmp_path: Path) -> None:
    """A broker counts dispatched records in its queues' ends before its async flush makes
    them durable, and its snapshot for readers stops at what is durable."""
    import os
    import signal
    import subprocess

    from clmq.client import BlockingAdmin, BlockingProducer
    from tests.cli_helpers import _brokers, free_port, popen

    ns_port, port = free_port(), free_port()
    ns = f"127.0.0.1:{ns_port}"
    (tmp_path / "broker.toml").write_text("flush_interval_ms = 4000\n")
    proc = popen(
        "dev",
        "--config",
        str(tmp_path / "broker.toml"),
        "--data-dir",
        str(tmp_path / "data"),
        "--port",
        str(port),
        "--namesrv-port",
        str(ns_port),
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(lambda: proc.poll() is not None or _brokers(ns) > 0, 60, "clmq dev to register its broker")
        with BlockingAdmin([ns]) as admin:
            admin.create_topic("late", 1)
        with BlockingProducer([ns]) as p:
            p.send_batch("late", [b"x%d" % i for i in range(100)])
        df = spark.read.format("clmq").options(broker=f"127.0.0.1:{port}", endingOffsets='{"late": {"0": 100}}').load()
        assert sorted(bytes(r.body) for r in df.select("body").collect()) == sorted(b"x%d" % i for i in range(100))
    finally:
        os.kill(proc.pid, signal.SIGINT)
        proc.wait(30)


def test_the_broker_s_own_topics_are_read_only_when_named(tmp_path: Path) -> None:
    available = {"orders": 2, "%TIMER%": 2, "%RETRY%g": 1, "%DLQ%g": 1}
    path = {"path": str(tmp_path)}
    assert resolve_topics(parse_options(path), available, "here") == ("orders",)
    assert resolve_topics(parse_options({**path, "topicPattern": ".*"}), available, "here") == ("orders",)
    assert resolve_topics(parse_options({**path, "topics": "%DLQ%g"}), available, "here") == ("%DLQ%g",)


@pytest.mark.slow
def test_bench_spark_reads_the_store_through_the_kafka_listener_with_sparks_kafka_source(tmp_path: Path) -> None:
    """``--kafka-jars``: a broker serves the bench's store and Spark's Kafka source (its jars
    as tests/java_deps.py finds them) reads it as the full scan and the narrow aggregate."""
    import os

    from tests import java_deps
    from tests.cli_helpers import clmq

    jars = java_deps.require("spark-kafka")
    out = clmq(
        "bench",
        "spark",
        "--messages",
        "2000",
        "--sizes",
        "200",
        "--queues",
        "4",
        "--runs",
        "1",
        "--export-runs",
        "0",
        "--index-queues",
        "0",
        "--kafka-jars",
        os.pathsep.join(jars),
        "--out-dir",
        str(tmp_path / "r"),
        cwd=tmp_path,
        timeout_s=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (result_path,) = (tmp_path / "r").glob("spark-*.json")
    result = json.loads(result_path.read_text())
    (size,) = result["sizes"]
    for name in ("kafka_full", "kafka_narrow"):
        case = size["cases"][name]
        assert case["rows_per_s"] > 0 and case["cpu_us_per_row"] > 0 and case["broker_cpu_us_per_row"] >= 0
    assert {"clmq_full", "parquet_full"} <= set(size["cases"])
    assert size["ratios"]["kafka_full"] and size["ratios"]["kafka_full_over_clmq"]
    assert result["kafka"]["jars"] == [Path(j).name for j in jars]
    assert "Spark's Kafka source via the Kafka listener, every column" in out.stdout


def test_bench_spark_refuses_missing_kafka_jars(tmp_path: Path) -> None:
    from tests.cli_helpers import clmq

    out = clmq("bench", "spark", "--kafka-jars", str(tmp_path / "nope.jar"), "--out-dir", str(tmp_path), cwd=tmp_path)
    assert out.returncode == 2 and "nope.jar" in out.stdout + out.stderr

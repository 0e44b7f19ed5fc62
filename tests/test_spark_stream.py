"""Structured Streaming from clmq: every row exactly once across a query stopped midway
and restarted from its checkpoint, across a restart of the broker it reads, Kafka's
maxOffsetsPerTrigger, lag in the progress, and failOnDataLoss when retention outruns
the stream."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from clmq.broker.store import Store, StoreConfig
from clmq.client import BlockingAdmin, BlockingProducer
from clmq.commitlog import CommitLogConfig
from clmq.common import Message
from tests.cli_helpers import _brokers, free_port, popen
from tests.waiting import wait_until


def config(path: Path, retention_bytes: int | None = None) -> StoreConfig:
    return StoreConfig(
        path,
        CommitLogConfig(
            segment_bytes=32 << 10,
            max_message_bytes=8192,
            retention_bytes=retention_bytes,
            boundary_interval_bytes=4096,
        ),
    )


def append(path: Path, start: int, n: int, retention_bytes: int | None = None) -> None:
    """``n`` messages with bodies ``m<i>`` (i from ``start``) over 4 queues of topic "s"."""
    with Store.open(config(path, retention_bytes)).start() as store:
        if store.topics.queue_count("s") is None:
            store.create_topic("s", 4)
        for a in range(start, start + n, 100):
            assert store.put_batch([Message("s", i % 4, b"m%d" % i) for i in range(a, min(start + n, a + 100))]).ok
        store.catch_up()
        store.flush()
        if retention_bytes is not None:
            store.apply_retention()
        store.checkpoint()


def bodies(spark: Any, out: Path) -> list[bytes]:
    return sorted(bytes(r.body) for r in spark.read.parquet(str(out)).select("body").collect())


def expected(a: int, b: int) -> list[bytes]:
    return sorted(b"m%d" % i for i in range(a, b))


def start_stream(spark: Any, source: dict[str, str], tmp_path: Path, available_now: bool, **options: str) -> Any:
    reader = spark.readStream.format("clmq").options(**source, **options).load()
    writer = (
        reader.select("body")
        .writeStream.format("parquet")
        .option("checkpointLocation", str(tmp_path / "cp"))
        .option("path", str(tmp_path / "out"))
    )
    writer = writer.trigger(availableNow=True) if available_now else writer.trigger(processingTime="0 seconds")
    return writer.start()


def batches_with_rows(q: Any) -> int:
    return len([p for p in q.recentProgress if p["numInputRows"]])


def test_a_query_stopped_midway_and_restarted_reads_every_row_once(spark: Any, tmp_path: Path) -> None:
    store = tmp_path / "store"
    append(store, 0, 1500)
    src = {"path": str(store)}
    q = start_stream(spark, src, tmp_path, False, maxOffsetsPerTrigger="100")
    try:
        wait_until(lambda: batches_with_rows(q) >= 3 or q.exception() is not None, 120, "three micro-batches")
        assert q.exception() is None
        assert all(p["numInputRows"] <= 100 for p in q.recentProgress)  # the Kafka name bounds rows per batch
        latest = q.lastProgress["sources"][0]["latestOffset"]
        assert latest and str(store) in latest, "the latest offset is reported (lag in the progress and the UI)"
    finally:
        q.stop()
    assert len(bodies(spark, tmp_path / "out")) < 1500, "the first run should have stopped midway"
    append(store, 1500, 200)
    q = start_stream(spark, src, tmp_path, True, maxOffsetsPerTrigger="400")
    q.awaitTermination(180)
    assert q.exception() is None
    assert bodies(spark, tmp_path / "out") == expected(0, 1700)


def test_a_stream_goes_on_across_a_restart_of_its_broker(spark: Any, tmp_path: Path) -> None:
    ns_port, port = free_port(), free_port()
    ns, addr = f"127.0.0.1:{ns_port}", f"127.0.0.1:{port}"

    def dev() -> subprocess.Popen[bytes]:
        proc = popen(
            "dev",
            "--data-dir",
            str(tmp_path / "data"),
            "--port",
            str(port),
            "--namesrv-port",
            str(ns_port),
            "--flush-mode",
            "sync",
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_until(lambda: proc.poll() is not None or _brokers(ns) > 0, 60, "clmq dev to register its broker")
        assert proc.poll() is None
        return proc

    def produce(a: int, b: int) -> None:
        with BlockingProducer([ns]) as p:
            for i in range(a, b, 50):
                p.send_batch("s", [b"m%d" % j for j in range(i, min(b, i + 50))])

    proc = dev()
    try:
        with BlockingAdmin([ns]) as admin:
            admin.create_topic("s", 4)
        produce(0, 600)
        q = start_stream(spark, {"broker": addr}, tmp_path, True, maxOffsetsPerTrigger="150")
        q.awaitTermination(180)
        assert q.exception() is None and batches_with_rows(q) >= 4
        os.kill(proc.pid, signal.SIGINT)
        proc.wait(30)
        proc = dev()  # the same data directory and port: the stream's positions still hold
        produce(600, 900)
        q = start_stream(spark, {"broker": addr}, tmp_path, True)
        q.awaitTermination(180)
        assert q.exception() is None
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGINT)
            proc.wait(30)
    assert bodies(spark, tmp_path / "out") == expected(0, 900)


def test_retention_past_the_stream_fails_it_or_is_skipped_with_fail_on_data_loss_false(
    spark: Any, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    append(store, 0, 300)
    src = {"path": str(store)}
    q = start_stream(spark, src, tmp_path, True)
    q.awaitTermination(120)
    assert bodies(spark, tmp_path / "out") == expected(0, 300)
    append(store, 300, 6000, retention_bytes=64 << 10)  # retention drops what the stream has not read yet
    q = start_stream(spark, src, tmp_path, True)
    with pytest.raises(Exception, match=r"deleted by retention before the query read them"):
        q.awaitTermination(120)
    q = start_stream(spark, src, tmp_path, True, failOnDataLoss="false")
    q.awaitTermination(120)
    assert q.exception() is None
    got = sorted(int(b[1:]) for b in bodies(spark, tmp_path / "out"))
    tail = got[300:]
    assert got[:300] == list(range(300)), "rows read before the loss are kept"
    assert tail == list(range(tail[0], 6300)) and tail[0] > 300, "after the loss: from what is left, to the end, once"

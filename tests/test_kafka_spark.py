"""The Kafka listener judged by Spark's own Kafka source (spark-sql-kafka-0-10, the
version in tests/java/spark-kafka/pom.xml, on the shared SparkSession of conftest.py)
against a real broker process: a batch read and an ``availableNow`` stream return the
rows clmq's own Spark source reads from the same topic, and what was produced.

Maven Central serves no spark-sql-kafka-0-10_2.13 4.3.0 (the installed PySpark's
version): the jars are 4.2.0's, with the kafka-clients it was built against (3.9.2).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from clmq import open_admin
from clmq.broker.service.kafka._mapping import to_kafka
from clmq.common import Record
from tests import java_deps
from tests.kafka_procs import in_thread, open_kafka

ck = pytest.importorskip("confluent_kafka")

Headers = tuple[tuple[str, bytes | None], ...]
# (topic, partition, offset, key, value, timestamp ms, headers)
Row = tuple[str, int, int, bytes | None, bytes | None, int, Headers]


def _record(i: int) -> tuple[bytes | None, bytes | None, int, list[tuple[str, bytes | None]]]:
    """Text, binary, empty and null keys; null values; repeated, binary and null headers."""
    key: bytes | None = f"key-{i}".encode()
    if i % 7 == 1:
        key = None
    elif i % 7 == 2:
        key = b"\xff\xfe" + bytes([i % 256])
    elif i % 7 == 3:
        key = b""
    value: bytes | None = f"value-{i:05d}".encode() + bytes(i % 40)
    if i % 11 == 4:
        value = None
    headers: list[tuple[str, bytes | None]] = [("h", b"x"), ("k", str(i).encode())]
    if i % 3 == 0:
        headers = [("h", b"x"), ("h", b"\x00\xff"), ("n", None)]
    if i % 5 == 0:
        headers = []
    return key, value, 1_650_000_000_000 + i * 13, headers


def produce(bootstrap: str, topic: str, first: int, count: int) -> list[Row]:
    """Records ``first..first+count`` through confluent-kafka (idempotent): the rows as
    sent, at the partition and offset each was acknowledged at."""
    producer = ck.Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "enable.idempotence": True})
    out: list[Row] = []
    errors: list[Any] = []

    def reporter(key: bytes | None, value: bytes | None, ts: int, headers: Headers) -> Any:
        def report(err: Any, msg: Any) -> None:
            if err:
                errors.append(err)
            else:
                out.append((msg.topic(), msg.partition(), msg.offset(), key, value, ts, headers))

        return report

    for i in range(first, first + count):
        key, value, ts, headers = _record(i)
        report = reporter(key, value, ts, tuple(headers))
        producer.produce(topic, key=key, value=value, headers=headers, timestamp=ts, on_delivery=report)
        producer.poll(0)
    assert producer.flush(30) == 0, "messages left unsent"
    assert not errors, errors[:3]
    return sorted(out, key=_order)


def same(got: list[Row], want: list[Row]) -> str:
    """Empty if equal, else the counts and the first rows that differ."""
    if got == want:
        return ""
    diff = next(((g, w) for g, w in zip(got, want) if g != w), None)
    return f"{len(got)} rows, {len(want)} expected; first difference (got, expected): {diff}"


def _order(r: Row) -> tuple[int, int]:
    return r[1], r[2]


def _bytes(b: Any) -> bytes | None:
    return None if b is None else bytes(b)


KAFKA_COLUMNS = ["topic", "partition", "offset", "key", "value", "unix_millis(timestamp) AS ts", "headers"]


def kafka_rows(df: Any) -> list[Row]:
    """Rows of Spark's Kafka source, with what the Kafka protocol says of each."""
    rows: list[Row] = []
    for r in df.selectExpr(*KAFKA_COLUMNS).collect():
        hs = tuple((h["key"], _bytes(h["value"])) for h in r["headers"] or [])
        rows.append((r["topic"], r["partition"], r["offset"], _bytes(r["key"]), _bytes(r["value"]), r["ts"], hs))
    return sorted(rows, key=_order)


def clmq_rows(spark: Any, namesrv: str, topic: str) -> list[Row]:
    """What clmq's own Spark source reads, seen as Kafka records (the broker's mapping)."""
    df = spark.read.format("clmq").options(nameserver=namesrv, topics=topic).load()
    rows: list[Row] = []
    for r in df.selectExpr("*", "unix_millis(born_timestamp) AS born_ms").collect():
        record = Record(
            topic=r["topic"],
            queue_id=r["queue_id"],
            queue_offset=r["queue_offset"],
            commitlog_offset=r["commitlog_offset"],
            size=0,
            body=bytes(r["body"]),
            tags=r["tags"] or "",
            keys=r["keys"] or "",
            properties=dict(r["properties"] or {}),
            flags=0,
            born_timestamp_ms=r["born_ms"],
            store_timestamp_ms=0,
            born_host=("", 0),
            store_host=("", 0),
            reconsume_times=r["reconsume_times"],
        )
        ts, key, value, headers = to_kafka(record)
        rows.append((r["topic"], r["queue_id"], r["queue_offset"], key, value, ts, tuple(headers)))
    return sorted(rows, key=_order)


def read_batch(spark: Any, bootstrap: str, topic: str) -> list[Row]:
    df = (
        spark.read.format("kafka")
        .option("kafka.bootstrap.servers", bootstrap)
        .option("subscribe", topic)
        .option("startingOffsets", "earliest")
        .option("endingOffsets", "latest")
        .option("includeHeaders", "true")
        .load()
    )
    return kafka_rows(df)


def read_stream(spark: Any, bootstrap: str, topic: str, checkpoint: Path) -> list[Row]:
    """One ``availableNow`` run of a stream into a foreachBatch sink: the rows it added."""
    df = (
        spark.readStream.format("kafka")
        .option("kafka.bootstrap.servers", bootstrap)
        .option("subscribe", topic)
        .option("startingOffsets", "earliest")
        .option("includeHeaders", "true")
        .option("maxOffsetsPerTrigger", "700")
        .load()
    )
    rows: list[Row] = []
    batches: list[int] = []

    def collect(batch: Any, batch_id: int) -> None:
        got = kafka_rows(batch)
        batches.append(len(got))
        rows.extend(got)

    query = (
        df.writeStream.foreachBatch(collect)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    try:
        assert query.awaitTermination(120), "the availableNow stream did not finish"
        assert query.exception() is None, query.exception()
    finally:
        query.stop()
    # maxOffsetsPerTrigger splits the run into several batches (offset ranges asked of the listener)
    assert len(batches) >= 2 or sum(batches) <= 700, batches
    return sorted(rows, key=_order)


def _assert_kafka_source(spark: Any) -> None:
    java_deps.require("spark-kafka")  # fails (or skips: Maven Central unreachable) without the jars
    try:
        spark._jvm.java.lang.Class.forName(
            "org.apache.spark.sql.kafka010.KafkaSourceProvider",
            True,
            spark._jvm.Thread.currentThread().getContextClassLoader(),
        )
    except Exception as e:  # the jars appeared after the shared session started
        pytest.fail(f"the shared SparkSession has no Kafka source (spark.jars of tests/conftest.py): {e}")


async def test_spark_kafka_source_batch_and_stream_read_what_clmq_reads(spark: Any, tmp_path: Path) -> None:
    _assert_kafka_source(spark)
    async with open_kafka(tmp_path) as kafka:
        async with open_admin([kafka.namesrv]) as admin:
            await admin.create_topic("sk", 3)
        sent = await in_thread(produce, kafka.bootstrap, "sk", 0, 2000)
        assert {r[1] for r in sent} == {0, 1, 2}

        batch = await in_thread(read_batch, spark, kafka.bootstrap, "sk")
        assert not (d := same(batch, sent)), d
        by_clmq = await in_thread(clmq_rows, spark, kafka.namesrv, "sk")
        assert not (d := same(batch, by_clmq)), d

        checkpoint = tmp_path / "checkpoint"
        with trio.fail_after(150):
            streamed = await in_thread(read_stream, spark, kafka.bootstrap, "sk", checkpoint)
        assert not (d := same(streamed, sent)), d
        # the same query again, from its checkpoint: only what was produced since
        more = await in_thread(produce, kafka.bootstrap, "sk", 2000, 300)
        with trio.fail_after(150):
            resumed = await in_thread(read_stream, spark, kafka.bootstrap, "sk", checkpoint)
        assert not (d := same(resumed, more)), d
        by_clmq = await in_thread(clmq_rows, spark, kafka.namesrv, "sk")
        assert not (d := same(by_clmq, sorted(sent + more, key=_order))), d

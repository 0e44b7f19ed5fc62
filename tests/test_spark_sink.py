"""The clmq sink (``df.write.format("clmq")``, ``df.writeStream.format("clmq")``) against a
real local SparkSession and a real name server and broker: what it writes is read back
by the clmq source, its options and columns are checked before any task runs, and a
broker's refusal fails the write with the broker's error."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any, Iterator

import pytest
from pyspark.sql.types import BinaryType, StructField, StructType

from clmq.client import BlockingAdmin, BlockingProducer, shard
from clmq.spark_connector._options import OptionError
from clmq.spark_connector._sink import KNOWN, SinkColumns, check_columns, parse_sink_options, send_all
from tests.service_helpers import Cluster, cluster_in_thread

UNIQ_KEY = "UNIQ_KEY"  # the id the producer gives every message (a property)
INPUT_SCHEMA = "body binary, keys string, tags string, properties map<string,string>, seq int"


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    with cluster_in_thread(tmp_path) as c:
        yield c


def create(c: Cluster, **topics: int) -> None:
    with BlockingAdmin(c.ns) as admin:
        for topic, queues in topics.items():
            admin.create_topic(topic, queues)


def settle(c: Cluster) -> None:
    """Until the broker serves readers everything it acknowledged (durable and dispatched)."""
    store = c.brokers["broker-a"].store
    assert store.wait_durable(store.end_offset, 10), "the broker's store did not fsync what it acknowledged"
    store.catch_up()


def read_back(spark: Any, c: Cluster, topic: str) -> list[dict[str, Any]]:
    """Every message of ``topic`` as the clmq source reads it, in (queue, offset) order."""
    settle(c)
    df = spark.read.format("clmq").options(nameserver=c.ns[0], topics=topic).load()
    rows = [r.asDict() for r in df.collect()]
    for r in rows:
        r["body"], r["properties"] = bytes(r["body"]), dict(r["properties"])
    return sorted(rows, key=lambda r: (r["queue_id"], r["queue_offset"]))


def writer(df: Any, c: Cluster, **options: Any) -> Any:
    return df.write.format("clmq").mode("append").options(nameserver=c.ns[0], **options)


def sample_rows(n: int) -> list[tuple]:
    """Varied rows: bodies of 0 to 3,000 bytes, keys (every third row none), tags,
    properties on every fifth row (non-ASCII too); ``seq`` numbers them. Keys: 8 (i % 12 not a multiple of 3)."""
    rows = []
    for i in range(n):
        body = bytes([i % 251]) * (i * 37 % 3000)
        key = "" if i % 3 == 0 else f"user-{i % 12}"
        props = {"n": str(i), "ü": "é" * (i % 4)} if i % 5 == 0 else {}
        rows.append((body, key, ["", "TagA", "TagB"][i % 3], props, i))
    return rows


def message(r: dict[str, Any]) -> tuple:
    """A read row's message as it was given: queue, tags, keys, properties, body."""
    return r["queue_id"], r["tags"], r["keys"], sorted(r["properties"].items()), r["body"]


def without_uniq(props: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in props.items() if k != UNIQ_KEY}


# ------------------------------------------------------------ what is written
def test_rows_read_back_equal_the_rows_written_keys_in_their_queue_in_order(spark: Any, cluster: Cluster) -> None:
    create(cluster, dst=4)
    rows = sample_rows(600)
    # by key: each key's rows in one task, in seq order, so their order is one to keep
    df = spark.createDataFrame(rows, INPUT_SCHEMA).repartition(4, "keys").sortWithinPartitions("seq")
    assert df.rdd.getNumPartitions() == 4
    writer(df.drop("seq"), cluster, topic="dst").save()
    got = read_back(spark, cluster, "dst")
    assert len(got) == 600
    assert sorted((r["body"], r["keys"], r["tags"], without_uniq(r["properties"])) for r in got) == sorted(
        (body, key, tag, props) for body, key, tag, props, _ in rows
    )
    assert all(UNIQ_KEY in r["properties"] for r in got)  # the producer's ids, one per message
    assert len({r["properties"][UNIQ_KEY] for r in got}) == 600
    seq_of = {body: i for body, _k, _t, _p, i in rows}  # bodies differ in length: one per row
    per_key: dict[str, list[int]] = defaultdict(list)
    for r in got:  # in (queue, offset) order
        if r["keys"]:
            assert r["queue_id"] == shard(r["keys"], 4), r["keys"]  # the producer's key routing
            per_key[r["keys"]].append(seq_of[r["body"]])
    assert len(per_key) == 8 and all(seqs == sorted(seqs) for seqs in per_key.values())
    unkeyed = {r["queue_id"] for r in got if not r["keys"]}
    assert unkeyed == {0, 1, 2, 3}  # no key: round robin over every queue


def test_a_topic_read_is_written_to_another_and_reads_back_the_same(spark: Any, cluster: Cluster) -> None:
    create(cluster, src=3, copy=3)
    with BlockingProducer(cluster.ns) as p:
        for i in range(300):
            p.submit("src", b"m%d" % i, keys=f"k{i % 7}", tags="T", properties={"i": str(i)} if i % 2 else None)
        p.flush()
    settle(cluster)
    src = spark.read.format("clmq").options(nameserver=cluster.ns[0], topics="src").load()
    assert len(src.columns) == 13  # every column the source has: the sink ignores those the broker sets
    # option topic overrides the rows' topic column (as Spark's Kafka sink); queue_id keeps each queue
    src.write.format("clmq").mode("append").options(nameserver=cluster.ns[0], topic="copy").save()
    before, after = read_back(spark, cluster, "src"), read_back(spark, cluster, "copy")
    assert len(before) == 300
    # the same messages in the same queues, properties (ids included) as they were
    assert sorted(message(r) for r in after) == sorted(message(r) for r in before)
    assert {r["topic"] for r in after} == {"copy"}


def test_string_bodies_and_the_singular_key_and_tag_columns(spark: Any, cluster: Cluster) -> None:
    create(cluster, words=2)
    df = spark.createDataFrame([(f"wörd {i}", f"k{i}", "T") for i in range(50)], "body string, key string, tag string")
    writer(df, cluster, topic="words", batchMaxBytes="4096", lingerMs="5", timeoutMs="5000").save()
    got = read_back(spark, cluster, "words")
    assert sorted((r["body"].decode(), r["keys"], r["tags"]) for r in got) == sorted(
        (f"wörd {i}", f"k{i}", "T") for i in range(50)
    )
    assert all(r["queue_id"] == shard(r["keys"], 2) for r in got)


def test_the_topic_column_sends_each_row_to_its_topic(spark: Any, cluster: Cluster) -> None:
    create(cluster, left=2, right=2)
    df = spark.createDataFrame(
        [("left" if i % 2 else "right", b"%d" % i) for i in range(40)], "topic string, body binary"
    )
    writer(df, cluster).save()
    assert sorted(int(r["body"]) for r in read_back(spark, cluster, "left")) == list(range(1, 40, 2))
    assert sorted(int(r["body"]) for r in read_back(spark, cluster, "right")) == list(range(0, 40, 2))


# ---------------------------------------------------------------- queue choice
def test_the_queue_id_column_and_the_queue_option_choose_the_queue(spark: Any, cluster: Cluster) -> None:
    create(cluster, q=4)
    # queue_id per row (null: the queue option's); keys do not move a row with a queue
    rows = [(b"%d" % i, f"k{i}", None if i % 5 == 0 else i % 3) for i in range(100)]
    df = spark.createDataFrame(rows, "body binary, keys string, queue_id int").repartition(3)
    writer(df, cluster, topic="q", queue="3").save()
    got = {int(r["body"]): r["queue_id"] for r in read_back(spark, cluster, "q")}
    assert got == {i: 3 if i % 5 == 0 else i % 3 for i in range(100)}


def test_a_queue_the_topic_lacks_fails_naming_it(spark: Any, cluster: Cluster) -> None:
    create(cluster, q=2)
    df = spark.createDataFrame([(b"x", 7)], "body binary, queue_id int")
    with pytest.raises(Exception, match="topic 'q' has no queue 7"):
        writer(df, cluster, topic="q").save()
    with pytest.raises(Exception, match="topic 'q' has no queue 5"):
        writer(df.drop("queue_id"), cluster, topic="q", queue="5").save()


# ------------------------------------------------------------------- failures
def test_an_unknown_topic_fails_naming_it(spark: Any, cluster: Cluster) -> None:
    df = spark.createDataFrame([(b"x",)], "body binary")
    with pytest.raises(Exception, match=r"cannot write to topic 'nope': .*no broker serves topic 'nope'"):
        writer(df, cluster, topic="nope").save()
    with pytest.raises(Exception, match=r"no reachable broker .* has topic 'nope'"):
        df.write.format("clmq").mode("append").options(broker=cluster.brokers["broker-a"].addr, topic="nope").save()


def test_a_message_the_broker_refuses_fails_the_write_with_the_brokers_error(spark: Any, cluster: Cluster) -> None:
    create(cluster, big=1)
    max_bytes = cluster.brokers["broker-a"].config.max_message_bytes
    df = spark.createDataFrame([(b"ok",), (b"x" * (max_bytes + 1),)], "body binary")
    with pytest.raises(Exception, match="MESSAGE_TOO_LARGE"):
        writer(df, cluster, topic="big").save()


def test_a_null_body_fails_naming_the_row(spark: Any, cluster: Cluster) -> None:
    create(cluster, n=1)
    df = spark.createDataFrame([(b"a",), (None,)], "body binary").coalesce(1)
    with pytest.raises(Exception, match=r"row 1 of this task \(topic 'n'\): column body is null"):
        writer(df, cluster, topic="n").save()


GOOD = {"nameserver": "127.0.0.1:9876", "topic": "t"}


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"topic": "t"}, "option nameserver"),
        ({**GOOD, "broker": "127.0.0.1:10911"}, "one of: option nameserver"),
        ({**GOOD, "nameserver": "localhost"}, "option nameserver='localhost': expected host:port"),
        ({"broker": "h:99999", "topic": "t"}, "option broker='h:99999'"),
        ({**GOOD, "topic": " "}, "option topic=''"),
        ({"nameserver": "127.0.0.1:9876"}, "option topic is required"),
        ({**GOOD, "queue": "-1"}, "option queue=-1: must be at least 0"),
        ({**GOOD, "queue": "two"}, "option queue='two': expected a whole number"),
        ({**GOOD, "batchMaxBytes": "0"}, "option batchMaxBytes=0: must be at least 1"),
        ({**GOOD, "lingerMs": "soon"}, "option lingerMs='soon'"),
        ({**GOOD, "timeoutMs": "0"}, "option timeoutMs=0"),
        ({**GOOD, "retryBudgetMs": "-5"}, "option retryBudgetMs=-5"),
        ({**GOOD, "topik": "t", "path": "/x"}, "unknown sink option\\(s\\) path, topik"),
    ],
)
def test_every_wrong_option_is_an_error_naming_it_before_any_task_runs(
    spark: Any, options: dict[str, str], named: str
) -> None:
    # No broker runs at 127.0.0.1:9876: the error comes from creating the writer, not from a task.
    df = spark.createDataFrame([(b"x",)], "body binary")
    with pytest.raises(Exception, match=named):
        df.write.format("clmq").mode("append").options(**options).save()


def test_overwrite_is_refused(spark: Any) -> None:
    df = spark.createDataFrame([(b"x",)], "body binary")
    with pytest.raises(Exception, match=r"only appends .*mode\('overwrite'\)"):
        df.write.format("clmq").mode("overwrite").options(**GOOD).save()


@pytest.mark.parametrize(
    ("schema", "named"),
    [
        ("body int", "column 'body' must be binary or string, not int"),
        ("body binary, keys int", "column 'keys' must be string, not int"),
        ("body binary, key binary", "column 'key' must be string, not binary"),
        ("body binary, tags array<string>", "column 'tags' must be string, not array<string>"),
        (
            "body binary, properties map<string,int>",
            "column 'properties' must be map<string,string>, not map<string,int>",
        ),
        ("body binary, queue_id string", "column 'queue_id' must be int or bigint"),
        ("body binary, topic binary", "column 'topic' must be string, not binary"),
        ("body binary, payload string", "column 'payload' is not one the clmq sink writes"),
        ("body binary, key string, keys string", "columns 'key' and 'keys' both give the message's keys"),
        ("keys string", "needs a column 'body'"),
    ],
)
def test_every_wrong_column_is_an_error_naming_it(spark: Any, schema: str, named: str) -> None:
    df = spark.createDataFrame([], schema)
    with pytest.raises(Exception, match=named):
        df.write.format("clmq").mode("append").options(**GOOD).save()


def test_options_map_onto_the_producers_settings() -> None:
    opts = parse_sink_options(
        {
            "NameServer": "a:1, b:2",
            "topic": "t",
            "queue": "2",
            "batchmaxbytes": "65_536",
            "lingerMs": "10",
            "timeoutMs": "2000",
            "retryBudgetMs": "0",
        }
    )
    assert opts.nameservers == ("a:1", "b:2") and opts.topic == "t" and opts.queue == 2
    assert opts.producer_kwargs() == {
        "batch_max_bytes": 65_536,
        "linger_ms": 10,
        "send_timeout_ms": 2000,
        "retry_budget_ms": 0,
    }
    assert parse_sink_options({"broker": "[::1]:10911", "topic": "t"}).brokers == ("[::1]:10911",)
    assert "topic" in KNOWN and "path" not in KNOWN
    with pytest.raises(OptionError, match="option topic is required"):
        check_columns(StructType([StructField("body", BinaryType())]), parse_sink_options({"broker": "h:1"}))


def test_a_task_counts_what_it_sent(cluster: Cluster) -> None:
    # what Spark runs per task, outside Spark: the commit message counts rows and body bytes
    create(cluster, t=2)
    opts = parse_sink_options({"nameserver": cluster.ns[0], "topic": "t"})
    batches = iter([{"body": [b"abc", b"de"]}, {"body": [b""] * 10}])
    done = send_all(opts, SinkColumns("body", False), batches)
    assert (done.rows, done.body_bytes) == (12, 5)


# ------------------------------------------------------------------ streaming
def test_a_stream_into_the_sink_with_available_now(spark: Any, cluster: Cluster, tmp_path: Path) -> None:
    create(cluster, events=3, mirror=3)

    def produce(start: int, n: int) -> None:
        with BlockingProducer(cluster.ns) as p:
            for i in range(start, start + n):
                p.submit("events", b"e%d" % i, keys=f"k{i % 5}")
            p.flush()
        settle(cluster)

    def run() -> None:
        q = (
            spark.readStream.format("clmq")
            .options(nameserver=cluster.ns[0], topics="events", maxRowsPerTrigger="70")
            .load()
            .writeStream.format("clmq")
            .options(nameserver=cluster.ns[0], topic="mirror")
            .option("checkpointLocation", str(tmp_path / "cp"))
            .trigger(availableNow=True)
            .start()
        )
        q.awaitTermination(120)
        assert q.exception() is None
        assert len([p for p in q.recentProgress if p["numInputRows"]]) >= 2  # several micro-batches

    produce(0, 200)
    run()
    mirrored = lambda: sorted((r["body"], r["keys"], r["queue_id"]) for r in read_back(spark, cluster, "mirror"))  # noqa: E731
    events = lambda: sorted((r["body"], r["keys"], r["queue_id"]) for r in read_back(spark, cluster, "events"))  # noqa: E731
    assert mirrored() == events() and len(events()) == 200
    produce(200, 100)
    run()  # the same query goes on where it stopped: only the new messages are sent
    assert mirrored() == events() and len(events()) == 300

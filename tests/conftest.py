"""Shared fixtures: small segments and queue files so that every test exercises rollover."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any, Iterator

import pytest

from clmq.broker.store import STORAGE_MODES, Store, StoreConfig
from clmq.commitlog import CommitLogConfig
from clmq.common import Message

# A test run started in the background by a shell without job control (`cmd &` in a
# script) has SIGINT ignored, and every clmq process it starts would inherit that (an
# ignored signal stays ignored across exec): the Ctrl-C tests would then see nothing
# happen. A handler of our own is reset to the default in children, so they get
# Ctrl-C as a terminal would give it.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def small_config(
    data_dir: Path,
    *,
    segment_bytes: int = 64 * 1024,
    max_message_bytes: int = 8 * 1024,
    log: dict[str, Any] | None = None,
    mode: str = "commitlog",
    **store: Any,
) -> StoreConfig:
    """A store config with tiny segments (rollover every ~60 records of 1 KiB)."""
    store.setdefault("storage_mode", mode)
    store.setdefault("index_interval_bytes", 1024)
    log_cfg = CommitLogConfig(
        segment_bytes=segment_bytes,
        max_message_bytes=max_message_bytes,
        boundary_interval_bytes=8 * 1024,
        **(log or {}),
    )
    store.setdefault("cq_entries_per_file", 50)
    return StoreConfig(data_dir, log_cfg, **store)


@pytest.fixture(params=STORAGE_MODES)
def mode(request: pytest.FixtureRequest) -> str:
    """Contract tests run once per storage mode."""
    return request.param


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture
def store(store_dir: Path, mode: str) -> Iterator[Store]:
    s = Store.open(small_config(store_dir, mode=mode)).start()
    s.create_topic("orders", 4)
    yield s
    s.close()


def msgs(topic: str, n: int, queues: int, size: int = 100, start: int = 0) -> list[Message]:
    """``n`` messages spread round-robin over ``queues``; bodies name their index."""
    return [
        Message(topic, (start + i) % queues, (b"%08d" % (start + i)).ljust(size, b"."), tags=f"T{(start + i) % 3}")
        for i in range(n)
    ]


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """One local SparkSession for the whole test run (starting one costs seconds), with
    the clmq data source registered and Python workers running this interpreter."""
    import os
    import sys

    os.environ["PYSPARK_PYTHON"] = sys.executable

    from pyspark.sql import SparkSession

    import clmq.spark_connector as spark_connector
    from tests.java_deps import spark_kafka_jars_if_any

    builder = (
        SparkSession.builder.master("local[2]")
        .appName("clmq tests")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
    )
    # Spark's own Kafka source, for test_kafka_spark.py (none if its jars cannot be had:
    # that test then fails or skips by itself, the others run as before).
    kafka_jars = spark_kafka_jars_if_any()
    if kafka_jars:
        builder = builder.config("spark.jars", ",".join(kafka_jars))
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    spark_connector.register(session)
    yield session
    session.stop()


# ZooKeeper fixtures (tests/zk.py): a session server, a chroot per test, a restartable server.
from tests.zk import zk_connect, zk_restartable, zk_server  # noqa: E402, F401

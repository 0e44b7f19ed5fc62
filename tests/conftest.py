"""Shared fixtures: small segments and queue files so that every test exercises rollover."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any, Iterator

import hypothesis
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


@pytest.fixture(scope="module", params=["compiled", "python"])
def each_decoder(request: pytest.FixtureRequest) -> Iterator[str]:
    """The tests of a module that uses it run with the compiled record decoder
    (common/_cdecode.c) and again with the pure-Python one, its fallback. Module-scoped
    (Hypothesis tests may use it) and set for the whole process: in-process brokers and
    consumers decode through it too."""
    from clmq.common import _many

    was = _many.COMPILED
    if request.param == "compiled" and was is None:
        pytest.skip("the compiled decoder was not built here (no C compiler at install)")
    _many.COMPILED = was if request.param == "compiled" else None
    try:
        yield request.param
    finally:
        _many.COMPILED = was


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


# Hypothesis' per-example deadline (200 ms) and its too-slow health check time the tests:
# on a loaded machine, with 4 workers on 2 cores, they fail tests that behave. Timing
# is judged by `clmq bench`, never by tests: neither is used.
hypothesis.settings.register_profile("clmq", deadline=None, suppress_health_check=[hypothesis.HealthCheck.too_slow])
hypothesis.settings.load_profile("clmq")

# Under pytest-xdist (scripts/run-tests.sh runs 4 workers, --dist loadgroup): each test
# is a unit of work of its own, handed to whichever worker is free, unless it is in an
# xdist_group (all of a group run on one worker, in order; the biggest groups first).
# - The tests that use the SparkSession share a worker: two groups of about 200 s each
#   on a loaded machine (one alone was about 400 s, a tail), so two JVMs of Spark, not
#   one per worker. A module's other tests that share a module fixture join its group.
# - The tests of a module that use one of its module-scoped fixtures (a `clmq dev`, a
#   cluster, a benchmark's run, a wheel, a pristine store) share a worker too: spread
#   over the workers, interleaved with other modules' tests, a module fixture was set up
#   again each time a worker came back to its module (pytest tears it down whenever the
#   next test is another module's), up to once per test.
#   A group's tests run in the order of their file, as without xdist (a test that stops
#   the module's `clmq dev` comes last there). Not for the fixtures in SPREAD_FIXTURES,
#   cheap to set up again, whose modules' long tests gain more from running side by side.
# - The long tests are handed out first, so that no worker is left with one at the end
#   (the groups go first anyway: xdist hands out the biggest first).
LONG_FIRST_MARKERS = ("slow",)
SHARED_SCOPES = ("module", "class", "package")
SPREAD_FIXTURES = frozenset({"harness"})  # the Kafka Java harness: compiled once, cached on disk
# The second Spark group's modules (the others' Spark tests are the first group, "spark").
SPARK_2_MODULES = frozenset({"test_spark_sink", "test_spark_export", "test_spark_options"})


def uses_spark(item: pytest.Item) -> bool:
    """Whether ``item`` uses the SparkSession."""
    return "spark" in getattr(item, "fixturenames", ())


def xdist_group_of(item: pytest.Item, spark_modules: set[str]) -> str | None:
    """The xdist_group ``item`` joins: its module's Spark group if it uses Spark, or a
    module fixture of a module in ``spark_modules``; its module's name when it uses a
    fixture set up once per module (or class); else None."""
    module = item.path.stem
    spark_group = "spark-2" if module in SPARK_2_MODULES else "spark"
    if uses_spark(item):
        return spark_group
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.items() if info is not None else ()
    if any(d and d[-1].scope in SHARED_SCOPES and name not in SPREAD_FIXTURES for name, d in defs):
        return spark_group if module in spark_modules else module
    return None


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Only in an xdist worker of a --dist loadgroup run: there the controller's -n is None, and
    # in one process (-n 0, -p no:xdist) there is nothing to share out (nor an xdist_group marker).
    if not getattr(config.option, "loadgroup", False):
        return
    grouped = set()
    spark_modules = {item.path.stem for item in items if uses_spark(item)}
    for item in items:
        group = xdist_group_of(item, spark_modules)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
            grouped.add(item.nodeid)
    # A stable sort: each group keeps its order.
    items.sort(
        key=lambda item: item.nodeid not in grouped and not any(item.get_closest_marker(m) for m in LONG_FIRST_MARKERS)
    )


class XdistGroupIds:
    """Keeps each xdist_group together under pytest 9. pytest-xdist (3.8) tells its
    scheduler a test's group by renaming the test ``<id>@<group>`` through
    ``item._nodeid``, which pytest 9 no longer reads (a node's id is ``item._id``): every
    test was then a unit of its own, the Spark tests' group included (a SparkSession on
    each worker). Run after xdist's hook, this renames the tests it could not."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        if not getattr(config.option, "loadgroup", False):
            return
        for item in items:
            names = {
                str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")
            }
            suffix = "@" + "_".join(sorted(names))
            node_id = getattr(item, "_id", None)
            if names and not item.nodeid.endswith(suffix) and hasattr(node_id, "parse"):
                item._id = type(node_id).parse(item.nodeid + suffix)


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(XdistGroupIds(), "clmq-xdist-group-ids")
    # The SparkSession of the tests (and of commands run with this environment) starts its
    # JVM with the tests' options (tests/jvm.py); a PYSPARK_SUBMIT_ARGS of the caller wins.
    import os

    from tests.jvm import PYSPARK_SUBMIT_ARGS

    os.environ.setdefault("PYSPARK_SUBMIT_ARGS", PYSPARK_SUBMIT_ARGS)


# ZooKeeper fixtures (tests/zk.py): a session server, a chroot per test, a restartable server.
from tests.zk import zk_connect, zk_restartable, zk_server  # noqa: E402, F401

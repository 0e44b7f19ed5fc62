"""``clmq export``'s consistent snapshots: the manifest, incremental exports that add up
to one full export (no gap, no duplicate, also while messages keep arriving), the
manifest's errors on the command line, and the progress bar. Real stores, a real local
SparkSession, real brokers."""

from __future__ import annotations

import base64
import json
import os
import pty
import re
import subprocess
import sys
import threading
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator

import pytest

from clmq.broker.store import Store
from clmq.client import BlockingAdmin, BlockingProducer
from clmq.common import Message
from clmq.spark_connector import export
from clmq.spark_connector._export import rate_text, rows_done
from clmq.spark_connector._manifest import (
    MANIFEST_NAME,
    ManifestError,
    check_manifest,
    read_manifest,
    resolve_snapshot,
    write_manifest,
)
from tests.cli_helpers import ENV, ROOT, clmq
from tests.conftest import msgs, small_config
from tests.service_helpers import cluster_in_thread
from tests.waiting import wait_until

Row = tuple[str, int, int, int, bytes]  # topic, queue id, queue offset, commit-log offset, body


def open_store(path: Path) -> Store:
    """A store with tiny segments (retention can take some) and two topics."""
    store = Store.open(small_config(path)).start()
    store.create_topic("orders", 4)
    store.create_topic("audit", 2)
    return store


def append(
    store: Store, n: int, start: int, topics: tuple[tuple[str, int], ...] = (("orders", 4), ("audit", 2))
) -> None:
    """``n`` messages per topic, spread over ``queues`` of it, made visible to a reader."""
    for topic, queues in topics:
        assert store.put_batch(msgs(topic, n, queues, size=60, start=start)).ok
    visible(store)


def visible(store: Store) -> None:
    """What was appended, made visible to a reader of the directory (checkpointed)."""
    store.catch_up()
    store.flush()  # the local reader sees what the checkpoint calls durable
    store.checkpoint()


def max_offsets(store: Store) -> dict[str, dict[int, int]]:
    return {t: {q: store.max_offset(t, q) for q in range(n)} for t, n in store.topics.all().items()}


def read_rows(spark: Any, *dirs: Path) -> list[Row]:
    """Every row of the Parquet outputs, sorted (duplicates kept: a test counts them)."""
    rows: list[Row] = []
    for d in dirs:
        df = spark.read.parquet(str(d)).select("topic", "queue_id", "queue_offset", "commitlog_offset", "body")
        rows += [(r[0], r[1], r[2], r[3], bytes(r[4])) for r in df.collect()]
    return sorted(rows)


def store_rows(store: Store, topic: str) -> list[Row]:
    """The topic's records as the store's own reader returns them."""
    out: list[Row] = []
    for q in range(store.topics.all()[topic]):
        offset = store.min_offset(topic, q)
        while got := store.get(topic, q, offset, 500).messages:
            out += [(r.topic, r.queue_id, r.queue_offset, r.commitlog_offset, r.body) for r in got]
            offset = got[-1].queue_offset + 1
    return sorted(out)


def ends(manifest: dict[str, Any]) -> dict[str, dict[int, int]]:
    return {t: {int(q): r["end"] for q, r in per.items()} for t, per in manifest["queues"].items()}


# ------------------------------------------------------------------- incremental rounds
def test_three_incremental_rounds_equal_one_full_export(spark: Any, tmp_path: Path) -> None:
    store = open_store(tmp_path / "store")
    src, out = {"path": str(tmp_path / "store")}, tmp_path / "out"
    append(store, 400, 0)
    first = export(spark, src, "parquet", str(out))
    assert first.rows == 800 and first.manifest_path == str(out / MANIFEST_NAME)
    append(store, 300, 400)
    store.create_topic("later", 2)  # a topic created after round 1 ...
    store.create_topic("audit", 3)  # ... and a queue added to a topic round 1 exported
    append(store, 50, 0, (("later", 2),))
    assert store.put_batch([Message("audit", 2, b"new queue %d" % i) for i in range(7)]).ok
    visible(store)
    second = export(spark, src, "parquet", str(out), "append", since_manifest=str(out))
    assert second.rows == 600 + 50 + 7
    queues = second.manifest["queues"] if second.manifest else {}
    assert queues["later"]["0"] == {"start": 0, "end": 25} and queues["audit"]["2"] == {"start": 0, "end": 7}
    assert queues["orders"]["0"] == {"start": 100, "end": 175}
    append(store, 200, 700)
    third = export(spark, src, "parquet", str(out), "append", since_manifest=str(out / MANIFEST_NAME))
    assert third.rows == 400 and third.manifest is not None and third.manifest["since"] == str(out / MANIFEST_NAME)
    assert ends(third.manifest) == max_offsets(store)
    full = export(spark, src, "parquet", str(tmp_path / "full"))
    rounds = read_rows(spark, out)  # the three rounds appended into one directory (the manifest is skipped)
    assert rounds == read_rows(spark, tmp_path / "full") and len(set(rounds)) == len(rounds) == full.rows
    assert rounds == sorted(store_rows(store, "orders") + store_rows(store, "audit") + store_rows(store, "later"))
    store.close()


def test_messages_appended_after_the_snapshot_are_in_the_next_round(spark: Any, tmp_path: Path) -> None:
    store = open_store(tmp_path / "store")
    src = {"path": str(tmp_path / "store")}
    append(store, 300, 0)
    at_start = max_offsets(store)
    snapshot = resolve_snapshot(src)  # the export's start ...
    append(store, 200, 300)  # ... then messages arrive before Spark plans and while it reads
    assert spark.read.format("clmq").load(src["path"]).count() == 1000  # a plain read now would see them
    first = export(spark, src, "parquet", str(tmp_path / "r1"), snapshot=snapshot)
    assert first.rows == 600 and first.manifest is not None
    assert ends(first.manifest) == at_start
    assert all(r["start"] == 0 for per in first.manifest["queues"].values() for r in per.values())
    assert max(r[2] for r in read_rows(spark, tmp_path / "r1") if (r[0], r[1]) == ("orders", 0)) == 74
    second = export(spark, src, "parquet", str(tmp_path / "r2"), since_manifest=str(tmp_path / "r1"))
    assert second.rows == 400
    assert {r[2] for r in read_rows(spark, tmp_path / "r2") if r[:2] == ("orders", 0)} == set(range(75, 125))
    both = read_rows(spark, tmp_path / "r1", tmp_path / "r2")
    assert both == sorted(store_rows(store, "orders") + store_rows(store, "audit"))
    idle = export(spark, src, "parquet", str(tmp_path / "r3"), since_manifest=str(tmp_path / "r2"))
    assert idle.rows == 0 and read_rows(spark, tmp_path / "r3") == [] and idle.manifest is not None
    assert all(r["start"] == r["end"] for per in idle.manifest["queues"].values() for r in per.values())
    assert second.manifest is not None and ends(idle.manifest) == ends(second.manifest)
    store.close()


def test_rounds_while_a_writer_keeps_appending_have_no_gap_and_no_duplicate(spark: Any, tmp_path: Path) -> None:
    store = open_store(tmp_path / "store")
    src = {"path": str(tmp_path / "store")}
    append(store, 100, 0)
    stop, written = threading.Event(), [0]

    def writer() -> None:  # a batch per checkpoint of the store's own housekeeping (every second)
        while not stop.is_set():
            for topic, queues in (("orders", 4), ("audit", 2)):
                assert store.put_batch(msgs(topic, 20, queues, size=60, start=100 + written[0])).ok
            store.catch_up()
            store.flush()
            wait_until(lambda: checkpointed(tmp_path / "store") >= store.end_offset, 30, "the store's checkpoint")
            written[0] += 20

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        prev: str | None = None
        for i in range(4):
            before = written[0]
            wait_until(
                lambda before=before: written[0] > before, 30, "the writer to append more"
            )  # the rounds race real appends
            export(spark, src, "parquet", str(tmp_path / f"r{i}"), since_manifest=prev)
            prev = str(tmp_path / f"r{i}")
    finally:
        stop.set()
        thread.join(60)
    last = read_manifest(str(prev))
    exported = read_rows(spark, *(tmp_path / f"r{i}" for i in range(4)))
    expected = [r for r in store_rows(store, "orders") + store_rows(store, "audit") if r[2] < ends(last)[r[0]][r[1]]]
    assert exported == sorted(expected) and len(set(exported)) == len(exported)
    store.close()


def checkpointed(store_dir: Path) -> int:
    """How far the store's checkpoint file says the log is durable (-1: being replaced)."""
    try:
        return int(json.loads((store_dir / "checkpoint").read_bytes())["log_durable"])
    except (OSError, ValueError, KeyError):
        return -1


def test_the_manifest_sits_beside_parquet_json_and_csv_which_read_back_without_it(spark: Any, tmp_path: Path) -> None:
    store = open_store(tmp_path / "store")
    append(store, 40, 0)
    store.close()
    for fmt in ("parquet", "json", "csv"):
        out = tmp_path / fmt
        summary = export(spark, {"path": str(tmp_path / "store")}, fmt, str(out))
        assert (out / MANIFEST_NAME).is_file() and summary.rows == 80
        back = spark.read.format(fmt).option("header", "true").load(str(out))  # Spark skips files named "_..."
        assert back.count() == 80 and "queue_offset" in back.columns, fmt
    bodies = spark.read.option("header", "true").csv(str(tmp_path / "csv")).select("body").collect()
    assert sorted(base64.b64decode(r[0], validate=True) for r in bodies) == sorted(  # one line each, no MIME breaks
        m.body for t, q in (("orders", 4), ("audit", 2)) for m in msgs(t, 40, q, size=60)
    )
    doc = json.loads((tmp_path / "csv" / MANIFEST_NAME).read_text())
    assert doc["kind"] == "clmq-export-manifest" and doc["version"] == 1 and doc["rows"] == 80
    assert doc["source"] == {"data_dir": str((tmp_path / "store").resolve())} and doc["topics"] == ["audit", "orders"]
    assert doc["queues"]["audit"] == {"0": {"start": 0, "end": 20}, "1": {"start": 0, "end": 20}}
    assert datetime.fromisoformat(doc["created"]).tzinfo is not None and doc["since"] is None


def test_a_remote_output_path_gets_its_manifest_through_hadoop(spark: Any, tmp_path: Path) -> None:
    store = open_store(tmp_path / "store")
    src = {"path": str(tmp_path / "store")}
    append(store, 30, 0)
    url = (tmp_path / "out").as_uri()  # file:///...: written and read through Hadoop's FileSystem
    first = export(spark, src, "parquet", url)
    assert first.manifest_path == url + "/" + MANIFEST_NAME
    assert json.loads((tmp_path / "out" / MANIFEST_NAME).read_text())["rows"] == 60
    append(store, 5, 30)
    second = export(spark, src, "parquet", (tmp_path / "next").as_uri(), since_manifest=url)
    assert second.rows == 10
    with pytest.raises(ManifestError, match="read through Spark"):
        read_manifest(url)  # without a session
    with pytest.raises(ManifestError, match="no such file"):
        read_manifest((tmp_path / "none").as_uri(), spark)
    store.close()


# ------------------------------------------------------------------------ manifest errors
def a_manifest(tmp_path: Path, store_dir: Path) -> Path:
    """A real manifest of ``store_dir`` as it is now (written without Spark)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    return Path(write_manifest(resolve_snapshot({"path": str(store_dir)}).manifest(0), str(tmp_path)))


def one_error_line(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    return lines[0]


def test_since_manifest_errors_on_the_command_line(tmp_path: Path) -> None:
    a, b = open_store(tmp_path / "a"), open_store(tmp_path / "b")
    append(a, 10, 0)
    append(b, 10, 0)
    a.close()
    b.close()
    of_a = a_manifest(tmp_path / "ma", tmp_path / "a")
    (tmp_path / "bad.json").write_text('{"kind": "clmq-export-manifest", ')
    base = ("export", "--data-dir", str(tmp_path / "b"), "--output", str(tmp_path / "o"))
    line = one_error_line(clmq(*base, "--since-manifest", str(tmp_path / "missing.json"), cwd=tmp_path))
    assert "missing.json" in line and "cannot read it" in line
    line = one_error_line(clmq(*base, "--since-manifest", str(tmp_path / "bad.json"), cwd=tmp_path))
    assert "bad.json: not valid JSON" in line
    line = one_error_line(clmq(*base, "--since-manifest", str(tmp_path / "ma"), cwd=tmp_path))
    assert f"it is of data directory {(tmp_path / 'a').resolve()}" in line
    assert f"this export reads data directory {(tmp_path / 'b').resolve()}" in line
    line = one_error_line(clmq(*base, "--since-manifest", str(of_a), "--from-offsets", "earliest", cwd=tmp_path))
    assert "leave out --from-offsets" in line
    assert not (tmp_path / "o").exists()


def test_a_manifest_behind_retention_or_past_the_queues_is_refused(tmp_path: Path) -> None:
    store = open_store(tmp_path / "store")
    append(store, 400, 0)
    early = resolve_snapshot({"path": str(tmp_path / "store"), "endingOffsets": '{"orders": {"0": 5}}'})
    path = write_manifest(early.manifest(0), str(tmp_path))
    assert read_manifest(path)["queues"]["orders"]["0"] == {"start": 0, "end": 5}
    assert store.apply_retention(now=4e9) > 0  # every segment but the active one is gone
    store.checkpoint()
    qmin = store.min_offset("orders", 0)
    assert qmin > 5
    with pytest.raises(
        ManifestError, match=rf"queue orders/0 continues at offset 5, .* offsets 5\.\.{qmin - 1} are lost"
    ):
        resolve_snapshot({"path": str(tmp_path / "store")}, path)
    doc = json.loads(Path(path).read_text())
    doc["queues"]["orders"]["0"] = {"start": 0, "end": 10_000}
    Path(path).write_text(json.dumps(doc))
    with pytest.raises(ManifestError, match="queue orders/0 ended at offset 10000, but the queue now ends at 100"):
        resolve_snapshot({"path": str(tmp_path / "store"), "topics": "orders"}, path)
    store.close()


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[]", "not a clmq export manifest"),
        ('{"kind": "clmq-export-manifest", "version": 9}', "manifest version 9"),
        ('{"kind": "clmq-export-manifest", "version": 1, "source": {"x": 1}}', '"source" must be'),
        (
            '{"kind": "clmq-export-manifest", "version": 1, "source": {"broker": "h:1"}, "queues": {"t": {"0": 3}}}',
            '"queues" must be',
        ),
        (
            '{"kind": "clmq-export-manifest", "version": 1, "source": {"broker": "h:1"}, '
            '"queues": {"t": {"0": {"start": 9, "end": 3}}}}',
            "queue t/0 has start 9 > end 3",
        ),
    ],
)
def test_malformed_manifests_are_named(text: str, says: str) -> None:
    with pytest.raises(ManifestError, match=says):
        check_manifest(text.encode(), "m.json")


# ---------------------------------------------------------------------------- brokers
@pytest.fixture
def two_brokers(tmp_path: Path) -> Iterator[list[str]]:
    with cluster_in_thread(tmp_path / "a") as one, cluster_in_thread(tmp_path / "b") as two:
        yield [one.brokers["broker-a"].addr, two.brokers["broker-a"].addr]


def test_several_brokers_export_without_a_manifest_and_refuse_since_manifest(
    spark: Any, tmp_path: Path, two_brokers: list[str]
) -> None:
    store = open_store(tmp_path / "store")
    append(store, 5, 0)
    store.close()
    manifest = a_manifest(tmp_path / "m", tmp_path / "store")
    both = ",".join(two_brokers)
    line = one_error_line(
        clmq(
            "export", "--broker", both, "--output", str(tmp_path / "o"), "--since-manifest", str(manifest), cwd=tmp_path
        )
    )
    assert (
        f"needs one store, but --broker names 2 brokers ({', '.join(two_brokers)})" in line
        and "--broker host:port" in line
    )
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / MANIFEST_NAME).write_text("{}")  # left by an earlier export of one broker
    summary = export(spark, {"broker": both}, "parquet", str(tmp_path / "o"), "append")
    assert summary.manifest is None and summary.manifest_path is None
    assert not (tmp_path / "o" / MANIFEST_NAME).exists()  # it no longer describes the directory


def test_one_broker_over_the_network_exports_incrementally(spark: Any, tmp_path: Path) -> None:
    with cluster_in_thread(tmp_path) as c:
        with BlockingAdmin(c.ns) as admin:
            admin.create_topic("net", 3)
        broker = c.brokers["broker-a"]
        with BlockingProducer(c.ns) as p:
            for i in range(10):
                p.send_batch("net", [b"a%d-%d" % (i, j) for j in range(30)])
            first = export(spark, {"nameserver": c.ns[0], "topics": "net"}, "parquet", str(tmp_path / "r1"))
            for i in range(10):
                p.send_batch("net", [b"b%d-%d" % (i, j) for j in range(30)])
        store = broker.store
        wait_until(lambda: sum(store.max_offset("net", q) for q in range(3)) == 600, 10, "every message dispatched")
        second = export(
            spark,
            {"broker": broker.addr, "topics": "net"},
            "parquet",
            str(tmp_path / "r2"),
            since_manifest=str(tmp_path / "r1"),
        )
        assert first.manifest is not None and first.manifest["source"] == {"broker": broker.addr}
        assert first.rows + second.rows == 600
        assert read_rows(spark, tmp_path / "r1", tmp_path / "r2") == store_rows(store, "net")


# ----------------------------------------------------------------------------- progress
def test_rows_done_is_exact_when_spark_counts_and_estimated_otherwise() -> None:
    assert rows_done(1000, 3, 4, 812) == 812  # the finished tasks' own count
    assert rows_done(1000, 3, 4, None) == 750  # the tasks' share of the planned rows
    assert rows_done(1000, 0, 0, None) == 0 and rows_done(1000, 5, 4, None) == 1000
    assert rows_done(1000, 4, 4, 1200) == 1000  # never past the bar's end before the last update
    assert rate_text(None, 0, 1.0) == "- rows/s"
    assert rate_text(None, 5000, 2.0) == "2,500 rows/s"  # one step: the average since the start
    assert rate_text(12345.6, 5000, 2.0) == "12,346 rows/s"


def test_the_progress_bar_shows_rows_rate_and_eta(spark: Any, tmp_path: Path) -> None:
    from rich.console import Console

    store = open_store(tmp_path / "store")
    append(store, 500, 0)
    store.close()
    console = Console(record=True, force_terminal=True, width=150)
    summary = export(
        spark,
        {"path": str(tmp_path / "store"), "minPartitions": "4"},
        "parquet",
        str(tmp_path / "o"),
        progress=True,
        console=console,
    )
    text = console.export_text()
    last = text.rsplit("exporting", 1)[1]  # the recording holds every refresh: the final one
    assert summary.rows == 1000 and "exporting" in text and "1,000/1,000 rows" in last, text[-500:]
    assert " rows/s" in last and "- rows/s" not in last and "ETA" in last, last


@pytest.mark.slow
def test_the_command_shows_progress_on_a_terminal_only_and_names_the_manifest(tmp_path: Path) -> None:
    store = open_store(tmp_path / "store")
    append(store, 100, 0)
    base = ("export", "--data-dir", str(tmp_path / "store"), "--master", "local[2]")
    piped = clmq(*base, "--output", str(tmp_path / "r1"), cwd=tmp_path, timeout_s=300)
    assert piped.returncode == 0, piped.stderr[-3000:]
    assert "exporting" not in piped.stdout  # not a terminal: no bar
    assert "exported 200 rows" in piped.stdout and f"manifest {tmp_path / 'r1' / MANIFEST_NAME}" in piped.stdout
    append(store, 10, 100)
    store.close()
    shown = run_on_a_terminal([*base, "--output", str(tmp_path / "r2"), "--since-manifest", str(tmp_path / "r1")])
    assert "exporting" in shown and "20/20 rows" in shown and "rows/s" in shown and "ETA" in shown, shown[-2000:]
    assert "exported 20 rows" in shown and f"manifest {tmp_path / 'r2' / MANIFEST_NAME}" in shown.replace("\r\n", "")


def run_on_a_terminal(args: list[str]) -> str:
    """``clmq args`` with stdout on a pseudo-terminal; what it printed there, as text."""
    main, sub = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "clmq", *args],
        cwd=ROOT,
        stdout=sub,
        stderr=subprocess.DEVNULL,
        env={**ENV, "TERM": "xterm"},
    )
    os.close(sub)
    out = bytearray()
    while True:
        try:
            chunk = os.read(main, 1 << 16)
        except OSError:  # EIO: the process closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(main)
    assert proc.wait(300) == 0, out[-3000:]
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.decode("utf-8", "replace"))  # without colours and cursor moves

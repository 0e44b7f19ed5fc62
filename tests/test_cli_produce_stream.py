"""``clmq produce`` reading stdin as a stream: a real subprocess whose stdin is a pipe,
against a real name server and broker (run by trio in a thread of this process)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from clmq.client import BlockingAdmin, BlockingConsumer, Record, shard
from tests.service_helpers import FAST_CONSUMER, Cluster, cluster_in_thread
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A name server and a broker (max message 256 KiB) with topic "sync" (2 queues)."""
    with cluster_in_thread(tmp_path) as c:
        yield c


def produce(ns: list[str], *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "clmq", "produce", *args, "--namesrv", ",".join(ns)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
    )


def stored(ns: list[str], topic: str = "sync") -> int:
    with BlockingAdmin(ns) as admin:
        return sum(q["max_offset"] for q in admin.describe_topic(topic))


def read_back(ns: list[str], count: int) -> list[Record]:
    got: list[Record] = []
    with BlockingConsumer(ns, "stream", {"sync": "*"}, **FAST_CONSUMER) as c:
        for _ in range(300):
            got += c.poll(0.1)
            if len(got) >= count:
                break
    return got


def test_lines_are_sent_as_they_arrive_then_every_line_once_in_order(cluster: Cluster) -> None:
    proc = produce(cluster.ns, "sync", "--sharding-key", "user-7")
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(b"first\n")
        proc.stdin.flush()
        # stdin still open: the line is stored and reported now, not at EOF
        line = proc.stdout.readline()
        assert line.startswith(b"broker-a queue %d offset 0 id " % shard("user-7", 2)), line
        assert wait_until(lambda: stored(cluster.ns) == 1, 10, "the first line stored before stdin closes")
        bodies = [b"line %d \x00\xff binary" % i for i in range(2000)]
        proc.stdin.write(b"".join(b + b"\n" for b in bodies) + b"last, without a newline")
        proc.stdin.close()
        out = line + proc.stdout.read()
        assert proc.wait(60) == 0, proc.stderr.read() if proc.stderr else b""
    finally:
        proc.kill()
        proc.wait()
    expected = [b"first", *bodies, b"last, without a newline"]
    results = out.splitlines()
    assert len(results) == len(expected)
    assert [int(r.split()[4]) for r in results] == list(range(len(expected)))  # offsets, in input order
    got = read_back(cluster.ns, len(expected))
    assert [r.body for r in sorted(got, key=lambda r: r.queue_offset)] == expected  # every line once, in order
    assert {r.queue_id for r in got} == {shard("user-7", 2)}


def test_a_failed_message_is_reported_and_the_exit_status_is_1(cluster: Cluster) -> None:
    """A message the broker refuses (over its 256 KiB max) and a line over
    --max-line-bytes: each named on stderr with its reason; the others are stored."""
    proc = produce(cluster.ns, "sync", "--max-line-bytes", str(512 * 1024))
    big, huge = b"x" * (300 * 1024), b"y" * (600 * 1024)
    out, err = proc.communicate(b"ok 1\n" + big + b"\nok 2\n" + huge + b"\nok 3\n", timeout=60)
    assert proc.returncode == 1
    assert out.count(b" offset ") == 3, out
    assert b"error: message 2: " in err and b"MESSAGE_TOO_LARGE" in err, err
    assert b"error: message 4: line longer than --max-line-bytes 524,288" in err, err
    assert b"error: 2 of 5 messages not stored" in err, err
    assert stored(cluster.ns) == 3


@pytest.mark.parametrize("case", ["unknown topic", "no name server"])
def test_an_unreachable_topic_fails_with_a_clear_message(cluster: Cluster, case: str) -> None:
    ns = cluster.ns if case == "unknown topic" else ["127.0.0.1:1"]
    proc = produce(ns, "nope" if case == "unknown topic" else "sync", "--retry-budget-ms", "500")
    out, err = proc.communicate(b"a\nb\n", timeout=60)
    text = (out + err).decode()
    assert proc.returncode == 1, text
    assert ("no broker serves topic 'nope'" if case == "unknown topic" else "127.0.0.1:1") in text, text


def test_a_partition_per_file_broker_s_messages_are_reported_without_an_id(tmp_path: Path) -> None:
    """Partition-per-file brokers store no CommitLog offsets, so their messages have no
    message id: each line is still reported (with "-"), in text and in JSON lines."""
    with cluster_in_thread(tmp_path, storage_mode="partition-per-file") as c:
        for extra, want in (((), " id -"), (("-o", "json"), '"msg_id": null')):
            proc = produce(c.ns, "sync", *extra)
            out, err = proc.communicate(b"one\ntwo\n", timeout=60)
            assert proc.returncode == 0, err.decode()
            lines = out.decode().splitlines()
            assert len(lines) == 2 and all(want in line for line in lines), lines
        assert stored(c.ns) == 4

"""The command line, run for real as a subprocess (tiny parameters: these check that the
commands work and report what they should, not how fast anything is)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from clmq.client import ConnectionFailed, NoRouteError, Routes, open_admin
from tests.ports import free_port
from tests.waiting import wait_until


def clmq(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "clmq", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env={"COLUMNS": "200", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )


def test_demo_appends_restarts_and_reads_back(tmp_path: Path) -> None:
    out = clmq("demo", "--data-dir", str(tmp_path / "d"), "--messages", "3000", "--queues", "4", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "appended 3,000 messages over 4 queues" in out.stdout
    assert "3,000 new messages read back" in out.stdout and "hello 2999" in out.stdout
    again = clmq("demo", "--data-dir", str(tmp_path / "d"), "--messages", "1000", "--queues", "4", cwd=tmp_path)
    assert "4,000 in the store" in again.stdout  # the data survived the first process


def test_help_on_every_command(tmp_path: Path) -> None:
    commands = [
        [],
        ["demo"],
        ["bench", "store"],
        ["bench", "compare"],
        ["bench", "e2e"],
        ["dev"],
        ["nameserver"],
        ["broker"],
        ["topic"],
        ["topic", "create"],
        ["topic", "list"],
        ["topic", "describe"],
        ["topic", "delete"],
        ["produce"],
        ["consume"],
        ["group"],
        ["group", "list"],
        ["group", "describe"],
        ["export"],
        ["bench", "spark"],
        ["cluster"],
        ["cluster", "list"],
        ["admin"],
        ["admin", "promote"],
        ["broker", "status"],
        ["dashboard"],
        ["message"],
        ["message", "read"],
        ["message", "get"],
        ["message", "find"],
        ["group", "members"],
        ["group", "delete"],
        ["group", "reset-offsets"],
        ["topic", "update"],
        ["store"],
        ["bench", "request-cost"],
        ["bench", "cold-reader"],
    ]
    for args in ([*c, "--help"] for c in commands):
        out = clmq(*args, cwd=tmp_path)
        assert out.returncode == 0 and "usage: clmq" in out.stdout


@pytest.mark.slow
def test_bench_store_reports_every_measurement(tmp_path: Path) -> None:
    out = clmq(
        "bench",
        "store",
        "--dir",
        str(tmp_path / "b"),
        "--sizes",
        "100",
        "--queues",
        "1,50",
        "--flush",
        "async",
        "--seconds",
        "0.2",
        "--runs",
        "1",
        "--rebuild-messages",
        "5000",
        "--scale-queues",
        "2000",
        "--json",
        str(tmp_path / "s.json"),
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads((tmp_path / "s.json").read_text())
    assert [(r["size"], r["queues"]) for r in result["append"]] == [(100, 1), (100, 50)]
    assert all(r["msgs_per_s"] > 0 for r in result["append"])
    assert result["rebuild"]["messages"] == 5000 and result["scale"]["messages"] == 6000
    assert "re-dispatch" in out.stdout and "read-back" in out.stdout


@pytest.mark.slow
def test_bench_e2e_reports_produce_consume_and_latency(tmp_path: Path) -> None:
    out = clmq(
        "bench",
        "e2e",
        "--api",
        "raw",
        "--sparse-total",
        "0",
        "--sizes",
        "100",
        "--queues",
        "1,20",
        "--flush",
        "async",
        "--seconds",
        "0.3",
        "--runs",
        "1",
        "--latency-rate",
        "1000",
        "--settle-seconds",
        "0",
        "--json",
        str(tmp_path / "e.json"),
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads((tmp_path / "e.json").read_text())
    assert [(r["size"], r["queues"], r["flush"]) for r in result["rows"]] == [(100, 1, "async"), (100, 20, "async")]
    for r in result["rows"]:  # every message produced was consumed back (the consumer stops when it has them all)
        assert r["messages"] > 0 and r["produce_msgs_per_s"] > 0 and r["consume_fetch_msgs_per_s"] > 0
        assert 0 < r["consumer_start_s"] < 30 and r["consume_msgs_per_s"] > 0
    raw = result["latency"]["raw"]
    assert raw["sends"] == 300 and 0 < raw["p50_ms"] <= raw["p99_ms"]
    assert "first batch after" in out.stdout and "p99" in out.stdout


@pytest.mark.slow
def test_bench_compare_runs_both_modes_and_draws_the_plot(tmp_path: Path) -> None:
    out = clmq(
        "bench",
        "compare",
        "--dir",
        str(tmp_path / "b"),
        "--sizes",
        "100",
        "--queues",
        "1,20",
        "--flush",
        "async",
        "--seconds",
        "0.2",
        "--runs",
        "1",
        "--json",
        str(tmp_path / "c.json"),
        "--plot",
        str(tmp_path / "c.png"),
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    rows = json.loads((tmp_path / "c.json").read_text())["rows"]
    assert {(r["queues"], r["pattern"]) for r in rows} == {
        (1, "round-robin"),
        (20, "round-robin"),
        (1, "skewed"),
        (20, "skewed"),
    }
    for r in rows:
        assert r["ratio"] == pytest.approx(r["commitlog"]["msgs_per_s"] / r["partition-per-file"]["msgs_per_s"])
        assert r["partition-per-file"]["max_open_fds"] > 0 and r["commitlog"]["p99_ms"] >= r["commitlog"]["p50_ms"]
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    assert "CL/PPF" in out.stdout


@pytest.mark.slow
def test_bench_compare_via_broker_drives_a_broker_per_mode(tmp_path: Path) -> None:
    out = clmq(
        "bench",
        "compare",
        "--via",
        "broker",
        "--dir",
        str(tmp_path / "b"),
        "--sizes",
        "100",
        "--queues",
        "1,300",
        "--patterns",
        "round-robin",
        "--flush",
        "sync",
        "--seconds",
        "0.5",
        "--runs",
        "1",
        "--json",
        str(tmp_path / "c.json"),
        "--plot",
        str(tmp_path / "c.png"),
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads((tmp_path / "c.json").read_text())
    assert result["via"] == "broker" and [r["queues"] for r in result["rows"]] == [1, 300]
    big = result["rows"][1]
    # the broker process itself holds a file per partition in partition-per-file mode
    assert big["partition-per-file"]["max_open_fds"] >= 300 > big["commitlog"]["max_open_fds"]
    assert all(r[m]["msgs_per_s"] > 0 for r in result["rows"] for m in ("commitlog", "partition-per-file"))


def test_dev_demo_shows_messages_flowing(tmp_path: Path) -> None:
    out = clmq(
        "dev",
        "--demo",
        "--exit-after-demo",
        "--data-dir",
        str(tmp_path / "d"),
        "--listen-port",
        "0",
        "--namesrv-port",
        "0",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("sent     queue") == 5 and out.stdout.count("received queue") == 5
    assert "messages flowed: produced 5, consumed 5" in out.stdout


def _free_port() -> int:
    return free_port()


def _registered_brokers(ns: str) -> set[str]:
    """The brokers the name server at ``ns`` knows (none while it is not up yet)."""

    async def ask() -> set[str]:
        async with open_admin([ns]) as admin:
            try:
                return {b["broker_name"] for b in await admin.brokers()}
            except ConnectionFailed:
                return set()

    return trio.run(ask)


def _routed_brokers(ns: str, topic: str) -> set[str]:
    """The brokers the name server at ``ns`` routes ``topic`` to."""

    async def ask() -> set[str]:
        async with open_admin([ns]) as admin:
            try:
                return {mq.broker_name for mq in await Routes(admin.rpc, [ns]).queues(topic)}
            except NoRouteError:
                return set()

    return trio.run(ask)


def test_service_commands_against_a_running_broker(tmp_path: Path) -> None:
    ns_port, broker_port = _free_port(), _free_port()
    ns = f"127.0.0.1:{ns_port}"
    conf = tmp_path / "broker.toml"
    conf.write_text(
        f'[broker]\nbroker_name = "b1"\nlisten_port = {broker_port}\nnamesrv_addrs = ["{ns}"]\n'
        f'data_dir = "{tmp_path / "data"}"\nregister_interval_ms = 200\n'
    )
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
        "CLMQ_LISTEN_PORT": str(ns_port),
    }
    procs = [
        subprocess.Popen([sys.executable, "-m", "clmq", "nameserver"], env=env, cwd=tmp_path),
        subprocess.Popen(
            [sys.executable, "-m", "clmq", "broker", "--config", str(conf)],
            cwd=tmp_path,
            env={**env, "CLMQ_LISTEN_PORT": str(broker_port)},
        ),
    ]
    try:
        wait_until(lambda: _registered_brokers(ns) == {"b1"}, 30, "broker b1 to register with the name server")
        listed = clmq("topic", "list", "--namesrv", ns, cwd=tmp_path)
        assert listed.returncode == 0, listed.stdout + listed.stderr
        assert clmq("topic", "create", "cli", "--queues", "3", "--namesrv", ns, cwd=tmp_path).returncode == 0
        # the broker re-registers at once; the name server tells nobody when it has the route
        wait_until(lambda: _routed_brokers(ns, "cli") == {"b1"}, 10, "the name server to route topic cli to b1")
        produced = clmq("produce", "cli", "one", "two", "three", "--tags", "T", "--namesrv", ns, cwd=tmp_path)
        assert produced.returncode == 0 and produced.stdout.count("offset 0") == 3, produced.stdout + produced.stderr
        consumed = clmq(
            "consume", "cli", "--group", "g", "--count", "3", "--idle-timeout", "10", "--namesrv", ns, cwd=tmp_path
        )
        assert consumed.returncode == 0 and sorted(
            line.split()[-1] for line in consumed.stdout.splitlines() if "[T]" in line
        ) == ["one", "three", "two"]
        described = clmq("group", "describe", "g", "--namesrv", ns, cwd=tmp_path)
        assert "total lag 0" in described.stdout, described.stdout
        topic = clmq("topic", "describe", "cli", "--namesrv", ns, cwd=tmp_path)
        assert topic.returncode == 0 and topic.stdout.count("b1") == 3
        missing = clmq("produce", "nope", "x", "--namesrv", ns, cwd=tmp_path)
        assert missing.returncode == 1 and "no broker serves topic 'nope'" in missing.stdout + missing.stderr
        bad = clmq("broker", "--config", str(tmp_path / "absent.toml"), cwd=tmp_path)
        assert bad.returncode == 2 and "does not exist" in bad.stderr  # a usage error
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            assert p.wait(30) == 0  # graceful stop on SIGTERM
    assert (tmp_path / "data" / "consumer_offsets.json").exists() and not (tmp_path / "data" / "abort").exists()


def test_benchmark_results_go_to_their_directory_with_a_plot(tmp_path: Path) -> None:
    """Not loose files in the current directory: ``--out-dir`` (default ./clmq-bench-results/),
    a JSON and a PNG per run."""
    out = clmq(
        "bench",
        "store",
        "--sizes",
        "100",
        "--queues",
        "1",
        "--flush",
        "async",
        "--seconds",
        "0.1",
        "--runs",
        "1",
        "--rebuild-messages",
        "0",
        "--scale-queues",
        "0",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    results = tmp_path / "clmq-bench-results"
    assert [p.suffix for p in sorted(results.glob("store-*.*"))] == [".json", ".png"]
    assert json.loads(next(results.glob("store-*.json")).read_text())["append"][0]["msgs_per_s"] > 0
    assert {p.name for p in tmp_path.iterdir()} == {"clmq-bench-results"}  # nothing else written here

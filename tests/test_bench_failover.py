"""``clmq bench failover`` run for real with two failovers of each kind (its own
ZooKeeper, name server and three broker processes): the JSON holds every figure and
the figures are plausible. A smoke test of the command, not a measurement."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def clmq(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "clmq", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={"COLUMNS": "200", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:  # type: ignore[type-arg]
    tmp = tmp_path_factory.mktemp("bench-failover")
    out = clmq(
        "bench",
        "failover",
        "--failovers",
        "2",
        "--after-seconds",
        "1",
        "--queues",
        "4",
        "--dir",
        str(tmp / "d"),
        "--json",
        str(tmp / "f.json"),
        "--plot",
        str(tmp / "f.png"),
        cwd=tmp,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (tmp / "f.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the plot was drawn
    assert not list((tmp / "d").iterdir()), "the run's directories were left behind"
    return json.loads((tmp / "f.json").read_text()), out.stdout


def test_every_failover_is_measured(run: tuple[dict, str]) -> None:  # type: ignore[type-arg]
    result, _ = run
    rows = result["failovers"]
    assert [(r["kind"], r["index"]) for r in rows] == [("sigkill", 0), ("graceful", 0), ("sigkill", 1), ("graceful", 1)]
    for r in rows:
        assert r["from"] != r["to"] and {r["from"], r["to"]} <= {0, 1, 2}, r
        # a new leader within the 2 s session plus slack on a loaded machine; a switch much faster
        assert 0 < r["failover_s"] < (20 if r["kind"] == "sigkill" else 10), r
        assert r["pause_s"] >= 0 and r["errors"] == 0, r
    for kind in ("sigkill", "graceful"):
        k = result["summary"][kind]
        assert k["count"] == 2 and 0 < k["median_s"] <= k["p99_s"] <= k["max_s"], k
    assert result["client_errors"] == 0, result["client_error_samples"]


def test_throughput_settings_and_table(run: tuple[dict, str]) -> None:  # type: ignore[type-arg]
    result, stdout = run
    tp = result["throughput"]
    assert tp["during_msgs_per_s"] > 0 and tp["after_msgs_per_s"] > 0 and tp["during_s"] > 0, tp
    assert 0.9 <= tp["after_s"] < 5, tp
    assert result["acknowledged_messages"] > 0 and result["problems"] == [], result["problems"]
    assert result["settings"]["session_ms"] == 2000 and result["settings"]["tick_ms"] == 500
    assert "median s" in stdout and "p99 s" in stdout and "client errors: 0" in stdout

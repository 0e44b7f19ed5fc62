"""``clmq bench replication`` run for real with tiny sizes: every case runs (separate
name server, leader and follower processes) and the JSON holds every figure. A smoke
test of the command, not of how fast anything is."""

from __future__ import annotations

import json
import math
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
        timeout=600,
        env={"COLUMNS": "200", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )


TINY = [
    "--queues",
    "20",
    "--followers",
    "0,1",
    "--ack-modes",
    "async,sync",
    "--seconds",
    "0.4",
    "--warmup-seconds",
    "0.1",
    "--runs",
    "1",
    "--lag-followers",
    "1",
    "--lag-seconds",
    "0.4",
    "--lag-warmup-seconds",
    "0.1",
    "--lag-sample-ms",
    "5",
    "--catchup-mb",
    "2",
    "--settle-seconds",
    "0",
    "--batch-messages",
    "16",
    "--senders",
    "4",
]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, object], str, Path]:
    tmp = tmp_path_factory.mktemp("bench-repl")
    out = clmq(
        "bench",
        "replication",
        *TINY,
        "--dir",
        str(tmp / "d"),
        "--json",
        str(tmp / "r.json"),
        "--markdown",
        str(tmp / "r.md"),
        "--plot",
        str(tmp / "r.png"),
        cwd=tmp,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads((tmp / "r.json").read_text()), out.stdout, tmp


def test_every_throughput_case_runs_with_figures_and_ratios(run: tuple[dict, str, Path]) -> None:  # type: ignore[type-arg]
    result, stdout, _ = run
    rows = result["throughput"]
    cases = [(r["queues"], r["followers"], r["ack_mode"], r["flush_mode"]) for r in rows]
    expected = [(20, f, a, "async") for f in (0, 1) for a in ("async", "sync")] + [(20, 0, "async", "sync")]
    assert sorted(cases) == sorted(expected)
    for r in rows:
        assert r["msgs_per_s"] > 0 and r["mb_per_s"] > 0 and r["errors"] == 0 and 1 <= r["queues_written"] <= 20, r
        assert 0 < r["p50_ms"] <= r["p99_ms"], r
        assert r["vs_0_followers"] > 0 and r["vs_sync_flush"] > 0
        assert {"client", "leader", "nameserver"} <= set(r["cpu_pct"]), r["cpu_pct"]
        assert (f"follower {r['followers']}" in r["cpu_pct"]) == (r["followers"] > 0)
        if r["followers"] == 0 and r["flush_mode"] == "async":
            assert r["vs_0_followers"] == 1.0
    assert "vs sync flush" in stdout and "CPU % client / leader / followers" in stdout


def test_lag_catchup_aims_and_outputs(run: tuple[dict, str, Path]) -> None:  # type: ignore[type-arg]
    result, stdout, tmp = run
    assert [r["queues"] for r in result["lag"]] == [20]
    for r in result["lag"]:
        assert r["followers"] == 1 and r["target_msgs_per_s"] > 0 and r["msgs_per_s"] > 0
        assert r["per_follower"]["1"]["samples"] > 0 and 0 <= r["lag_p50_ms"] <= r["lag_p99_ms"] <= r["lag_max_ms"]
        assert 0 <= r["lag_p50_bytes"] <= r["lag_p99_bytes"]
    c = result["catchup"]
    assert c["log_mb"] >= 2 and c["mb_per_s"] > 0 and not math.isnan(c["copy_s"])
    assert c["catchup_bytes_per_s_setting"] == 256 << 20
    aims = [a["aim"] for a in result["aims"]]
    assert len(aims) == 2 and all(isinstance(a["met"], bool) for a in result["aims"])  # lag, catch-up
    assert result["machine"]["cpus"] >= 1 and len(result["runs"]) == 1 and "load_before" in result["machine"]
    assert "| queues |" in (tmp / "r.md").read_text() and (tmp / "r.png").stat().st_size > 0
    assert "catch-up of an empty follower" in stdout and "JSON written to" in stdout

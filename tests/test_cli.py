"""The command line, run for real as a subprocess (tiny parameters: these check that the
commands work and report what they should, not how fast anything is)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def clmq(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "broker.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin",
                                            "PYTHONPATH": str(Path(__file__).resolve().parents[1])})  # fmt: skip


def test_demo_appends_restarts_and_reads_back(tmp_path: Path) -> None:
    out = clmq("demo", "--data-dir", str(tmp_path / "d"), "--messages", "3000", "--queues", "4", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "appended 3,000 messages over 4 queues" in out.stdout
    assert "3,000 new messages read back" in out.stdout and "hello 2999" in out.stdout
    again = clmq("demo", "--data-dir", str(tmp_path / "d"), "--messages", "1000", "--queues", "4", cwd=tmp_path)
    assert "4,000 in the store" in again.stdout  # the data survived the first process


def test_help_on_every_command(tmp_path: Path) -> None:
    for args in (["--help"], ["demo", "--help"], ["bench", "store", "--help"], ["bench", "compare", "--help"]):
        out = clmq(*args, cwd=tmp_path)
        assert out.returncode == 0 and "usage: clmq" in out.stdout


@pytest.mark.slow
def test_bench_store_reports_every_measurement(tmp_path: Path) -> None:
    out = clmq("bench", "store", "--dir", str(tmp_path / "b"), "--sizes", "100", "--queues", "1,50", "--flush", "async",
               "--seconds", "0.2", "--runs", "1", "--rebuild-messages", "5000", "--scale-queues", "2000",
               "--json", str(tmp_path / "s.json"), cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stderr
    result = json.loads((tmp_path / "s.json").read_text())
    assert [(r["size"], r["queues"]) for r in result["append"]] == [(100, 1), (100, 50)]
    assert all(r["msgs_per_s"] > 0 for r in result["append"])
    assert result["rebuild"]["messages"] == 5000 and result["scale"]["messages"] == 6000
    assert "re-dispatch" in out.stdout and "read-back" in out.stdout


@pytest.mark.slow
def test_bench_compare_runs_both_modes_and_draws_the_plot(tmp_path: Path) -> None:
    out = clmq("bench", "compare", "--dir", str(tmp_path / "b"), "--sizes", "100", "--queues", "1,20",
               "--flush", "async", "--seconds", "0.2", "--runs", "1", "--json", str(tmp_path / "c.json"),
               "--plot", str(tmp_path / "c.png"), cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = json.loads((tmp_path / "c.json").read_text())["rows"]
    assert {(r["queues"], r["pattern"]) for r in rows} == {(1, "round-robin"), (20, "round-robin"), (1, "skewed"), (20, "skewed")}
    for r in rows:
        assert r["ratio"] == pytest.approx(r["commitlog"]["msgs_per_s"] / r["partition-per-file"]["msgs_per_s"])
        assert r["partition-per-file"]["max_open_fds"] > 0 and r["commitlog"]["p99_ms"] >= r["commitlog"]["p50_ms"]
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    assert "CL/PPF" in out.stdout

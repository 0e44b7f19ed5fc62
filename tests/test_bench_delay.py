"""``clmq bench delay`` run for real with tiny sizes (a broker process per part): the
JSON holds the send rates of both kinds, the lateness of every message due in the
window (all of them delivered), the memory figures and the aims, and the plot is
drawn. A smoke test of the command, not a measurement."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

PENDING = [300, 3000]


def clmq(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "clmq", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={"COLUMNS": "200", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )


@pytest.mark.slow  # about 25 s: three broker processes, a few seconds of waiting for messages to come due
def test_every_figure_is_measured(tmp_path: Path) -> None:
    out = clmq(
        "bench",
        "delay",
        "--runs",
        "2",
        "--seconds",
        "0.3",
        "--batch",
        "50",
        "--senders",
        "2",
        "--pending",
        ",".join(map(str, PENDING)),
        "--spread-seconds",
        "4",
        "--measure-seconds",
        "1.5",
        "--lead-seconds",
        "1",
        "--settle-seconds",
        "0",
        "--json",
        str(tmp_path / "d.json"),
        "--markdown",
        str(tmp_path / "d.md"),
        "--plot",
        str(tmp_path / "d.png"),
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result: dict[str, Any] = json.loads((tmp_path / "d.json").read_text())
    t = result["throughput"]
    assert [(s["run"], s["kind"]) for s in t["samples"]] == [
        (0, "plain"),
        (0, "scheduled"),
        (1, "scheduled"),
        (1, "plain"),
    ]
    assert (
        t["failed"] == 0
        and t["plain_msgs_per_s"] > 0
        and t["scheduled_msgs_per_s"] > 0
        and len(t["ratios_by_run"]) == 2
    )
    assert [r["pending"] for r in result["precision"]] == PENDING
    for r in result["precision"]:
        assert (
            r["schedule_failed"] == 0 and r["expected"] > 0 and r["missing"] == 0 and r["samples"] == r["expected"]
        ), r
        assert 0 <= r["p50_ms"] <= r["p99_ms"] <= r["max_ms"] < 15_000, r
        assert 0 < r["pending_at_window"] <= r["pending"], r
        m = r["memory"]
        assert m["enqueued_counted"] == r["pending"], m  # the timer took every scheduled message
        assert 0 < m["pending_counted"] <= r["pending"], m  # under load, some may be due already
        assert m["rss_after_bytes"] > 0 and m["timer_memory_bytes"] > 0, m
    assert [a["aim"].split(" ")[0] for a in result["aims"]] == ["scheduled", "lateness", "broker", "timer_memory_bytes"]
    assert all(isinstance(a["met"], bool) for a in result["aims"])
    assert "Aims" in (tmp_path / "d.md").read_text()
    assert (tmp_path / "d.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

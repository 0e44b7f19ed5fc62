"""``clmq bench trace`` run for real with tiny sizes (one broker process with
``trace_enabled``): the JSON holds both cases' rates untraced and traced, the traced
clients' event counts (the producer's events all written, and so stored in
%TRACE%), the ratios and the aims, and the plot is drawn. A smoke test of the
command, not a measurement."""

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


@pytest.mark.slow  # about 15 s: a broker process, two short runs of each case
def test_every_figure_is_measured(tmp_path: Path) -> None:
    out = clmq(
        "bench",
        "trace",
        "--runs",
        "2",
        "--seconds",
        "0.3",
        "--senders",
        "4",
        "--consume-messages",
        "2000",
        "--settle-seconds",
        "0",
        "--json",
        str(tmp_path / "t.json"),
        "--markdown",
        str(tmp_path / "t.md"),
        "--plot",
        str(tmp_path / "t.png"),
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "t.json").read_text())
    for case in ("produce", "consume"):
        figures = result["summary"][case]
        assert figures["untraced"]["msgs_per_s"] > 0 and figures["traced"]["msgs_per_s"] > 0
        assert len(figures["ratios_by_run"]) == 2
    produced = result["summary"]["produce"]["trace_events"]
    assert produced["written"] == produced["recorded"] > 0 and produced["dropped"] == 0
    consumed = result["summary"]["consume"]["trace_events"]
    assert consumed["recorded"] + consumed["dropped"] == 2 * 2 * 2000  # delivered and acked, 2 runs
    assert result["trace_records"] > 0
    assert [a["aim"].split(":")[0] for a in result["aims"]] == ["produce", "consume"]
    assert "### Aims" in (tmp_path / "t.md").read_text()
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

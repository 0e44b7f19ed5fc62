"""``clmq bench cold-reader`` run for real with tiny sizes (one broker process): the
JSON holds both runs' tail-reader figures and the cold reader's rate, and the plot is
drawn. A smoke test of the command, not a measurement."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_the_figures_of_both_runs_are_written(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "clmq",
            "bench",
            "cold-reader",
            "--backlog-mb",
            "4",
            "--rate",
            "500",
            "--seconds",
            "1",
            "--settle-seconds",
            "0.5",
            "--out-dir",
            str(tmp_path / "results"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    (found,) = (tmp_path / "results").glob("*.json")
    result = json.loads(found.read_text())
    assert result["without"]["hot_messages"] > 0 and result["with"]["hot_messages"] > 0
    assert result["without"]["cold_messages"] == 0 and result["with"]["cold_messages"] > 0
    assert list((tmp_path / "results").glob("*.png")), "the plot is drawn"

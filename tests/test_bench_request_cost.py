"""``clmq bench request-cost`` run for real with a tiny case (a broker process per flush
mode and run): every case is measured per run, the rows are the medians, the regression
line (produce at 200 in flight) is judged against the aim, and the Markdown says so. A
smoke test of the command, not a measurement."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_bench_e2e import clmq


@pytest.mark.slow  # about 10 s: two broker processes
def test_request_cost_runs_medians_and_the_regression_line(tmp_path: Path) -> None:
    out = clmq(
        "bench",
        "request-cost",
        "--requests",
        "300",
        "--concurrency",
        "1,200",
        "--flush",
        "async",
        "--runs",
        "2",
        "--json",
        str(tmp_path / "c.json"),
        "--markdown",
        str(tmp_path / "c.md"),
        "--plot",
        str(tmp_path / "c.png"),
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / "c.json").read_text())
    assert result["runs"] == 2 and len(result["samples"]) == 4
    assert [(r["kind"], r["flush"], r["concurrency"]) for r in result["rows"]] == [
        ("produce", "async", 1),
        ("produce", "async", 200),
    ]
    for r in result["rows"]:
        assert r["requests"] == 300 and r["broker_us_per_request"] > 0 and r["requests_per_s"] > 0, r
    [line] = result["regression"]
    assert line["concurrency"] == 200 and line["aim_us"] == 50
    assert line["met"] == (line["broker_us_per_request"] <= 50)
    assert "Regression line: produce, async flush, 200 in flight" in (tmp_path / "c.md").read_text()
    assert "regression line: produce, async flush, 200 in flight" in out.stdout
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

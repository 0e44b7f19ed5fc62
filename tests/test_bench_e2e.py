"""``clmq bench e2e`` run for real with tiny cases (a broker process per case, every
API): the JSON holds every case of every run and the medians, every message produced
is read back, the aims are computed, and the Markdown and the plot are written. A smoke
test of the command, not a measurement; plus the aims' verdicts on given figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from clmq.bench.e2e_report import aims, medians
from clmq.bench.e2e_security import summary as security_summary

APIS = ["public", "public-many", "public-batches", "raw"]
SPARSE_TOTAL = 2000
LATENCY_RATE = 200  # msgs/s, for 3 s (the latency case's shortest)


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
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str, Path]:
    tmp = tmp_path_factory.mktemp("bench-e2e")
    out = clmq(
        "bench",
        "e2e",
        "--api",
        ",".join(APIS),
        "--runs",
        "1",
        "--seconds",
        "0.3",
        "--sizes",
        "1024",
        "--queues",
        "1,20",
        "--flush",
        "async",
        "--sparse-total",
        str(SPARSE_TOTAL),
        "--sparse-queues",
        "1,200",
        "--latency-rate",
        str(LATENCY_RATE),
        "--settle-seconds",
        "0",
        "--json",
        str(tmp / "e.json"),
        "--markdown",
        str(tmp / "e.md"),
        "--plot",
        str(tmp / "e.png"),
        cwd=tmp,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads((tmp / "e.json").read_text()), out.stdout, tmp


@pytest.mark.slow  # about 40 s: 18 broker processes
def test_every_case_of_every_api_is_measured_and_read_back(run: tuple[dict[str, Any], str, Path]) -> None:
    result, stdout, _ = run
    assert result["apis"] == APIS and result["runs"] == 1
    assert [(r["api"], r["queues"]) for r in result["rows"]] == [(a, q) for q in (1, 20) for a in APIS]
    assert [(r["api"], r["queues"]) for r in result["sparse"]] == [(a, q) for q in (1, 200) for a in APIS]
    for r in result["rows"] + result["sparse"]:
        assert r["failed"] == 0 and r["messages"] > 0 and r["consumed"] == r["messages"], r
        assert r["produce_msgs_per_s"] > 0 and r["consume_msgs_per_s"] > 0 and r["consume_fetch_msgs_per_s"] > 0, r
        assert r["size"] == 1024 and r["flush"] == "async" and 0 < r["consumer_start_s"] < 30, r
        assert r["produce_broker_cpu_us_per_msg"] > 0 and r["consume_client_cpu_us_per_msg"] > 0, r
    for r in result["sparse"]:  # the fixed total, every message of it stored and read back
        assert r["case"] == "sparse" and r["messages"] == SPARSE_TOTAL, r
    # every run's samples are kept besides the medians
    assert len(result["samples"]["rows"]) == len(result["rows"]) and len(result["samples"]["sparse"]) == 8
    assert "read back" in stdout


@pytest.mark.slow  # about 40 s: 18 broker processes
def test_latency_through_both_apis(run: tuple[dict[str, Any], str, Path]) -> None:
    result, _, _ = run
    lat = result["latency"]
    assert set(lat) == {"public", "raw"}  # public-batches sends as public does: measured once
    assert lat["public"]["batch"] == 1 and lat["public"]["sends"] + lat["public"]["failed"] == 3 * LATENCY_RATE
    assert lat["raw"]["batch"] == 10 and lat["raw"]["sends"] == 3 * LATENCY_RATE // 10
    for v in lat.values():
        assert 0 < v["p50_ms"] <= v["p99_ms"] <= v["max_ms"], v


@pytest.mark.slow  # about 40 s: 18 broker processes
def test_aims_markdown_and_plot(run: tuple[dict[str, Any], str, Path]) -> None:
    result, _, tmp = run
    ratios = {(a["api"], a["aim"]) for a in result["aims"] if " / raw, " in a["aim"]}
    assert ratios == {
        (api, f"produce {api} / raw, {case}, {q}, async flush")
        for api in APIS[:-1]
        for case, qs in (("timed", ("1 queue", "20 queues")), ("sparse", ("1 queue", "200 queues")))
        for q in qs
    }
    sparse_ratios = [a["aim"] for a in result["aims"] if a["api"] == "public-many" and "sparse case" in a["aim"]]
    assert sparse_ratios == [
        "sparse case, produce at 200 queues / at 1 queue",
        "sparse case, consume at 200 queues / at 1 queue",
    ]
    public = [a["aim"] for a in result["aims"] if a["api"] == "public"]
    assert public[:2] == ["produce at 1 queue, 1 KiB, async flush (msgs/s)", "produce at 20 queues / at 1 queue"]
    assert (
        sum(a.startswith("consume, timed") for a in public) == 2
        and sum(a.startswith("consume, sparse") for a in public) == 2
    )
    assert public[-1].startswith(f"produce p99 at {LATENCY_RATE}")
    for a in result["aims"]:
        assert isinstance(a["met"], bool) and a["ratio"] == pytest.approx(a["measured"] / a["target"]), a
    md = (tmp / "e.md").read_text()
    assert "### Aims" in md and "Sparse case" in md and md.count("| public |") >= 4
    assert (tmp / "e.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_api_is_a_usage_error(tmp_path: Path) -> None:
    out = clmq("bench", "e2e", "--api", "public,bogus", cwd=tmp_path)
    assert out.returncode == 2 and "unknown api ['bogus']" in out.stderr


def _row(api: str, case: str, queues: int, produce: float, consume: float) -> dict[str, Any]:
    return {
        "api": api,
        "case": case,
        "size": 1024,
        "queues": queues,
        "flush": "async",
        "produce_msgs_per_s": produce,
        "consume_msgs_per_s": consume,
        "consume_fetch_msgs_per_s": consume * 1.1,
        "messages": 100,
    }


def test_aims_verdicts_from_given_figures() -> None:
    runs = [_row("public", "timed", 1, 160_000 + d, 300_000) for d in (0, -20_000, 40_000)]
    runs += [_row("public", "timed", 10_000, 125_000 + d, 240_000) for d in (0, 10_000, -10_000)]
    rows = medians(runs)
    assert [(r["queues"], r["produce_msgs_per_s"]) for r in rows] == [(1, 160_000), (10_000, 125_000)]
    result = {
        "apis": ["public"],
        "rows": rows,
        "sparse": [_row("public", "sparse", 10_000, 50_000, 251_000)],
        "latency": {"public": {"rate_msgs_per_s": 10_000, "p99_ms": 4.2, "failed": 0}},
    }
    verdicts = {a["aim"].split(" (")[0]: (a["met"], round(a["ratio"], 4)) for a in aims(result)}
    assert verdicts == {
        "produce at 1 queue, 1 KiB, async flush": (True, round(160_000 / 150_000, 4)),
        "produce at 10,000 queues / at 1 queue": (False, round(125_000 / 160_000 / 0.8, 4)),
        "consume, timed, 1 queue": (True, 1.2),
        "consume, timed, 10,000 queues": (False, 0.96),
        "consume, sparse, 10,000 queues": (True, 1.004),
        "produce p99 at 10,000 msgs/s, sync flush, 1 KiB": (True, 0.84),
    }
    result["latency"]["public"]["failed"] = 1  # a send that failed: the p99 aim is not met, whatever the p99
    assert not aims(result)[-1]["met"]


# ``--tls --auth`` (issue 31): every mode measured against plaintext in the same run.
SECURITY_MODES = ["plain", "tls", "auth", "tls+auth"]


def test_tls_and_auth_modes_against_plaintext(tmp_path: Path) -> None:
    """A tiny run (one API, one queue count, 4 broker processes): each mode's case is
    measured and read back, its ratios to plaintext and the aims are in the JSON, the
    Markdown and the plot are written. No speed is asserted."""
    out = clmq(
        "bench",
        "e2e",
        "--tls",
        "--auth",
        "--security-only",
        "--api",
        "raw",
        "--queues",
        "1",
        "--runs",
        "1",
        "--seconds",
        "0.2",
        "--settle-seconds",
        "0",
        "--json",
        str(tmp_path / "s.json"),
        "--markdown",
        str(tmp_path / "s.md"),
        "--plot",
        str(tmp_path / "s.png"),
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / "s.json").read_text())
    assert [(r["mode"], r["size"], r["queues"], r["flush"]) for r in result["rows"]] == [
        (m, 1024, 1, "async") for m in SECURITY_MODES
    ]
    assert result["sparse"] == [] and result["latency"] == {}  # --security-only: the timed cases alone
    for r in result["rows"]:
        assert r["failed"] == 0 and r["messages"] > 0 and r["consumed"] == r["messages"], r
    security = result["security"]
    assert security["modes"] == SECURITY_MODES and security["user"] == "bench"
    assert [r["mode"] for r in security["ratios"]] == SECURITY_MODES[1:]
    for r in security["ratios"]:
        assert r["runs"] == 1 and r["produce_ratio"] > 0 and r["consume_ratio"] > 0, r
    assert {(a["mode"], a["aim"].split(",")[0], a["target"]) for a in security["aims"]} == {
        ("tls", "produce", 0.7),
        ("tls", "consume", 0.5),
        ("auth", "produce", 0.95),
        ("auth", "consume", 0.95),
        ("tls+auth", "produce", 0.7),
        ("tls+auth", "consume", 0.5),
    }
    assert ", tls+auth: 1024 B" in out.stdout
    md = (tmp_path / "s.md").read_text()
    assert "### TLS and authentication against plaintext" in md and md.count("| raw | timed | 1024 | 1 | async |") == 3
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_security_only_needs_a_mode(tmp_path: Path) -> None:
    out = clmq("bench", "e2e", "--security-only", cwd=tmp_path)
    assert out.returncode == 2 and "--security-only needs --tls or --auth" in out.stderr


def test_security_ratios_are_taken_within_each_run() -> None:
    """Each run's mode over that run's plaintext, then the median over the runs (a
    slow run slows every mode alike, and cancels out)."""
    samples = []
    for run, (scale, tls_produce) in enumerate([(1.0, 0.8), (0.5, 0.6), (1.2, 0.7)]):
        for mode, produce, consume in (("plain", 100_000, 200_000), ("tls", 100_000 * tls_produce, 90_000)):
            row = {**_row("raw", "timed", 1, produce * scale, consume * scale), "mode": mode, "run": run}
            row |= {"produce_broker_cpu_us_per_msg": 2.0, "consume_broker_cpu_us_per_msg": 1.0}
            samples.append(row)
    (r,) = security_summary(samples, ["plain", "tls"])["ratios"]
    assert r["mode"] == "tls" and r["runs"] == 3
    assert r["produce_ratio"] == pytest.approx(0.7) and r["consume_ratio"] == pytest.approx(0.45)
    assert r["produce_msgs_per_s"] == pytest.approx(80_000)  # the median of 80k, 30k and 84k: its own ratio is not 0.7
    verdicts = {a["aim"].split(",")[0]: a["met"] for a in security_summary(samples, ["plain", "tls"])["aims"]}
    assert verdicts == {"produce": True, "consume": False}
    assert [m["mode"] for m in medians(samples)] == ["plain", "tls"]  # the run number is not a figure
    assert all("run" not in m for m in medians(samples))

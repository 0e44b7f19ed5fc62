"""``clmq bench pop`` run for real at a tiny size (one broker process, member
processes): the JSON holds, per handler time and member count, both kinds' median
rates, CPU per message and the POP / queue-based ratio of each run; the crashed
member's messages all came back to the survivors, none before its invisible time ran
out; the aims are judged; the Markdown tables and the plot are written. A smoke test of
the command, not a measurement."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from clmq.bench.pop_procs import MemberProcess, split
from clmq.bench.pop_report import rate_of

ROOT = Path(__file__).resolve().parents[1]


def clmq(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "clmq", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={"COLUMNS": "200", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
    )


@pytest.mark.slow  # about 30 s: a broker process, 8 groups of member processes, a crash and its invisible time
def test_every_figure_is_measured(tmp_path: Path) -> None:
    out = clmq(
        "bench",
        "pop",
        "--messages",
        "3000",
        "--size-bytes",
        "256",
        "--queues",
        "2",
        "--members",
        "3,6",
        "--handler-ms-list",
        "0,2",
        "--runs",
        "1",
        "--seconds",
        "10",
        "--handler-seconds",
        "0.5",
        "--member-processes",
        "2",
        "--crash-messages",
        "60",
        "--crash-invisible-ms",
        "1000",
        "--crash-survivors",
        "2",
        "--settle-seconds",
        "0",
        "--json",
        str(tmp_path / "p.json"),
        "--markdown",
        str(tmp_path / "p.md"),
        "--plot",
        str(tmp_path / "p.png"),
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-3000:]
    result = json.loads((tmp_path / "p.json").read_text())
    rows = result["throughput"]
    assert [(r["handler_ms"], r["members"]) for r in rows] == [(0, 3), (0, 6), (2, 3), (2, 6)]
    for r in rows:
        assert r["queue_msgs_per_s"] > 0 and r["pop_msgs_per_s"] > 0, r
        assert len(r["ratios_by_run"]) == 1 and r["ratio"] > 0
        assert r["pop_broker_cpu_us_per_msg"] > 0
    assert len(result["samples"]) == 8
    for s in result["samples"]:
        if s["handler_ms"] == 0:
            assert s["acked"] >= 3000, s  # a fresh group handled the whole topic
    crash = result["crash"]
    assert crash["held"] == 60 and crash["redelivered"] == 60 and crash["missing"] == 0
    assert crash["early"] == 0 and crash["second_attempts"] == 60  # none before its deadline; each its 2nd delivery
    assert [a["aim"].split(",")[0] for a in result["aims"]] == [
        "POP / queue-based",
        "POP / queue-based",
        "POP 6 / 3 members (2 queues)",
        "crashed member's messages back",
    ]
    text = (tmp_path / "p.md").read_text()
    assert "### Throughput" in text and "### Redelivery" in text and "### Aims" in text
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@given(st.integers(1, 500), st.integers(1, 64))
def test_members_are_spread_evenly_over_processes(members: int, processes: int) -> None:
    shares = split(members, processes)
    assert sum(shares) == members and len(shares) == min(members, processes)
    assert min(shares) >= 1 and max(shares) - min(shares) <= 1


def test_a_rate_is_counted_from_the_first_acknowledgement_to_the_target() -> None:
    timeline = [(10.0, 0), (10.5, 0), (11.0, 100), (12.0, 1100), (12.5, 1500), (13.0, 1500)]
    r = rate_of(timeline, 1500)
    assert r["msgs_per_s"] == pytest.approx(1400 / 1.5) and r["startup_s"] == pytest.approx(1.0)
    assert r["acked"] == 1500
    assert rate_of([(1.0, 0), (2.0, 0)], 10)["msgs_per_s"] == 0.0


def test_a_member_process_that_fails_is_reported_with_its_error() -> None:
    async def main() -> None:
        proc = await MemberProcess.start({"name": "broken", "role": "no-such-role"})
        try:
            with pytest.raises(RuntimeError, match=r"(?s)member process broken exited.*no-such-role"):
                await proc.expect("ready")
            with pytest.raises(RuntimeError, match="member process broken exited 1"):
                await proc.finish()
        finally:
            proc.close()

    trio.run(main)


@pytest.mark.parametrize(
    ("option", "error"),
    [
        (["--members", "0,8"], "expected counts >= 1"),
        (["--runs", "0"], "expected a count >= 1"),
        (["--handler-ms-list", "-1"], "expected numbers >= 0"),
        (["--pop-batch", "many"], "expected a count, got 'many'"),
    ],
)
def test_bad_options_are_usage_errors_before_anything_starts(option: list[str], error: str, tmp_path: Path) -> None:
    out = clmq("bench", "pop", *option, "--out-dir", str(tmp_path / "out"), cwd=tmp_path)
    assert out.returncode == 2 and error in out.stderr, out.stderr
    assert not (tmp_path / "out").exists()

"""``clmq bench peers`` run for real with its smallest case: Apache Kafka 4.4.0 started
from its Maven jars (KRaft, one node) and driven by its own Java client, and clmq through
its own client and through its Kafka listener with that Java client. Every system
produced and read back every message, the JSON holds the samples, the medians and the
ratios, and the table and the plot are written. A smoke test, not a measurement. Also:
without ``java`` the command says what it needs and exits 2, and the ratios from given
figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from clmq.bench.peers_report import summarize

from .java_deps import require

ROOT = Path(__file__).resolve().parents[1]
MESSAGES = 500
WARMUP = 50  # messages each Java producer sends before its measured load
LATENCY_RATE = 100  # msgs/s, for 1 s


def clmq(*args: str, cwd: Path, path: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "clmq", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env={"COLUMNS": "200", "PATH": path, "PYTHONPATH": str(ROOT), "HOME": os.environ.get("HOME", "/root")}
        | (env or {}),
    )


@pytest.mark.slow  # about a minute: a Kafka broker, two clmq brokers and their JVM clients
def test_smallest_case_against_kafka_every_message_produced_and_consumed(tmp_path: Path) -> None:
    require("peers-kafka")  # the jars, fetched by scripts/_java_deps.sh (fails in CI when missing)
    out = clmq(
        "bench",
        "peers",
        "--systems",
        "clmq,clmq-kafka,kafka",
        "--queues",
        "3",
        "--flush",
        "async",
        "--messages",
        str(MESSAGES),
        "--runs",
        "1",
        "--warmup-messages",
        str(WARMUP),
        "--latency-rate",
        str(LATENCY_RATE),
        "--latency-seconds",
        "1",
        "--latency-queues",
        "3",
        "--json",
        str(tmp_path / "p.json"),
        "--markdown",
        str(tmp_path / "p.md"),
        "--plot",
        str(tmp_path / "p.png"),
        cwd=tmp_path,
        path=os.environ["PATH"],
        env={"CLMQ_PEERS_KAFKA_PARTITIONS_PER_OP": "2"},  # Kafka's topic grows in two steps, as at 10,000
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result: dict[str, Any] = json.loads((tmp_path / "p.json").read_text())
    samples = result["samples"]
    cases = {(s["kind"], s["system"]) for s in samples}
    assert cases == {(k, s) for k in ("produce", "consume", "latency") for s in ("clmq", "clmq-kafka", "kafka")}
    for s in samples:
        assert not s["incomplete"] and s["done"] == s["asked"], s
        if s["kind"] == "produce":
            assert s["asked"] == MESSAGES and s["msgs_per_s"] > 0 and s["created_s"] >= 0, s
        elif s["kind"] == "consume":  # everything stored, the warm-up messages included, read back
            warmup = 1 if s["system"] == "clmq" else WARMUP + 1
            assert s["asked"] == MESSAGES + warmup and s["msgs_per_s"] > 0, s
        else:
            assert s["asked"] == LATENCY_RATE and 0 < s["p50_ms"] <= s["p99_ms"] <= s["max_ms"], s
    ratios = {r["kind"]: r for r in result["ratios"]}
    assert set(ratios) == {"produce", "consume", "latency"}
    assert all(r["clmq_over_kafka"] > 0 and r["clmq_over_rocketmq"] is None for r in ratios.values())
    assert "| async | 3 | kafka |" in (tmp_path / "p.md").read_text()
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_case_that_fails_is_reported_and_the_others_still_run(tmp_path: Path) -> None:
    # clmq refuses a topic of 70,000 queues (at most 65,536): that case fails for real.
    out = clmq(
        "bench", "peers", "--systems", "clmq", "--queues", "70000,2", "--flush", "async", "--messages", "200",
        "--runs", "1", "--latency-rate", "0", "--consume-queues", "2", "--json", str(tmp_path / "p.json"),
        "--markdown", str(tmp_path / "p.md"), "--plot", str(tmp_path / "p.png"), cwd=tmp_path, path=os.environ["PATH"],
    )  # fmt: skip
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert "clmq, 70,000 queues, async flush: FAILED:" in out.stdout and "Traceback" not in out.stderr
    result: dict[str, Any] = json.loads((tmp_path / "p.json").read_text())
    [failure] = result["failures"]
    assert (failure["system"], failure["queues"], failure["run"]) == ("clmq", 70000, 1)
    assert "65536" in failure["error"].replace(",", ""), failure
    assert {(s["kind"], s["queues"], s["done"]) for s in result["samples"]} == {
        ("produce", 2, 200),
        ("consume", 2, 201),
    }
    assert "**failed cases**" in (tmp_path / "p.md").read_text()


def test_without_java_the_command_says_what_it_needs(tmp_path: Path) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    out = clmq("bench", "peers", "--systems", "kafka", "--out-dir", str(tmp_path), cwd=tmp_path, path=str(empty))
    assert out.returncode == 2, out.stdout + out.stderr
    assert "needs a JDK (java, javac) and Maven (mvn)" in out.stderr and "missing: java, javac, mvn" in out.stderr
    assert "Traceback" not in out.stderr and not list(tmp_path.glob("*.json"))


def _s(kind: str, system: str, figure: float, run: int) -> dict[str, Any]:
    head = "p99_ms" if kind == "latency" else "msgs_per_s"
    return {
        "kind": kind,
        "system": system,
        "queues": 1000,
        "flush": "sync",
        "run": run,
        head: figure,
        "incomplete": False,
    }


def test_medians_and_ratios_from_given_figures() -> None:
    samples = [_s("produce", "clmq", v, i) for i, v in enumerate((90.0, 100.0, 130.0))]
    samples += [_s("produce", "rocketmq", v, i) for i, v in enumerate((40.0, 50.0, 70.0))]
    samples += [_s("produce", "kafka", v, i) for i, v in enumerate((200.0, 210.0, 400.0))]
    samples += [_s("latency", "clmq", 4.0, 0), _s("latency", "kafka", 8.0, 0)]
    result = summarize(samples)
    med = {(m["kind"], m["system"]): m for m in result["medians"]}
    assert med[("produce", "clmq")]["msgs_per_s"] == 100.0 and med[("produce", "clmq")]["runs"] == 3
    ratios = {r["kind"]: r for r in result["ratios"]}
    assert ratios["produce"]["clmq_over_rocketmq"] == pytest.approx(2.0)
    assert ratios["produce"]["clmq_over_kafka"] == pytest.approx(100 / 210)
    assert ratios["latency"]["figure"] == "p99_ms" and ratios["latency"]["clmq_over_kafka"] == pytest.approx(0.5)
    assert ratios["latency"]["clmq_over_rocketmq"] is None

"""``clmq bench kafka`` run for real with tiny cases (a broker process per case, both
clients, each in its own process): the JSON holds every sample and the medians, every
message produced is read back, the CPU ratios and the aims are computed, and the
Markdown and the plot are written. A smoke test of the command, not a measurement;
plus the aims' verdicts on given figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from clmq.bench.kafka_report import aims, cpu_ratios, medians

pytest.importorskip("confluent_kafka")

MESSAGES = 2000
LATENCY_RATE = 200  # msgs/s, for 1 s


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
    tmp = tmp_path_factory.mktemp("bench-kafka")
    out = clmq(
        "bench",
        "kafka",
        "--runs",
        "1",
        "--messages",
        str(MESSAGES),
        "--partitions",
        "1,20",
        "--consume-partitions",
        "1,20",
        "--flush",
        "async",
        "--latency-rate",
        str(LATENCY_RATE),
        "--latency-seconds",
        "1",
        "--latency-flush",
        "async",
        "--settle-seconds",
        "0",
        "--json",
        str(tmp / "k.json"),
        "--markdown",
        str(tmp / "k.md"),
        "--plot",
        str(tmp / "k.png"),
        cwd=tmp,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads((tmp / "k.json").read_text()), out.stdout, tmp


@pytest.mark.slow  # about 25 s: 10 broker processes and as many client processes
def test_every_case_of_both_clients_is_measured_and_read_back(run: tuple[dict[str, Any], str, Path]) -> None:
    result, stdout, _ = run
    assert result["runs"] == 1 and result["clients"] == ["kafka", "native"]
    assert [(r["client"], r["partitions"]) for r in result["produce"]] == [
        (c, p) for p in (1, 20) for c in ("kafka", "native")
    ]
    for r in result["produce"]:
        assert r["messages"] == MESSAGES and r["failed"] == 0 and r["flush"] == "async", r
        # CPU is read in clock ticks (10 ms): a tiny case may show none
        assert r["msgs_per_s"] > 0 and r["broker_cpu_us_per_msg"] >= 0 and r["client_cpu_us_per_msg"] > 0, r
    assert [(r["client"], r["partitions"]) for r in result["consume"]] == [
        (c, p) for p in (1, 20) for c in ("kafka", "native")
    ]
    for r in result["consume"]:  # everything stored, the warm-up message included, read back
        assert r["messages"] == MESSAGES + 1 and 0 < r["msgs_per_s"] <= r["fetch_msgs_per_s"], r
    for r in result["latency"]:
        assert r["answered"] == LATENCY_RATE and r["failed"] == 0, r
        assert 0 < r["p50_ms"] <= r["p99_ms"] <= r["max_ms"], r
    assert [r["client"] for r in result["latency"]] == ["kafka", "native"]
    assert len(result["samples"]["produce"]) == 4 and len(result["samples"]["consume"]) == 4
    assert "kafka produce, 1 partitions" in stdout and "native consume, 20 partitions" in stdout


@pytest.mark.slow  # about 25 s: 10 broker processes and as many client processes
def test_cpu_ratios_aims_markdown_and_plot(run: tuple[dict[str, Any], str, Path]) -> None:
    result, _, tmp = run
    # one row per case measured by both clients (none where the native side used less than a clock tick)
    cases = [(c["phase"], c["partitions"]) for c in result["cpu_ratios"]]
    assert set(cases) <= {(ph, p) for ph in ("produce", "consume") for p in (1, 20)}
    for c in result["cpu_ratios"]:
        assert c["ratio"] == pytest.approx(c["kafka_us_per_msg"] / c["native_us_per_msg"]), c
    names = [a["aim"] for a in result["aims"]]
    assert names[0].startswith("librdkafka produce at 1 partition") and "20 partitions / at 1" in names[1]
    assert sum(n.startswith("librdkafka consume") for n in names) == 2
    assert sum(n.startswith("broker CPU per message") for n in names) == len(cases)
    for a in result["aims"]:
        assert isinstance(a["met"], bool) and a["ratio"] == pytest.approx(a["measured"] / a["target"]), a
    md = (tmp / "k.md").read_text()
    assert "Aims:" in md and "Kafka / native" in md and md.count("| kafka |") >= 4
    assert (tmp / "k.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_client_is_a_usage_error(tmp_path: Path) -> None:
    out = clmq("bench", "kafka", "--clients", "kafka,bogus", cwd=tmp_path)
    assert out.returncode == 2 and "clients: a list of kafka, native" in out.stderr


def _produce(client: str, partitions: int, rate: float, cpu: float) -> dict[str, Any]:
    return {
        "client": client,
        "partitions": partitions,
        "flush": "async",
        "msgs_per_s": rate,
        "broker_cpu_us_per_msg": cpu,
    }


def test_aims_verdicts_from_given_figures() -> None:
    runs = [_produce("kafka", 1, 160_000 + d, 6.0) for d in (0, -30_000, 10_000)]
    runs += [_produce("native", 1, 90_000, 5.0) for _ in range(3)]
    runs += [_produce("kafka", 10_000, 120_000, 13.0), _produce("native", 10_000, 80_000, 9.0)]
    rows = medians(runs, ("client", "partitions", "flush"))
    assert [(r["client"], r["partitions"], r["msgs_per_s"], r["runs"]) for r in rows][:2] == [
        ("kafka", 1, 160_000, 3),
        ("native", 1, 90_000, 3),
    ]
    result: dict[str, Any] = {
        "flushes": ["async"],
        "produce": rows,
        "consume": [
            {
                "client": "kafka",
                "partitions": 1,
                "msgs_per_s": 210_000,
                "fetch_msgs_per_s": 250_000,
                "broker_cpu_us_per_msg": 3.0,
            },
            {
                "client": "native",
                "partitions": 1,
                "msgs_per_s": 190_000,
                "fetch_msgs_per_s": 200_000,
                "broker_cpu_us_per_msg": 2.0,
            },
        ],
        "latency": [{"client": "kafka", "flush": "async", "rate_msgs_per_s": 10_000, "p99_ms": 8.0, "failed": 0}],
    }
    result["cpu_ratios"] = cpu_ratios(result)
    verdicts = [(a["aim"].split(" (")[0], a["met"], round(a["ratio"], 4)) for a in aims(result)]
    assert verdicts == [
        ("librdkafka produce at 1 partition, 1 KiB, acks=all, async flush", True, round(160_000 / 150_000, 4)),
        ("librdkafka produce at 10,000 partitions / at 1, async flush", False, round(120_000 / 160_000 / 0.8, 4)),
        ("librdkafka consume at 1 partition", True, 1.05),
        ("librdkafka produce p99 at 10,000 msgs/s, acks=all, async flush", True, 0.8),
        ("broker CPU per message Kafka / native, produce, 1 partition, async flush", True, round(1.2 / 1.3, 4)),
        (
            "broker CPU per message Kafka / native, produce, 10,000 partitions, async flush",
            False,
            round(13 / 9 / 1.3, 4),
        ),
        ("broker CPU per message Kafka / native, consume, 1 partition, async flush", False, round(1.5 / 1.3, 4)),
    ]

"""``clmq bench latency`` run for real at a tiny size (a name server, a broker, a producer
process and a long-polling consumer process): the JSON holds p50, p99, p99.9 and max of
send-to-ack and of send-to-deliver, every message acknowledged and delivered, the
per-second timeline, the aims; the plots are written. A smoke test of the command, not
a measurement. Also: the schedule the producer processes share, and histograms merged
across processes."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from clmq.bench import latency_hist
from clmq.bench.latency import cases
from clmq.bench.latency_floor import floor_waits, measure_floor
from clmq.bench.latency_load import HEADER, NS_PER_S, Recorder, Schedule, generate, producer_result
from clmq.bench.latency_report import aims, markdown, timeline_path
from clmq.broker.cli.main import main
from clmq.broker.service import Broker
from clmq.client import open_producer
from tests.service_helpers import Cluster

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


@pytest.mark.slow  # about 10 s: a name server, a broker, a producer and a consumer process
def test_every_message_is_acked_and_delivered_and_measured(tmp_path: Path) -> None:
    out = clmq(
        "bench",
        "latency",
        "--cases",
        "e2e",
        "--e2e-rates",
        "300",
        "--flush",
        "async",
        "--seconds",
        "1",
        "--warmup-seconds",
        "0.5",
        "--settle-seconds",
        "0",
        "--json",
        "lat.json",
        "--markdown",
        "lat.md",
        "--plot",
        "lat.png",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads((tmp_path / "lat.json").read_text())
    [case] = result["cases"]
    assert (case["kind"], case["flush"], case["rate"], case["producers"]) == ("e2e", "async", 300, 1)
    assert case["scheduled"] == case["submitted"] == 450  # 1.5 s at 300/s
    assert case["measured"] == 300  # the last 1 s
    assert case["acked"] == case["delivered"] == 450 and case["failed"] == 0 and case["duplicates"] == 0
    assert case["complete"]
    for name in ("ack", "e2e", "ack_from_submit"):
        figures = case[name]
        assert figures["count"] == 300, name
        assert 0 < figures["p50_ms"] <= figures["p99_ms"] <= figures["p99_9_ms"] <= figures["max_ms"], name
    assert case["e2e"]["p50_ms"] >= case["ack"]["p50_ms"] * 0.5  # delivered after (about) being stored
    assert [p["second"] for p in case["timeline"]] == [0, 1]
    assert sum(p["count"] for p in case["timeline"]) == sum(p["count"] for p in case["e2e_timeline"]) == 450
    assert case["achieved_msgs_per_s"] > 0 and case["client_cpu_us_per_msg"] > 0
    assert case["stalls"]["loop_stalls_during_load"] >= 0  # the broker's stall detector, read from BROKER_INFO
    assert {a["status"] for a in result["aims"]} == {"not measured"}  # no sync 10k/50k case in a smoke run
    assert result["disk_floor"] == []  # measured only for sync-flush cases
    assert (tmp_path / "lat.png").stat().st_size > 0
    assert timeline_path(tmp_path / "lat.png").stat().st_size > 0
    assert "| e2e | async | 300 |" in (tmp_path / "lat.md").read_text()


def test_bad_options_are_refused_with_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv, says in (
        (["--rates", "0"], "expected values > 0"),
        (["--cases", "broker,bogus"], "choose among broker, replicated, e2e"),
    ):
        with pytest.raises(SystemExit) as exit_:
            main(["bench", "latency", *argv])
        assert exit_.value.code == 2 and says in capsys.readouterr().err
    assert main(["bench", "latency", "--message-bytes", "8", "--out-dir", str(tmp_path)]) == 2
    assert "at least 16" in capsys.readouterr().out


def test_the_default_run_covers_the_issue() -> None:
    args = argparse.Namespace(
        rates=[1_000, 10_000, 50_000], e2e_rates=[10_000], cases=["broker", "replicated", "e2e"],
        flush=["async", "sync"], producers=0,
    )  # fmt: skip
    got = {(c["kind"], c["flush"], c["rate"]) for c in cases(args)}
    want = {(k, f, r) for k in ("broker", "replicated") for f in ("async", "sync") for r in args.rates}
    assert got == want | {("e2e", "async", 10_000), ("e2e", "sync", 10_000)}
    assert max(c["producers"] for c in cases(args)) > 1  # 50k msgs/s is shared by several processes


@settings(max_examples=60, deadline=None)
@given(
    rate=st.integers(1, 60_000),
    producers=st.integers(1, 8),
    seconds=st.floats(0.01, 0.5),
    t0=st.integers(0, 1 << 50),
)
def test_the_producers_share_one_constant_rate_schedule(rate: int, producers: int, seconds: float, t0: int) -> None:
    """Producer k of P owns messages k, k+P, ...: together every message of the run once,
    message i due at t0 + i / rate, whoever sends it."""
    spec = {"rate": rate, "producers": producers, "warmup_s": 0.0, "seconds": seconds, "behind_max_s": 1.0}
    due: dict[int, int] = {}
    for k in range(producers):
        sched = Schedule({**spec, "index": k}, t0)
        times = [sched.due_ns(j) for j in range(sched.count)]
        assert times == sorted(times)
        for j, t in enumerate(times):
            due[j * producers + k] = t
    total = int(rate * seconds)
    assert sorted(due) == list(range(total))
    assert all(due[i] == t0 + i * NS_PER_S // rate for i in due)


@settings(max_examples=15, deadline=None)
@given(st.lists(st.lists(st.integers(0, 10_000_000), max_size=100), min_size=1, max_size=4))
def test_histograms_merged_across_processes_equal_one_of_everything(parts: list[list[int]]) -> None:
    merged = latency_hist.merge(latency_hist.encode(latency_hist.of(p)) for p in parts)
    whole = latency_hist.of(v for p in parts for v in p)
    assert latency_hist.summary(merged) == latency_hist.summary(whole)
    assert merged.get_total_count() == sum(len(p) for p in parts)
    values = [v for p in parts for v in p]
    if values:  # within the histogram's 3 significant digits (and 1 µs at the bottom)
        assert abs(merged.get_max_value() - max(max(values), 1)) <= max(values) / 1000 + 1


async def _generate(broker: Broker, spec: dict[str, object], t0: int) -> dict[str, Any]:
    """Run one producer process's generator in this process against a real broker."""
    sched = Schedule({"index": 0, "producers": 1, "warmup_s": 0.0, **spec}, t0)
    rec = Recorder(sched.count)
    pad = bytes(1024 - HEADER.size)
    async with open_producer(broker_addrs=[broker.addr]) as p:
        await generate(p, "lat", sched, rec, pad)
        await p.flush()
    return producer_result(spec, sched, rec)


async def test_the_generator_sends_on_schedule_and_every_answer_is_timed(nursery: trio.Nursery, tmp_path: Path) -> None:
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    broker = await c.start_broker("broker-a")
    await c.create_topic("lat", 2)
    doc = await _generate(broker, {"rate": 2000, "seconds": 0.1, "behind_max_s": 30.0}, time.monotonic_ns())
    assert doc["scheduled"] == doc["submitted"] == doc["acked"] == doc["measured"] == 200 and doc["failed"] == 0
    ack, late = latency_hist.merge([doc["hist"]["ack"]]), latency_hist.merge([doc["hist"]["late"]])
    assert ack.get_total_count() == late.get_total_count() == 200
    # from the intended time: never less than the time the generator was late
    assert ack.get_min_value() >= 1 and ack.get_max_value() >= late.get_max_value()


async def test_a_generator_too_far_behind_stops_and_counts_what_it_did_not_send(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    broker = await c.start_broker("broker-a")
    await c.create_topic("lat", 2)
    behind = time.monotonic_ns() - 10 * NS_PER_S  # the whole schedule (and its grace) is over
    doc = await _generate(broker, {"rate": 1000, "seconds": 0.5, "behind_max_s": 1.0}, behind)
    assert (doc["scheduled"], doc["submitted"], doc["acked"], doc["measured"]) == (500, 0, 0, 500)


def test_an_arrival_waits_for_the_end_of_the_first_sync_that_starts_after_it() -> None:
    # syncs back to back: 0-1 s, 1-3 s, 3-4 s; an arrival each second from 0 to 3
    assert floor_waits([(0.0, 1.0), (1.0, 3.0), (3.0, 4.0)], rate=1) == [1.0, 2.0, 2.0, 1.0]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 0.01), st.floats(0.0001, 0.02)), min_size=2, max_size=50), st.integers(10, 5000))
def test_each_wait_is_to_the_end_of_the_first_sync_starting_after_the_arrival(
    gaps_and_lengths: list[tuple[float, float]], rate: int
) -> None:
    syncs, t = [], 0.0
    for gap, length in gaps_and_lengths:
        syncs.append((t + gap, t + gap + length))
        t += gap + length
    waits = floor_waits(syncs, rate)
    arrival = syncs[0][0]
    for w in waits:  # the arrivals, every 1/rate s from the first start, against a plain scan
        start, end = next((s, e) for s, e in syncs if s >= arrival)
        assert w == pytest.approx(end - arrival, abs=1e-9) and w >= end - start - 1e-9
        arrival += 1 / rate
    assert arrival > syncs[-1][0]  # and none was left out


def test_the_disks_floor_is_measured_in_the_directory_and_leaves_nothing(tmp_path: Path) -> None:
    f = measure_floor(tmp_path, 0.3, 1000, 1024)
    assert f["rate"] == 1000 and f["fdatasyncs"] >= 2
    d, w = f["fdatasync"], f["floor"]
    assert 0 < d["p50_ms"] <= d["p99_ms"] <= d["max_ms"]
    assert 0 < w["p50_ms"] <= w["p99_ms"] <= w["p99_9_ms"] <= w["max_ms"]
    assert list(tmp_path.iterdir()) == []


def test_an_aim_below_the_disks_floor_says_so() -> None:
    floor = {"rate": 10_000, "fdatasyncs": 100, "fdatasync": {"p50_ms": 0.1, "p99_ms": 0.3, "max_ms": 8.0},
             "floor": {"p50_ms": 0.2, "p99_ms": 6.5, "p99_9_ms": 8.0, "max_ms": 8.2}}  # fmt: skip
    case = {"kind": "broker", "rate": 10_000, "flush": "sync", "ack": {"p99_ms": 9.0}, "generator_saturated": False,
            "disk_floor": floor}  # fmt: skip
    by_aim = {a["aim"]: a for a in aims([case])}
    p99 = by_aim["10k msgs/s, one broker: p99 <= 2 ms"]
    assert (p99["value_ms"], p99["disk_floor_ms"], p99["status"]) == (9.0, 6.5, "not met (below the disk's floor)")
    assert by_aim["50k msgs/s, one broker: p99 <= 5 ms"]["status"] == "not measured"
    text = markdown(
        {"cases": [], "failed_cases": [], "aims": list(by_aim.values()), "disk_floor": [{"kind": "broker", **floor}]}
    )
    assert "| broker sync 10,000 msgs/s | 100 | 0.10 / 0.30 / 8.00 | 0.20 / 6.50 / 8.00 / 8.20 |" in text


def test_each_sync_case_gets_the_disks_floor_at_its_rate_measured_right_before_it(tmp_path: Path) -> None:
    from clmq.bench.latency import _floor

    lines: list[str] = []
    args = argparse.Namespace(floor_seconds=0.2, message_bytes=1024)
    assert _floor(args, tmp_path, {"kind": "broker", "flush": "async", "rate": 1000}, lines.append) is None
    f = _floor(args, tmp_path, {"kind": "e2e", "flush": "sync", "rate": 2000}, lines.append)
    assert f is not None and f["rate"] == 2000 and f["fdatasyncs"] >= 2
    assert lines and lines[0].startswith("the disk's floor before e2e sync 2,000/s")
    args.floor_seconds = 0
    assert _floor(args, tmp_path, {"kind": "e2e", "flush": "sync", "rate": 2000}, lines.append) is None

"""Event-loop stalls (issue 34): a real broker's instrument times every task step of its
trio run; a step over ``stall_threshold_ms`` is named, counted per task kind, exported
on /metrics and in BROKER_INFO; a garbage collection that makes a step long is said to
be one; the setting is checked."""

from __future__ import annotations

import gc
import socket
import time
from pathlib import Path
from typing import Callable

import pytest
import trio

from clmq.broker.service import BrokerConfig
from clmq.broker.service._stalls import _INSTALLED, GC_CLOCK, STALL_LOG_INTERVAL_S
from clmq.client import open_admin, open_producer
from clmq.protocol import Frame, RequestCode
from tests.service_helpers import Cluster
from tests.test_metrics import http_get, samples
from tests.waiting import await_until

TOPIC = "stalled"


def busy(ms: float) -> None:
    """Hold the event loop for ``ms`` milliseconds of work (what a blocking call on the
    loop does: no await inside)."""
    until = time.perf_counter() + ms / 1000
    while time.perf_counter() < until:
        pass


async def blocks_the_loop(ms: float) -> None:
    await trio.lowlevel.checkpoint()
    busy(ms)
    await trio.lowlevel.checkpoint()


async def test_a_task_blocking_the_loop_is_named_counted_and_exported(nursery: trio.Nursery, tmp_path: Path) -> None:
    cluster = Cluster(nursery, tmp_path)
    await cluster.start_nameserver()
    broker = await cluster.start_broker("broker-a", metrics_port=0, stall_threshold_ms=50)
    async with trio.open_nursery() as n:
        n.start_soon(blocks_the_loop, 120, name="tests.test_stalls.blocks_the_loop")
    async with open_admin(cluster.ns) as admin:
        info = await admin.broker_info(broker.addr)
    assert info["loop_stalls_by_task"].get("test_stalls.blocks_the_loop") == 1
    assert info["loop_stalls"] >= 1 and info["loop_stall_max_ms"] >= 120
    assert info["stall_threshold_ms"] == 50
    ours = [s for s in info["loop_stalls_recent"] if s["task"] == "test_stalls.blocks_the_loop"]
    assert len(ours) == 1 and ours[0]["ms"] >= 120 and ours[0]["kind"] == "test_stalls.blocks_the_loop"
    assert "blocks_the_loop" in ours[0]["awaiting"]  # where it was when the step ended
    # Busy work runs on a CPU (unless the OS preempts the loop thread: then it says so).
    assert ours[0]["cpu_ms"] > 0 or ours[0]["preempted"] > 0
    assert 0 <= info["loop_stalls_off_cpu"] <= info["loop_stalls"]
    assert sum(info["loop_stalls_on_cpu_by_task"].values()) + info["loop_stalls_off_cpu"] == info["loop_stalls"]
    m = samples((await http_get(broker.metrics_port, "/metrics"))[1])
    assert m[("clmq_loop_stalls_total", (("task", "test_stalls.blocks_the_loop"),))] == 1
    assert m[("clmq_loop_stall_duration_seconds_count", ())] >= 1
    assert m[("clmq_loop_stall_max_seconds", ())] >= 0.12


async def handle(frame: Frame) -> None:
    """Shaped like the transport's per-request task (``Connection._handle(frame, ...)``)."""
    await trio.lowlevel.checkpoint()
    busy(80)
    await trio.lowlevel.checkpoint()


async def test_a_request_task_that_blocks_the_loop_is_named_by_its_code(nursery: trio.Nursery, tmp_path: Path) -> None:
    cluster = Cluster(nursery, tmp_path)
    await cluster.start_nameserver()
    broker = await cluster.start_broker("broker-a", stall_threshold_ms=50)
    async with trio.open_nursery() as n:
        n.start_soon(handle, Frame(RequestCode.PULL_MESSAGE, 1), name="clmq.x.Connection._handle")
    kind = "Connection._handle[PULL_MESSAGE]"
    assert broker.ctx.stalls.fields()["loop_stalls_by_task"].get(kind) == 1


async def test_a_busy_broker_without_stalls_counts_none(nursery: trio.Nursery, tmp_path: Path) -> None:
    cluster = Cluster(nursery, tmp_path)
    await cluster.start_nameserver()
    broker = await cluster.start_broker("broker-a", metrics_port=0, stall_threshold_ms=100, flush_mode="sync")
    await cluster.create_topic(TOPIC, 4)
    async with open_producer(cluster.ns) as producer:
        for _ in range(200):
            await producer.submit(TOPIC, b"x" * 1024)
        await producer.flush()
    await http_get(broker.metrics_port, "/metrics")
    async with open_admin(cluster.ns) as admin:
        info = await admin.broker_info(broker.addr)
    # The broker's own work never held the loop that long. (On a machine with more
    # runnable threads than cores the OS may preempt the loop thread for longer: such a
    # step is counted, as off CPU.)
    assert info["loop_stalls_on_cpu_by_task"] == {}
    assert info["loop_stalls"] == info["loop_stalls_off_cpu"]
    m = samples((await http_get(broker.metrics_port, "/metrics"))[1])
    assert m[("clmq_loop_stall_duration_seconds_count", ())] == info["loop_stalls"]
    assert not any(name == "clmq_loop_stalls_on_cpu_total" for name, _labels in m)


async def collects_garbage(cycles: int) -> None:
    """Make ``cycles`` reference cycles (in steps of their own), then one step that
    only collects them."""
    for _ in range(cycles // 50_000):
        for _ in range(50_000):
            a: list[object] = []
            a.append([a])
        await trio.lowlevel.checkpoint()
    gc.collect()
    await trio.lowlevel.checkpoint()


async def test_a_stall_made_by_garbage_collection_is_attributed_to_gc(nursery: trio.Nursery, tmp_path: Path) -> None:
    cluster = Cluster(nursery, tmp_path)
    await cluster.start_nameserver()
    broker = await cluster.start_broker("broker-a", stall_threshold_ms=20)
    keep = [[[i]] for i in range(400_000)]  # live objects every full collection walks
    async with trio.open_nursery() as n:
        n.start_soon(collects_garbage, 400_000, name="tests.test_stalls.collects_garbage")
    del keep
    async with open_admin(cluster.ns) as admin:
        info = await admin.broker_info(broker.addr)
    gc_stalls = [s for s in info["loop_stalls_recent"] if s["kind"] == "gc"]
    assert gc_stalls, info["loop_stalls_recent"]
    assert gc_stalls[-1]["task"] == "test_stalls.collects_garbage" and gc_stalls[-1]["gc_ms"] >= 10
    assert info["loop_stalls_by_task"]["gc"] >= 1 and info["gc_collections"] >= 1


@pytest.mark.parametrize("bad", [-1, -100])
def test_the_stall_threshold_setting_is_checked(bad: int) -> None:
    with pytest.raises(ValueError, match="stall_threshold_ms must be at least 0"):
        BrokerConfig(stall_threshold_ms=bad)
    assert BrokerConfig(stall_threshold_ms=0).stall_threshold_ms == 0  # 0: off


async def test_a_threshold_of_zero_times_nothing(nursery: trio.Nursery, tmp_path: Path) -> None:
    cluster = Cluster(nursery, tmp_path)
    await cluster.start_nameserver()
    broker = await cluster.start_broker("broker-a", stall_threshold_ms=0)
    await blocks_the_loop(60)
    async with open_admin(cluster.ns) as admin:
        info = await admin.broker_info(broker.addr)
    assert info["stall_threshold_ms"] == 0 and info["loop_stalls"] == 0
    assert GC_CLOCK not in gc.callbacks  # what a detector that runs installs
    assert not any(broker.ctx.stalls in run for run in _INSTALLED.values())


async def test_a_running_detector_times_collections_until_its_broker_stops(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """The counterpart of the test above: what it finds absent is there while a detector runs."""
    cluster = Cluster(nursery, tmp_path)
    await cluster.start_nameserver()
    broker = await cluster.start_broker("broker-a", stall_threshold_ms=50)
    assert GC_CLOCK in gc.callbacks
    assert any(broker.ctx.stalls in run for run in _INSTALLED.values())
    await cluster.stop_broker("broker-a")
    assert GC_CLOCK not in gc.callbacks


async def test_two_brokers_in_one_process_count_a_stall_and_log_it_once(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cluster = Cluster(nursery, tmp_path)
    await cluster.start_nameserver()
    a = await cluster.start_broker("broker-a", stall_threshold_ms=50)
    b = await cluster.start_broker("broker-b", stall_threshold_ms=50)
    # No line in the last STALL_LOG_INTERVAL_S (a stall while starting): the next one is logged.
    await await_until(
        lambda: time.monotonic() - a.ctx.stalls._logged_at >= STALL_LOG_INTERVAL_S, 10, "the log interval to pass"
    )
    with caplog.at_level("WARNING", logger="clmq.broker.stalls"):
        async with trio.open_nursery() as n:
            n.start_soon(blocks_the_loop, 120, name="tests.test_stalls.shared_loop")
    for broker in (a, b):  # one loop: each broker's figures are the loop's
        assert broker.ctx.stalls.fields()["loop_stalls_by_task"].get("test_stalls.shared_loop") == 1
    lines = [r.getMessage() for r in caplog.records if "test_stalls.shared_loop" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("broker broker-a:"), lines


async def blocks_in_a_system_call(ms: float) -> None:
    """A blocking call on the loop (as an fsync or a cold read would be): a receive on
    a socket nobody writes to, with a timeout."""
    await trio.lowlevel.checkpoint()
    a, b = socket.socketpair()
    with a, b:
        a.settimeout(ms / 1000)
        with pytest.raises(TimeoutError):
            a.recv(1)
    await trio.lowlevel.checkpoint()


async def test_a_blocking_call_on_the_loop_is_a_stall_off_cpu_that_says_it_blocked(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    cluster = Cluster(nursery, tmp_path)
    await cluster.start_nameserver()
    broker = await cluster.start_broker("broker-a", stall_threshold_ms=50)
    async with trio.open_nursery() as n:
        n.start_soon(blocks_in_a_system_call, 120, name="tests.test_stalls.blocks_in_a_system_call")
    info = broker.ctx.stalls.fields()
    ours = [s for s in info["loop_stalls_recent"] if s["task"] == "test_stalls.blocks_in_a_system_call"]
    assert len(ours) == 1 and ours[0]["ms"] >= 120
    assert ours[0]["cpu_ms"] < 60 and ours[0]["blocked"] >= 1  # waiting in the kernel, not running
    assert "test_stalls.blocks_in_a_system_call" not in info["loop_stalls_on_cpu_by_task"]
    assert info["loop_stalls_off_cpu"] >= 1


async def waits_for(start: trio.Event, step: Callable[[], None]) -> None:
    """One step of ``step()`` as soon as ``start`` is set (every such task in one batch)."""
    await start.wait()
    step()
    await trio.lowlevel.checkpoint()


async def parked(nursery: trio.Nursery, start: trio.Event, step: Callable[[], None], name: str) -> None:
    async def task(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await waits_for(start, step)  # parked on the event before start() returns

    await nursery.start(task, name=name)


async def test_a_step_blocked_after_busy_steps_of_the_same_iteration_is_off_cpu(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """The CPU time a stall is judged by is the loop thread's over a window that starts
    shortly before the stall, not since the loop's last I/O wait: three busy steps (each
    under the threshold) then one that sleeps, in one batch, are not "on CPU"."""
    cluster = Cluster(nursery, tmp_path)
    await cluster.start_nameserver()
    broker = await cluster.start_broker("broker-a", stall_threshold_ms=100)
    start = trio.Event()
    async with trio.open_nursery() as n:
        # Trio runs a batch forwards or backwards: busy steps on both sides of the sleep.
        for i in range(3):
            await parked(n, start, lambda: busy(60), f"tests.test_stalls.busy_before_{i}")
        await parked(n, start, lambda: time.sleep(0.15), "tests.test_stalls.sleeps_on_the_loop")
        for i in range(3):
            await parked(n, start, lambda: busy(60), f"tests.test_stalls.busy_after_{i}")
        start.set()
    info = broker.ctx.stalls.fields()
    ours = [s for s in info["loop_stalls_recent"] if s["task"] == "test_stalls.sleeps_on_the_loop"]
    assert len(ours) == 1 and ours[0]["ms"] >= 150, info["loop_stalls_recent"]
    assert "test_stalls.sleeps_on_the_loop" not in info["loop_stalls_on_cpu_by_task"], ours
    # The window's wall time and the stall's are read at slightly different instants
    # (CI saw 150.21 against 150.23 ms): the window covers the stall to within 0.5 ms.
    assert ours[0]["cpu_window_ms"] >= ours[0]["ms"] - 0.5 and ours[0]["cpu_ms"] * 2 < ours[0]["cpu_window_ms"]

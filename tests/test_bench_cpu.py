"""bench.cpu reads another process's CPU time finer than /proc's 10 ms ticks, exited
threads included, so a short case never reports 0 µs of broker CPU per message."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench.cpu import cpu_seconds

# The child burns the CPU milliseconds it reads on stdin, in a thread that then exits,
# and says how much its own process clock moved.
CHILD = """
import sys, threading, time
def burn(ms):
    end = time.thread_time() + ms / 1000
    while time.thread_time() < end:
        pass
print("ready", flush=True)
for line in sys.stdin:
    t0 = time.process_time()
    t = threading.Thread(target=burn, args=(float(line),))
    t.start(); t.join()
    print(time.process_time() - t0, flush=True)
"""


@pytest.mark.parametrize("ms", [2.0, 7.0, 40.0])
def test_a_burst_shorter_than_a_tick_in_a_thread_that_exits_is_measured(ms: float) -> None:
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdin and child.stdout
        assert child.stdout.readline() == "ready\n"  # start-up is over
        before = cpu_seconds(child.pid)
        child.stdin.write(f"{ms}\n")
        child.stdin.flush()
        own = float(child.stdout.readline())  # the child has finished the burst
        after = cpu_seconds(child.pid)
    finally:
        child.kill()
        child.wait()
    assert own >= ms / 1000
    # What we read from outside is what the child read from inside, plus the little it
    # spent reading stdin and printing: never the 0 or 10 ms a tick count would give.
    assert own <= after - before <= own + 0.005, (before, after, own)


def test_a_process_that_is_gone_reads_zero() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert cpu_seconds(child.pid) == 0.0

"""SIGKILL at random moments: every message reported durable survives, exactly once."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from clmq.broker.store import Store

from .crash_writer import QUEUES, config

WRITER = Path(__file__).with_name("crash_writer.py")


def run_and_kill(data_dir: Path, tag: str, delay_s: float, wait_ready: bool, mode: str = "commitlog") -> list[str]:
    """Start the writer, SIGKILL it ``delay_s`` after start (or after READY); return acked bodies."""
    proc = subprocess.Popen([sys.executable, str(WRITER), str(data_dir), tag, mode], stdout=subprocess.PIPE, text=True)
    acked: list[str] = []
    ready = threading.Event()

    def reader() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("READY"):
                ready.set()
            elif line.startswith("ACK "):
                acked.extend(line.split()[1:])

    t = threading.Thread(target=reader)
    t.start()
    if wait_ready:
        assert ready.wait(30), "writer did not start"
    # Not a wait: the random delay is the point, to land the kill at an arbitrary moment
    # of the appends (or of the recovery, when not waiting for READY).
    time.sleep(delay_s)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    t.join()
    return acked


@pytest.mark.slow
def test_acknowledged_messages_survive_sigkill(tmp_path: Path, mode: str) -> None:
    rng = random.Random(1234)
    acked: list[str] = []
    rounds = 12
    for r in range(rounds):
        # Most rounds die while appending; some while opening (recovery itself).
        wait_ready = r % 4 != 3
        acked += run_and_kill(
            tmp_path, f"r{r}", rng.uniform(0.05, 0.6) if wait_ready else rng.uniform(0.05, 0.4), wait_ready, mode
        )
        with Store.open(config(str(tmp_path), mode)) as store:
            stored: list[str] = []
            for q in range(QUEUES):
                msgs = store.get("c", q, 0, 1_000_000).messages if store.topics.queue_count("c") else []
                assert [m.queue_offset for m in msgs] == list(range(len(msgs)))  # dense offsets
                stored += [m.body.decode() for m in msgs]
            dupes = [b for b, n in Counter(stored).items() if n > 1]
            assert not dupes, f"round {r}: duplicated {dupes[:5]}"
            missing = set(acked) - set(stored)
            assert not missing, f"round {r}: {len(missing)} acknowledged messages lost, e.g. {sorted(missing)[:5]}"
    assert len(acked) > 1000  # the rounds did real work

"""The waits between a message's append and a long-polling consumer's receive() that
are not needed: a long poll that starts waiting ends the dispatcher's pause between
rounds (``Dispatcher.hurry``), so what was appended since its last round reaches the
poll without waiting out ``round_interval_ms``."""

from __future__ import annotations

import threading
from pathlib import Path

from clmq.commitlog import CommitLog, CommitLogConfig
from clmq.common import Message
from clmq.consumequeue import ConsumeQueueSet, Dispatcher

from .waiting import wait_until

LONG_PAUSE_MS = 600_000.0  # far longer than any test: only hurry() (or wake()) can end it


def _running(
    tmp_path: Path, round_interval_ms: float
) -> tuple[CommitLog, ConsumeQueueSet, Dispatcher, threading.Event, threading.Thread]:
    lg = CommitLog.open(tmp_path / "log", CommitLogConfig(), clean=False, checkpoint_offset=None)
    queues = ConsumeQueueSet(tmp_path / "cq", 16, 8)
    d = Dispatcher(lg, queues, 0)
    stop = threading.Event()
    t = threading.Thread(target=d.dispatch_loop, args=(stop, 100, round_interval_ms), daemon=True)
    t.start()
    return lg, queues, d, stop, t


def _stop(lg: CommitLog, d: Dispatcher, stop: threading.Event, t: threading.Thread) -> None:
    stop.set()
    d.wake()
    t.join(10)
    assert not t.is_alive()
    lg.close()


def test_a_waiting_reader_ends_the_pause_between_rounds(tmp_path: Path) -> None:
    lg, queues, d, stop, t = _running(tmp_path, LONG_PAUSE_MS)
    try:
        lg.append([Message("t", 0, b"first")])  # after a quiet spell: dispatched at once
        wait_until(lambda: queues.queue("t", 0).next_offset == 1, 10, "the first record dispatched")
        lg.append([Message("t", 0, b"second"), Message("t", 1, b"third")])  # the loop now pauses 600 s
        d.hurry()
        wait_until(
            lambda: queues.queue("t", 0).next_offset == 2 and queues.queue("t", 1).next_offset == 1,
            10,
            "the records appended during the pause dispatched once a reader waits",
        )
        assert d.hurried == 1
    finally:
        _stop(lg, d, stop, t)

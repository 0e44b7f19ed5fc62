"""Progress of a recovery (issue 18): the storage layer reports the validation of the
CommitLog after an unclean shutdown to the registered sink, in order, up to its total;
a sink that fails does not fail the recovery; the broker's start renders it."""

from __future__ import annotations

from pathlib import Path

from clmq.commitlog import CommitLog, CommitLogConfig, set_progress_sink
from tests.conftest import msgs

CFG = CommitLogConfig(segment_bytes=32 * 1024, max_message_bytes=4096, boundary_interval_bytes=4096)


def filled_log(path: Path) -> int:
    log = CommitLog.open(path, CFG, clean=False, checkpoint_offset=None)
    for _ in range(40):
        assert log.append(msgs("t", 20, 4, size=300)).ok
    log.flush()
    end = log.write_offset
    log.abandon()  # as if the process died: the next open validates everything
    return end


def test_a_recovery_reports_its_progress_in_order_up_to_the_total(tmp_path: Path) -> None:
    end = filled_log(tmp_path)
    seen: list[tuple[str, int, int]] = []
    set_progress_sink(lambda phase, done, total: seen.append((phase, done, total)))
    try:
        CommitLog.open(tmp_path, CFG, clean=False, checkpoint_offset=None).close()
    finally:
        set_progress_sink(None)
    assert len(seen) > 3 and all("validating" in phase for phase, _, _ in seen)
    done = [d for _, d, _ in seen]
    assert done == sorted(done) and seen[-1][1] == seen[-1][2] >= end - CFG.segment_bytes  # to the end of the log


def test_a_failing_sink_does_not_fail_the_recovery(tmp_path: Path) -> None:
    filled_log(tmp_path)

    def broken(phase: str, done: int, total: int) -> None:
        raise RuntimeError("the display went away")

    set_progress_sink(broken)
    try:
        log = CommitLog.open(tmp_path, CFG, clean=False, checkpoint_offset=None)
        assert log.write_offset > 0
        log.close()
    finally:
        set_progress_sink(None)

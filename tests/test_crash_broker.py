"""SIGKILL a real broker (sync flush) at random moments under load, in both storage
modes, and restart it on the same data directory; then read everything back through
the public consumer. No acknowledged message may be missing or read back different;
a message may be stored twice only if its send failed and was retried."""

from __future__ import annotations

from pathlib import Path

import pytest

from clmq.client import MessageQueue, Record, SendResult

from .crash_broker import Batch, Figures, Ledger, audit, audit_live, body_for, crash_loop, digest


def check(figures: Figures, rounds: int, root: Path) -> None:
    print(f"\nkill -9 loop: {figures.summary()}")
    assert not (root / "data" / "abort").exists(), "the last, graceful stop left the unclean-shutdown marker"
    detail = f"{figures.summary()}; e.g. {figures.examples[:5]}"
    assert figures.rounds == rounds, detail
    assert figures.healthy_rounds == rounds, detail  # the produce right after every restart succeeded
    assert (
        figures.topics_missing == 0 and figures.missing == 0 and figures.short_queues == 0 and figures.reassigned == 0
    ), detail
    assert figures.differing == 0 and figures.unknown == 0, detail
    assert figures.holes == 0 and figures.unclean_stops == 0, detail
    assert figures.unexplained_duplicates == 0, detail
    assert figures.live_differing == 0 and figures.live_read > 0, detail  # what the group received while sending
    assert figures.offsets_checked > 0 and figures.offsets_beyond_end == 0 and figures.offsets_went_back == 0, detail
    assert figures.acked > 0 and figures.read >= figures.acked, detail


async def test_acknowledged_messages_survive_broker_sigkill_quick(tmp_path: Path, mode: str) -> None:
    rounds = 3
    figures = await crash_loop(tmp_path, mode, rounds, (100, 300), 14)
    check(figures, rounds, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_acknowledged_messages_survive_broker_sigkill(tmp_path: Path, mode: str) -> None:
    rounds = 50
    figures = await crash_loop(tmp_path, mode, rounds, (100, 600), 1414, 5)
    check(figures, rounds, tmp_path)


def _record(topic: str, queue_id: int, offset: int, body: bytes) -> Record:
    host = ("127.0.0.1", 1)
    return Record(topic, queue_id, offset, 0, len(body), body, "", "", {}, 0, 0, 0, host, host, 0)


def test_the_audit_counts_every_kind_of_fault() -> None:
    """The checker itself: each fault the loop looks for is counted (a check that cannot
    fail would pass the loop whatever the broker did)."""
    ledger = Ledger()
    batch = Batch("t", 0, [f"m{i}" for i in range(6)], [body_for(f"m{i}", 40) for i in range(6)])
    ledger.sent.update((i, digest(b)) for i, b in zip(batch.ids, batch.bodies))
    ledger.failed(Batch("t", 0, ["m5"], [batch.bodies[5]]))  # m5's first send failed; it was retried
    mq = MessageQueue("t", "b", 0, "a")
    assert (
        ledger.record(Batch("t", 0, batch.ids[:5], batch.bodies[:5]), SendResult(mq, [0, 1, 2, 3, 4], [0] * 5, True))
        == []
    )
    assert (
        len(ledger.record(Batch("t", 0, ["m5"], [batch.bodies[5]]), SendResult(mq, [4], [0], True))) == 1
    )  # offset 4 again
    b = batch.bodies
    records = [
        _record("t", 0, 0, b[0]),  # m0 good
        _record("t", 0, 1, b[2]),  # another message at m1's acknowledged offset: differing
        _record("t", 0, 2, b[2]),  # m2 good, and m2 twice without a retry: an unexplained duplicate
        # offset 3 (m3) absent: missing, and a hole
        _record("t", 0, 4, b[4]),
        _record("t", 0, 5, b"x" * 10),  # never sent
        _record("t", 0, 6, b[5]),
        _record("t", 0, 7, b[5]),
    ]  # m5 twice: its retry, allowed
    figures = Figures()
    audit(ledger, records, figures)
    assert (figures.acked, figures.read, figures.missing, figures.differing, figures.holes, figures.unknown) == (
        5,
        7,
        1,
        1,
        1,
        1,
    )
    assert (figures.duplicates, figures.unexplained_duplicates) == (1 + 1, 1)
    live = {
        ("t", 0, 0): b[0],
        ("t", 0, 1): b[2],
        ("t", 0, 9): b[3],
        ("t", 0, 10): b"y" * 5,
    }  # good, differing, unacked, unknown
    audit_live(live, ledger, figures)
    assert (figures.live_read, figures.live_differing) == (4, 2)

"""Which producer groups are polling CHECK_TRANSACTIONS, and the checks of the half
messages of groups that are not: RocketMQ's checker counts every look at a half
message due for a check, answered or not, so a half whose producers all died (or
never poll) reaches ``transaction_check_max`` and ``transaction_unresolved`` decides;
without that it would stay pending for ever and hold the CommitLog's retention."""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Container

import trio

from clmq.common import TRANS_OP_CHECK
from clmq.protocol.transport import RequestError

from .._config import BrokerConfig
from .._context import BrokerContext
from ._ending import op_record, store_together
from ._pending import Half, PendingSet

log = logging.getLogger("clmq.transactions")


COUNT_RECORDS_PER_CALL = 10_000  # check op records of unpolled halves stored per store call (~1.5 MB)


def wall_ms() -> int:
    """Wall-clock milliseconds since the epoch (the times halves are scheduled by)."""
    return int(time.time() * 1000)


class Polls:
    """When each group last polled (a poll's start or end), for the groups that polled
    within ``transaction_orphan_after_ms``; ``waiters`` are the polls waiting now."""

    def __init__(self, config: BrokerConfig, waiters: dict[str, list[trio.Event]]) -> None:
        self.config, self.waiters = config, waiters
        self.last_ms: dict[str, int] = {}  # group -> wall ms of its last poll's start or end
        self.started_ms = 0  # wall ms the leader's pending set was built

    def restart(self, now_ms: int) -> None:
        """A leader's pending set was (re)built: every group counts as having polled now
        (its producers may be reconnecting to this new leader)."""
        self.started_ms, self.last_ms = now_ms, {}

    def polled(self, group: str) -> None:
        """A CHECK_TRANSACTIONS poll of ``group`` began or ended now."""
        self.last_ms[group] = wall_ms()

    def polling(self, group: str, now_ms: int) -> bool:
        """A producer of ``group`` polls now or polled within ``transaction_orphan_after_ms``
        (a live producer polls again as soon as it has answered its checks)."""
        if self.waiters.get(group):
            return True
        return now_ms - self.last_ms.get(group, self.started_ms) <= self.config.transaction_orphan_after_ms

    def why(self, group: str, now_ms: int) -> str:
        """What a decision's log line adds when the group has no producer polling."""
        return "" if self.polling(group, now_ms) else " (no producer of the group polled)"

    def unclaimed(self, halves: PendingSet, now_ms: int, ending: Container[int]) -> list[Half]:
        """The halves handed to a polling group's polls that none took within
        ``transaction_orphan_after_ms`` (its pollers may not WRITE their real topic, say):
        a look that counts as a check, else a poll that is never handed them would keep
        them from being counted for ever. Oldest first; stops at the first one still fresh."""
        out, window = [], self.config.transaction_orphan_after_ms
        for group, ready in halves.ready.items():
            if not self.polling(group, now_ms):
                continue  # counted whole by the caller
            for half in ready.values():
                if now_ms - half.ready_ms <= window:
                    break
                if half.offset in halves.pending and half.offset not in ending:
                    out.append(half)
        return out

    def forget_quiet(self, now_ms: int) -> None:
        """Drop the groups quiet for longer than ``transaction_orphan_after_ms`` (they
        count as not polling either way): the map holds the groups polling lately only."""
        timeout = self.config.transaction_orphan_after_ms
        for group in [g for g, t in self.last_ms.items() if now_ms - t > timeout]:
            del self.last_ms[group]


async def count_unasked(ctx: BrokerContext, halves: PendingSet, orphans: list[Half], now_ms: int) -> None:
    """Halves due for a check whose group has no producer polling: the look counts as a
    check, recorded by a check op record as an asked one (so the count survives a
    crash and a fail-over); due again ``transaction_timeout_ms`` later. If the records
    cannot be stored, nothing is counted and they are due again at the next look."""
    halves.asked(orphans, now_ms)
    counted: list[Half] = []
    for at in range(0, len(orphans), COUNT_RECORDS_PER_CALL):
        chunk = orphans[at : at + COUNT_RECORDS_PER_CALL]
        try:
            await store_together(ctx, [op_record(TRANS_OP_CHECK, h.offset) for h in chunk])
        except RequestError as e:
            rest = orphans[at:]
            log.warning("transactions: checks of %d half messages not counted: %s", len(rest), e.text)
            for half in rest:
                half.last_check_ms = 0
                halves.again(half)
            break
        for half in chunk:
            half.checks += 1
        counted += chunk
    halves.stats.checks += len(counted)
    for group, n in Counter(h.group for h in counted).items():
        log.info("transactions: no producer of group %s polls: %d of its half messages counted as checked", group, n)


def log_unresolved(msg_id: str, half: Half, why: str, outcome: str) -> None:
    """The warning of a half message decided by ``transaction_unresolved``: its id,
    group, real topic, checks, why (no producer polled) and ``outcome``."""
    log.warning(
        "transactions: half message %s of group %s for topic %s unresolved after %d checks%s: %s",
        msg_id,
        half.group,
        half.topic,
        half.checks,
        why,
        outcome,
    )

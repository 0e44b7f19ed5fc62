"""What a POP consumer keeps of each message it popped and has not settled: the
receipt handle the broker gave it (a :class:`clmq.common.Record` has no room for one:
its slots are the stored fields), and counts of what happened to them."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Iterator

from clmq.common import Record

# What ACK_MESSAGE and CHANGE_INVISIBLE_TIME answer per handle (protocol/_codes.py), and
# the client's own: "unreachable": no leader took the request within retry_budget_ms (the
# message comes back after its invisible time, unless a try nobody answered was applied);
# "unknown": a change whose retry was refused after a try whose outcome is unknown (it may
# have been applied under a handle this consumer never got: the message comes back after
# its invisible time, the new one or the old, to any member).
OK, EXPIRED, GONE, INVALID, UNREACHABLE, UNKNOWN = "ok", "expired", "gone", "invalid", "unreachable", "unknown"


@dataclass
class Receipt:
    """One popped message in flight with this member."""

    record: Record
    broker_name: str  # the replication group that popped it (its leader settles it)
    addr: str  # that group's leader when it was popped (followed when it moves)
    handle: str  # the current receipt handle (replaced by an extend)
    attempt: int  # 1: first delivery
    deadline_ms: int  # epoch ms: delivered again to the group unless settled before


@dataclass
class PopStats:
    """Counts since the consumer opened (plain attributes: read them any time)."""

    popped: int = 0  # messages received from brokers
    redelivered: int = 0  # of those, deliveries after the first (attempt > 1)
    acked: int = 0  # acknowledgements the broker took ("ok")
    ack_expired: int = 0  # acknowledgements refused: the invisible time had passed
    ack_gone: int = 0  # acknowledgements of messages settled already
    ack_invalid: int = 0  # handles the broker did not know
    unreachable: int = 0  # acks and changes no leader answered within retry_budget_ms
    unknown: int = 0  # changes whose outcome is unknown (a try timed out, the retry was refused)
    nacked: int = 0  # messages handed back (CHANGE_INVISIBLE_TIME with a delay) that the broker took
    extended: int = 0  # invisible times changed ("ok")
    released: int = 0  # popped, never handed out, made visible again at close
    pop_errors: int = 0  # POP requests that failed (retried with back-off)


# A receipt whose deadline passed this long ago is forgotten (its record was dropped
# without an ack, or is being handled for very long: an ack of it then answers "expired",
# as for any record this consumer holds no receipt of).
FORGET_AFTER_DEADLINE_MS = 10 * 60 * 1000
PRUNE_EVERY_ADDS = 4096  # receipts added between two looks for forgotten ones


class Receipts:
    """Receipts by record identity (the records handed out are the keys' owners: a
    receipt holds its record, so an id is not reused while it is here)."""

    def __init__(self) -> None:
        self._by_id: dict[int, Receipt] = {}
        self._adds = 0

    def add(self, receipt: Receipt) -> None:
        self._by_id[id(receipt.record)] = receipt
        self._adds += 1
        if self._adds % PRUNE_EVERY_ADDS == 0:
            self.prune(int(time.time() * 1000))

    def prune(self, now_ms: int) -> int:
        """Forget receipts past their deadline by ``FORGET_AFTER_DEADLINE_MS``; how many."""
        old = [k for k, r in self._by_id.items() if r.deadline_ms + FORGET_AFTER_DEADLINE_MS < now_ms]
        for k in old:
            del self._by_id[k]
        return len(old)

    def get(self, record: Record) -> Receipt | None:
        receipt = self._by_id.get(id(record))
        return receipt if receipt is not None and receipt.record is record else None

    def drop(self, record: Record) -> None:
        receipt = self._by_id.get(id(record))
        if receipt is not None and receipt.record is record:
            del self._by_id[id(record)]

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[Receipt]:
        return iter(list(self._by_id.values()))

    def split(self, records: Iterable[Record]) -> tuple[dict[str, list[tuple[int, Receipt]]], list[int]]:
        """``records`` by broker name as (position, receipt), and the positions of those
        without a receipt (settled through this consumer already, refused, forgotten, or
        not popped by it)."""
        by_broker: dict[str, list[tuple[int, Receipt]]] = {}
        missing: list[int] = []
        for i, record in enumerate(records):
            receipt = self.get(record)
            if receipt is None:
                missing.append(i)
            else:
                by_broker.setdefault(receipt.broker_name, []).append((i, receipt))
        return by_broker, missing

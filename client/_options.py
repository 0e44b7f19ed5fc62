"""A consumer's options and subscription filters (plain data, shared by the consumer
and its fetcher)."""

from __future__ import annotations

from dataclasses import dataclass


class TagFilter:
    """A subscription expression: ``*`` (everything) or ``TagA || TagB``."""

    def __init__(self, expression: str = "*") -> None:
        expr = expression.strip()
        self.expression = expr or "*"
        self.tags: list[str] | None = (
            None if self.expression == "*" else sorted({t.strip() for t in expr.split("||") if t.strip()})
        )

    def matches(self, tag: str) -> bool:
        return self.tags is None or tag in self.tags


@dataclass
class ConsumerOptions:
    mode: str = "clustering"  # or "broadcasting"
    start_from: str | int = "earliest"  # "earliest", "latest" or a timestamp in ms (for queues never committed)
    client_id: str = ""
    pull_batch: int = 256  # messages per queue per fetch
    pull_wait_ms: int = 15_000  # long poll of idle queues on the broker (woken by new messages; RocketMQ holds 15 s)
    fetch_queues: int = 1024  # queues per fetch request
    fetch_max_messages: int = 4096  # messages per fetch request, in all
    fetches_in_flight: int = 4  # data requests per broker
    watches_in_flight: int = 64  # long polls of idle queues per broker (each newly idle set gets one at once)
    heartbeat_interval_ms: int = 1000
    rebalance_interval_ms: int = 2000
    commit_interval_ms: int = 1000
    buffered_batches: int = 64  # pulled and not yet received (backpressure)
    request_timeout_ms: int = 3000
    # A queue whose next record is damaged (the broker answers CORRUPT) is paused and
    # asked again this often, in case an operator repairs it; the others go on.
    damaged_queue_retry_ms: int = 10_000

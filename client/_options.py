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
    # A commit that hits a dead or demoted leader (connection failed, NOT_LEADER) is
    # retried at the group's leader as fresh routes name it, for up to this long.
    retry_budget_ms: int = 15_000
    # A queue whose next record is damaged (the broker answers CORRUPT) is paused and
    # asked again this often, in case an operator repairs it; the others go on.
    damaged_queue_retry_ms: int = 10_000
    # Replication (docs/replication.md): pull from one of a group's followers instead of
    # its leader (commits, heartbeats and offset look-ups stay with the leader). Falls
    # back to the leader while the group has no follower or its follower fails.
    read_from_followers: bool = False
    # A leader's hint (suggest_follower: this consumer is far behind) moves the group's
    # pulls to a follower for this long, then back to the leader; 0: ignore hints.
    follower_read_hold_ms: int = 30_000
    # A follower that failed a pull (down, an error, or it lacks what was asked) is not
    # pulled from for this long: the leader serves meanwhile.
    follower_failure_backoff_ms: int = 5_000

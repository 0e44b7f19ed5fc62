"""A consumer's options and subscription filters (plain data, shared by the consumer
and its fetcher)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from clmq.protocol import MAX_RECONSUME_TIMES
from clmq.protocol.transport import ClientSecurity


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


@dataclass(frozen=True)
class ConsumerOptions:
    """A consumer's settings; :func:`open_consumer`, ``open_asyncio_consumer`` and
    ``BlockingConsumer`` take each as a keyword argument. Values are checked when made
    (a ``ValueError`` names the option), before any connection."""

    mode: Literal["clustering", "broadcasting"] = "clustering"
    # Where a queue this group never committed starts: its first or its next message, or
    # the first stored at or after a time (ms since the epoch).
    start_from: Literal["earliest", "latest"] | int = "earliest"
    client_id: str = ""
    pull_batch: int = 1024  # messages per queue per fetch
    pull_wait_ms: int = 15_000  # long poll of idle queues on the broker (woken by new messages; RocketMQ holds 15 s)
    fetch_queues: int = 1024  # queues per fetch request
    fetch_max_messages: int = 4096  # messages per fetch request, in all
    # Bytes of records per fetch answer (the broker stops adding queues past it, and
    # clamps it to its max_pull_bytes); a first message larger than it comes alone.
    fetch_max_bytes: int = 4 << 20
    # Bytes per watch answer (watches wake idle queues; data requests then read them):
    # small, so that up to watches_in_flight of them fit in the prefetch bound.
    watch_max_bytes: int = 64 << 10
    fetches_in_flight: int = 4  # data requests per broker
    watches_in_flight: int = 64  # long polls of idle queues per broker (each newly idle set gets one at once)
    # Prefetch: records fetched and not yet returned by receive(), plus what the
    # requests in flight may still bring, stay within this many bytes (a single
    # message larger than it is still fetched, alone). Fetches go on while the
    # application processes what receive() returned, so receive() rarely waits.
    prefetch_max_bytes: int = 32 << 20
    # Messages one receive() returns at most: everything buffered, across queues, up
    # to this (a queue's batch is never split, so one batch may exceed it).
    receive_max_messages: int = 4096
    heartbeat_interval_ms: int = 1000
    rebalance_interval_ms: int = 2000
    commit_interval_ms: int = 1000  # processed offsets are committed this often: one request per broker
    buffered_batches: int = 0  # obsolete (prefetch_max_bytes bounds the buffer); accepted and ignored
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
    # Redelivery (docs/consuming.md), clustering mode. Failed messages (Consumer.nack)
    # come back after a delay; after this many redeliveries they go to %DLQ%<group>
    # (None: the broker's max_reconsume_times, 16).
    max_reconsume_times: int | None = None
    # The delay before the n-th redelivery is retry_delays_ms[min(n - 1, len - 1)]
    # (None: the broker's back-off levels, 10 s ... 2 h).
    retry_delays_ms: tuple[int, ...] | None = None
    # Orderly consumption: each queue is processed by one member at a time, in order,
    # holding the queue's lock on its broker (clustering mode only).
    orderly: bool = False
    lock_retry_ms: int = 500  # assigned queues not locked yet (another member holds them) are asked for this often
    # Held locks are renewed this often (or every third of the broker's lock_lease_ms, 30 s, if that is shorter).
    lock_renew_interval_ms: int = 10_000
    orderly_retry_delay_ms: int = 1000  # orderly: a failed message is delivered again, in place, after this long
    # TLS and a login for every connection (None: from $CLMQ_TLS_*, $CLMQ_USER, $CLMQ_PASSWORD, else neither)
    security: ClientSecurity | None = None
    # Message traces (docs/traces.md): delivered, acked and sent-back events, written to %TRACE% in the background.
    trace: bool = False
    trace_buffer_max_events: int = 8192  # events waiting to be written; more are dropped (counted)
    trace_flush_interval_ms: int = 200  # buffered events are written at least this often

    def __post_init__(self) -> None:
        if type(self.trace) is not bool:
            raise ValueError(f"trace={self.trace!r}: must be True or False")
        if self.mode == "pop":  # type: ignore[comparison-overlap]
            raise ValueError(
                "mode='pop': POP consumption has its own consumer: use open_pop_consumer "
                "(asyncio: open_asyncio_pop_consumer; blocking: BlockingPopConsumer)"
            )
        if self.mode not in ("clustering", "broadcasting"):
            raise ValueError(f"mode={self.mode!r}: use clustering or broadcasting")
        if not _start_ok(self.start_from):
            raise ValueError(f"start_from={self.start_from!r}: use earliest, latest or a time in ms since the epoch")
        for name in _AT_LEAST_ONE:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.orderly and self.mode != "clustering":
            raise ValueError(
                f"orderly=True needs mode='clustering' (queue locks are per group), got mode={self.mode!r}"
            )
        if self.orderly_retry_delay_ms < 0:
            raise ValueError(f"orderly_retry_delay_ms must be >= 0, got {self.orderly_retry_delay_ms}")
        if self.max_reconsume_times is not None and not 0 <= self.max_reconsume_times <= MAX_RECONSUME_TIMES:
            raise ValueError(
                f"max_reconsume_times must be in 0..{MAX_RECONSUME_TIMES} (or None: the broker's), "
                f"got {self.max_reconsume_times}"
            )
        if self.retry_delays_ms is not None:
            object.__setattr__(self, "retry_delays_ms", tuple(self.retry_delays_ms))  # a list given: kept as a tuple
            if not self.retry_delays_ms or any(type(d) is not int or d < 0 for d in self.retry_delays_ms):
                raise ValueError(
                    f"retry_delays_ms must be a non-empty sequence of milliseconds >= 0 (or None: the "
                    f"broker's), got {self.retry_delays_ms!r}"
                )


def _start_ok(start: object) -> bool:
    """``earliest``, ``latest`` or a time in ms (an int, or its digits)."""
    if isinstance(start, str):
        return start in ("earliest", "latest") or start.isdigit()
    return type(start) is int and start >= 0


# Limits a consumer cannot work with at 0 (a byte bound of 0 left every fetch waiting).
_AT_LEAST_ONE = (
    "pull_batch",
    "fetch_queues",
    "fetch_max_messages",
    "fetch_max_bytes",
    "watch_max_bytes",
    "fetches_in_flight",
    "watches_in_flight",
    "prefetch_max_bytes",
    "receive_max_messages",
    "lock_retry_ms",
    "lock_renew_interval_ms",
    "trace_buffer_max_events",
    "trace_flush_interval_ms",
)

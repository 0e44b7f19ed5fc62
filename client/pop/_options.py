"""A POP consumer's options (plain data, checked when made)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from clmq.protocol import MAX_RECONSUME_TIMES
from clmq.protocol.transport import ClientSecurity

# The default back-off of a nack without a delay: the n-th attempt that failed waits
# DEFAULT_RETRY_DELAYS_MS[min(n - 1, len - 1)] before it is delivered again.
DEFAULT_RETRY_DELAYS_MS = (1_000, 5_000, 10_000, 30_000, 60_000, 120_000, 300_000)


@dataclass(frozen=True)
class PopConsumerOptions:
    """A POP consumer's settings; :func:`open_pop_consumer`, ``open_asyncio_pop_consumer``
    and ``BlockingPopConsumer`` take each as a keyword argument. Values are checked when
    made (a ``ValueError`` names the option), before any connection."""

    # How long a popped message stays invisible to the rest of the group (its member
    # acknowledges, nacks or extends it meanwhile); then it is delivered again.
    invisible_time_ms: int = 30_000
    max_messages: int = 32  # messages one POP_MESSAGE asks for (the broker clamps it to its pop_max_messages)
    # POP requests in flight per (topic, broker group): while one waits for its pop to be
    # stored, another is being answered (the prefetch bound holds for all of them).
    pops_in_flight: int = 2
    # Long poll: a POP finding nothing visible waits this long on the broker for messages
    # (the broker cuts it to its pop_max_wait_ms).
    pop_wait_ms: int = 15_000
    # Messages popped and not yet handed out by receive() (or run()): no POP is sent
    # while the buffer holds this many, so that messages do not wait out their invisible
    # time in this member while other members could take them.
    prefetch_max_messages: int = 64
    pop_max_bytes: int | None = None  # bytes of records one POP answer holds at most (None: the broker's)
    receive_max_messages: int = 32  # messages one receive() returns at most
    orderly: bool = False  # a queue's messages one batch at a time, in queue order (orderly POP)
    # After this many redeliveries a message goes to %DLQ%<group> (None: the broker's, 16).
    max_reconsume_times: int | None = None
    # nack() without a delay: the n-th failed attempt waits retry_delays_ms[min(n - 1, len - 1)].
    retry_delays_ms: tuple[int, ...] = DEFAULT_RETRY_DELAYS_MS
    start_from: Literal["earliest", "latest"] = "earliest"  # where a group new to a queue starts
    client_id: str = ""  # "" : host@pid@object
    handler_concurrency: int = 8  # run(): handlers running at once (orderly: queues handled at once)
    request_timeout_ms: int = 3000  # ACK and CHANGE_INVISIBLE_TIME requests; a POP waits pop_wait_ms more
    # ACKs and changes that hit a dead or demoted leader are retried at the leader fresh
    # routes name for up to this long (then the message is "unreachable": it comes back).
    retry_budget_ms: int = 15_000
    route_refresh_interval_ms: int = 10_000  # how often routes are asked again for new brokers and leaders
    max_backoff_ms: int = 2_000  # a broker that fails a POP is asked again after 50 ms, doubling up to this
    # On close, what was popped and never handed out is made visible at once
    # (CHANGE_INVISIBLE_TIME 0) instead of waiting out its invisible time.
    release_on_close: bool = True
    # TLS and a login for every connection (None: from $CLMQ_TLS_*, $CLMQ_USER, $CLMQ_PASSWORD, else neither)
    security: ClientSecurity | None = None

    def __post_init__(self) -> None:
        for name in _AT_LEAST_ONE:
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("pop_wait_ms", "max_backoff_ms"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ValueError(f"{name} must be milliseconds >= 0, got {value!r}")
        if self.pop_max_bytes is not None and (type(self.pop_max_bytes) is not int or self.pop_max_bytes < 1):
            raise ValueError(f"pop_max_bytes must be bytes >= 1 (or None: the broker's), got {self.pop_max_bytes!r}")
        if self.start_from not in ("earliest", "latest"):
            raise ValueError(f"start_from={self.start_from!r}: use earliest or latest")
        for name in ("orderly", "release_on_close"):
            if type(getattr(self, name)) is not bool:
                raise ValueError(f"{name}={getattr(self, name)!r}: must be True or False")
        if self.max_reconsume_times is not None and not (
            type(self.max_reconsume_times) is int and 0 <= self.max_reconsume_times <= MAX_RECONSUME_TIMES
        ):
            raise ValueError(
                f"max_reconsume_times must be in 0..{MAX_RECONSUME_TIMES} (or None: the broker's), "
                f"got {self.max_reconsume_times!r}"
            )
        delays = self.retry_delays_ms
        if isinstance(delays, list):
            delays = tuple(delays)
            object.__setattr__(self, "retry_delays_ms", delays)  # a list given: kept as a tuple
        if not isinstance(delays, tuple) or not delays or any(type(d) is not int or d < 0 for d in delays):
            raise ValueError(f"retry_delays_ms must be a non-empty sequence of milliseconds >= 0, got {delays!r}")
        if not isinstance(self.client_id, str):
            raise ValueError(f"client_id must be a string, got {self.client_id!r}")

    def retry_delay_ms(self, attempt: int) -> int:
        """The back-off of a nack without a delay after the ``attempt``-th delivery failed."""
        delays = self.retry_delays_ms
        return delays[min(max(attempt, 1) - 1, len(delays) - 1)]


_AT_LEAST_ONE = (
    "invisible_time_ms",
    "max_messages",
    "pops_in_flight",
    "prefetch_max_messages",
    "receive_max_messages",
    "handler_concurrency",
    "request_timeout_ms",
    "retry_budget_ms",
    "route_refresh_interval_ms",
)

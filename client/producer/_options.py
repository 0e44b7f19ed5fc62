"""The producer's options (:class:`ProducerOptions`): one frozen dataclass, checked
when made, read by the producer, its accumulator and its senders."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from clmq.protocol.transport import ClientSecurity

from ._transaction import TransactionListener, check_wrapped
from ._tries import RetryPolicy

DEFAULT_RETRIES = 2
DEFAULT_RETRY_BUDGET_MS = 15_000
BUFFER_FULL_MODES = ("block", "raise")


@dataclass(frozen=True)
class ProducerOptions:
    """A producer's settings; :func:`open_producer`, ``open_asyncio_producer`` and
    ``BlockingProducer`` take each as a keyword argument (see :class:`Producer` for
    what they do). Every value is checked here: a ``ValueError`` names the option."""

    send_timeout_ms: int = 3000  # an answer not here by then: an unknown outcome (retried with dedup)
    # Tries: at least 1 + retries (None: 2), and beyond that until retry_budget_ms since
    # the submit (None: 15 s; 0 when retries is given, the count-only behaviour of old).
    retries: int | None = None
    fault_backoff_ms: int = 3000  # a broker that failed is skipped by round robin for this long
    replication_retry_backoff_ms: int = 200  # the pause before a retry after NOT_ENOUGH_REPLICAS
    retry_budget_ms: int | None = None
    retry_backoff_ms: int = 50  # the pause before a retry, doubled each time ...
    retry_backoff_max_ms: int = 500  # ... up to this
    unique_ids: bool = True  # UNIQ_KEY per message: off, a retry after an unknown outcome may store twice
    linger_ms: int = 0  # how long a batch waits for more (0: sent at once, coalescing what comes meanwhile)
    batch_max_bytes: int = 1 << 20  # a request's batches, per broker and topic (a larger batch goes alone)
    max_in_flight: int = 5  # requests per broker
    buffer_max_bytes: int = 64 << 20  # encoded bytes accepted and not yet answered
    buffer_full: Literal["block", "raise"] = "block"  # when the buffer is full: wait, or BufferFullError at once
    buffer_block_max_ms: int = 60_000  # "block": waits this long for room, then BufferFullError
    # TLS and a login for every connection (None: from $CLMQ_TLS_*, $CLMQ_USER, $CLMQ_PASSWORD, else neither)
    security: ClientSecurity | None = None
    # Message traces (docs/traces.md): a `sent` event per message, written to %TRACE% in the background.
    trace: bool = False
    trace_buffer_max_events: int = 8192  # events waiting to be written; more are dropped (counted)
    trace_flush_interval_ms: int = 200  # buffered events are written at least this often
    # Transactions (send_in_transaction, docs/transactions.md): the producer group the
    # broker checks back with, and the listener that executes and checks local
    # transactions (with a group, the producer polls the brokers for checks).
    transaction_group: str | None = None
    transaction_listener: TransactionListener | None = None
    transaction_check_concurrency: int = 4  # checks run at once
    transaction_check_timeout_ms: int = 5_000  # a check slower than this: UNKNOWN (asked again later)

    def __post_init__(self) -> None:
        _check_positive(self, "send_timeout_ms", "batch_max_bytes", "max_in_flight", "buffer_max_bytes")
        _check_positive(self, "trace_buffer_max_events", "trace_flush_interval_ms")
        _check_not_negative(
            self,
            "retry_backoff_ms",
            "retry_backoff_max_ms",
            "fault_backoff_ms",
            "replication_retry_backoff_ms",
            "linger_ms",
            "buffer_block_max_ms",
        )
        for name in ("retries", "retry_budget_ms"):
            if getattr(self, name) is not None:
                _check_not_negative(self, name)
        if self.buffer_full not in BUFFER_FULL_MODES:
            raise ValueError(f"buffer_full={self.buffer_full!r}: must be one of {', '.join(BUFFER_FULL_MODES)}")
        for flag in ("unique_ids", "trace"):
            if type(getattr(self, flag)) is not bool:
                raise ValueError(f"{flag}={getattr(self, flag)!r}: must be True or False")
        self._check_transactions()

    def _check_transactions(self) -> None:
        _check_positive(self, "transaction_check_concurrency", "transaction_check_timeout_ms")
        group = self.transaction_group
        if group is not None and (not isinstance(group, str) or not group or group.startswith("%")):
            raise ValueError(f"transaction_group={group!r}: must be a group name (not empty, not starting with %)")
        if self.transaction_listener is not None:
            check_wrapped(self.transaction_listener)

    def retry_policy(self) -> RetryPolicy:
        """The retry settings, defaults applied (see ``retries``)."""
        retries = DEFAULT_RETRIES if self.retries is None else self.retries
        budget_ms = self.retry_budget_ms
        if budget_ms is None:
            budget_ms = DEFAULT_RETRY_BUDGET_MS if self.retries is None else 0
        return RetryPolicy(
            retries,
            budget_ms,
            self.retry_backoff_ms,
            self.retry_backoff_max_ms,
            self.fault_backoff_ms,
            self.replication_retry_backoff_ms,
        )


def _check_positive(options: ProducerOptions, *names: str) -> None:
    for name in names:
        value = getattr(options, name)
        if type(value) is not int or value <= 0:
            raise ValueError(f"{name}={value!r}: must be a positive integer")


def _check_not_negative(options: ProducerOptions, *names: str) -> None:
    for name in names:
        value = getattr(options, name)
        if type(value) is not int or value < 0:
            raise ValueError(f"{name}={value!r}: must be an integer >= 0")

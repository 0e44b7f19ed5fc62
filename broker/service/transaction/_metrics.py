"""Transactions' Prometheus metrics, read from the running service when scraped."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ._service import Transactions


class TransactionCollector:
    """``clmq_transactions_pending`` (-1: no leader's service runs here), and the
    committed, rolled back and checks counters (since this broker became the leader)."""

    def __init__(self, service: Transactions) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        """The transaction service's gauges and counters, read from ``Transactions.fields()``."""
        f = self.service.fields()
        yield GaugeMetricFamily(
            "clmq_transactions_pending",
            "Half messages stored and not yet committed or rolled back (-1: not the leader)",
            value=int(f["transactions_pending"]),
        )
        yield GaugeMetricFamily(
            "clmq_transactions_failing",
            "1 while the transaction service is stopped by an error (retried every second)",
            value=1 if f["transactions_failure"] else 0,
        )
        for name, text in (
            ("committed", "Half messages committed (made visible in their real queue) since start"),
            ("rolled_back", "Half messages rolled back (by their producer or as unresolved) since start"),
            ("checks", "Check-backs asked of producers since start"),
        ):
            yield CounterMetricFamily(f"clmq_transactions_{name}", text, value=int(f[f"transactions_{name}"]))

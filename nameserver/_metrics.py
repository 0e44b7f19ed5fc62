"""The name server's Prometheus metrics: requests per code (count, errors, latency),
brokers registered (healthy or not), topics routed. Read when scraped."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from clmq.protocol import RequestCode
from clmq.protocol.transport import LoginStats, RequestStats, metrics_page, rendered_in_thread

from ._routes import RouteTable


def _no_failures() -> int:
    return 0


class NameServerCollector:
    def __init__(
        self,
        routes: RouteTable,
        requests: RequestStats,
        tls_failures: Callable[[], int] = _no_failures,
        logins: LoginStats | None = None,
    ) -> None:
        self.routes, self.requests = routes, requests
        self.tls_failures = tls_failures
        self.logins = logins or LoginStats()

    def collect(self) -> Iterator[Metric]:
        total = CounterMetricFamily("clmq_nameserver_requests", "Requests answered, per request code", labels=["code"])
        errors = CounterMetricFamily(
            "clmq_nameserver_request_errors", "Requests answered with an error", labels=["code"]
        )
        latency = HistogramMetricFamily(
            "clmq_nameserver_request_duration_seconds", "From taking a request up to its answer", labels=["code"]
        )
        for code, st, cumulative in self.requests.histogram_rows():
            name = RequestCode(code).name if code in RequestCode._value2member_map_ else str(code)
            total.add_metric([name], st.requests)
            errors.add_metric([name], st.errors)
            latency.add_metric([name], cumulative, st.seconds_sum)
        yield from (total, errors, latency)
        brokers = self.routes.cluster(time.monotonic() * 1000)
        registered = GaugeMetricFamily("clmq_nameserver_brokers", "Brokers registered", labels=["healthy"])
        registered.add_metric(["true"], sum(1 for b in brokers if b.get("healthy", True)))
        registered.add_metric(["false"], sum(1 for b in brokers if not b.get("healthy", True)))
        yield registered
        topics = {t for b in brokers for t in b.get("topics", {})}
        yield GaugeMetricFamily("clmq_nameserver_topics", "Topics routed", value=len(topics))
        failures = CounterMetricFamily(
            "clmq_tls_handshake_failures", "TLS handshakes that failed, per listener", labels=["listener"]
        )
        failures.add_metric(["native"], self.tls_failures())
        yield failures
        yield CounterMetricFamily(
            "clmq_login_failures", "Failed logins, answered late and logged with the peer", value=self.logins.failed
        )
        yield CounterMetricFamily("clmq_requests_denied", "Requests the ACLs refused", value=self.logins.denied)


def metrics_registry(
    routes: RouteTable,
    requests: RequestStats,
    tls_failures: Callable[[], int] = _no_failures,
    logins: LoginStats | None = None,
) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(NameServerCollector(routes, requests, tls_failures, logins))
    return registry


def metrics_route(registry: CollectorRegistry) -> Any:
    """The HTTP route of the metrics port: GET /metrics (collected on the loop, rendered
    in a worker thread)."""
    return metrics_page(rendered_in_thread(registry.collect, generate_latest), CONTENT_TYPE_LATEST)

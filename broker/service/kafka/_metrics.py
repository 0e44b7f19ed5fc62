"""The Kafka listener's Prometheus metrics (read when scraped, like the broker's own):
requests, failures and answer times per Kafka API, connections, connections refused
and closed for bad input, and the Kafka groups."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from clmq.protocol.kafka import api_name

if TYPE_CHECKING:
    from ._service import KafkaService


class KafkaCollector:
    """A Prometheus collector of one broker's Kafka listener."""

    def __init__(self, service: KafkaService) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        yield from self._requests()
        listener = self.service.listener
        yield GaugeMetricFamily("clmq_kafka_connections", "Kafka client connections open", value=listener.connections)
        yield CounterMetricFamily(
            "clmq_kafka_connections_refused",
            "Kafka connections closed at once: kafka_max_connections reached",
            value=listener.refused_connections,
        )
        yield CounterMetricFamily(
            "clmq_kafka_closed_bad_input",
            "Kafka connections closed for a request that could not be decoded or was too large",
            value=listener.closed_bad_input,
        )
        yield CounterMetricFamily(
            "clmq_kafka_login_failures", "Failed SASL logins on the Kafka listener", value=self.service.sasl.failed
        )
        yield CounterMetricFamily(
            "clmq_kafka_requests_denied",
            "Kafka requests (or parts of them) the ACLs refused",
            value=self.service.denied,
        )
        groups = self.service.groups.groups()
        yield GaugeMetricFamily("clmq_kafka_groups", "Kafka consumer groups this broker coordinates", value=len(groups))
        yield GaugeMetricFamily(
            "clmq_kafka_group_members", "Members of the Kafka groups", value=sum(len(g["members"]) for g in groups)
        )

    def _requests(self) -> Iterator[Metric]:
        total = CounterMetricFamily("clmq_kafka_requests", "Kafka requests answered, per API", labels=["api"])
        failed = CounterMetricFamily(
            "clmq_kafka_request_failures", "Kafka requests whose handler failed (connection closed)", labels=["api"]
        )
        latency = HistogramMetricFamily(
            "clmq_kafka_request_duration_seconds", "From reading a Kafka request to its answer ready", labels=["api"]
        )
        for key, st, cumulative in self.service.listener.stats.histogram_rows():
            name = api_name(key).lower()
            total.add_metric([name], st.requests)
            failed.add_metric([name], st.errors)
            latency.add_metric([name], cumulative, st.seconds_sum)
        yield from (total, failed, latency)

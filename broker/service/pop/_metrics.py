"""POP's Prometheus metrics, read from the running service when scraped."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ._service import PopService

_COUNTERS = (
    ("popped", "Messages delivered by POP (first deliveries and redeliveries) since this leader started"),
    ("acked", "POP deliveries acknowledged since this leader started"),
    ("ack_expired", "Acknowledgements refused: the delivery's invisible time had passed, or it was delivered again"),
    ("redelivered", "POP deliveries of messages delivered before (not acknowledged in time, or nacked)"),
    ("dead_lettered", "POP messages copied to their group's dead-letter topic"),
)


class PopCollector:
    """``clmq_pop_*`` per group: the counters since this broker became the leader and
    the in-flight gauge (nothing while no leader's POP state runs here)."""

    def __init__(self, service: PopService) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        """The POP service's counters and gauge, labelled by group."""
        state = self.service.state
        groups = sorted(state.groups.items()) if state is not None else []
        for name, text in _COUNTERS:
            family = CounterMetricFamily(f"clmq_pop_{name}", text, labels=["group"])
            for group, g in groups:
                family.add_metric([group], getattr(g.stats, name))
            yield family
        inflight = GaugeMetricFamily(
            "clmq_pop_inflight", "POP deliveries not yet settled (popped, not acknowledged)", labels=["group"]
        )
        for group, g in groups:
            inflight.add_metric([group], g.inflight())
        yield inflight
        yield GaugeMetricFamily(
            "clmq_pop_failing",
            "1 while the POP service is stopped by an error (rebuilt every second)",
            value=1 if self.service.failure or self.service.save_failure else 0,
        )

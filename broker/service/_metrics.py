"""The broker's numbers for people and machines: traffic per topic, rates, status
fields of BROKER_INFO, and a Prometheus collector that reads all of it when scraped.

Counting on the request path is a few integer adds (``TopicTraffic``); everything else
(store size, group lag, replication lag, fsync times) is read from the running state
at scrape time, bounded in cost.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from importlib import metadata as importlib_metadata
from typing import Any, Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from clmq.commitlog import FSYNC_BUCKETS_S
from clmq.protocol import RequestCode
from clmq.protocol.transport import RequestStats, cumulative_buckets

from ._context import BrokerContext
from ._index_requests import index_fields
from ._trace_buffer import trace_fields

METRICS_MAX_LAG_SERIES = 10_000  # group lag series per scrape at most (a label per group and queue)


def clmq_version() -> str:
    try:
        return importlib_metadata.version("clmq")
    except importlib_metadata.PackageNotFoundError:  # run from a source tree
        return "0.1.0+source"


def status_fields(ctx: BrokerContext, started: float) -> dict[str, Any]:
    """The fields BROKER_INFO adds for ``clmq broker status`` and the dashboard."""
    store = ctx.store
    directory = store.directory
    usage = shutil.disk_usage(directory)
    segments = _segments(ctx)
    return {
        "version": clmq_version(),
        "uptime_s": round(time.monotonic() - started, 1),
        "disk_used_bytes": usage.used,
        "disk_free_bytes": usage.free,
        "disk_total_bytes": usage.total,
        "store_bytes": sum(size for _base, size, _path in segments),
        "segments": len(segments),
        **ctx.traffic.rates(),
        **trace_fields(ctx.config, ctx.tracer),
        **index_fields(store),
        **ctx.stalls.fields(),
    }


def _segments(ctx: BrokerContext) -> list[tuple[int, int, Any]]:
    log = getattr(ctx.store, "log", None)
    return list(log.segments()) if log is not None else []


def open_files() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # not Linux: unknown
        return -1


class BrokerCollector:
    """A Prometheus collector reading the broker's state when scraped."""

    def __init__(
        self,
        ctx: BrokerContext,
        requests: RequestStats,
        connections: Any,
        timer: Callable[[], dict[str, int | str]] | None = None,
        tls_failures: Callable[[], dict[str, int]] | None = None,
    ) -> None:
        self.ctx, self.requests, self.connections = ctx, requests, connections
        self.timer = timer  # BROKER_INFO's timer fields
        self.tls_failures = tls_failures  # failed TLS handshakes per listener

    def collect(self) -> Iterator[Metric]:
        yield from self._traffic()
        yield from self._request_metrics()
        yield from self._store_metrics()
        yield from self._group_lag()
        yield from self._replication()
        yield from self._timer()
        yield from self._tls()
        yield from self._access()
        yield from self.ctx.stalls.metrics()

    def _access(self) -> Iterator[Metric]:
        stats = self.ctx.security.access.stats  # both listeners' (native and Kafka)
        yield CounterMetricFamily(
            "clmq_login_failures", "Failed logins, answered late and logged with the peer", value=stats.failed
        )
        yield CounterMetricFamily(
            "clmq_requests_denied", "Requests (or parts of them) the ACLs refused", value=stats.denied
        )

    def _tls(self) -> Iterator[Metric]:
        failures = CounterMetricFamily(
            "clmq_tls_handshake_failures", "TLS handshakes that failed, per listener", labels=["listener"]
        )
        for listener, count in sorted((self.tls_failures() if self.tls_failures else {}).items()):
            failures.add_metric([listener], count)
        yield failures

    def _timer(self) -> Iterator[Metric]:
        if self.timer is None:
            return
        f = self.timer()
        yield _gauge(
            "clmq_timer_pending_messages",
            "Scheduled messages not yet delivered (-1: no timer runs here)",
            int(f["timer_pending"]),
        )
        yield _gauge(
            "clmq_timer_memory_bytes",
            "Memory the timer holds (wheel, links, this second)",
            int(f["timer_memory_bytes"]),
        )
        yield _gauge(
            "clmq_timer_failing",
            "1 while the timer is stopped by an error (retried every second)",
            1 if f["timer_failure"] else 0,
        )
        for name, text in (
            ("delivered", "Scheduled messages delivered since start"),
            ("cancelled", "Scheduled messages cancelled at their time since start"),
            ("undeliverable", "Scheduled messages dropped: real queue gone or record damaged"),
        ):
            yield CounterMetricFamily(f"clmq_timer_{name}", text, value=int(f[f"timer_{name}"]))

    def _traffic(self) -> Iterator[Metric]:
        names = (
            ("messages_in", "Messages stored, per topic"),
            ("bytes_in", "Message bytes stored, per topic"),
            ("messages_out", "Messages served to readers, per topic"),
            ("bytes_out", "Record bytes served to readers, per topic"),
        )
        for i, (name, text) in enumerate(names):
            family = CounterMetricFamily(f"clmq_{name}", text, labels=["topic"])
            for topic, row in sorted(self.ctx.traffic.by_topic.items()):
                family.add_metric([topic], row[i])
            yield family

    def _request_metrics(self) -> Iterator[Metric]:
        total = CounterMetricFamily("clmq_requests", "Requests answered, per request code", labels=["code"])
        errors = CounterMetricFamily(
            "clmq_request_errors", "Requests answered with an error, per code", labels=["code"]
        )
        latency = HistogramMetricFamily(
            "clmq_request_duration_seconds", "From taking a request up to its answer queued", labels=["code"]
        )
        for code, st, cumulative in self.requests.histogram_rows():
            name = _code_name(code)
            total.add_metric([name], st.requests)
            errors.add_metric([name], st.errors)
            latency.add_metric([name], cumulative, st.seconds_sum)
        yield from (total, errors, latency)

    def _store_metrics(self) -> Iterator[Metric]:
        store = self.ctx.store
        segments = _segments(self.ctx)
        yield _gauge("clmq_store_bytes", "Bytes of CommitLog segments on disk", sum(s for _b, s, _p in segments))
        yield _gauge("clmq_store_segments", "CommitLog segment files", len(segments))
        yield _gauge("clmq_log_end_offset_bytes", "The CommitLog's end (bytes ever written)", store.end_offset)
        yield _gauge("clmq_log_durable_offset_bytes", "How far the CommitLog is fsynced", store.durable_offset)
        yield _gauge(
            "clmq_dispatch_lag_bytes", "CommitLog bytes not yet dispatched to the queues", store.dispatch_lag_bytes
        )
        yield _gauge("clmq_connections", "Client connections open", self.connections())
        yield _gauge("clmq_open_files", "File descriptors open in the broker's process", open_files())
        log = getattr(store, "log", None)
        if log is not None:
            _count, total, buckets = log.flush_times.snapshot()
            family = HistogramMetricFamily("clmq_flush_duration_seconds", "One flush of the CommitLog (its fsyncs)")
            family.add_metric([], cumulative_buckets(FSYNC_BUCKETS_S, buckets), total)
            yield family

    def _group_lag(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "clmq_group_lag_messages",
            "Messages of a queue a group has not committed past",
            labels=["group", "topic", "queue"],
        )
        store, rows = self.ctx.store, 0
        # Every group of a topic shares its queues' ends: each is read once per scrape
        # (the scrape's collection runs on the event loop; docs/benchmarks.md "Event-loop stalls").
        ends: dict[tuple[str, int], int | None] = {}
        for group in self.ctx.offsets.groups():
            for key, committed in sorted(self.ctx.offsets.of_group(group).items()):
                if rows >= METRICS_MAX_LAG_SERIES:
                    break
                if key not in ends:
                    ends[key] = store.max_offset(*key) if store.queue_exists(*key) else None
                end = ends[key]
                if end is not None:
                    family.add_metric([group, key[0], str(key[1])], max(0, end - committed))
                    rows += 1
        yield family

    def _replication(self) -> Iterator[Metric]:
        status = self.ctx.replica.status()
        lag = GaugeMetricFamily(
            "clmq_replica_lag_bytes", "A follower's lag behind its leader (leader's view)", labels=["broker_id", "addr"]
        )
        in_sync = GaugeMetricFamily(
            "clmq_replica_in_sync", "1 if a follower is in sync (leader's view)", labels=["broker_id", "addr"]
        )
        for r in status.get("replicas", []):
            lag.add_metric([str(r.get("broker_id")), str(r.get("addr", ""))], r.get("lag_bytes", 0))
            in_sync.add_metric([str(r.get("broker_id")), str(r.get("addr", ""))], 1 if r.get("in_sync") else 0)
        yield from (lag, in_sync)
        yield _gauge("clmq_leader", "1 if this broker leads its group", 1 if status.get("role") == "leader" else 0)


def _gauge(name: str, text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, text, value=value)


def _code_name(code: int) -> str:
    try:
        return RequestCode(code).name
    except ValueError:
        return str(code)

"""Stalls the detector found (docs/operations.md "Event-loop stalls"), each held to
its fix: a /metrics scrape (10,000 group-lag series took about 45 ms of CPU to render
as text, on the loop) reads the state on the loop and renders the text in a worker
thread, on the broker and on the name server."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Iterator

import trio
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric

from clmq.broker.service._stalls import task_kind
from clmq.nameserver import NameServer, NameServerConfig
from clmq.nameserver import serve as serve_nameserver
from tests.service_helpers import Cluster
from tests.test_metrics import http_get, samples

SCRAPE_TASK_KIND = "_http._one"  # what a stall during a scrape is counted as


class Witness:
    """A collector in a service's own registry: where its family is collected (thread
    and task kind) and where its samples are read to be rendered as text."""

    def __init__(self) -> None:
        self.collected_in: list[int] = []
        self.collected_by: list[str] = []
        self.rendered_in: list[int] = []

    def collect(self) -> Iterator[Metric]:
        self.collected_in.append(threading.get_ident())
        self.collected_by.append(task_kind(trio.lowlevel.current_task()))
        yield _WitnessedFamily(self)


class _WitnessedFamily(GaugeMetricFamily):
    def __init__(self, witness: Witness) -> None:
        super().__init__("clmq_test_witness", "A family that notes where it is rendered", value=1)
        self.witness = witness

    @property  # type: ignore[override]
    def samples(self) -> Any:
        if getattr(self, "witness", None) is not None:  # read to render, not to be built
            self.witness.rendered_in.append(threading.get_ident())
        return self._samples

    @samples.setter
    def samples(self, value: Any) -> None:
        self._samples = value


async def scraped_off_the_loop(registry: CollectorRegistry, port: int) -> None:
    witness = Witness()
    registry.register(witness)
    loop = threading.get_ident()
    for _ in range(2):
        m = samples((await http_get(port, "/metrics"))[1])
        assert m[("clmq_test_witness", ())] == 1
    assert witness.collected_in == [loop, loop]  # the state is read on the loop, at one instant
    assert witness.collected_by == [SCRAPE_TASK_KIND] * 2  # so a stall in it is named so
    assert witness.rendered_in and loop not in witness.rendered_in  # the text in a worker thread


async def test_a_broker_scrape_is_collected_on_the_loop_and_rendered_off_it(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    cluster = Cluster(nursery, tmp_path)
    await cluster.start_nameserver()
    broker = await cluster.start_broker("broker-a", metrics_port=0, stall_threshold_ms=20)
    await scraped_off_the_loop(broker.metrics, broker.metrics_port)
    assert (await http_get(broker.metrics_port, "/nope"))[0] == 404


async def test_a_name_server_scrape_is_collected_on_the_loop_and_rendered_off_it(nursery: trio.Nursery) -> None:
    ns: NameServer = await nursery.start(serve_nameserver, NameServerConfig(listen_port=0, metrics_port=0))
    await scraped_off_the_loop(ns.metrics, ns.metrics_port)
    assert (await http_get(ns.metrics_port, "/nope"))[0] == 404

"""The GIL's switch interval while a broker runs (issue 34's tail latency).

A broker's store threads (flusher, dispatcher, housekeeping) and its event loop share
one GIL. A thread coming back from ``fdatasync`` (or the loop from ``epoll_wait``)
while another runs Python waits until that one is asked to let go: the switch
interval, 5 ms by default, which made a sync-flush answer wait 5 ms at the median
whenever the loop was busy. A running broker lowers it to ``gil_switch_interval_us``;
the last broker to stop puts it back.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import trio

from clmq.broker.service import BrokerConfig

from .service_helpers import Cluster


async def test_a_running_broker_lowers_the_switch_interval_and_puts_it_back(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    before = sys.getswitchinterval()
    assert before > 0.0005  # the interpreter's default (5 ms)
    cluster = Cluster(nursery, tmp_path)
    await cluster.start_nameserver()
    await cluster.start_broker("broker-a")
    assert sys.getswitchinterval() == pytest.approx(BrokerConfig().gil_switch_interval_us / 1e6)
    await cluster.start_broker("broker-b", gil_switch_interval_us=200)
    assert sys.getswitchinterval() == pytest.approx(200e-6)  # the lowest asked for
    await cluster.stop_broker("broker-b")
    await cluster.stopped["broker-b"].wait()
    assert sys.getswitchinterval() == pytest.approx(BrokerConfig().gil_switch_interval_us / 1e6)  # broker-a's
    await cluster.stop_broker("broker-a")
    await cluster.stopped["broker-a"].wait()
    assert sys.getswitchinterval() == before


async def test_an_interval_already_lower_is_left_as_it_is(nursery: trio.Nursery, tmp_path: Path) -> None:
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    try:
        cluster = Cluster(nursery, tmp_path)
        await cluster.start_nameserver()
        await cluster.start_broker("broker-a", gil_switch_interval_us=500)
        assert sys.getswitchinterval() == pytest.approx(1e-4, rel=0.02)
    finally:
        sys.setswitchinterval(before)


@pytest.mark.parametrize("us", [0, -1])
def test_the_switch_interval_must_be_positive(us: int) -> None:
    with pytest.raises(ValueError, match="gil_switch_interval_us"):
        BrokerConfig(gil_switch_interval_us=us)


def test_the_store_imports_numpy_ma_before_its_first_round() -> None:
    """``np.unique`` imports ``numpy.ma`` the first time it runs (``np.ma.is_masked``):
    8.7 ms here, 0.3 s in a loaded profile, on the dispatcher thread with the GIL held,
    in the middle of a fresh broker's first produce answers. The store imports it with
    itself instead."""
    code = "import sys, clmq.broker.store; print('numpy.ma' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "True"

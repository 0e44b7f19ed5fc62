"""The tests' own ports (tests/ports.py): never in the kernel's ephemeral range, never
shared by two xdist workers of a run, whatever the worker count and the range."""

from __future__ import annotations

import socket

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.ports import MIN_TEST_PORTS, free_port_block, usable_ports, worker_block


@given(
    low=st.integers(1024, 60000),
    width=st.integers(100, 30000),
    workers=st.integers(1, 64),
)
def test_worker_blocks_are_disjoint_and_outside_the_ephemeral_range(low: int, width: int, workers: int) -> None:
    high = min(low + width, 65535)
    try:
        ports = usable_ports((low, high))
    except OSError as e:  # too few ports on either side: said loudly, naming the range
        assert f"{low}-{high}" in str(e)
        return
    assert len(ports) >= MIN_TEST_PORTS and not set(ports) & set(range(low, high + 1))
    blocks = [worker_block(ports, f"gw{i}", workers) for i in range(workers)] + [worker_block(ports, "", workers)]
    seen: set[int] = set()
    for block in blocks:
        assert len(block) > 0 and set(block) <= set(ports) and not seen & set(block)
        seen |= set(block)


def test_a_worker_beyond_the_count_is_refused() -> None:
    with pytest.raises(OSError, match="gw8 beyond PYTEST_XDIST_WORKER_COUNT=8"):
        worker_block(range(20000, 32768), "gw8", 8)


def test_a_low_ephemeral_range_moves_the_test_ports_above_it() -> None:
    assert usable_ports((20500, 60999)) == range(61000, 65536)


def test_a_block_of_consecutive_ports_is_free_and_shares_no_port_with_later_ones() -> None:
    first = free_port_block(4)
    later = free_port_block(4)
    assert not set(range(first, first + 4)) & set(range(later, later + 4))
    for port in range(first, first + 4):
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free: binds

"""Ports for the servers the tests start, safe when several test processes run at once.

A port from ``bind(("127.0.0.1", 0))`` comes from the kernel's ephemeral range, the
same range every ``connect()`` on the machine takes its source ports from: between the
moment a test learns the port and the moment its broker binds it, another pytest-xdist
worker's ``bind(0)`` or any client's connection may take it. So the tests' ports come
from below the ephemeral range (above it on a machine whose range starts too low), a
block of its own for each xdist worker (``gw0``, ``gw1``, ... from
``PYTEST_XDIST_WORKER``, as many blocks as ``PYTEST_XDIST_WORKER_COUNT`` says, and one
for a run without xdist), handed
out in turn from a random start, and each is checked free (bound without SO_REUSEADDR,
which also refuses a port with connections still in TIME_WAIT) before it is given.
"""

from __future__ import annotations

import os
import random
import socket
from itertools import count
from pathlib import Path
from typing import Iterator

# The lowest port the tests use; the highest is just below the kernel's ephemeral range.
FIRST_TEST_PORT = 20000
# Fewest ports the tests need below the ephemeral range; with fewer (a machine whose
# ip_local_port_range starts at or below FIRST_TEST_PORT + this), the ports above the
# range's end are used instead, and if those are fewer too, free_port fails naming both.
MIN_TEST_PORTS = 1000
LAST_PORT = 65535


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[:2]
        return int(low), int(high)
    except (OSError, ValueError, IndexError):
        return 32768, 60999


def usable_ports(ephemeral: tuple[int, int] | None = None) -> range:
    """The ports the tests may use: below the ephemeral range (``ephemeral``: low, high;
    None: the kernel's), else above it; OSError if neither has MIN_TEST_PORTS."""
    low, high = ephemeral or _ephemeral_range()
    for ports in (range(FIRST_TEST_PORT, low), range(high + 1, LAST_PORT + 1)):
        if len(ports) >= MIN_TEST_PORTS:
            return ports
    raise OSError(
        f"no {MIN_TEST_PORTS} test ports outside the ephemeral range {low}-{high} "
        f"(net.ipv4.ip_local_port_range): the tests' servers would race every connect() for them"
    )


def _workers() -> int:
    """Blocks: one per xdist worker (PYTEST_XDIST_WORKER_COUNT), one for a run without xdist."""
    try:
        return max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    except ValueError:
        return 1


def worker_block(ports: range, worker: str, workers: int) -> range:
    """Worker ``worker``'s share of ``ports`` (gwN: block N of ``workers``; "" for a run
    without xdist: the last block): no two workers of a run share a port."""
    size = len(ports) // (workers + 1)
    index = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else workers
    if worker and index >= workers:
        raise OSError(f"xdist worker {worker} beyond PYTEST_XDIST_WORKER_COUNT={workers}")
    start = ports.start + index * size
    return range(start, start + size)


def _block() -> range:
    """This process's ports."""
    return worker_block(usable_ports(), os.environ.get("PYTEST_XDIST_WORKER", ""), _workers())


def _candidates() -> Iterator[int]:
    block = _block()
    offset = random.randrange(len(block))
    for i in count():
        yield block[(offset + i) % len(block)]


_NEXT = _candidates()


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_block(count: int) -> int:
    """The first of ``count`` consecutive ports on 127.0.0.1 free now, all in this
    worker's block and taken in turn as free_port's are (so no port handed out before,
    and maybe not bound yet, is in it): for a command that numbers its servers' ports
    from one, such as ``clmq dev --groups G --replicas N --listen-port P``."""
    block = _block()
    for _ in range(len(block)):
        run = [next(_NEXT) for _ in range(count)]
        if run == list(range(run[0], run[0] + count)) and all(_is_free(p) for p in run):
            return run[0]
    raise OSError(f"no {count} consecutive free ports in this worker's block of {len(block)} ports")


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on (nor is connected from) now, that no
    other worker of this test run will be given."""
    block_size = len(_block())
    for _ in range(block_size):
        port = next(_NEXT)
        if _is_free(port):
            return port
    raise OSError(f"no free port in this worker's block of {block_size} ports")

"""ZooKeeper for the tests: one real standalone server per test session (a ``java``
subprocess, see :class:`clmq.devtools.zkserver.LocalZooKeeper`), a fresh chroot
per test on it, and a server of its own for tests that stop or restart ZooKeeper.

Nothing is skipped: without Java or ZooKeeper's jar the fixtures fail with the
``apt-get install`` line that fixes it (``scripts/run-tests.sh`` installs both).
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Iterator

import pytest

from clmq.devtools.zkserver import LocalZooKeeper, ZooKeeperError
from tests.ports import free_port

# Fast failover in tests: a 2000 ms session is 4 ticks, not Debian's 1 tick of 2000 ms.
TEST_TICK_TIME_MS = 500


def start_server(directory: Path) -> LocalZooKeeper:
    """A started server in ``directory``; the test fails (never skips) when it cannot start."""
    server = LocalZooKeeper(directory, client_port=free_port(), tick_time_ms=TEST_TICK_TIME_MS)
    try:
        return server.start()
    except ZooKeeperError as e:
        pytest.fail(f"cannot start ZooKeeper for the tests: {e}", pytrace=False)


def fresh_chroot() -> str:
    """A chroot no other test uses: ``/t-<uuid hex>`` (the coordinator creates it)."""
    return f"/t-{uuid.uuid4().hex}"


@pytest.fixture(scope="session")
def zk_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalZooKeeper]:
    """One ZooKeeper server for the whole test session, stopped at its end. Tests must
    not stop, pause or restart it (use ``zk_restartable`` for that)."""
    server = start_server(tmp_path_factory.mktemp("zookeeper"))
    yield server
    server.stop()


@pytest.fixture
def zk_connect(zk_server: LocalZooKeeper) -> str:
    """A connect string with a chroot of this test's own: ``127.0.0.1:PORT/t-<uuid hex>``."""
    return zk_server.connect_string(fresh_chroot())


@pytest.fixture
def zk_restartable(tmp_path: Path) -> Iterator[LocalZooKeeper]:
    """A ZooKeeper server for this test alone (stop, kill, pause, restart it freely);
    stopped after the test."""
    server = start_server(tmp_path / "zookeeper")
    yield server
    server.stop()

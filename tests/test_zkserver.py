"""The ZooKeeper launcher and the test fixtures built on it (real java processes)."""

from __future__ import annotations

from broker.coordination.zkserver import LocalZooKeeper, four_letter_word


def test_the_session_server_serves_and_each_test_gets_its_own_chroot(zk_server: LocalZooKeeper, zk_connect: str) -> None:
    assert zk_server.ruok()
    assert "Mode: standalone" in four_letter_word(zk_server.port, "srvr")
    host_port, chroot = zk_connect.split("/", 1)
    assert host_port == f"127.0.0.1:{zk_server.port}"
    assert chroot.startswith("t-") and len(chroot) == 2 + 32

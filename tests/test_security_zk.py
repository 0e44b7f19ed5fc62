"""ZooKeeper digest auth (``zk_auth``): clmq's nodes carry an ACL for that identity
alone, so a client without it can neither read nor change the groups' states; brokers
with it elect a leader as usual. A real ZooKeeper server (tests/zk.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from kazoo.client import KazooClient
from kazoo.exceptions import NoAuthError

from clmq.broker.coordination._state import group_path
from tests.service_helpers import Cluster
from tests.test_coordination import FAST, one_leader


async def test_zk_auth_guards_clmqs_nodes(nursery: trio.Nursery, tmp_path: Path, zk_connect: str) -> None:
    cluster = Cluster(nursery, tmp_path)
    await cluster.start_nameserver()
    for i in range(2):
        await cluster.start_broker("zg", key=f"z{i}", broker_id=i, zookeeper=zk_connect, zk_auth="clmq:s3cret", **FAST)
    leader = await one_leader(cluster)
    assert leader.coordinator is not None and leader.coordinator.state is not None  # elected through ZooKeeper
    hosts, _, chroot = zk_connect.partition("/")
    path = group_path("/" + chroot, "zg")

    def look() -> None:
        outsider = KazooClient(hosts=hosts)
        outsider.start(timeout=10)
        try:
            with pytest.raises(NoAuthError):
                outsider.get_acls(path)
            with pytest.raises(NoAuthError):
                outsider.get_children(path)
            with pytest.raises(NoAuthError):
                outsider.set(path, b"forged")
        finally:
            outsider.stop()
            outsider.close()
        insider = KazooClient(hosts=hosts, auth_data=[("digest", "clmq:s3cret")])
        insider.start(timeout=10)
        try:
            assert insider.get_children(path)  # the members
            acls, _ = insider.get_acls(path)
            assert [a.id.scheme for a in acls] == ["digest"] and acls[0].id.id.startswith("clmq:")
        finally:
            insider.stop()
            insider.close()

    await trio.to_thread.run_sync(look)

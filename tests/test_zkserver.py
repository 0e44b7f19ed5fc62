"""The ZooKeeper launcher, the fixtures built on it and the TCP proxy of the fault
tests: real java processes, real sockets on 127.0.0.1."""

from __future__ import annotations

import socket
import threading
from pathlib import Path
from typing import Iterator

import pytest

from clmq.devtools.zkserver import LocalZooKeeper, ZooKeeperError, four_letter_word, free_port
from tests.tcp_proxy import Proxy

REPLY_TIMEOUT_S = 5.0


def port_is_free(port: int) -> bool:
    """A new server can listen on ``port`` (with SO_REUSEADDR, as ZooKeeper does: the
    server side of our ``ruok`` probes leaves TIME_WAIT entries on it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_the_session_server_serves_and_each_test_gets_its_own_chroot(
    zk_server: LocalZooKeeper, zk_connect: str
) -> None:
    assert zk_server.ruok()
    assert "Mode: standalone" in four_letter_word(zk_server.port, "srvr")
    host_port, chroot = zk_connect.split("/", 1)
    assert host_port == f"127.0.0.1:{zk_server.port}"
    assert chroot.startswith("t-") and len(chroot) == 2 + 32
    assert zk_server.connect_string() == host_port
    assert zk_server.connect_string("/clmq-dev") == zk_server.connect_string("clmq-dev") == f"{host_port}/clmq-dev"


def test_restart_keeps_the_port_and_the_data_and_stop_frees_the_port(zk_restartable: LocalZooKeeper) -> None:
    zk = zk_restartable
    port, pid = zk.port, zk.pid
    assert "tickTime=500" in zk.config_path.read_text()
    zk.restart()
    assert (zk.port, zk.serving()) == (port, True)
    assert zk.pid != pid
    assert any(zk.data_dir.iterdir())  # the snapshot/log directory of the first run is reused
    zk.stop()
    assert not zk.is_running() and not zk.ruok()
    assert port_is_free(port)
    zk.stop()  # stopping twice is harmless


def test_a_killed_or_paused_server_comes_back(zk_restartable: LocalZooKeeper) -> None:
    zk = zk_restartable
    zk.pause()
    assert four_letter_word(zk.port, "ruok", timeout_s=0.3) == ""  # accepted by the kernel, never answered
    zk.resume()
    assert zk.ruok()
    zk.kill()
    assert not zk.ruok()
    zk.start()
    assert zk.serving()
    zk.pause()
    zk.stop()  # a paused server still stops on SIGTERM (it is resumed first)
    assert not zk.is_running()


@pytest.mark.parametrize(
    "missing",
    [{"jar": "/nowhere/zookeeper.jar"}, {"slf4j_jar": "/nowhere/slf4j-simple.jar"}, {"java": "no-such-java-for-clmq"}],
    ids=["jar", "slf4j", "java"],
)
def test_a_missing_install_is_a_clear_error(tmp_path: Path, missing: dict[str, str]) -> None:
    with pytest.raises(ZooKeeperError) as e:
        LocalZooKeeper(tmp_path, **missing).start()  # type: ignore[arg-type]
    assert next(iter(missing.values())) in str(e.value)
    assert "apt-get install libzookeeper-java default-jre-headless" in str(e.value)


def test_a_server_that_cannot_start_fails_with_its_log(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        zk = LocalZooKeeper(tmp_path, client_port=taken.getsockname()[1], start_timeout_s=20)
        with pytest.raises(ZooKeeperError) as e:
            zk.start()
    assert "log " in str(e.value) and str(zk.log_path) in str(e.value)
    assert "Address already in use" in str(e.value) or "BindException" in str(e.value)
    assert not zk.is_running()


# --- the TCP proxy ----------------------------------------------------------------


@pytest.fixture
def echo_port() -> Iterator[int]:
    """An echo server: every connection gets back what it sends, upper-cased (so that a
    reply is told apart from the request)."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve_one(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data.upper())

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve_one, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield listener.getsockname()[1]
    listener.close()


def exchange(conn: socket.socket, data: bytes) -> bytes:
    conn.sendall(data)
    got = b""
    while len(got) < len(data):
        chunk = conn.recv(65536)
        if not chunk:
            break
        got += chunk
    return got


def test_the_proxy_forwards_both_ways_and_stopping_it_drops_every_connection(echo_port: int) -> None:
    with Proxy(f"127.0.0.1:{echo_port}") as proxy:
        conns = [socket.create_connection(("127.0.0.1", proxy.port), timeout=REPLY_TIMEOUT_S) for _ in range(3)]
        big = bytes(range(97, 123)) * 40_000  # ~1 MB each way, many chunks
        assert exchange(conns[0], big) == big.upper()
        assert all(exchange(c, b"ping") == b"PING" for c in conns)
        proxy.stop()
        for c in conns:
            with c:
                try:
                    assert c.recv(1) == b""  # an end of stream ...
                except ConnectionResetError:
                    pass  # ... or a reset: either way the connection is gone
        port = proxy.port
        proxy.start()  # the network heals on the same port
        assert proxy.port == port
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=REPLY_TIMEOUT_S) as c:
            assert exchange(c, b"again") == b"AGAIN"


def test_a_paused_proxy_holds_connections_open_and_silent(echo_port: int) -> None:
    with Proxy(f"127.0.0.1:{echo_port}") as proxy, socket.create_connection(("127.0.0.1", proxy.port)) as c:
        c.settimeout(REPLY_TIMEOUT_S)
        assert exchange(c, b"one") == b"ONE"
        proxy.pause()
        c.sendall(b"two")
        c.settimeout(0.3)
        with pytest.raises(TimeoutError):
            c.recv(16)
        proxy.resume()
        c.settimeout(REPLY_TIMEOUT_S)
        assert c.recv(16) == b"TWO"


def test_the_proxy_carries_zookeeper_and_a_dead_target_closes_the_client(zk_server: LocalZooKeeper) -> None:
    with Proxy(zk_server.connect_string()) as proxy:
        assert four_letter_word(proxy.port, "ruok") == "imok"
    with Proxy(f"127.0.0.1:{free_port()}") as proxy, socket.create_connection(("127.0.0.1", proxy.port)) as c:
        c.settimeout(REPLY_TIMEOUT_S)
        assert c.recv(1) == b""

"""Limits at the door, through real sockets on 127.0.0.1 against a real broker: too many
connections, descriptor exhaustion, half frames, slow senders, idle connections, wire
garbage. Each runs with a well-behaved client alongside that must see no error, and
checks what the broker holds (its buffer accounting, or a subprocess broker's RSS)."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clmq.broker.service import Broker
from clmq.client import ConnectionFailed, RpcClient, open_admin, open_producer
from clmq.common import MiB
from clmq.nameserver import NameServerConfig
from clmq.nameserver import serve as serve_nameserver
from clmq.protocol import NEED_DATA, ErrorCode, RequestCode
from clmq.protocol.transport import background_nursery
from tests.service_helpers import Cluster
from tests.waiting import await_until, wait_until
from tests.wire_fuzz import (
    GoodClient,
    broker_in_thread,
    decode_frames,
    frame_bytes,
    half_frame_prefix,
    iter_chunks,
    junk_streams,
    raw_connect,
    read_until_closed,
    start_broker_process,
    stop_broker_process,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
async def cluster(nursery: trio.Nursery, tmp_path: Path) -> Cluster:
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    return c


async def _good_client(nursery: trio.Nursery, addr: str) -> tuple[GoodClient, trio.Event]:
    good, stop = GoodClient(addr), trio.Event()
    await good.prepare()
    nursery.start_soon(good.run, stop)
    await await_until(lambda: good.rounds >= 3, 10, "the good client's first rounds")
    return good, stop


async def _refused_or_open(stream: trio.SocketStream, timeout_s: float = 0.2) -> bytes | None:
    """What the server sent before closing ``stream``, or None if it keeps it open."""
    got = b""
    with trio.move_on_after(timeout_s):
        while True:
            try:
                chunk = await stream.receive_some(65536)
            except trio.BrokenResourceError:
                return got
            if not chunk:
                return got
            got += chunk
    return None


def _server_warnings(caplog: pytest.LogCaptureFixture, word: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("clmq.server") and word in r.getMessage()]


# ----------------------------------------------------------------- connections
async def _flood_beyond_the_limit(broker: Broker, count: int = 60) -> None:
    """Open ``count`` connections to a broker allowing 20: the rest are told why and
    closed, the first stay open; then close them all."""
    host, port = broker.addr.rsplit(":", 1)
    before, refused_before = broker.rpc.connections, broker.rpc.refused_connections
    flood = [await trio.open_tcp_stream(host, int(port)) for _ in range(count)]
    await await_until(lambda: broker.rpc.connections == 20, 10, "the broker to fill its 20 connections")
    answers: list[bytes | None] = [None] * count

    async def answer(i: int) -> None:
        answers[i] = await _refused_or_open(flood[i])

    async with trio.open_nursery() as n:
        for i in range(count):
            n.start_soon(answer, i)
    refused = [a for a in answers if a is not None]
    assert len(refused) == broker.rpc.refused_connections - refused_before >= count - 20
    assert broker.rpc.connections == 20  # the accepted ones stay open
    for data in refused:  # each refused one is told why, then closed
        (header,) = decode_frames(data)
        assert header["e"] == ErrorCode.TOO_MANY_CONNECTIONS and "max_connections=20" in header["m"]
    async with background_nursery() as n:  # what a client refused says
        rpc = RpcClient(n)
        with pytest.raises(ConnectionFailed, match=r"refused by the server: too many connections.*max_connections=20"):
            await rpc.request(broker.addr, RequestCode.BROKER_INFO)
        await rpc.aclose()
    for s in flood:
        await s.aclose()
    await await_until(lambda: broker.rpc.connections <= before, 10, "the flood's connections to close")


async def test_connections_beyond_max_connections_are_refused_cleanly_and_logged_once_per_burst(
    cluster: Cluster, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    broker = await cluster.start_broker(max_connections=20)
    good, stop = await _good_client(nursery, broker.addr)
    for burst in (1, 2):
        await _flood_beyond_the_limit(broker)
        assert len(_server_warnings(caplog, "max_connections")) == burst  # one line per burst
        async with open_admin(broker_addrs=[broker.addr]) as admin:  # serving again, on a new connection
            assert "good" in await admin.list_topics()
    stop.set()
    assert good.errors == []
    assert not [r for r in caplog.records if r.exc_info]  # no tracebacks


def test_a_flood_beyond_the_descriptor_limit_is_refused_and_the_broker_keeps_serving(tmp_path: Path) -> None:
    """The user's case: ulimit -n 1024 and 1,100 idle connections."""
    b = start_broker_process(tmp_path, {}, nofile=1024)
    flood: list[socket.socket] = []
    try:
        good = GoodClient(b.addr)
        trio.run(good.prepare)

        async def alongside() -> None:
            stop = trio.Event()
            async with trio.open_nursery() as n:
                n.start_soon(good.run, stop)
                for _ in range(1100):
                    flood.append(await trio.to_thread.run_sync(raw_connect, b.addr))
                await trio.to_thread.run_sync(
                    wait_until, lambda: "refusing connections" in b.log, 20, "the refusal logged"
                )
                rounds = good.rounds
                await await_until(lambda: good.rounds >= rounds + 20, 20, "the good client to go on")
                stop.set()

        trio.run(alongside)
        assert good.errors == []
        assert b.open_descriptors() < 1024
        for s in flood:
            s.close()
        flood.clear()
        wait_until(lambda: b.open_descriptors() < 100, 20, "the broker to close the flood's connections")
        after = GoodClient(b.addr)  # new connections are served again

        async def one_more() -> None:
            stop = trio.Event()
            async with trio.open_nursery() as n:
                n.start_soon(after.run, stop)
                await await_until(lambda: after.rounds >= 3, 10, "a new client's rounds")
                stop.set()

        trio.run(one_more)
        assert after.errors == []
    finally:
        for s in flood:
            s.close()
        assert stop_broker_process(b) == 0
    log = b.log
    assert "Traceback" not in log and "trio.serve_listeners" not in log, log[-3000:]
    assert log.count("refusing connections") == 1, log


def test_the_accept_loop_survives_running_out_of_descriptors(tmp_path: Path) -> None:
    """With no descriptors held back, accept itself fails (EMFILE): the broker backs off,
    says so once, and accepts again once descriptors are free."""
    b = start_broker_process(tmp_path, {"reserved_file_descriptors": 0, "max_connections": 1000}, nofile=64)
    flood: list[socket.socket] = []
    try:
        for _ in range(100):  # more than 64: the kernel queues what the broker cannot accept
            flood.append(raw_connect(b.addr))
        wait_until(lambda: "out of file descriptors" in b.log, 20, "the broker to report running out of descriptors")
        assert b.proc.poll() is None
        for s in flood:
            s.close()
        flood.clear()
        wait_until(lambda: b.open_descriptors() < 40, 20, "the broker to close the flood's connections")
        with raw_connect(b.addr) as s:
            s.sendall(frame_bytes(RequestCode.BROKER_INFO, 7))
            got, _closed = read_until_closed(s, 5)
            (header,) = decode_frames(got)[:1]
            assert header["i"] == 7 and not header.get("e")
    finally:
        for s in flood:
            s.close()
        assert stop_broker_process(b) == 0
    log = b.log
    assert "Traceback" not in log and "trio.serve_listeners" not in log, log[-3000:]
    assert log.count("out of file descriptors") == 1, log


# ----------------------------------------------------------------- buffered bytes
def test_half_frames_hold_no_more_memory_than_the_buffer_caps(tmp_path: Path) -> None:
    """The user's case scaled down: eight clients each send part of a large frame and
    stop. The broker reads no more than max_buffered_request_bytes of them."""
    cap = 48 * MiB
    b = start_broker_process(
        tmp_path,
        {
            "max_frame_bytes": 32 * MiB,
            "max_connection_buffer_bytes": 32 * MiB,
            "max_buffered_request_bytes": cap,
            "frame_timeout_ms": 120_000,
        },
    )
    try:
        good = GoodClient(b.addr)
        trio.run(good.prepare)
        peak, sent = [0], [0]

        async def attacker(host: str, port: int) -> None:
            stream = await trio.open_tcp_stream(host, port)
            await stream.send_all(half_frame_prefix(24 * MiB))
            for _ in range(20):
                await stream.send_all(b"x" * MiB)
            sent[0] += 1
            await trio.sleep_forever()

        async def sample() -> None:
            while True:
                peak[0] = max(peak[0], b.rss_bytes)
                await trio.sleep(0.02)  # sampling a subprocess's memory: nothing to wait on

        async def attack() -> None:
            host, port = b.addr.rsplit(":", 1)
            stop = trio.Event()
            async with trio.open_nursery() as n:
                n.start_soon(good.run, stop)
                await await_until(lambda: good.rounds >= 5, 10, "the good client's first rounds")
                base = peak[0] = b.rss_bytes
                n.start_soon(sample)
                for _ in range(8):
                    n.start_soon(attacker, host, int(port))
                rounds = good.rounds
                await await_until(lambda: sent[0] == 8 or good.rounds >= rounds + 300, 60, "attackers or good client")
                peak[0] = max(peak[0], b.rss_bytes)
                stop.set()
                n.cancel_scope.cancel()
            grown = peak[0] - base
            assert grown < cap + 24 * MiB, f"RSS grew by {grown / MiB:.0f} MiB with a cap of {cap / MiB:.0f} MiB"

        trio.run(attack)
        assert good.errors == []
    finally:
        assert stop_broker_process(b) == 0


async def test_large_frames_beyond_the_global_cap_wait_their_turn_and_complete(
    cluster: Cluster, nursery: trio.Nursery
) -> None:
    """Back-pressure, not refusal: frames that together exceed the cap are read one
    after another, and small requests still pass meanwhile."""
    broker = await cluster.start_broker(
        max_frame_bytes=4 * MiB, max_connection_buffer_bytes=4 * MiB, max_buffered_request_bytes=6 * MiB
    )
    good, stop = await _good_client(nursery, broker.addr)
    await GoodClient(broker.addr, topic="big").prepare()  # a topic of their own (see the report on OFFSET_OVERFLOW)
    done: list[int] = []
    checked = trio.Event()

    async def big_sender(i: int) -> None:
        async with open_producer(broker_addrs=[broker.addr]) as producer:
            batch = [b"%d-%d-" % (i, k) + b"y" * 240_000 for k in range(12)]  # ~2.9 MiB in one frame
            await producer.send_batch("big", batch)
            done.append(i)
            await checked.wait()  # its connection stays open, silent

    async with trio.open_nursery() as n:
        for i in range(4):
            n.start_soon(big_sender, i)
        await await_until(lambda: len(done) == 4, 30, "every big frame to be taken")
        assert broker.rpc.peak_buffered_request_bytes <= 6 * MiB
        stop.set()
        # silent connections hold nothing, whatever they sent before
        await await_until(lambda: broker.rpc.buffered_request_bytes == 0, 10, "the accounting to return to zero")
        checked.set()
    assert good.errors == []


# ----------------------------------------------------------------- time limits
async def test_a_frame_that_does_not_complete_in_time_closes_its_connection(
    cluster: Cluster, nursery: trio.Nursery
) -> None:
    broker = await cluster.start_broker(frame_timeout_ms=400, idle_timeout_ms=60_000)
    good, stop = await _good_client(nursery, broker.addr)
    host, port = broker.addr.rsplit(":", 1)
    half = await trio.open_tcp_stream(host, int(port))  # half a frame, then silence
    await half.send_all(half_frame_prefix(100_000) + b"z" * 50_000)
    slow = await trio.open_tcp_stream(host, int(port))  # a byte at a time: never idle
    frame = half_frame_prefix(1000) + b"z" * 1000

    async def trickle() -> None:
        try:
            for piece in iter_chunks(frame, [1]):
                await slow.send_all(piece)
                await trio.sleep(0.05)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    nursery.start_soon(trickle)
    start = trio.current_time()
    for stream in (half, slow):
        with trio.fail_after(10):
            assert await _refused_or_open(stream, 10) is not None  # closed by the broker
    assert trio.current_time() - start >= 0.35
    stop.set()
    await await_until(lambda: broker.rpc.buffered_request_bytes == 0, 10, "the accounting to return to zero")
    assert good.errors == []


async def test_idle_connections_are_closed_but_long_polls_are_not(cluster: Cluster, nursery: trio.Nursery) -> None:
    broker = await cluster.start_broker(idle_timeout_ms=300, max_pull_wait_ms=30_000)
    good, stop = await _good_client(nursery, broker.addr)
    host, port = broker.addr.rsplit(":", 1)
    idle = await trio.open_tcp_stream(host, int(port))
    poller = await trio.open_tcp_stream(host, int(port))
    ask = {"topic": "good", "queue_id": 0, "offset": 10**6, "max_messages": 1, "max_wait_ms": 1500}
    await poller.send_all(frame_bytes(RequestCode.PULL_MESSAGE, 5, ask))
    with trio.fail_after(10):
        assert await _refused_or_open(idle, 10) is not None  # idle: closed
        got = b""
        while not decode_frames(got):
            got += await poller.receive_some(65536)  # the long poll is answered, not cut
    (header,) = decode_frames(got)
    assert header["i"] == 5 and not header.get("e")
    stop.set()
    assert good.errors == []


# ----------------------------------------------------------------- the wire fuzzer
@pytest.fixture(scope="module")
def fuzz_broker(tmp_path_factory: pytest.TempPathFactory):
    with broker_in_thread(
        tmp_path_factory.mktemp("fuzz"),
        max_frame_bytes=2 * MiB,
        max_connection_buffer_bytes=2 * MiB,
        max_buffered_request_bytes=4 * MiB,
        frame_timeout_ms=300,
    ) as tb:
        yield tb
        assert tb.good.errors == []
        tb.finish_good()
        rpc = tb.broker.rpc
        wait_until(
            lambda: tb.call(lambda: rpc.buffered_request_bytes == 0 and rpc.connections == 0),
            10,
            "every connection closed and every byte given back",
        )


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(junk=junk_streams(), pieces=st.lists(st.integers(1, 64), max_size=4))
def test_wire_garbage_costs_only_its_own_connection(fuzz_broker, junk: tuple[bytes, bool], pieces: list[int]) -> None:
    data, keep_open = junk
    rpc = fuzz_broker.broker.rpc
    rounds = fuzz_broker.good.rounds
    with raw_connect(fuzz_broker.broker.addr) as s:
        try:
            for piece in iter_chunks(data, pieces if len(data) < 400 else []):
                s.sendall(piece)
            if not keep_open:
                s.shutdown(socket.SHUT_WR)
            read_until_closed(s, 1.0 if keep_open else 5.0)
        except OSError:
            pass  # the broker gave up on us first (EPIPE, ECONNRESET, or ENOTCONN at our shutdown)
    # the good client's own requests (under 1 KiB each) come and go meanwhile
    wait_until(
        lambda: fuzz_broker.call(lambda: rpc.buffered_request_bytes < 4096 and rpc.connections <= 2),
        10,
        "the broker to drop the garbage connection and its bytes",
    )
    assert rpc.peak_buffered_request_bytes <= 4 * MiB
    wait_until(lambda: fuzz_broker.good.rounds > rounds, 10, "the good client to go on")
    assert fuzz_broker.good.errors == []


# ----------------------------------------------------------------- clmq dev
def _clmq(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "clmq", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={"COLUMNS": "300", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), **env},
    )


def test_dev_takes_the_broker_settings_from_the_environment_file_and_flags(tmp_path: Path) -> None:
    demo = ("dev", "--demo", "--exit-after-demo", "--port", "0", "--namesrv-port", "0")
    env_dir = tmp_path / "from-env"
    out = _clmq(
        *demo, cwd=tmp_path, CLMQ_FLUSH_MODE="sync", CLMQ_STORAGE_MODE="partition-per-file", CLMQ_DATA_DIR=str(env_dir)
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "partition-per-file, sync flush" in out.stdout and str(env_dir) in out.stdout, out.stdout
    assert (env_dir / "partitions").is_dir() and "produced 5, consumed 5" in out.stdout
    conf = tmp_path / "dev.toml"
    conf.write_text(f'[broker]\nflush_mode = "sync"\ndata_dir = "{tmp_path / "from-file"}"\n')
    out = _clmq(*demo, "--config", str(conf), "--flush-mode", "async", cwd=tmp_path, CLMQ_FLUSH_MODE="bogus")
    assert out.returncode == 0, out.stdout + out.stderr  # the flag wins over the environment and the file
    assert "commitlog, async flush" in out.stdout and (tmp_path / "from-file" / "commitlog").is_dir(), out.stdout
    bad = _clmq(*demo, cwd=tmp_path, CLMQ_FLUSH_MODE="sometimes")
    assert bad.returncode == 2 and "sometimes" in bad.stderr, bad.stdout + bad.stderr  # a usage error


# ----------------------------------------------------------------- the framing the budget relies on
@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=8), cuts=st.lists(st.integers(1, 700), max_size=6))
def test_framing_agrees_with_the_decoder_on_every_frame(sizes: list[int], cuts: list[int]) -> None:
    """The budget charges each decoded frame the length the framing saw: both must
    agree frame by frame, however the stream is cut, with frames too large among them."""
    from clmq.protocol import Frame, FrameDecoder, encode_frame
    from clmq.protocol.transport._limits import Framing

    limit = 2048
    stream = b"".join(encode_frame(Frame(60, i + 1, {}, b"b" * n)) for i, n in enumerate(sizes))
    decoder, framing = FrameDecoder(limit), Framing(limit)
    emitted: list[int] = []
    for piece in iter_chunks(stream, cuts):
        decoder.receive_data(piece)
        framing.feed(piece)
        while not isinstance(event := decoder.next_event(), type(NEED_DATA)):
            if isinstance(event, Frame):
                emitted.append(framing.done.popleft())
                assert emitted[-1] == len(encode_frame(event))
    assert not framing.done and not framing.started
    assert len(emitted) == sum(1 for n in sizes if len(encode_frame(Frame(60, 1, {}, b"b" * n))) <= limit)


async def test_the_name_server_takes_its_own_connection_limit(nursery: trio.Nursery) -> None:
    """The name server has the broker's limits at the door, as its own settings."""
    ns = await nursery.start(serve_nameserver, NameServerConfig(listen_port=0, max_connections=3))
    addr = f"127.0.0.1:{ns.rpc.port}"
    held = [await trio.open_tcp_stream("127.0.0.1", ns.rpc.port) for _ in range(3)]
    await await_until(lambda: ns.rpc.connections == 3, 10, "the name server to take 3 connections")
    async with background_nursery() as n:
        rpc = RpcClient(n)
        with pytest.raises(ConnectionFailed, match=r"too many connections.*max_connections=3"):
            await rpc.request(addr, RequestCode.GET_CLUSTER)
        for s in held:
            await s.aclose()
        await await_until(lambda: ns.rpc.connections == 0, 10, "the held connections to close")
        await rpc.request(addr, RequestCode.GET_CLUSTER)  # served again once there is room
        await rpc.aclose()

"""Helpers for the transport-limit tests: a broker in a subprocess (its own descriptor
limit, its RSS measurable), a well-behaved client that produces and reads back while
others misbehave, raw connections, and a Hypothesis strategy of wire garbage."""

from __future__ import annotations

import contextlib
import os
import re
import resource
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import msgpack
import trio
import trio.lowlevel
from hypothesis import strategies as st

from clmq.client import open_admin, open_producer
from clmq.protocol import Frame, RequestCode, encode_frame
from clmq.protocol.transport import RpcClient, background_nursery

ROOT = Path(__file__).resolve().parents[1]
PREFIX = struct.Struct("<II")


# ----------------------------------------------------------------- subprocess broker
@dataclass
class BrokerProcess:
    """A ``clmq broker`` subprocess; ``stderr`` is its log (WARNING and above)."""

    proc: subprocess.Popen[str]
    addr: str
    log_path: Path

    @property
    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    @property
    def log(self) -> str:
        return self.log_path.read_text()

    def open_descriptors(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))


def _toml(settings: dict[str, Any]) -> str:
    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        return f'"{v}"' if isinstance(v, str) else str(v)

    return "[broker]\n" + "".join(f"{k} = {value(v)}\n" for k, v in settings.items())


def start_broker_process(tmp: Path, settings: dict[str, Any], *, nofile: int | None = None) -> BrokerProcess:
    """Start ``clmq broker`` on a free port with ``settings`` (a TOML file) and, if
    given, a descriptor limit of ``nofile``; returns once it is listening."""
    conf = tmp / "broker.toml"
    conf.write_text(
        _toml(
            {
                "broker_name": "b1",
                "listen_port": 0,
                "data_dir": str(tmp / "data"),
                "auto_create_topics": True,
                **settings,
            }
        )
    )

    def limit() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    log_path = tmp / "broker.log"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "COLUMNS": "300"}
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "clmq", "broker", "--config", str(conf)],
            cwd=tmp,
            env=env,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            preexec_fn=limit,
        )
    assert proc.stdout is not None
    deadline = time.monotonic() + 30
    out = ""
    while time.monotonic() < deadline:  # the listening line is the event awaited
        ready, _, _ = select.select([proc.stdout], [], [], deadline - time.monotonic())
        if not ready:
            break
        line = proc.stdout.readline()
        if not line:
            break
        out += line
        found = re.search(r"broker b1 on (\S+:\d+),", line)
        if found:
            return BrokerProcess(proc, found.group(1), log_path)
    proc.kill()
    raise AssertionError(f"the broker did not start: {out}\n{log_path.read_text()}")


def stop_broker_process(b: BrokerProcess) -> int:
    b.proc.send_signal(signal.SIGTERM)
    try:
        return b.proc.wait(30)
    except subprocess.TimeoutExpired:
        b.proc.kill()
        raise


# ----------------------------------------------------------------- raw connections
def raw_connect(addr: str, timeout_s: float = 5.0) -> socket.socket:
    host, port = addr.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=timeout_s)


def frame_bytes(code: int, request_id: int, fields: dict[str, Any] | None = None, body: bytes = b"") -> bytes:
    return encode_frame(Frame(code, request_id, fields or {}, body))


def half_frame_prefix(total_body_bytes: int, request_id: int = 1) -> bytes:
    """The prefix and header of a SEND_MESSAGE frame announcing ``total_body_bytes`` of
    body, to be followed by (part of) the body."""
    header = msgpack.packb({"v": 1, "c": int(RequestCode.SEND_MESSAGE), "i": request_id, "f": 0, "x": {"topic": "t"}})
    return PREFIX.pack(4 + len(header) + total_body_bytes, len(header)) + header


def read_until_closed(sock: socket.socket, timeout_s: float) -> tuple[bytes, bool]:
    """Everything the peer sends until it closes (True) or ``timeout_s`` passes (False)."""
    sock.settimeout(timeout_s)
    got = b""
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            chunk = sock.recv(65536)
            if not chunk:
                return got, True
            got += chunk
    except ConnectionResetError:
        return got, True
    except TimeoutError:
        pass
    return got, False


def decode_frames(data: bytes) -> list[dict[str, Any]]:
    """The headers of the complete frames in ``data``."""
    out, pos = [], 0
    while pos + 8 <= len(data):
        length, hlen = PREFIX.unpack_from(data, pos)
        if pos + 4 + length > len(data):
            break
        out.append(msgpack.unpackb(data[pos + 8 : pos + 8 + hlen], raw=False, strict_map_key=False))
        pos += 4 + length
    return out


# ----------------------------------------------------------------- the good client
@dataclass
class GoodClient:
    """Produces a message and reads it back, again and again; every failure is kept."""

    addr: str
    topic: str = "good"
    rounds: int = 0
    errors: list[str] = field(default_factory=list)

    async def prepare(self) -> None:
        async with open_admin(broker_addrs=[self.addr]) as admin:
            try:
                await admin.create_topic(self.topic, 1)
            except Exception as e:
                if "exists" not in str(e):
                    raise

    async def run(self, stop: trio.Event, timeout_ms: int = 10_000) -> None:
        async with open_producer(broker_addrs=[self.addr]) as producer, background_nursery() as nursery:
            rpc = RpcClient(nursery)
            try:
                while not stop.is_set():
                    await self._round(producer, rpc, timeout_ms)
            finally:
                await rpc.aclose()
                nursery.cancel_scope.cancel()

    async def _round(self, producer: Any, rpc: RpcClient, timeout_ms: int) -> None:
        payload = b"good-%08d" % self.rounds
        try:
            with trio.fail_after(timeout_ms / 1000):
                sent = await producer.send(self.topic, payload)
                got = await rpc.request(
                    self.addr,
                    RequestCode.PULL_MESSAGE,
                    {
                        "topic": self.topic,
                        "queue_id": 0,
                        "offset": sent.queue_offset,
                        "max_messages": 1,
                        "max_wait_ms": timeout_ms // 2,
                    },
                    timeout_ms=timeout_ms,
                )
            if got.fields.get("count") != 1 or payload not in got.body:
                self.errors.append(f"round {self.rounds}: read back {got.fields} {got.body[-40:]!r}")
        except Exception as e:
            self.errors.append(f"round {self.rounds}: {type(e).__name__}: {e}")
            await trio.sleep(0.05)  # do not spin on a dead broker
        self.rounds += 1


# ----------------------------------------------------------------- wire garbage
_INTS = st.integers(-(2**63), 2**64 - 1)  # what msgpack can carry: anything larger cannot be on the wire
_FIELDS = st.dictionaries(
    st.text(max_size=8), st.one_of(_INTS, st.text(max_size=8), st.binary(max_size=8), st.none()), max_size=4
)
_HEADER_MAPS = st.fixed_dictionaries(
    {
        "v": st.integers(-2, 3),
        "c": st.sampled_from([60, 9999, 10, 11, 12, 52]),
        "i": st.integers(-5, 2**40),
        "f": st.integers(0, 3),
    },
    optional={"x": _FIELDS},
)
_HEADERS = st.one_of(_HEADER_MAPS, _INTS, st.text(max_size=20), st.lists(_INTS, max_size=4), st.binary(max_size=16))


def _header(draw: Any) -> bytes:
    return msgpack.packb(draw(_HEADERS))  # type: ignore[no-any-return]


@st.composite
def junk_streams(draw: Any) -> tuple[bytes, bool]:
    """Bytes a broken or hostile client might send, and whether it then keeps the
    connection open (half frames: the server must give up on them by itself)."""
    kind = draw(st.sampled_from(["random", "wrong-length", "truncated-header", "header-garbage", "huge", "many"]))
    header = _header(draw)
    body = draw(st.binary(max_size=64))
    if kind == "random":
        data = draw(st.binary(min_size=1, max_size=300))
    elif kind == "wrong-length":  # declared lengths that disagree with what follows
        length = draw(st.integers(0, 2**32 - 1))
        hlen = draw(st.one_of(st.just(len(header)), st.integers(0, 2**32 - 1)))
        data = PREFIX.pack(length, hlen) + header + body
    elif kind == "truncated-header":
        cut = draw(st.integers(0, max(0, len(header) - 1)))
        data = PREFIX.pack(4 + len(header) + len(body), len(header)) + header[:cut]
    elif kind == "header-garbage":  # a well-framed header that is not a frame header
        data = PREFIX.pack(4 + len(header) + len(body), len(header)) + header + body
    elif kind == "huge":  # a frame too large, or a large one never finished
        declared = draw(st.sampled_from([1 << 20, 3 << 20, (1 << 32) - 8]))
        data = PREFIX.pack(declared, len(header)) + header + body
    else:  # several valid-looking frames back to back, the last one cut
        frames = b"".join(PREFIX.pack(4 + len(header) + len(body), len(header)) + header + body for _ in range(3))
        data = frames[: draw(st.integers(1, len(frames)))]
    return data, draw(st.booleans())


def iter_chunks(data: bytes, sizes: list[int]) -> Iterator[bytes]:
    """``data`` cut into pieces of ``sizes`` (cycled), as a slow sender sends it."""
    pos, i = 0, 0
    while pos < len(data):
        n = max(1, sizes[i % len(sizes)]) if sizes else len(data)
        yield data[pos : pos + n]
        pos += n
        i += 1


# ----------------------------------------------------------------- a broker in a thread
@dataclass
class ThreadBroker:
    """A broker served by trio in a thread, with a good client running against it."""

    broker: Any
    good: GoodClient
    token: trio.lowlevel.TrioToken
    stop_good: trio.Event
    good_done: trio.Event

    def finish_good(self) -> None:
        """Stop the good client and wait until it has closed its connections."""
        self.call(self.stop_good.set)
        trio.from_thread.run(self.good_done.wait, trio_token=self.token)

    def call(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(*args)`` on the broker's trio thread (its state is not thread-safe)."""
        return trio.from_thread.run_sync(fn, *args, trio_token=self.token)


@contextlib.contextmanager
def broker_in_thread(root: Path, **settings: Any) -> Iterator[ThreadBroker]:
    """A broker with ``settings`` and a :class:`GoodClient` producing and reading back
    all along, run by trio in a thread; the client is stopped when the block ends."""
    import threading

    from tests.service_helpers import Cluster

    stop_all, started, ready = threading.Event(), threading.Event(), []

    async def serve() -> None:
        try:
            async with trio.open_nursery() as n:
                c = Cluster(n, root)
                await c.start_nameserver()
                broker = await c.start_broker(**settings)
                good = GoodClient(broker.addr)
                await good.prepare()
                stop_good, good_done = trio.Event(), trio.Event()

                async def run_good() -> None:
                    try:
                        await good.run(stop_good)
                    finally:
                        good_done.set()

                n.start_soon(run_good)
                ready.append(ThreadBroker(broker, good, trio.lowlevel.current_trio_token(), stop_good, good_done))
                started.set()
                await trio.to_thread.run_sync(stop_all.wait, 300)
                stop_good.set()
                await trio.lowlevel.checkpoint()
                n.cancel_scope.cancel()
        finally:
            started.set()

    server = threading.Thread(target=trio.run, args=(serve,))
    server.start()
    try:
        started.wait(30)
        assert ready, "the broker did not start"
        yield ready[0]
    finally:
        stop_all.set()
        server.join(60)

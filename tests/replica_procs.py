"""Replication groups as real processes (used by ``test_replication_procs.py``).

A name server and brokers run as ``python -m broker.cli ...`` with settings files,
each broker with its own data directory and a port of its own that it keeps across
restarts (so that a restarted broker is the same address to its group). The harness
kills (SIGKILL), pauses (SIGSTOP), resumes (SIGCONT) and restarts them, and waits for
what replication should do by polling REPLICA_STATUS (``tests/waiting.py``), never by
sleeping. Logs are compared by reading the segment files straight from the data
directories: the bytes ``[start, end)`` of two replicas must be identical.
"""

from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import trio

from clmq.common import Message, Record
from clmq.protocol import ErrorCode, Frame, PullStatus, RequestCode, decode_records, encode_batch
from clmq.protocol.transport import ConnectionFailed, RpcClient, RpcError, background_nursery
from tests import ports
from tests.waiting import await_until

READY_TIMEOUT_S = 30
REQUEST_TIMEOUT_MS = 10_000
GROUP = "g"  # the replication group's broker name
_ROOT = str(Path(__file__).resolve().parents[1])  # the project, for PYTHONPATH
_READY_LINE = {"broker": "broker ", "nameserver": "name server on "}

# Fast reactions for tests: registrations, metadata copies and retries every 100-200 ms.
BROKER_DEFAULTS: dict[str, Any] = {
    "broker_name": GROUP,
    "segment_bytes": 1 << 20,
    "max_message_bytes": 64 << 10,
    "register_interval_ms": 200,
    "replica_metadata_interval_ms": 100,
    "replica_retry_ms": 100,
    "replica_fetch_wait_ms": 200,
    "offset_flush_interval_ms": 100,
    "client_expiry_ms": 2000,
}
NAMESERVER_DEFAULTS: dict[str, Any] = {"broker_expiry_ms": 3000, "scan_interval_ms": 100}


def free_port() -> int:
    """A port nobody listens on now (the broker binds it a moment later; SO_REUSEADDR
    lets a restarted broker bind it again at once)."""
    return ports.free_port()


def toml_value(value: Any) -> str:
    """The TOML form of a setting's value (str, bool, int, list, dict of those)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{toml_value(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"no TOML form for {value!r}")


def write_settings(path: Path, section: str, settings: dict[str, Any]) -> Path:
    path.write_text(f"[{section}]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in settings.items()))
    return path


# ----------------------------------------------------------------- processes
@dataclass
class Service:
    """One ``clmq broker`` or ``clmq nameserver`` process, restartable on its settings."""

    key: str  # the test's name for it ("g0", "ns")
    verb: str  # "broker" or "nameserver"
    conf: Path
    out: Path  # stdout (the ready line), appended to at every start
    err: Path  # stderr (the logs), appended to at every start
    port: int
    proc: trio.Process | None = None
    paused: bool = False

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def start(self) -> None:
        """Start the process and return once it printed that it serves."""
        assert not self.running, f"{self.key} is running already"
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": _ROOT, "PYTHONUNBUFFERED": "1", "COLUMNS": "1000"}
        lines_before = self._ready_lines()
        with self.out.open("ab") as out, self.err.open("ab") as err:
            self.proc = await trio.lowlevel.open_process(
                [sys.executable, "-m", "clmq", self.verb, "--config", str(self.conf)],
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                env=env,
            )
        self.paused = False

        def ready() -> bool:
            if not self.running:
                raise AssertionError(f"{self.key} exited ({self.returncode()}) while starting: {self.tail()}")
            return self._ready_lines() > lines_before

        await await_until(ready, READY_TIMEOUT_S, f"{self.key} ({self.verb}) to print that it serves")

    def _ready_lines(self) -> int:
        if not self.out.exists():
            return 0
        return sum(
            1 for line in self.out.read_text(errors="replace").splitlines() if line.startswith(_READY_LINE[self.verb])
        )

    def returncode(self) -> int | None:
        return self.proc.returncode if self.proc is not None else None

    def tail(self, n: int = 3000) -> str:
        """The end of the process's logs, for an assertion's message."""
        return self.err.read_text(errors="replace")[-n:] if self.err.exists() else ""

    async def kill(self) -> None:
        """SIGKILL and wait for the exit (a paused process dies as well)."""
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()
        self.paused = False

    def pause(self) -> None:
        """SIGSTOP: the process keeps its sockets but answers nothing."""
        assert self.proc is not None and self.running
        self.proc.send_signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        assert self.proc is not None and self.running
        self.proc.send_signal(signal.SIGCONT)
        self.paused = False


@dataclass
class Broker(Service):
    data_dir: Path = field(default_factory=Path)
    broker_id: int = 0


# ----------------------------------------------------------------- the group
class Group:
    """A name server and the brokers of one group (broker name :data:`GROUP`), as
    processes under ``root``; ``rpc`` talks to any of them directly."""

    def __init__(self, root: Path, rpc: RpcClient) -> None:
        self.root = root
        self.rpc = rpc
        self.nameserver: Service | None = None
        self.brokers: dict[str, Broker] = {}

    @property
    def ns_addr(self) -> str:
        assert self.nameserver is not None
        return self.nameserver.addr

    async def start_nameserver(self, **settings: Any) -> Service:
        port = free_port()
        conf = write_settings(
            self.root / "ns.toml", "nameserver", {"listen_port": port, **NAMESERVER_DEFAULTS, **settings}
        )
        self.nameserver = Service("ns", "nameserver", conf, self.root / "ns.out", self.root / "ns.err", port)
        await self.nameserver.start()
        return self.nameserver

    async def start_broker(self, key: str, broker_id: int, *, follow: str | None = None, **settings: Any) -> Broker:
        """Start broker ``key`` of the group (a follower of broker ``follow``, if given)."""
        port, data_dir = free_port(), self.root / key
        base: dict[str, Any] = {
            **BROKER_DEFAULTS,
            "broker_id": broker_id,
            "listen_port": port,
            "data_dir": str(data_dir),
            "namesrv_addrs": [self.ns_addr],
        }
        if follow is not None:
            base.update(role="follower", leader_addr=self.brokers[follow].addr)
        conf = write_settings(self.root / f"{key}.toml", "broker", {**base, **settings})
        broker = Broker(
            key,
            "broker",
            conf,
            self.root / f"{key}.out",
            self.root / f"{key}.err",
            port,
            data_dir=data_dir,
            broker_id=broker_id,
        )
        self.brokers[key] = broker
        await broker.start()
        return broker

    def __getitem__(self, key: str) -> Broker:
        return self.brokers[key]

    async def close(self) -> None:
        for service in [*self.brokers.values(), *([self.nameserver] if self.nameserver else [])]:
            await service.kill()

    def logs(self) -> str:
        """Every broker's log tail, for an assertion's message."""
        return "\n".join(f"--- {k}:\n{b.tail(1500)}" for k, b in self.brokers.items())

    # ------------------------------------------------------------- asking
    async def call(
        self,
        key: str,
        code: int,
        fields: dict[str, Any] | None = None,
        body: bytes = b"",
        timeout_ms: int = REQUEST_TIMEOUT_MS,
    ) -> Frame:
        """A request to broker ``key``; the answer, error or not."""
        return await self.rpc.request(self[key].addr, code, fields, body, timeout_ms=timeout_ms, check=False)

    async def status(self, key: str) -> dict[str, Any]:
        """REPLICA_STATUS of broker ``key``."""
        reply = await self.call(key, RequestCode.REPLICA_STATUS, timeout_ms=3000)
        assert not reply.error_code, f"{key}: REPLICA_STATUS failed: {reply.error_text}"
        return reply.fields

    async def try_status(self, key: str) -> dict[str, Any] | None:
        """REPLICA_STATUS, or None while the broker does not answer."""
        try:
            return await self.status(key)
        except (ConnectionFailed, RpcError, trio.TooSlowError):
            return None

    async def wait_status(
        self, key: str, check: Callable[[dict[str, Any]], bool], timeout_s: float, what: str
    ) -> dict[str, Any]:
        """Poll broker ``key``'s REPLICA_STATUS until ``check`` accepts it."""

        async def ok() -> dict[str, Any] | None:
            st = await self.try_status(key)
            return st if st is not None and check(st) else None

        try:
            return await await_until(ok, timeout_s, f"{key}: {what}")
        except TimeoutError as e:
            raise AssertionError(f"{e}; last status {await self.try_status(key)}\n{self.logs()}") from None

    async def cluster(self) -> dict[str, dict[str, Any]]:
        """The name server's GET_CLUSTER: broker key -> its row (brokers of this group only)."""
        reply = await self.rpc.request(self.ns_addr, RequestCode.GET_CLUSTER, timeout_ms=3000)
        by_addr = {b["addr"]: b for b in reply.fields["brokers"]}
        return {k: by_addr[b.addr] for k, b in self.brokers.items() if b.addr in by_addr}

    async def wait_cluster(
        self, check: Callable[[dict[str, dict[str, Any]]], bool], timeout_s: float, what: str
    ) -> dict[str, dict[str, Any]]:
        """Poll the name server's GET_CLUSTER until ``check`` accepts it."""

        async def ok() -> dict[str, dict[str, Any]] | None:
            rows = await self.cluster()
            return rows if check(rows) else None

        return await await_until(ok, timeout_s, f"the name server: {what}")

    async def wait_in_sync(self, leader: str, followers: list[str], timeout_s: float = 30) -> int:
        """Wait until every follower's log ends where the leader's does and the leader
        lists it in sync (traffic must have stopped); returns that end."""

        async def caught_up() -> int | None:
            lead = await self.try_status(leader)
            if lead is None or lead["role"] != "leader":
                return None
            rows = {r["broker_id"]: r for r in lead["replicas"]}
            for key in followers:
                st, row = await self.try_status(key), rows.get(self[key].broker_id)
                if st is None or row is None or not row["in_sync"] or st["end_offset"] != lead["end_offset"]:
                    return None
            return int(lead["end_offset"]) or -1  # -1: an empty log (0 would read as "not yet")

        try:
            return max(0, await await_until(caught_up, timeout_s, f"{followers} to catch up with {leader}"))
        except TimeoutError as e:
            states = {k: await self.try_status(k) for k in [leader, *followers]}
            raise AssertionError(f"{e}; statuses {states}\n{self.logs()}") from None


@asynccontextmanager
async def open_group(root: Path) -> AsyncIterator[Group]:
    """A :class:`Group` under ``root`` with a name server running; every process it
    started is killed on the way out."""
    async with background_nursery() as nursery:
        rpc = RpcClient(nursery)
        group = Group(root, rpc)
        try:
            await group.start_nameserver()
            yield group
        finally:
            with trio.CancelScope(shield=True):
                await group.close()
                await rpc.aclose()
            nursery.cancel_scope.cancel()


# ----------------------------------------------------------------- logs on disk
def segments(data_dir: Path) -> list[tuple[int, Path]]:
    """``(base, path)`` of every segment file of a broker's CommitLog, oldest first."""
    return sorted((int(p.stem), p) for p in (data_dir / "commitlog").glob("*.log"))


def log_bytes(data_dir: Path, start: int, end: int) -> bytes:
    """The log's bytes ``[start, end)``, read from the segment files; the segments must
    follow each other without a gap (each begins where the one before ends)."""
    out, pos = bytearray(), start
    segs = segments(data_dir)
    for i, (base, path) in enumerate(segs):
        size = path.stat().st_size
        if i + 1 < len(segs):
            assert base + size == segs[i + 1][0], (
                f"{data_dir}: segment {base} ends at {base + size}, next at {segs[i + 1][0]}"
            )
        if base + size <= pos or base >= end:
            continue
        assert base <= pos, f"{data_dir}: no segment holds offset {pos} (next begins at {base})"
        with path.open("rb") as f:
            f.seek(pos - base)
            chunk = f.read(min(end, base + size) - pos)
        out += chunk
        pos += len(chunk)
    assert pos == end, f"{data_dir}: the log's files end at {pos}, not {end}"
    return bytes(out)


def first_difference(a: bytes, b: bytes) -> int | None:
    """The index of the first differing byte (None: identical)."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def assert_identical(dirs: dict[str, Path], end: int, start: int = 0) -> str:
    """Every log's bytes ``[start, end)`` are identical; returns their digest."""
    data = {k: log_bytes(d, start, end) for k, d in dirs.items()}
    (first, ref), *rest = data.items()
    for key, got in rest:
        at = first_difference(ref, got)
        assert at is None, f"{key}'s log differs from {first}'s at offset {start + at} (compared [{start}, {end}))"
    return hashlib.sha256(ref).hexdigest()


# ----------------------------------------------------------------- traffic
def body_for(msg_id: str, size: int) -> bytes:
    """A body of ``size`` bytes (at least the id) that names its message."""
    head = msg_id.encode() + b"|"
    seed = hashlib.blake2b(head).digest()
    fill = (seed * (size // len(seed) + 1))[: max(0, size - len(head))]
    return head + fill


def msg_id_of(body: bytes) -> str:
    return body.split(b"|", 1)[0].decode(errors="replace")


async def send(
    group: Group, key: str, topic: str, queue_id: int, bodies: list[bytes], timeout_ms: int = REQUEST_TIMEOUT_MS
) -> Frame:
    """SEND_MESSAGE of ``bodies`` to one queue of broker ``key``; the answer, error or not."""
    batch = encode_batch([Message(topic, queue_id, b) for b in bodies])
    return await group.call(key, RequestCode.SEND_MESSAGE, {"topic": topic}, batch, timeout_ms=timeout_ms)


async def create_topic(group: Group, key: str, topic: str, queue_count: int) -> None:
    reply = await group.call(key, RequestCode.CREATE_TOPIC, {"topic": topic, "queue_count": queue_count})
    assert not reply.error_code, f"CREATE_TOPIC {topic} on {key}: {reply.error_text}"


async def read_queue(group: Group, key: str, topic: str, queue_id: int, start: int = 0) -> list[Record]:
    """Every message of one queue of broker ``key`` from ``start`` (raw PULL_MESSAGE),
    once the broker has dispatched what its log holds: an acknowledged message reaches
    its queue a dispatcher round after the ack (CI once read a queue before its last
    message was there)."""
    await wait_dispatched(group, key)
    records: list[Record] = []
    offset = start
    while True:
        reply = await group.call(
            key, RequestCode.PULL_MESSAGE, {"topic": topic, "queue_id": queue_id, "offset": offset, "max_messages": 512}
        )
        assert reply.error_code == ErrorCode.OK, f"{key}: pull {topic}/{queue_id}@{offset}: {reply.error_text}"
        f = reply.fields
        if f["status"] != PullStatus.FOUND.value:
            assert f["status"] in (PullStatus.NO_MESSAGE.value, PullStatus.NO_QUEUE.value), (key, topic, queue_id, f)
            return records
        got = decode_records(reply.body, f"{key} {topic}/{queue_id}")
        records += got
        offset = f["next_offset"]


async def wait_dispatched(group: Group, key: str, timeout_s: float = 30) -> None:
    """Until broker ``key``'s whole log is confirmed (REPLICA_STATUS: a follower learns
    the confirmed offset with the next chunk or its leader's next in-sync check; a leader
    waits for its in-sync followers) and dispatched (BROKER_INFO: no log bytes waiting)."""

    async def done() -> bool:
        status = await group.status(key)
        if status["confirmed_offset"] != status["end_offset"]:
            return False
        reply = await group.call(key, RequestCode.BROKER_INFO, {})
        assert reply.error_code == ErrorCode.OK, f"{key}: BROKER_INFO: {reply.error_text}"
        return reply.fields["dispatch_lag_bytes"] == 0

    await await_until(done, timeout_s, f"{key}: the dispatcher to catch up")


async def committed_offsets(
    group: Group, key: str, consumer_group: str, queues: list[tuple[str, int]]
) -> list[list[int] | None]:
    """QUERY_QUEUE_OFFSETS on broker ``key``: per queue [committed or -1, min, max] (None: no queue)."""
    reply = await group.call(
        key, RequestCode.QUERY_QUEUE_OFFSETS, {"group": consumer_group, "queues": [list(q) for q in queues]}
    )
    assert not reply.error_code, f"{key}: QUERY_QUEUE_OFFSETS: {reply.error_text}"
    return list(reply.fields["offsets"])


async def commit(group: Group, key: str, consumer_group: str, offsets: dict[tuple[str, int], int]) -> None:
    reply = await group.call(
        key,
        RequestCode.COMMIT_OFFSET,
        {"group": consumer_group, "offsets": [[t, q, o] for (t, q), o in sorted(offsets.items())]},
    )
    assert not reply.error_code, f"{key}: COMMIT_OFFSET: {reply.error_text}"


@dataclass
class Ledger:
    """What a test's producers sent and what the leader acknowledged."""

    acked: dict[tuple[str, int, int], bytes] = field(default_factory=dict)  # (topic, queue, offset) -> body
    errors: list[str] = field(default_factory=list)  # error answers and failed requests, in order
    sends: int = 0  # requests answered OK
    bytes_acked: int = 0

    def record(self, topic: str, queue_id: int, bodies: list[bytes], reply: Frame) -> None:
        offsets = reply.fields["queue_offsets"]
        assert len(offsets) == len(bodies), (topic, queue_id, offsets)
        for offset, body in zip(offsets, bodies):
            key = (topic, queue_id, offset)
            assert key not in self.acked, f"{key} acknowledged twice"
            self.acked[key] = body
        self.sends += 1
        self.bytes_acked += sum(map(len, bodies))

    def per_queue(self) -> dict[tuple[str, int], dict[int, bytes]]:
        out: dict[tuple[str, int], dict[int, bytes]] = {}
        for (t, q, o), body in self.acked.items():
            out.setdefault((t, q), {})[o] = body
        return out


async def send_and_record(
    group: Group,
    key: str,
    topic: str,
    queue_id: int,
    bodies: list[bytes],
    ledger: Ledger,
    timeout_ms: int = REQUEST_TIMEOUT_MS,
) -> Frame | None:
    """Send; record an acknowledgement in ``ledger``, or the error (None: no answer)."""
    try:
        reply = await send(group, key, topic, queue_id, bodies, timeout_ms)
    except (ConnectionFailed, RpcError, trio.TooSlowError) as e:
        ledger.errors.append(f"{topic}/{queue_id}: {type(e).__name__}: {e}")
        return None
    if reply.error_code:
        ledger.errors.append(f"{topic}/{queue_id}: {ErrorCode(reply.error_code).name}: {reply.error_text}")
    else:
        ledger.record(topic, queue_id, bodies, reply)
    return reply


def queue_check(records: list[Record], acked: dict[int, bytes], where: str) -> list[str]:
    """Problems of one queue read back: offsets not 0, 1, 2... (a gap), an acknowledged
    offset missing or holding another body."""
    problems = [
        f"{where}: offset {r.queue_offset} read at position {i}" for i, r in enumerate(records) if r.queue_offset != i
    ]
    read = {r.queue_offset: r.body for r in records}
    for offset, body in sorted(acked.items()):
        if offset not in read:
            problems.append(
                f"{where}: acknowledged offset {offset} ({msg_id_of(body)}) missing (queue has {len(records)})"
            )
        elif read[offset] != body:
            problems.append(
                f"{where}: offset {offset} holds {msg_id_of(read[offset])}, {msg_id_of(body)} was acknowledged"
            )
    return problems[:20]

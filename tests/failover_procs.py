"""Failover groups as real processes (used by ``test_failover_procs.py``,
``test_failover_chaos.py``): three brokers of one group with the ``zookeeper`` setting
(the coordinator elects the leader, 2 s sessions, sync acks with
``min_insync_replicas = 2``), a name server, on top of ``replica_procs.py``.

Brokers run with ``-v`` so that their logs hold the once-per-term lines the checks parse
("broker <id> leads the group, epoch <E>" and "acknowledged its first write of epoch
<E>"). The leader is found by asking every broker's REPLICA_STATUS: exactly one says
``role = leader`` and its ``coordination`` block names itself with a live session. Waits
poll (``tests/waiting.py``), never sleep.

A follower's *network cut* is its ZooKeeper connection going through a proxy process
(``tests/tcp_proxy.Proxy``) that the test pauses (SIGSTOP: packets are neither answered
nor refused, like a cable pulled): its session lapses while its replication connection
to the leader stays up. That is the fault that matters for election: a replica out of
touch with ZooKeeper must never be elected, and must rejoin once back.
"""

from __future__ import annotations

import functools
import re
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import trio

from clmq.common import Record
from clmq.protocol.transport import ConnectionFailed, RpcError
from tests.waiting import await_until

from .replica_procs import (
    _ROOT,
    BROKER_DEFAULTS,
    READY_TIMEOUT_S,
    Broker,
    Group,
    Ledger,
    assert_identical,
    body_for,
    create_topic,
    free_port,
    msg_id_of,
    queue_check,
    read_queue,
    send_and_record,
    write_settings,
)

SESSION_TIMEOUT_MS = 2000
# Every broker may lead: ZooKeeper decides. Sync acks held by 2 of the 3 replicas.
FAILOVER_DEFAULTS: dict[str, Any] = {
    **BROKER_DEFAULTS,
    "zk_session_timeout_ms": SESSION_TIMEOUT_MS,
    "ack_mode": "sync",
    "min_insync_replicas": 2,
    "replication_timeout_ms": 3000,
    "replica_lag_max_ms": 2000,
    "leader_transfer_timeout_ms": 5000,
}
# A new leader within the session timeout plus this much (election, registration, a
# loaded 2-core machine running other tests).
ELECTION_SLACK_S = 8.0
LEADS = re.compile(r"(\S+): broker (\d+) leads the group, epoch (\d+), from offset (\d+)")
FIRST_ACK = re.compile(r"(\S+): broker (\d+) acknowledged its first write of epoch (\d+)")


def chroot_of(connect: str) -> str:
    """The ``/chroot`` part of a connect string ("" when none)."""
    hosts_end = connect.find("/")
    return connect[hosts_end:] if hosts_end >= 0 else ""


@dataclass
class VerboseBroker(Broker):
    """A broker process started with ``-v`` (INFO logs: the per-term lines)."""

    async def start(self) -> None:
        assert not self.running, f"{self.key} is running already"
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": _ROOT, "PYTHONUNBUFFERED": "1", "COLUMNS": "1000"}
        before = self._ready_lines()
        with self.out.open("ab") as out, self.err.open("ab") as err:
            self.proc = await trio.lowlevel.open_process(
                [sys.executable, "-m", "clmq", "-v", self.verb, "--config", str(self.conf)],
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                env=env,
            )
        self.paused = False

        def ready() -> bool:
            if not self.running:
                raise AssertionError(f"{self.key} exited ({self.returncode()}) while starting: {self.tail()}")
            return self._ready_lines() > before

        await await_until(ready, READY_TIMEOUT_S, f"{self.key} to print that it serves")


def is_leader(status: dict[str, Any] | None) -> bool:
    """A broker that leads by ZooKeeper's word: role leader, a live session, and the
    group state naming it."""
    if status is None or status.get("role") != "leader":
        return False
    coord = status.get("coordination") or {}
    return coord.get("session") == "CONNECTED" and coord.get("leader") == status.get("broker_id")


@dataclass
class Terms:
    """The per-term lines of every broker's log: who led and who acknowledged in which epoch."""

    leads: dict[int, set[int]] = field(default_factory=lambda: defaultdict(set))  # epoch -> broker ids
    acks: dict[int, set[int]] = field(default_factory=lambda: defaultdict(set))

    def problems(self) -> list[str]:
        out = [f"epoch {e}: brokers {sorted(b)} all acknowledged writes" for e, b in self.acks.items() if len(b) > 1]
        out += [f"epoch {e}: brokers {sorted(b)} all led" for e, b in self.leads.items() if len(b) > 1]
        return out


def parse_terms(logs: list[str]) -> Terms:
    terms = Terms()
    for text in logs:
        for m in LEADS.finditer(text):
            terms.leads[int(m.group(3))].add(int(m.group(2)))
        for m in FIRST_ACK.finditer(text):
            terms.acks[int(m.group(3))].add(int(m.group(2)))
    return terms


class FailoverGroup:
    """Three (or more) brokers of group "g" coordinated through ZooKeeper ``zk``."""

    def __init__(self, group: Group, zk: str) -> None:
        self.g = group
        self.zk = zk
        self.keys: list[str] = []

    def __getitem__(self, key: str) -> Broker:
        return self.g[key]

    async def start_broker(self, key: str, broker_id: int, *, zk_port: int | None = None, **settings: Any) -> Broker:
        """Start broker ``key``; ``zk_port``: reach ZooKeeper through this port (a proxy's)."""
        zk = self.zk if zk_port is None else f"127.0.0.1:{zk_port}{chroot_of(self.zk)}"
        port, data_dir = free_port(), self.g.root / key
        values = {
            **FAILOVER_DEFAULTS,
            "broker_id": broker_id,
            "listen_port": port,
            "data_dir": str(data_dir),
            "namesrv_addrs": [self.g.ns_addr],
            "zookeeper": zk,
            **settings,
        }
        conf = write_settings(self.g.root / f"{key}.toml", "broker", values)
        root = self.g.root
        broker = VerboseBroker(
            key, "broker", conf, root / f"{key}.out", root / f"{key}.err", port, data_dir=data_dir, broker_id=broker_id
        )
        self.g.brokers[key] = broker
        self.keys.append(key)
        await broker.start()
        return broker

    async def start(
        self, topics: dict[str, int], n: int = 3, zk_ports: dict[str, int] | None = None, **settings: Any
    ) -> str:
        """Brokers g0..g<n-1> (all started before any is needed as leader), ``topics``
        created on the elected leader and every replica in sync; returns the leader's key."""
        async with trio.open_nursery() as nursery:
            for i in range(n):
                port = (zk_ports or {}).get(f"g{i}")
                nursery.start_soon(functools.partial(self.start_broker, f"g{i}", i, zk_port=port, **settings))
        leader = await self.wait_leader()
        for topic, queues in topics.items():
            await create_topic(self.g, leader, topic, queues)
        await self.wait_settled(leader)
        return leader

    # ------------------------------------------------------------- who leads
    async def statuses(self) -> dict[str, dict[str, Any] | None]:
        """REPLICA_STATUS of every running, unpaused broker (None: no answer)."""
        out: dict[str, dict[str, Any] | None] = {}
        for key in self.keys:
            b = self.g[key]
            out[key] = await self.g.try_status(key) if b.running and not b.paused else None
        return out

    async def find_leader(self, exclude: frozenset[str] = frozenset()) -> str | None:
        """The one broker that leads (not in ``exclude``), or None: none yet, or more than one."""
        found = [k for k, st in (await self.statuses()).items() if is_leader(st)]
        return found[0] if len(found) == 1 and found[0] not in exclude else None

    async def wait_leader(self, exclude: frozenset[str] = frozenset(), timeout_s: float | None = None) -> str:
        """Wait until exactly one broker leads (another than ``exclude``)."""
        timeout = timeout_s if timeout_s is not None else SESSION_TIMEOUT_MS / 1000 + ELECTION_SLACK_S
        try:
            return await await_until(lambda: self.find_leader(exclude), timeout, f"a leader not in {sorted(exclude)}")
        except TimeoutError as e:
            raise AssertionError(f"{e}; statuses {await self.statuses()}\n{self.g.logs()}") from None

    async def wait_settled(self, leader: str, timeout_s: float = 30) -> int:
        """Traffic stopped: every running follower holds the leader's whole log and the
        leader's ZooKeeper in-sync set names every running broker; returns the log end."""
        followers = [k for k in self.keys if k != leader and self.g[k].running]
        end = await self.g.wait_in_sync(leader, followers, timeout_s)
        want = sorted(self.g[k].broker_id for k in [leader, *followers])
        await self.g.wait_status(
            leader,
            lambda st: sorted((st.get("coordination") or {}).get("isr", [])) == want,
            timeout_s,
            f"ZooKeeper's in-sync set to be {want}",
        )
        return end

    # ------------------------------------------------------------- faults
    async def kill(self, key: str) -> float:
        """SIGKILL broker ``key``; returns when (trio clock) it was killed."""
        at = trio.current_time()
        await self.g[key].kill()
        return at

    async def restart(self, key: str) -> None:
        await self.g[key].kill()
        await self.g[key].start()

    def pause(self, key: str) -> float:
        at = trio.current_time()
        self.g[key].pause()
        return at

    def resume(self, key: str) -> None:
        self.g[key].resume()

    # ------------------------------------------------------------- checks
    def terms(self) -> Terms:
        return parse_terms([self.g[k].err.read_text(errors="replace") for k in self.keys if self.g[k].err.exists()])

    async def check_acked(self, leader: str, ledger: Ledger) -> dict[tuple[str, int], list[Record]]:
        """Every acknowledged message of ``ledger`` is on ``leader``, once, at its offset;
        returns the queues read."""
        problems: list[str] = []
        read: dict[tuple[str, int], list[Record]] = {}
        for (topic, queue_id), acked in ledger.per_queue().items():
            records = await read_queue(self.g, leader, topic, queue_id)
            read[(topic, queue_id)] = records
            problems += queue_check(records, acked, f"{leader} {topic}/{queue_id}")
            counts: dict[str, int] = defaultdict(int)
            for r in records:
                counts[msg_id_of(r.body)] += 1
            problems += [
                f"{topic}/{queue_id}: {msg_id_of(b)} stored {counts[msg_id_of(b)]} times"
                for b in acked.values()
                if counts[msg_id_of(b)] != 1
            ][:5]
        assert not problems, "\n".join(problems[:20])
        return read

    async def check_end(self, leader: str, ledger: Ledger) -> str:
        """After the traffic: every broker running and settled, acknowledged writes on the
        leader, every log byte-identical, no two brokers in one epoch; the logs' digest."""
        for key in self.keys:
            if not self.g[key].running:
                await self.g[key].start()
        end = await self.wait_settled(leader)
        await self.check_acked(leader, ledger)
        digest = assert_identical({k: self.g[k].data_dir for k in self.keys}, end)
        problems = self.terms().problems()
        assert not problems, problems
        return digest


# ----------------------------------------------------------------- traffic
@dataclass
class Sender:
    """Raw SEND_MESSAGE of unique bodies to one queue of whichever broker leads: on an
    error or no answer it finds the leader again and goes on with new bodies (what a
    send that failed did is unknown; only acknowledged bodies are checked)."""

    fg: FailoverGroup
    topic: str
    queue_id: int
    ledger: Ledger
    tag: str
    batch: int = 4
    size: int = 200
    timeout_ms: int = 3000
    sent: int = 0
    ack_times: list[float] = field(default_factory=list)  # trio clock of every acknowledgement

    async def run(self, stop: trio.Event) -> None:
        leader: str | None = None
        while not stop.is_set():
            if leader is None:
                leader = await self._leader(stop)
                continue
            bodies = [body_for(f"{self.tag}-{self.sent + i}", self.size) for i in range(self.batch)]
            self.sent += self.batch
            reply = await send_and_record(
                self.fg.g, leader, self.topic, self.queue_id, bodies, self.ledger, self.timeout_ms
            )
            if reply is None or reply.error_code:
                leader = None
            else:
                self.ack_times.append(trio.current_time())

    async def _leader(self, stop: trio.Event) -> str | None:
        async def found() -> str | bool | None:
            return stop.is_set() or await self.fg.find_leader()

        try:
            got = await await_until(found, 60, "a leader to send to")
        except (TimeoutError, ConnectionFailed, RpcError):
            return None
        return got if isinstance(got, str) else None


async def run_senders(senders: list[Sender], stop: trio.Event, nursery: trio.Nursery) -> None:
    for s in senders:
        nursery.start_soon(s.run, stop)


async def wait_acks(senders: list[Sender], more: int, timeout_s: float, what: str) -> None:
    """Wait until the senders together got ``more`` acknowledgements than now."""
    target = sum(len(s.ack_times) for s in senders) + more
    errors = {id(s.ledger): len(s.ledger.errors) for s in senders}
    try:
        await await_until(lambda: sum(len(s.ack_times) for s in senders) >= target, timeout_s, what)
    except TimeoutError as e:  # say what the sends got meanwhile (a timeout alone told nothing in CI)
        ledgers = {id(s.ledger): s.ledger for s in senders}
        failed = [err for key, ledger in ledgers.items() for err in ledger.errors[errors[key] :]]
        sent = sum(s.sent for s in senders)
        raise AssertionError(f"{e}; {sent} messages sent in all, sends failed meanwhile: {failed[:5]}") from e


def first_ack_after(senders: list[Sender], t: float) -> float | None:
    """The first acknowledgement (trio clock) at or after ``t``."""
    after = [a for s in senders for a in s.ack_times if a >= t]
    return min(after) if after else None

"""The client side of ``clmq bench failover``: a continuous sync-replicated producer
(the public client with its retry budget) whose every acknowledgement is kept with its
time and the broker that gave it, and the leader found by asking the brokers."""

from __future__ import annotations

import bisect
import itertools
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import trio

from clmq.client import Admin, ConnectionFailed, MessageQueue, NoRouteError, Producer, RpcError, SendError
from clmq.common import Message

from .failover_cluster import FailoverCluster

TOPIC = "failover"
POLL_S = 0.005  # how often an awaited acknowledgement or status is looked for


@dataclass
class Acks:
    """Every acknowledged send: when (trio clock), by which broker, how many messages."""

    times: list[float] = field(default_factory=list)
    addrs: list[str] = field(default_factory=list)
    messages: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # SendErrors (retry budget spent, not retryable)

    def add(self, at: float, addr: str, messages: int) -> None:
        self.times.append(at)
        self.addrs.append(addr)
        self.messages.append(messages)

    def first_by(self, after: float, addrs: set[str]) -> float | None:
        """The first acknowledgement at or after ``after`` by a broker in ``addrs``."""
        start = bisect.bisect_left(self.times, after)  # appended in time order
        return next((self.times[j] for j in range(start, len(self.times)) if self.addrs[j] in addrs), None)

    def messages_between(self, start: float, end: float) -> int:
        return sum(m for t, m in zip(self.times, self.messages) if start <= t <= end)

    def longest_gap(self, start: float, end: float) -> float:
        """The longest time without an acknowledgement within ``[start, end]`` (its edges count)."""
        ts = [start, *(t for t in self.times if start <= t <= end), end]
        return max((b - a for a, b in itertools.pairwise(ts)), default=0.0)


async def send_forever(producer: Producer, acks: Acks, size: int, batch: int, queues: int) -> None:
    """One sender: batches round-robin over the topic's queues until cancelled."""
    body = os.urandom(size)
    turn = itertools.count(int.from_bytes(os.urandom(2), "big"))

    def pick(mqs: Sequence[MessageQueue], _first: Message) -> MessageQueue:
        return mqs[next(turn) % len(mqs)]

    while True:
        msgs = [Message(TOPIC, 0, body) for _ in range(batch)]
        try:
            result = await producer.send_batch(TOPIC, msgs, selector=pick)
        except (SendError, NoRouteError) as e:
            acks.errors.append(str(e)[:300])
            await trio.sleep(0.05)  # a send that failed within its budget: do not spin
            continue
        acks.add(trio.current_time(), result.queue.addr, batch)


async def statuses(admin: Admin, cluster: FailoverCluster) -> dict[str, dict[str, Any]]:
    """REPLICA_STATUS of every running broker that answers (address -> status)."""
    out: dict[str, dict[str, Any]] = {}
    for node in cluster.nodes:
        if not node.running:
            continue
        try:
            with trio.fail_after(2):
                out[node.addr] = await admin.replica_status(node.addr)
        except (ConnectionFailed, RpcError, trio.TooSlowError):  # a broker going down answers nothing
            continue
    return out


def leads(status: dict[str, Any]) -> bool:
    coord = status.get("coordination") or {}
    return (
        status.get("role") == "leader"
        and coord.get("session") == "CONNECTED"
        and coord.get("leader") == status.get("broker_id")
    )


async def wait_leader(admin: Admin, cluster: FailoverCluster, timeout_s: float, exclude: str = "") -> str:
    """The address of the one broker that leads (not ``exclude``)."""
    with trio.fail_after(timeout_s):
        while True:
            found = [a for a, st in (await statuses(admin, cluster)).items() if leads(st)]
            if len(found) == 1 and found[0] != exclude:
                return found[0]
            await trio.sleep(POLL_S * 4)


async def wait_all_in_sync(admin: Admin, cluster: FailoverCluster, timeout_s: float) -> str:
    """Wait until the leader's ZooKeeper in-sync set names every broker; the leader's address."""
    with trio.fail_after(timeout_s):
        while True:
            for addr, st in (await statuses(admin, cluster)).items():
                if leads(st) and len(st["coordination"].get("isr", [])) == len(cluster.nodes):
                    return addr
            await trio.sleep(POLL_S * 4)


async def wait_first_ack(acks: Acks, after: float, addrs: set[str], timeout_s: float) -> float:
    """Seconds from ``after`` to the first acknowledgement by one of ``addrs``."""
    with trio.fail_after(timeout_s):
        while (t := acks.first_by(after, addrs)) is None:  # noqa: ASYNC110 - polled list of acks
            await trio.sleep(POLL_S)
    return t - after

"""The chaos run of issue 16 (slow): at least 50 leader failures of mixed kinds (SIGKILL
then restart, SIGSTOP beyond the ZooKeeper session then SIGCONT, a graceful switch)
under continuous sync-replicated produce from retrying producers (the public client,
``retry_budget_ms``) and a consumer group. Then: every acknowledged message on the
final leader exactly once and at the offset acknowledged, per-queue order kept,
delivered to the group at least once, no two brokers led or acknowledged in one epoch
(their log lines), every log byte-identical. Harness: ``failover_procs.py``."""

from __future__ import annotations

import itertools
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trio

from clmq.client import SendError, open_admin, open_consumer, open_producer
from clmq.common import Message
from tests.waiting import await_until

from .failover_procs import FailoverGroup
from .replica_procs import Ledger, body_for, committed_offsets, msg_id_of, open_group

TOPIC = "chaos"
QUEUES = 4
FAILURES = 50
KINDS = ("sigkill", "sigstop", "graceful")
RETRY_BUDGET_MS = 30_000  # a send outlives any one failover (a few seconds)
SEED = 16
GROUP = "chaos-group"


@dataclass
class Traffic:
    """What the producers had acknowledged (queue -> [(sequence, offset, body)]), their
    errors, and the message ids the consumer group received."""

    acked: dict[int, list[tuple[int, int, bytes]]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    received: dict[str, tuple[int, int]] = field(default_factory=dict)  # message id -> (queue, offset)
    producers_done: int = 0
    how: dict[tuple[int, int], str] = field(default_factory=dict)  # (queue, first seq) -> who acknowledged, when

    def count(self) -> int:
        return sum(len(v) for v in self.acked.values())

    def ledger(self) -> Ledger:
        ledger = Ledger()
        for q, rows in self.acked.items():
            for _, offset, body in rows:
                ledger.acked[(TOPIC, q, offset)] = body
        return ledger


async def producer_loop(ns: str, queue_id: int, traffic: Traffic, stop: trio.Event) -> None:
    """One producer sending 4-message batches to one queue, numbered in order."""
    rows = traffic.acked.setdefault(queue_id, [])
    seq = 0
    async with open_producer([ns], retry_budget_ms=RETRY_BUDGET_MS) as producer:
        while not stop.is_set():
            bodies = [body_for(f"q{queue_id}-{seq + i}", 150) for i in range(4)]
            try:
                res = await producer.send_batch(
                    TOPIC, [Message(TOPIC, 0, b) for b in bodies], selector=lambda mqs, _m: mqs[queue_id]
                )
            except SendError as e:
                traffic.errors.append(f"q{queue_id}-{seq}: {e}")
            else:
                rows += [(seq + i, off, b) for i, (off, b) in enumerate(zip(res.queue_offsets, bodies))]
                traffic.how[(queue_id, seq)] = (
                    f"{res.queue.addr}{' duplicate' if res.duplicate else ''} "
                    f"{res.queue_offsets} at {time.strftime('%H:%M:%S')}"
                )
            seq += 4
    traffic.producers_done += 1


async def consumer_loop(ns: str, traffic: Traffic, stop: trio.Event) -> None:
    async with open_consumer([ns], GROUP, {TOPIC: "*"}, commit_interval_ms=200) as consumer:
        while not stop.is_set():
            with trio.move_on_after(0.5):
                for r in await consumer.receive():
                    traffic.received[msg_id_of(r.body)] = (r.queue_id, r.queue_offset)


async def fail_once(fg: FailoverGroup, kind: str, rng: random.Random, traffic: Traffic) -> None:
    """One leader failure of ``kind``; returns once a new leader acknowledged writes and
    every broker is back in ZooKeeper's in-sync set."""
    leader = await fg.wait_leader()
    if kind == "sigkill":
        await fg.kill(leader)
        await fg.wait_leader(exclude=frozenset({leader}))
        await fg[leader].start()
    elif kind == "sigstop":
        fg.pause(leader)
        await fg.wait_leader(exclude=frozenset({leader}))
        fg.resume(leader)
    else:
        target = rng.choice([k for k in fg.keys if k != leader])
        async with open_admin(broker_addrs=[fg[target].addr]) as admin:
            await admin.promote(fg[target].addr)
        await fg.wait_leader(exclude=frozenset({leader}))
    before = traffic.count()
    await await_until(lambda: traffic.count() >= before + 8, 30, f"writes after a {kind} failure")
    new = await fg.wait_leader()
    await fg.g.wait_status(
        new,
        lambda st: len((st.get("coordination") or {}).get("isr", [])) == len(fg.keys),
        30,
        "every broker back in the in-sync set",
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_fifty_mixed_leader_failures_lose_nothing_acknowledged(tmp_path: Path, zk_connect: str) -> None:
    rng = random.Random(SEED)
    kinds = [KINDS[i % len(KINDS)] for i in range(FAILURES)]
    rng.shuffle(kinds)
    traffic = Traffic()
    async with open_group(tmp_path) as g:
        fg = FailoverGroup(g, zk_connect)
        await fg.start({TOPIC: QUEUES})
        stop, stop_consumer = trio.Event(), trio.Event()
        async with trio.open_nursery() as nursery:
            for q in range(QUEUES):
                nursery.start_soon(producer_loop, g.ns_addr, q, traffic, stop)
            nursery.start_soon(consumer_loop, g.ns_addr, traffic, stop_consumer)
            await await_until(lambda: traffic.count() >= 40, 30, "writes before the first failure")
            for i, kind in enumerate(kinds):
                try:
                    await fail_once(fg, kind, rng, traffic)
                except AssertionError as e:
                    raise AssertionError(f"failure {i} ({kind}): {e}") from None
            stop.set()
            delivered = await all_delivered(traffic)
            stop_consumer.set()
        await check_after(fg, traffic, delivered)


async def all_delivered(traffic: Traffic) -> bool:
    """Whether the group received every acknowledged message (once the producers are done)."""
    await await_until(lambda: traffic.producers_done == QUEUES, 60, "the producers to stop")

    def want() -> set[str]:
        return {msg_id_of(b) for rows in traffic.acked.values() for _, _, b in rows}

    try:
        await await_until(
            lambda: want() <= set(traffic.received), 60, "the group to receive every acknowledged message"
        )
    except TimeoutError:
        return False
    return True


async def check_after(fg: FailoverGroup, traffic: Traffic, delivered: bool) -> None:
    problems = [f"{len(traffic.errors)} sends failed: {traffic.errors[:3]}"] if traffic.errors else []
    problems += order_problems(traffic)
    assert not problems, "\n".join(problems)
    final = await fg.wait_leader()
    await fg.check_end(final, traffic.ledger())  # every acknowledged message stored once, logs identical
    assert delivered, await undelivered(fg, final, traffic)
    # every failure made a new term, and the one-ack-per-epoch check was not vacuous (a
    # term may end before it acknowledges anything: killed or paused right after its
    # election, so most terms, not all, must have acknowledged)
    terms = fg.terms()
    assert traffic.count() >= 40 + 8 * FAILURES, traffic.count()
    assert len(terms.leads) > FAILURES and len(terms.acks) >= FAILURES * 4 // 5, (len(terms.leads), len(terms.acks))


def order_problems(traffic: Traffic) -> list[str]:
    """Per queue, a message sent after another but acknowledged at a lower offset (one
    producer per queue sends a batch only after the one before was acknowledged)."""
    out = []
    for q, rows in sorted(traffic.acked.items()):
        rows = sorted(rows)
        out += [
            f"queue {q}: seq {a[0]} acknowledged at {a[1]} ({traffic.how.get((q, a[0] - a[0] % 4))}), "
            f"then seq {b[0]} at {b[1]} ({traffic.how.get((q, b[0] - b[0] % 4))})"
            for a, b in itertools.pairwise(rows)
            if b[1] <= a[1]
        ][:3]
        seen: dict[int, int] = {}
        for seq, offset, _ in rows:
            if offset in seen:
                out.append(
                    f"queue {q}: offset {offset} acknowledged to seq {seen[offset]} "
                    f"({traffic.how.get((q, seen[offset] - seen[offset] % 4))}) and to seq {seq} "
                    f"({traffic.how.get((q, seq - seq % 4))})"
                )
            seen[offset] = seq
    return out


async def undelivered(fg: FailoverGroup, leader: str, traffic: Traffic) -> str:
    """What the group missed, per queue, with its committed offsets."""
    committed = await committed_offsets(fg.g, leader, GROUP, [(TOPIC, q) for q in range(QUEUES)])
    lines = []
    for q, rows in sorted(traffic.acked.items()):
        missing = [(seq, off) for seq, off, b in rows if msg_id_of(b) not in traffic.received]
        got = [off for qq, off in traffic.received.values() if qq == q]
        if missing:
            lines.append(
                f"queue {q}: {len(missing)} of {len(rows)} not received, first (seq, offset) {missing[:3]}, "
                f"received offsets up to {max(got, default=-1)}, committed {committed[q]}"
            )
    return "the group missed acknowledged messages:\n" + "\n".join(lines)

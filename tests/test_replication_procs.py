"""Replication between real broker processes (``python -m broker.cli broker``), each with
its own data directory, behind a real name server: brokers are killed (SIGKILL),
paused (SIGSTOP/SIGCONT), restarted and promoted while producers send, and afterwards
the logs are compared byte for byte straight from the segment files, and every
acknowledged message is read back. Group "g": broker ids 0 (the first leader), 1, 2.
Waits poll REPLICA_STATUS (``tests/waiting.py``); the harness is ``replica_procs.py``."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import pytest
import trio

from clmq.broker.replication import LeaderEpochs
from clmq.broker.store import load_json
from clmq.client import shard
from clmq.common import Record
from clmq.protocol import ErrorCode, RequestCode
from clmq.protocol.transport import ConnectionFailed, RpcError
from tests.waiting import await_until

from .replica_procs import (
    Group,
    Ledger,
    assert_identical,
    body_for,
    commit,
    committed_offsets,
    create_topic,
    msg_id_of,
    open_group,
    queue_check,
    read_queue,
    segments,
    send,
    send_and_record,
)

TOPIC = "orders"
QUEUES = 8


async def start_group(g: Group, followers: int = 2, **settings: Any) -> list[str]:
    """Leader g0 and followers g1.. (every broker with ``settings``: any may lead later);
    the topic created and replicated. Returns the keys."""
    await g.start_broker("g0", 0, **settings)
    keys = ["g0"]
    for i in range(1, followers + 1):
        await g.start_broker(f"g{i}", i, follow="g0", **settings)
        keys.append(f"g{i}")
    await create_topic(g, "g0", TOPIC, QUEUES)
    await g.wait_in_sync("g0", keys[1:])
    return keys


async def produce_until(
    g: Group,
    key: str,
    ledger: Ledger,
    stop: trio.Event,
    rng: random.Random,
    tag: str,
    sizes: tuple[int, int] = (16, 4000),
    pace_s: float = 0.0,
) -> None:
    """Send batches of 1-8 messages to random queues of :data:`TOPIC` until ``stop``
    (``pace_s`` apart: a producer slower than a throttle)."""
    n = 0
    while not stop.is_set():
        await trio.sleep(pace_s)  # pacing, not a wait for an event
        queue_id = rng.randrange(QUEUES)
        bodies = [body_for(f"{tag}-{n + i}", rng.randint(*sizes)) for i in range(rng.randint(1, 8))]
        n += len(bodies)
        await send_and_record(g, key, TOPIC, queue_id, bodies, ledger)


async def wait_bytes(g: Group, key: str, at_least: int, what: str, timeout_s: float = 30) -> int:
    """Wait until broker ``key``'s log ends at ``at_least`` or beyond; returns its end."""
    st = await g.wait_status(key, lambda s: s["end_offset"] >= at_least, timeout_s, what)
    return int(st["end_offset"])


async def check_queues(g: Group, key: str, ledger: Ledger) -> None:
    """Every acknowledged message is in its queue on broker ``key``, the queues without gaps."""
    problems: list[str] = []
    for (topic, queue_id), acked in sorted(ledger.per_queue().items()):
        problems += queue_check(await read_queue(g, key, topic, queue_id), acked, f"{key} {topic}/{queue_id}")
    assert not problems, problems[:20]


# ----------------------------------------------------------------- 1. follower SIGKILL
async def test_follower_killed_and_restarted_under_load_catches_up_without_gap(tmp_path: Path) -> None:
    """Async acks; follower g1 is SIGKILLed while a producer sends, misses a stretch of
    the log, and is restarted on its data directory while the producer goes on: it
    rejoins the in-sync set, and once traffic stops its log is byte-identical to the
    leader's and every acknowledged message is in its queues."""
    async with open_group(tmp_path) as g:
        keys = await start_group(g, replica_lag_max_ms=1000)
        ledger, stop, rng = Ledger(), trio.Event(), random.Random(15)
        async with trio.open_nursery() as n:
            for t in range(2):
                n.start_soon(produce_until, g, "g0", ledger, stop, random.Random(rng.random()), f"p{t}")
            killed_at = await wait_bytes(g, "g1", 200_000, "g1 to copy the first 200 KB under load")
            await g["g1"].kill()
            await g.wait_status(
                "g0", lambda s: not _row(s, 1)["in_sync"], 10, "the leader to drop g1 from the in-sync set"
            )
            await wait_bytes(g, "g0", killed_at + 1_000_000, "the leader to grow 1 MB while g1 is down")
            await g["g1"].start()
            await g.wait_status(
                "g0",
                lambda s: _row(s, 1)["in_sync"] and _row(s, 1)["acked_offset"] > killed_at + 1_000_000,
                30,
                "g1 to catch up and rejoin the in-sync set while the producer sends",
            )
            stop.set()
        assert not ledger.errors, ledger.errors[:5]
        end = await g.wait_in_sync("g0", keys[1:])
        assert end > killed_at + 1_000_000 and ledger.sends > 100
        assert_identical({k: g[k].data_dir for k in keys}, end)
        await check_queues(g, "g1", ledger)


def _row(status: dict[str, Any], broker_id: int) -> dict[str, Any]:
    """The leader's row for follower ``broker_id`` (an absent one reads as out of sync)."""
    rows = [r for r in status.get("replicas", []) if r["broker_id"] == broker_id]
    return rows[0] if rows else {"in_sync": False, "acked_offset": -1, "broker_id": broker_id}


# ----------------------------------------------------------------- 2. leader SIGKILL, sync acks
KEYS = [f"key-{i}" for i in range(12)]  # sharding keys: one producer task each, several per queue
CONSUMER_GROUP = "cg"


async def produce_keyed(
    g: Group,
    key: str,
    sharding_key: str,
    ledger: Ledger,
    order: dict[str, list[int]],
    next_seq: dict[str, int] | None = None,
) -> None:
    """Send 1-3 messages at a time, in order, to the sharding key's queue until an error
    (the leader's death); ``order[sharding_key]`` lists the sequence numbers acknowledged,
    ``next_seq`` (kept across calls) the next one to send."""
    seqs = next_seq if next_seq is not None else {}
    queue_id, seq = shard(sharding_key, QUEUES), seqs.get(sharding_key, 0)
    rng = random.Random(f"{sharding_key}-{seq}")
    while True:
        bodies = [body_for(f"{sharding_key}-{seq + i}", rng.randint(16, 2000)) for i in range(rng.randint(1, 3))]
        seqs[sharding_key] = seq + len(bodies)  # a failed send's numbers are not used again
        reply = await send_and_record(g, key, TOPIC, queue_id, bodies, ledger)
        if reply is None or reply.error_code:
            return
        order.setdefault(sharding_key, []).extend(range(seq, seq + len(bodies)))
        seq += len(bodies)


async def promote(g: Group, key: str, force: bool = False) -> int:
    """PROMOTE broker ``key``; returns its epoch as the leader."""
    reply = await g.call(key, RequestCode.PROMOTE, {"force": force})
    assert not reply.error_code, f"PROMOTE {key} (force {force}): {reply.error_text}"
    return int(reply.fields["epoch"])


async def promote_first(g: Group, candidates: list[str]) -> str:
    """After the leader's death: PROMOTE (without force) the first of ``candidates`` that
    accepts (it was in sync at the leader's last answer); returns its key."""
    refusals = []
    for key in candidates:
        reply = await g.call(key, RequestCode.PROMOTE, {})
        if not reply.error_code:
            return key
        refusals.append(f"{key}: {ErrorCode(reply.error_code).name}: {reply.error_text}")
    raise AssertionError(f"no follower could be promoted: {refusals}")


async def wait_offsets(g: Group, keys: list[str], want: dict[tuple[str, int], int], what: str) -> None:
    """Wait until brokers ``keys`` all report the consumer group's committed offsets ``want``."""
    queues = sorted(want)

    async def seen() -> bool:
        for key in keys:
            try:
                rows = await committed_offsets(g, key, CONSUMER_GROUP, queues)
            except (ConnectionFailed, RpcError, trio.TooSlowError):
                return False
            if [r[0] if r else None for r in rows] != [want[q] for q in queues]:
                return False
        return True

    await await_until(seen, 20, what)


def check_key_order(records_by_queue: dict[int, list[Record]], order: dict[str, list[int]]) -> list[str]:
    """Per sharding key: its messages appear in its queue in the order they were sent,
    and every acknowledged one is there."""
    problems = []
    for sharding_key, acked in order.items():
        seqs = [
            int(msg_id_of(r.body).rsplit("-", 1)[1])
            for r in records_by_queue[shard(sharding_key, QUEUES)]
            if msg_id_of(r.body).rsplit("-", 1)[0] == sharding_key
        ]
        if seqs != sorted(seqs) or len(set(seqs)) != len(seqs):
            problems.append(f"{sharding_key}: read out of order or twice: {seqs[:30]}")
        if missing := set(acked) - set(seqs):
            problems.append(f"{sharding_key}: acknowledged, not read: {sorted(missing)[:10]}")
    return problems


async def test_leader_killed_under_sync_acks_promoted_follower_has_every_ack(tmp_path: Path) -> None:
    """Sync acks, min_insync_replicas=2, leader and two followers; producers send by
    sharding key and record every acknowledgement; a consumer group commits; the leader
    is SIGKILLed mid-traffic and the in-sync follower with the shorter log promoted. Every
    acknowledged message is on the new leader, in order per key; the group's offsets are
    there; the other follower follows the new leader, byte for byte, and sync writes
    work again."""
    async with open_group(tmp_path) as g:
        await start_group(g, ack_mode="sync", min_insync_replicas=2)
        ledger, order = Ledger(), dict[str, list[int]]()
        async with trio.open_nursery() as n:
            for sharding_key in KEYS:
                n.start_soon(produce_keyed, g, "g0", sharding_key, ledger, order)
            await await_until(lambda: len(ledger.acked) >= 300, 30, "300 acknowledged messages")
            committed = {(TOPIC, q): len(acked) // 2 for (_t, q), acked in ledger.per_queue().items()}
            await commit(g, "g0", CONSUMER_GROUP, committed)
            await wait_offsets(g, ["g1", "g2"], committed, "both followers to copy the group's offsets")
            at_kill = len(ledger.acked)
            await await_until(lambda: len(ledger.acked) >= at_kill + 300, 30, "300 more acknowledged messages")
            await g["g0"].kill()  # the producers stop at their first failed send
        assert len(ledger.errors) <= len(KEYS), ledger.errors  # one failed send per producer: the kill
        # The follower with the shorter log, if both are in sync: the other must then cut
        # the unacknowledged tail the new leader never had.
        ends = {k: (await g.status(k))["end_offset"] for k in ("g1", "g2")}
        new = await promote_first(g, sorted(ends, key=lambda k: ends[k]))
        other = "g2" if new == "g1" else "g1"
        reads = {q: await read_queue(g, new, TOPIC, q) for q in range(QUEUES)}
        problems = [
            p for (_t, q), acked in ledger.per_queue().items() for p in queue_check(reads[q], acked, f"{new} {q}")
        ]
        assert not problems + check_key_order(reads, order), (problems + check_key_order(reads, order))[:20]
        rows = await committed_offsets(g, new, CONSUMER_GROUP, sorted(committed))
        assert [r[0] if r else None for r in rows] == [committed[q] for q in sorted(committed)]
        await g.wait_status(
            other,
            lambda s: s["leader_addr"] == g[new].addr and s["in_sync"],
            30,
            f"{other} to follow the new leader {new} and be in sync",
        )
        reply = await send(g, new, TOPIC, 0, [b"after the promotion"])
        assert not reply.error_code, f"a sync write to the new leader: {reply.error_text}"
        end = await g.wait_in_sync(new, [other])
        assert_identical({k: g[k].data_dir for k in (new, other)}, end)


# ----------------------------------------------------------------- 3. divergent tail
async def write_bytes(g: Group, key: str, tag: str, at_least: int, ledger: Ledger) -> None:
    """Send messages to broker ``key`` until ``at_least`` bytes were acknowledged."""
    rng, n, goal = random.Random(tag), 0, ledger.bytes_acked + at_least
    while ledger.bytes_acked < goal:
        bodies = [body_for(f"{tag}-{n + i}", rng.randint(500, 4000)) for i in range(8)]
        n += len(bodies)
        reply = await send_and_record(g, key, TOPIC, rng.randrange(QUEUES), bodies, ledger)
        assert reply is not None and not reply.error_code, ledger.errors[-1:]


async def queue_ends(g: Group, key: str) -> dict[tuple[str, int], int]:
    rows = await committed_offsets(g, key, CONSUMER_GROUP, [(TOPIC, q) for q in range(QUEUES)])
    return {(TOPIC, q): row[2] for q, row in enumerate(rows) if row}


async def test_old_leader_rejoins_and_cuts_its_divergent_tail(tmp_path: Path) -> None:
    """The followers are killed; the leader takes (async) writes no follower has, then
    dies; a follower is started and promoted (forced: it was not in sync) and takes
    other writes at the same offsets. The old leader, started again, hears from the name
    server that a newer leader exists, steps down, cuts its log to where the terms
    agree, copies the new leader's bytes, and ends byte-identical to it; its
    consumer offsets are within its queues."""
    async with open_group(tmp_path) as g:
        keys = await start_group(g)
        common, divergent, later = Ledger(), Ledger(), Ledger()
        await write_bytes(g, "g0", "common", 200_000, common)
        agreed = await g.wait_in_sync("g0", ["g1", "g2"])
        ends = await queue_ends(g, "g0")
        await commit(g, "g0", CONSUMER_GROUP, ends)
        await wait_offsets(g, ["g1", "g2"], ends, "the followers to copy the group's offsets")
        await g["g1"].kill()
        await g["g2"].kill()
        await write_bytes(g, "g0", "divergent", 600_000, divergent)  # only the leader has these
        await commit(g, "g0", CONSUMER_GROUP, await queue_ends(g, "g0"))  # offsets only the old leader knows
        old_end = (await g.status("g0"))["end_offset"]
        await g["g0"].kill()
        await g["g1"].start()
        assert (await g.status("g1"))["end_offset"] == agreed
        not_in_sync = await g.call("g1", RequestCode.PROMOTE, {})
        assert not_in_sync.error_code == ErrorCode.NOT_IN_SYNC, not_in_sync  # it never caught up with g0's last writes
        epoch = await promote(g, "g1", force=True)
        await write_bytes(g, "g1", "later", 100_000, later)  # at the offsets of the old leader's divergent tail
        await g["g2"].start()
        await g.wait_status("g2", lambda s: s["leader_addr"] == g["g1"].addr, 30, "g2 to follow the new leader g1")
        await g["g0"].start()
        # A follower's epoch is its log's latest term: it reaches the new leader's once the
        # first bytes of that term are copied, a moment after it names the new leader.
        await g.wait_status(
            "g0",
            lambda s: s["role"] == "follower" and s["leader_addr"] == g["g1"].addr and s["epoch"] >= epoch,
            30,
            "the old leader to step down, follow g1 and copy its term",
        )
        rows = await g.wait_cluster(lambda c: c.get("g0", {}).get("role") == "follower", 10, "g0 listed as a follower")
        assert rows["g1"]["role"] == "leader" and rows["g1"]["epoch"] == epoch, rows
        end = await g.wait_in_sync("g1", ["g0", "g2"])
        assert agreed < end < old_end  # the old leader's log end dropped: its divergent tail is gone
        assert_identical({k: g[k].data_dir for k in keys}, end)
        ids = {msg_id_of(r.body) for q in range(QUEUES) for r in await read_queue(g, "g0", TOPIC, q)}
        assert not {msg_id_of(b) for b in divergent.acked.values()} & ids, "a divergent message survived"
        assert {msg_id_of(b) for b in [*common.acked.values(), *later.acked.values()]} <= ids
        rows = await committed_offsets(g, "g0", CONSUMER_GROUP, sorted(ends))
        assert all(row is not None and row[0] <= row[2] for row in rows), rows  # no offset past a queue's end
        await wait_offsets(g, ["g0"], ends, "the old leader to take the new leader's group offsets")


# ----------------------------------------------------------------- 4. lagging followers
LAG_MAX_MS = 1000
REPLICATION_TIMEOUT_MS = 3000
SLACK_S = 3.0  # a loaded 2-core machine: scheduling, registration and poll intervals


async def refused_quickly(g: Group, deadline_s: float) -> list[tuple[str, float]]:
    """Send sync writes one after another until one is refused with NOT_ENOUGH_REPLICAS;
    each answer's code and seconds. Every answer must come in time (none hangs) and
    none may be OK (no follower can hold the bytes)."""
    answers: list[tuple[str, float]] = []
    give_up = time.monotonic() + deadline_s
    while not answers or answers[-1][0] != "NOT_ENOUGH_REPLICAS":
        assert time.monotonic() < give_up, f"no NOT_ENOUGH_REPLICAS within {deadline_s} s: {answers}"
        t0 = time.monotonic()
        reply = await send(
            g,
            "g0",
            TOPIC,
            1,
            [b"while both followers are paused"],
            timeout_ms=REPLICATION_TIMEOUT_MS + int(SLACK_S * 1000),
        )
        answers.append((ErrorCode(reply.error_code).name, time.monotonic() - t0))
        assert answers[-1][0] in ("REPLICATION_TIMEOUT", "NOT_ENOUGH_REPLICAS"), answers
    return answers


async def test_paused_followers_leave_and_rejoin_the_in_sync_set(tmp_path: Path) -> None:
    """Sync acks, min_insync_replicas=2: a follower paused with SIGSTOP leaves the in-sync
    set within about replica_lag_max_ms and writes go on with the other; with both
    paused, writes are refused (NOT_ENOUGH_REPLICAS, or REPLICATION_TIMEOUT for one
    caught while the set shrank), never hung; resumed, both catch up and rejoin, and
    sync writes are acknowledged again."""
    async with open_group(tmp_path) as g:
        keys = await start_group(
            g,
            ack_mode="sync",
            min_insync_replicas=2,
            replica_lag_max_ms=LAG_MAX_MS,
            replication_timeout_ms=REPLICATION_TIMEOUT_MS,
        )
        ledger, stop = Ledger(), trio.Event()
        async with trio.open_nursery() as n:
            n.start_soon(produce_until, g, "g0", ledger, stop, random.Random(4), "p")
            await await_until(lambda: ledger.sends >= 20, 20, "20 sync sends")
            g["g1"].pause()
            t0 = time.monotonic()
            await g.wait_status("g0", lambda s: not _row(s, 1)["in_sync"], 10, "the leader to drop paused g1")
            left_after = time.monotonic() - t0
            sends = ledger.sends
            await await_until(lambda: ledger.sends >= sends + 20, 20, "20 more sync sends with g1 paused")
            stop.set()
        assert not ledger.errors, ledger.errors[:5]  # sends waited for g1 to leave, then went on with g2
        assert LAG_MAX_MS / 2000 < left_after < LAG_MAX_MS / 1000 + SLACK_S, left_after  # about replica_lag_max_ms
        g["g2"].pause()
        answers = await refused_quickly(g, LAG_MAX_MS / 1000 + REPLICATION_TIMEOUT_MS / 1000 + 3 * SLACK_S)
        assert all(s < REPLICATION_TIMEOUT_MS / 1000 + SLACK_S for _code, s in answers), answers
        assert answers[-1][1] < 1.0, answers  # refused before anything is written: no waiting
        print(f"\ng1 left the in-sync set after {left_after:.2f} s; writes with both paused: {answers}")
        st = await g.status("g0")
        assert not _row(st, 1)["in_sync"] and not _row(st, 2)["in_sync"], st
        g["g1"].resume()
        g["g2"].resume()
        await g.wait_status(
            "g0",
            lambda s: _row(s, 1)["in_sync"] and _row(s, 2)["in_sync"],
            30,
            "both followers to rejoin the in-sync set",
        )
        ok = await send_and_record(g, "g0", TOPIC, 2, [b"after the followers rejoined"], ledger)
        assert ok is not None and not ok.error_code, ledger.errors[-1:]
        end = await g.wait_in_sync("g0", keys[1:])
        assert_identical({k: g[k].data_dir for k in keys}, end)


# ----------------------------------------------------------------- 5. thousands of queues
WIDE_TOPICS = {"wide-a": 1000, "wide-b": 1000, "wide-c": 1200}  # 3,200 queues
SENDERS = 6


def queue_cycle(rng: random.Random) -> Iterator[tuple[str, int]]:
    """Every queue of :data:`WIDE_TOPICS` in a random order, again and again."""
    queues = [(t, q) for t, count in sorted(WIDE_TOPICS.items()) for q in range(count)]
    while True:
        rng.shuffle(queues)
        yield from queues


async def produce_wide(
    g: Group, ledger: Ledger, goal_bytes: int, queues: Iterator[tuple[str, int]], rng: random.Random
) -> None:
    """Single messages and batches of up to 8, 1 B..8 KiB each (most under 200 B), to
    the next queue of ``queues``, until ``goal_bytes`` were acknowledged (by all senders)."""
    while ledger.bytes_acked < goal_bytes:
        topic, queue_id = next(queues)
        count = 1 if rng.random() < 0.7 else rng.randint(2, 8)
        bodies = [rng.randbytes(rng.randint(1, 8192 if rng.random() < 0.1 else 200)) for _ in range(count)]
        reply = await send_and_record(g, "g0", topic, queue_id, bodies, ledger)
        assert reply is not None and not reply.error_code, ledger.errors[-1:]


async def queue_maxima(g: Group, key: str) -> dict[str, list[int]]:
    """topic -> every queue's max offset, as broker ``key`` reports (DESCRIBE_TOPIC)."""
    out = {}
    for topic in WIDE_TOPICS:
        reply = await g.call(key, RequestCode.DESCRIBE_TOPIC, {"topic": topic})
        assert not reply.error_code, f"{key}: DESCRIBE_TOPIC {topic}: {reply.error_text}"
        out[topic] = [q["max_offset"] for q in reply.fields["queues"]]
    return out


async def wide_traffic_identical_logs(tmp_path: Path, ack_mode: str, goal_bytes: int) -> None:
    other = "async" if ack_mode == "sync" else "sync"
    async with open_group(tmp_path) as g:
        keys = await start_group(g, ack_mode=ack_mode, topic_ack_modes={"wide-c": other}, min_insync_replicas=2)
        for topic, count in WIDE_TOPICS.items():
            await create_topic(g, "g0", topic, count)
        ledger, rng = Ledger(), random.Random(f"wide-{ack_mode}")
        t0, queues = time.monotonic(), queue_cycle(rng)
        async with trio.open_nursery() as n:
            for _ in range(SENDERS):
                n.start_soon(produce_wide, g, ledger, goal_bytes, queues, random.Random(rng.random()))
        seconds = time.monotonic() - t0
        end = await g.wait_in_sync("g0", keys[1:], timeout_s=60)
        digest = assert_identical({k: g[k].data_dir for k in keys}, end)
        assert all(len(segments(g[k].data_dir)) >= goal_bytes >> 20 for k in keys)  # rolled, across blank markers
        leader = await queue_maxima(g, "g0")
        assert sum(map(sum, leader.values())) == len(ledger.acked)
        assert len(ledger.per_queue()) >= 2000, len(ledger.per_queue())  # thousands of queues
        for key in keys[1:]:  # the followers' own queues, built by their own dispatchers

            async def same(key: str = key) -> bool:
                return await queue_maxima(g, key) == leader

            await await_until(same, 20, f"{key}'s queues to end where the leader's do")
        sample = rng.sample(sorted(ledger.per_queue().items()), 30)
        problems = [
            p for (t, q), acked in sample for p in queue_check(await read_queue(g, "g2", t, q), acked, f"g2 {t}/{q}")
        ]
        assert not problems, problems
        print(
            f"\n{ack_mode}: {len(ledger.acked)} messages to {len(ledger.per_queue())} queues in {ledger.sends} sends "
            f"({seconds:.1f} s), {end} log bytes, sha256 {digest[:16]}"
        )


@pytest.mark.parametrize("ack_mode", ["async", "sync"])
async def test_logs_byte_identical_after_mixed_traffic_over_thousands_of_queues(tmp_path: Path, ack_mode: str) -> None:
    """Leader and two followers, 3,200 queues, messages of 1 B..8 KiB alone and in
    batches, the default ack mode and the other one for one topic; 1 MiB segments, so
    the stream crosses segment ends. Every log is byte-identical, the followers' queues
    end where the leader's do, and sampled queues read back from a follower."""
    await wide_traffic_identical_logs(tmp_path, ack_mode, 5 << 19)


@pytest.mark.slow
@pytest.mark.parametrize("ack_mode", ["async", "sync"])
async def test_logs_byte_identical_after_heavy_mixed_traffic(tmp_path: Path, ack_mode: str) -> None:
    """As above with 32 MB of traffic (32 segments)."""
    await wide_traffic_identical_logs(tmp_path, ack_mode, 32 << 20)


# ----------------------------------------------------------------- a new, empty replica
CATCHUP_BYTES_PER_S = 1 << 20


async def test_an_empty_follower_added_under_load_copies_the_log_throttled(tmp_path: Path) -> None:
    """A third broker with an empty data directory joins a group whose log spans
    several segments while a producer sends: it copies the whole log from the first
    segment, no faster than replica_catchup_bytes_per_s allows (one second of tokens
    in hand), joins the in-sync set, and ends byte-identical, with the leader's terms."""
    async with open_group(tmp_path) as g:
        throttled = {"replica_catchup_bytes_per_s": CATCHUP_BYTES_PER_S, "replica_fetch_max_bytes": 128 << 10}
        await start_group(g, followers=1, **throttled)
        await write_bytes(g, "g0", "before", 3 << 20, Ledger())
        ledger, stop = Ledger(), trio.Event()
        async with trio.open_nursery() as n:
            # Paced below the throttle (about 0.2 MB/s): a follower must be able to catch up.
            n.start_soon(produce_until, g, "g0", ledger, stop, random.Random(6), "during", (16, 1000), 0.01)
            log_at_join = (await g.status("g0"))["end_offset"]
            t0 = time.monotonic()
            await g.start_broker("g2", 2, follow="g0", **throttled)
            await g.wait_status("g0", lambda s: _row(s, 2)["in_sync"], 60, "the new follower to join the in-sync set")
            took = time.monotonic() - t0
            stop.set()
        assert not ledger.errors, ledger.errors[:5]
        floor_s = (log_at_join - CATCHUP_BYTES_PER_S - (128 << 10)) / CATCHUP_BYTES_PER_S
        assert took >= floor_s, f"{log_at_join} bytes copied in {took:.2f} s: faster than the throttle allows"
        end = await g.wait_in_sync("g0", ["g1", "g2"])
        assert_identical({k: g[k].data_dir for k in ("g0", "g1", "g2")}, end)
        assert LeaderEpochs.load(g["g2"].data_dir).entries == LeaderEpochs.load(g["g0"].data_dir).entries
        await check_queues(g, "g2", ledger)
        print(f"\nan empty follower copied {log_at_join} bytes (and the traffic meanwhile) in {took:.2f} s")


# ----------------------------------------------------------------- a loop of faults
FAULTS = (
    "kill_leader",
    "restart_leader",
    "pause_leader",
    "kill_follower",
    "kill_follower_catching_up",
    "pause_follower",
)
LEADER_FAULTS = ("kill_leader", "restart_leader", "pause_leader")  # the producers stop at their first failed send


@dataclass
class Loop:
    """A fault loop's state: who leads, what was acknowledged and committed."""

    g: Group
    rng: random.Random
    leader: str = "g0"
    ledger: Ledger = field(default_factory=Ledger)
    order: dict[str, list[int]] = field(default_factory=dict)
    committed: dict[tuple[str, int], int] = field(default_factory=dict)
    next_seq: dict[str, int] = field(default_factory=dict)
    faults: list[str] = field(default_factory=list)

    @property
    def followers(self) -> list[str]:
        return sorted(set(self.g.brokers) - {self.leader})

    async def acks(self, more: int) -> None:
        goal, errors = len(self.ledger.acked) + more, len(self.ledger.errors)
        try:
            await await_until(lambda: len(self.ledger.acked) >= goal, 60, f"{more} more acknowledged messages")
        except TimeoutError as e:  # a producer stops at its first failed send: say what failed
            failed = self.ledger.errors[errors:][:5]
            raise AssertionError(f"{e} in {self.faults}; sends failed meanwhile: {failed}") from e


async def kill_leader(loop: Loop) -> None:
    """SIGKILL the leader; promote an in-sync follower (without force); the other
    follows it; the old leader restarts, steps down and follows."""
    g, old = loop.g, loop.leader
    await g[old].kill()
    candidates = loop.followers
    loop.rng.shuffle(candidates)  # either in-sync follower: the other may have to cut an unacknowledged tail
    loop.leader = key = await promote_first(g, candidates)
    for other in loop.followers:
        if other != old:
            await g.wait_status(other, lambda s: s["leader_addr"] == g[key].addr, 30, f"{other} to follow {key}")
    await g[old].start()
    await g.wait_status(
        old,
        lambda s: s["role"] == "follower" and s["leader_addr"] == g[key].addr,
        30,
        f"the old leader {old} to step down and follow {key}",
    )


async def pause_leader(loop: Loop) -> None:
    """SIGSTOP the leader for 0.5-3 s (a stall: its followers' fetches time out, sends
    wait), then SIGCONT: it goes on leading; the followers rejoin."""
    g = loop.g
    g[loop.leader].pause()
    await trio.sleep(loop.rng.uniform(0.5, 3.0))  # the stall's length is the fault, not a wait for an event
    g[loop.leader].resume()
    await g.wait_status(loop.leader, lambda s: s["role"] == "leader", 10, "the stalled leader to answer")


def saved_offsets(data_dir: Path) -> dict[tuple[str, int], int]:
    """The consumer group's offsets in a broker's ``consumer_offsets.json``."""
    loaded = load_json(data_dir / "consumer_offsets.json")
    rows = loaded.value.get("offsets", []) if loaded.value else []
    if loaded.value and loaded.value.get("version") == 2:  # a row per (group, topic): queue ids, offsets
        return {(t, q): o for group, t, qs, os in rows if group == CONSUMER_GROUP for q, o in zip(qs, os)}
    return {(t, q): o for group, t, q, o in rows if group == CONSUMER_GROUP}


async def restart_leader(loop: Loop) -> None:
    """SIGKILL the leader and start it again, promoting nobody: it leads again with a
    new epoch, and the followers join its new term."""
    g, key = loop.g, loop.leader
    epoch = (await g.status(key))["epoch"]
    # A broker keeps its consumer offsets every offset_flush_interval_ms: a restart (with
    # no promotion) loses the last interval's commits, by design. Kill it after that.
    await await_until(lambda: saved_offsets(g[key].data_dir) == loop.committed, 10, f"{key} to save the offsets")
    await g[key].kill()
    await g[key].start()
    await g.wait_status(key, lambda s: s["role"] == "leader" and s["epoch"] > epoch, 10, f"{key} to lead a new term")


async def fault_round(loop: Loop, fault: str) -> None:
    """Produce by key; at a random moment inflict ``fault``; stop; check that
    every replica is in sync and byte-identical, and the group's offsets survived."""
    g = loop.g
    loop.faults.append(fault)
    errors_before = len(loop.ledger.errors)
    async with trio.open_nursery() as n:
        for sharding_key in KEYS:
            n.start_soon(produce_keyed, g, loop.leader, sharding_key, loop.ledger, loop.order, loop.next_seq)
        await loop.acks(loop.rng.randint(50, 400))
        loop.committed = {(TOPIC, q): len(acked) // 2 for (_t, q), acked in loop.ledger.per_queue().items()}
        await commit(g, loop.leader, CONSUMER_GROUP, loop.committed)
        await wait_offsets(g, loop.followers, loop.committed, "the followers to copy the group's offsets")
        if fault == "kill_leader":
            await kill_leader(loop)
        elif fault == "pause_leader":
            await pause_leader(loop)
        elif fault == "restart_leader":
            await restart_leader(loop)
        else:
            await follower_fault(loop, fault)
        n.cancel_scope.cancel()
    errors = loop.ledger.errors[errors_before:]
    assert len(errors) <= (len(KEYS) if fault in LEADER_FAULTS else 0), errors[:5]
    end = await g.wait_in_sync(loop.leader, loop.followers, timeout_s=60)
    assert_identical({k: g[k].data_dir for k in g.brokers}, end)
    await wait_offsets(g, [loop.leader], loop.committed, f"the leader to hold the group's offsets after {loop.faults}")


async def follower_fault(loop: Loop, fault: str) -> None:
    """SIGKILL (then restart) or SIGSTOP (then SIGCONT) a follower under load: it leaves
    the in-sync set, writes go on, and it rejoins while they do. ``kill_follower_catching_up``
    kills it once more at a random moment of its catch-up."""
    g, key = loop.g, loop.rng.choice(loop.followers)
    broker_id = g[key].broker_id
    if fault == "pause_follower":
        g[key].pause()
    else:
        await g[key].kill()
    await g.wait_status(loop.leader, lambda s: not _row(s, broker_id)["in_sync"], 20, f"{key} to leave the in-sync set")
    await loop.acks(loop.rng.randint(50, 300))
    if fault == "pause_follower":
        g[key].resume()
    else:
        await g[key].start()
    if fault == "kill_follower_catching_up":
        at = (await g.status(key))["end_offset"]
        await g.wait_status(key, lambda s: s["end_offset"] > at, 20, f"{key} to start catching up")
        await trio.sleep(loop.rng.uniform(0, 0.3))  # a random moment of the catch-up, not a wait for an event
        await g[key].kill()
        await g[key].start()
    await g.wait_status(loop.leader, lambda s: _row(s, broker_id)["in_sync"], 30, f"{key} to rejoin under load")
    await loop.acks(50)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("replica_ack", ["written", "flushed"])
async def test_loop_of_leader_and_follower_faults_loses_no_acknowledged_message(
    tmp_path: Path, replica_ack: str
) -> None:
    """Sync acks, min_insync_replicas=2, three brokers; rounds of keyed traffic, each with
    a random fault: the leader SIGKILLed and a follower promoted, the old leader
    rejoining; the leader SIGKILLed and restarted (a new term); the leader stalled
    (SIGSTOP) and resumed; a follower SIGKILLed and restarted (and killed again while
    catching up); a follower paused and resumed.
    After every round all logs are byte-identical and the group's offsets are on the
    leader; at the end every acknowledged message is on the last leader, in order per key."""
    async with open_group(tmp_path) as g:
        await start_group(g, ack_mode="sync", min_insync_replicas=2, replica_lag_max_ms=1000, replica_ack=replica_ack)
        loop = Loop(g, random.Random(f"faults-{replica_ack}"))
        faults = list(FAULTS) * 3  # each kind three times, in a random order
        loop.rng.shuffle(faults)
        for fault in faults:
            await fault_round(loop, fault)
        reads = {q: await read_queue(g, loop.leader, TOPIC, q) for q in range(QUEUES)}
        problems = [
            p for (_t, q), acked in loop.ledger.per_queue().items() for p in queue_check(reads[q], acked, f"queue {q}")
        ]
        problems += check_key_order(reads, loop.order)
        assert not problems, problems[:20]
        print(f"\nfaults {loop.faults}: {len(loop.ledger.acked)} acknowledged messages, all on {loop.leader}")

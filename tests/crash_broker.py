"""Kill -9 loops through a real broker process (used by ``test_crash_broker.py``).

A round: start ``clmq broker`` (sync flush) on a data directory; check what it
recovered (every acknowledged offset below its queue's end, the group's committed
offsets within their queues and not behind the previous restart's) and that it is
healthy (one produce must succeed); run producers that send numbered messages with
distinct bodies to several topics and queues and record every acknowledged one, and a
consumer group that reads and commits meanwhile; SIGKILL the broker once a random
number of messages of that round were acknowledged, a random few milliseconds later
(several sends are in flight then, so the kill lands at an arbitrary point of the
broker's work); in a quarter of the rounds SIGTERM first and SIGKILL at a random moment
of the graceful stop. Sends that failed are sent again, identical, in the next round:
that is the only way a message may be stored twice. At the end everything is read back
through the public consumer and compared with the ledger (:func:`audit`).
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import re
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import trio

from clmq.client import (
    ClmqError,
    Message,
    NoRouteError,
    Producer,
    Record,
    SendResult,
    open_admin,
    open_consumer,
    open_producer,
)
from tests.waiting import await_until

TOPICS = {"crash-a": 4, "crash-b": 3, "crash-c": 1}  # topic -> queue count
PRODUCERS = 2  # client connections
TASKS_PER_PRODUCER = 3  # concurrent sends per connection
GROUP = "crash-g"  # a clustering consumer reads (and commits) while the producers send
LARGE_SHARE, LARGE_BODY_BYTES = 0.03, 30_000  # a few large bodies: batches past the inline-append size, big records
TERM_FIRST_SHARE = 0.25  # of the rounds: SIGTERM, then SIGKILL at a random moment of the graceful stop
READY_TIMEOUT_S = 30
ROUND_TIMEOUT_S = 60
READ_TIMEOUT_S = 120
_ROOT = str(Path(__file__).resolve().parents[1])  # the project, for PYTHONPATH
_READY = re.compile(rb"^broker \S+ on (\S+?:\d+),", re.M)

Key = tuple[str, int, int]  # topic, queue id, queue offset


def digest(body: bytes) -> bytes:
    return hashlib.blake2b(body, digest_size=8).digest()


def body_for(msg_id: str, size: int) -> bytes:
    """A body that names its message and is filled with bytes derived from the name,
    so that a resend is identical and any two messages differ."""
    head = msg_id.encode() + b"|"
    seed = hashlib.blake2b(head).digest()
    fill = (seed * (size // len(seed) + 1))[: max(0, size - len(head))]
    return head + fill


def msg_id_of(body: bytes) -> str:
    return body.split(b"|", 1)[0].decode(errors="replace")


@dataclass
class Batch:
    topic: str
    queue_id: int
    ids: list[str]
    bodies: list[bytes]


@dataclass
class Ledger:
    """What was sent and what the broker acknowledged as durable."""

    acked: dict[Key, bytes] = field(default_factory=dict)  # -> digest of the body acknowledged there
    acked_ids: set[str] = field(default_factory=set)
    sent: dict[str, bytes] = field(default_factory=dict)  # message id -> digest of its body
    retried: set[str] = field(default_factory=set)  # ids sent more than once (after a failed send)
    to_retry: list[Batch] = field(default_factory=list)
    next_id: int = 0

    def new_batch(self, rng: random.Random, tag: str) -> Batch:
        topic = rng.choice(sorted(TOPICS))
        ids = [f"{tag}-{self.next_id + i}" for i in range(rng.randint(1, 8))]
        self.next_id += len(ids)
        bodies = [body_for(i, rng.randint(24, LARGE_BODY_BYTES if rng.random() < LARGE_SHARE else 3000)) for i in ids]
        self.sent.update((i, digest(b)) for i, b in zip(ids, bodies))
        return Batch(topic, rng.randrange(TOPICS[topic]), ids, bodies)

    def record(self, batch: Batch, result: SendResult) -> list[str]:
        """Note an acknowledgement; returns the offsets that had been acknowledged
        before for another message (an acknowledged message overwritten: must not happen)."""
        assert len(result.queue_offsets) == len(batch.ids), (batch.ids, result.queue_offsets)
        reassigned = []
        for offset, msg_id, body in zip(result.queue_offsets, batch.ids, batch.bodies):
            key = (batch.topic, result.queue.queue_id, offset)
            if key in self.acked:  # keep the first: the read-back then counts it as differing too
                reassigned.append(f"{key} acknowledged for {msg_id} after another message")
            else:
                self.acked[key] = digest(body)
            self.acked_ids.add(msg_id)
        return reassigned

    def failed(self, batch: Batch) -> None:
        self.retried.update(batch.ids)
        self.to_retry.append(batch)


# ----------------------------------------------------------------- the broker process
@dataclass
class BrokerProcess:
    proc: trio.Process
    addr: str


def broker_config(root: Path, mode: str) -> Path:
    """A broker config with sync flush and small segments (every round rolls files)."""
    conf = root / f"broker-{mode}.toml"
    conf.write_text(
        f'[broker]\nbroker_name = "crash"\nlisten_port = 0\ndata_dir = "{root / "data"}"\n'
        f'storage_mode = "{mode}"\nflush_mode = "sync"\nsegment_bytes = {256 * 1024}\n'
        f"max_message_bytes = {64 * 1024}\nsync_flush_timeout_ms = 10000\noffset_flush_interval_ms = 100\n"
    )
    return conf


def _data_dir(conf: Path) -> Path:
    """The data directory a :func:`broker_config` file names."""
    found = re.search(r'^data_dir = "(.*)"$', conf.read_text(), re.M)
    assert found, f"no data_dir in {conf}"
    return Path(found.group(1))


def tail(log: Path) -> str:
    """The end of the brokers' stderr, for an assertion's message."""
    return log.read_text(errors="replace")[-3000:]


async def launch(conf: Path, log: Path) -> trio.Process:
    """``clmq broker --config conf``; stderr appended to ``log``."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": _ROOT, "PYTHONUNBUFFERED": "1", "COLUMNS": "1000"}
    with log.open("ab") as err:
        return await trio.lowlevel.open_process(
            [sys.executable, "-m", "clmq", "broker", "--config", str(conf)], stdout=subprocess.PIPE, stderr=err, env=env
        )


async def wait_ready(proc: trio.Process, log: Path) -> str:
    """The broker's address, once it printed that it serves (its listening socket is open)."""
    assert proc.stdout is not None
    seen = b""
    with trio.move_on_after(READY_TIMEOUT_S):
        while True:
            chunk = await proc.stdout.receive_some()
            if not chunk:
                break
            seen += chunk
            if m := _READY.search(seen):
                return m.group(1).decode()
    await reap(proc)
    raise AssertionError(
        f"the broker did not start (exit {proc.returncode}): {seen.decode(errors='replace')}\nstderr: {tail(log)}"
    )


async def reap(proc: trio.Process) -> None:
    """SIGKILL (if still running), wait for the exit, close the pipe."""
    proc.kill()
    await proc.wait()
    if proc.stdout is not None:
        await proc.stdout.aclose()


async def start_broker(conf: Path, log: Path) -> BrokerProcess:
    proc = await launch(conf, log)
    return BrokerProcess(proc, await wait_ready(proc, log))


async def kill_while_starting(conf: Path, log: Path, delay_s: float) -> bool:
    """Start a broker and SIGKILL it ``delay_s`` later, typically while it opens (recovers)
    the store; True if it was still starting then."""
    proc = await launch(conf, log)
    # Not a wait for an event: the random delay is the point, to land the kill anywhere in the start.
    await trio.sleep(delay_s)
    proc.kill()
    await proc.wait()
    assert proc.stdout is not None
    printed = await proc.stdout.receive_some()
    await reap(proc)
    return _READY.search(printed) is None


# ----------------------------------------------------------------- rounds
@dataclass
class RoundState:
    broker: BrokerProcess
    kill_after: int  # acknowledged messages of this round
    jitter_s: float  # then this much later
    term_grace_s: float | None  # SIGTERM first, SIGKILL this much later (None: SIGKILL only)
    acked: int = 0
    killed: bool = False  # the end of the round began: failed sends are expected from here on
    exit_before_kill: int | None = None  # the graceful stop finished before the SIGKILL came, with this code
    errors_while_up: list[str] = field(default_factory=list)  # failed sends before the kill: must stay empty
    offsets_file: Path | None = None  # the broker's consumer offsets: the kill waits until the group is in it

    def kill(self) -> None:
        if not self.killed:
            self.killed = True
            self.broker.proc.kill()  # SIGKILL

    async def acknowledged(self, count: int) -> None:
        """Count acknowledged messages; the one that reaches ``kill_after`` kills the broker."""
        before, self.acked = self.acked, self.acked + count
        if before < self.kill_after <= self.acked and not self.killed:
            # Not waits for events: random delays while the other senders go on, so that
            # the kill lands anywhere in the broker's work, not just after a reply (and,
            # after a SIGTERM, before, during or after the graceful stop).
            await self._group_recorded()
            await trio.sleep(self.jitter_s)
            if self.term_grace_s is not None and not self.killed:
                self.killed = True
                self.broker.proc.terminate()
                await trio.sleep(self.term_grace_s)
                self.exit_before_kill = self.broker.proc.poll()
            self.broker.proc.kill()
            self.killed = True

    async def _group_recorded(self) -> None:
        """Until the group's committed offsets are on disk (an event, not a time): on a fast
        machine a round's acknowledgements can all come before the group's first commit is
        flushed, and a restart would then have no offsets to check. Bounded: if they never
        come, the round goes on and the offsets check reports it."""
        path = self.offsets_file
        if path is None:
            return

        def recorded() -> bool:
            try:
                return GROUP.encode() in path.read_bytes()
            except FileNotFoundError:
                return False

        with contextlib.suppress(TimeoutError):
            await await_until(recorded, ROUND_TIMEOUT_S / 3, f"group {GROUP}'s offsets in {path}")


@dataclass
class Figures:
    rounds: int = 0
    healthy_rounds: int = 0  # the first produce after the restart succeeded
    startup_kills: int = 0  # extra kills that landed while the broker was starting
    term_first: int = 0  # rounds ended by SIGTERM, then SIGKILL
    stopped_before_kill: int = 0  # of those, the graceful stop had finished before the SIGKILL
    unclean_stops: int = 0  # of those, with an exit code other than 0
    topics_missing: int = 0  # topics the broker did not know after a restart
    short_queues: int = 0  # queues whose end, at a restart, was below an acknowledged offset
    reassigned: int = 0  # acknowledged offsets acknowledged again for another message
    offsets_checked: int = 0  # (queue, committed offset) pairs of the group checked at restarts
    offsets_beyond_end: int = 0  # a group's committed offset past its queue's end, after a restart
    offsets_went_back: int = 0  # a committed offset lower after a restart than after the one before
    live_read: int = 0  # messages the group's consumer received while the producers sent
    live_differing: int = 0  # of those, at an acknowledged offset with another body (or never sent)
    sends_acked: int = 0
    sends_failed: int = 0
    acked: int = 0
    read: int = 0
    missing: int = 0
    differing: int = 0
    holes: int = 0
    unknown: int = 0
    duplicates: int = 0  # messages stored at more than one offset (each a retried, unacknowledged send)
    unexplained_duplicates: int = 0
    stored_unacked: int = 0  # stored though their send failed (the reply was lost in the kill)
    seconds: float = 0.0
    examples: list[str] = field(default_factory=list)

    def summary(self) -> str:
        skip = {"examples"}
        return ", ".join(
            f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in vars(self).items() if k not in skip
        )


async def _send(producer: Producer, batch: Batch) -> SendResult:
    """Send ``batch`` to its queue (the producer sets each message's queue id)."""
    msgs = [Message(batch.topic, batch.queue_id, b) for b in batch.bodies]
    return await producer.send_batch(batch.topic, msgs, selector=lambda mqs, _m: mqs[batch.queue_id])


async def _produce(
    producer: Producer, state: RoundState, ledger: Ledger, figures: Figures, rng: random.Random, tag: str
) -> None:
    """Send batches (retries of failed ones first) until the broker is killed."""
    while not state.killed:
        batch = ledger.to_retry.pop() if ledger.to_retry else ledger.new_batch(rng, tag)
        try:
            result = await _send(producer, batch)
        except ClmqError as e:
            figures.sends_failed += 1
            ledger.failed(batch)
            if not state.killed:
                seen = await _what_the_broker_says(state.broker.addr)
                state.errors_while_up.append(f"{batch.topic}/{batch.queue_id}: {type(e).__name__}: {e}; then {seen}")
                state.kill()  # the round is spoilt: stop it, the assertion names the error
            return
        if not result.durable or result.flush_timeout:
            ledger.failed(batch)  # not acknowledged as durable: treat as a failed send
            if not state.killed:
                state.errors_while_up.append(f"{batch.topic}/{batch.queue_id}: not durable ({result})")
            continue
        reassigned = ledger.record(batch, result)
        figures.reassigned += len(reassigned)
        figures.examples += reassigned
        figures.sends_acked += 1
        await state.acknowledged(len(batch.ids))


async def _what_the_broker_says(addr: str) -> str:
    """For an assertion's message: the broker's topics and state, asked anew."""
    try:
        async with open_admin(broker_addrs=[addr]) as admin:
            with trio.fail_after(10):
                return f"the broker lists {await admin.list_topics()}, info {await admin.brokers()}"
    except (ClmqError, trio.TooSlowError) as e:
        return f"the broker does not answer ({type(e).__name__}: {e})"


async def _queue_ends(addr: str) -> dict[tuple[str, int], int]:
    """(topic, queue) -> max offset, as the broker reports it."""
    async with open_admin(broker_addrs=[addr]) as admin:
        return {(t, q["queue_id"]): q["max_offset"] for t in TOPICS for q in await admin.describe_topic(t)}


async def _check_ends(addr: str, ledger: Ledger, figures: Figures) -> None:
    """Every acknowledged offset is below its queue's end right after the restart."""
    ends = await _queue_ends(addr)
    for topic in sorted(set(TOPICS) - {t for t, _q in ends}):
        figures.topics_missing += 1
        figures.examples.append(f"round {figures.rounds}: topic {topic} is missing after the restart")
    highest: dict[tuple[str, int], int] = {}
    for t, q, o in ledger.acked:
        highest[(t, q)] = max(highest.get((t, q), -1), o)
    for tq, o in sorted(highest.items()):
        if ends.get(tq, 0) <= o:
            figures.short_queues += 1
            figures.examples.append(f"round {figures.rounds}: {tq} ends at {ends.get(tq)}, offset {o} was acknowledged")


async def _check_group(addr: str, figures: Figures, restored: dict[tuple[str, int], int]) -> None:
    """The group's committed offsets after the restart: within their queues, and not below
    what the previous restart had restored (offsets are written atomically, and the group's
    one consumer only commits forward from there)."""
    async with open_admin(broker_addrs=[addr]) as admin:
        rows = (await admin.describe_group(GROUP))["queues"]
    figures.offsets_checked += len(rows)
    for row in rows:
        tq, committed = (row["topic"], row["queue_id"]), row["committed"]
        if not 0 <= committed <= row["max_offset"]:
            figures.offsets_beyond_end += 1
            figures.examples.append(
                f"round {figures.rounds}: {GROUP} committed {committed} on {tq}, end {row['max_offset']}"
            )
        if committed < restored.get(tq, 0):
            figures.offsets_went_back += 1
            figures.examples.append(
                f"round {figures.rounds}: {GROUP} committed {committed} on {tq}, {restored[tq]} before"
            )
        restored[tq] = committed


def audit_live(live: dict[Key, bytes], ledger: Ledger, figures: Figures) -> None:
    """What the group's consumer received during the round, against the ledger."""
    figures.live_read += len(live)
    for key, body in live.items():
        want = ledger.acked.get(key)
        if ledger.sent.get(msg_id_of(body)) != digest(body) or (want is not None and want != digest(body)):
            figures.live_differing += 1
            figures.examples.append(f"round {figures.rounds}: {key} received as {body[:40]!r}")


async def _consume(addr: str, live: dict[Key, bytes]) -> None:
    """Receive (and commit) as the group's one member until cancelled."""
    async with open_consumer(
        None,
        GROUP,
        dict.fromkeys(TOPICS, "*"),
        broker_addrs=[addr],
        pull_wait_ms=200,
        heartbeat_interval_ms=200,
        rebalance_interval_ms=500,
        commit_interval_ms=50,
        request_timeout_ms=2000,
    ) as consumer:
        while True:
            for rec in await consumer.receive():
                live[(rec.topic, rec.queue_id, rec.queue_offset)] = rec.body


async def _probe(addr: str, ledger: Ledger, figures: Figures, rng: random.Random, tag: str) -> None:
    """One produce right after the restart: it must succeed (the broker is healthy)."""
    async with open_producer(broker_addrs=[addr], retries=0, send_timeout_ms=10_000) as producer:
        batch = ledger.new_batch(rng, f"{tag}-probe")
        try:
            result = await _send(producer, batch)
        except ClmqError as e:
            ledger.failed(batch)
            figures.examples.append(f"round {figures.rounds}: the produce after the restart failed: {e}")
            return
        if result.durable and not result.flush_timeout:
            reassigned = ledger.record(batch, result)
            figures.reassigned += len(reassigned)
            figures.examples += reassigned
            figures.healthy_rounds += 1
        else:
            ledger.failed(batch)
            figures.examples.append(f"round {figures.rounds}: the produce after the restart was not durable: {result}")


async def one_round(
    conf: Path,
    log: Path,
    ledger: Ledger,
    figures: Figures,
    rng: random.Random,
    acks_per_round: tuple[int, int],
    restored: dict[tuple[str, int], int],
) -> None:
    """Restart the broker on its data directory, check it, produce (and consume), kill it."""
    tag, live = f"r{figures.rounds}", dict[Key, bytes]()
    broker = await start_broker(conf, log)
    try:
        with trio.fail_after(ROUND_TIMEOUT_S):
            await _check_ends(broker.addr, ledger, figures)
            await _check_group(broker.addr, figures, restored)
            await _probe(broker.addr, ledger, figures, rng, tag)
            grace = rng.uniform(0, 0.8) if rng.random() < TERM_FIRST_SHARE else None
            state = RoundState(
                broker,
                rng.randint(*acks_per_round),
                rng.uniform(0, 0.02),
                grace,
                offsets_file=_data_dir(conf) / "consumer_offsets.json",
            )
            async with trio.open_nursery() as outer:
                outer.start_soon(_consume, broker.addr, live)
                async with trio.open_nursery() as nursery:
                    for p in range(PRODUCERS):
                        nursery.start_soon(
                            _run_producer, state, ledger, figures, random.Random(rng.random()), f"{tag}-p{p}"
                        )
                outer.cancel_scope.cancel()  # the broker is gone: the consumer stops too
        audit_live(live, ledger, figures)
        _end_of_round(state, figures)
    finally:
        await reap(broker.proc)
        figures.rounds += 1


def _end_of_round(state: RoundState, figures: Figures) -> None:
    figures.term_first += state.term_grace_s is not None
    if state.exit_before_kill is not None:
        figures.stopped_before_kill += 1
        if state.exit_before_kill != 0:
            figures.unclean_stops += 1
            figures.examples.append(f"round {figures.rounds}: the graceful stop exited {state.exit_before_kill}")
    assert not state.errors_while_up, (
        f"round {figures.rounds}: sends failed while the broker was up: {state.errors_while_up[:3]}; "
        f"so far {figures.summary()}, e.g. {figures.examples[:5]}"
    )


async def _warm_routes(producer: Producer) -> None:
    """Fetch the routes before sending: a route look-up that times out on a loaded
    machine (3 s) is no failure of the broker's storage, and must not spoil a round."""

    async def routed() -> bool:
        try:
            for topic in TOPICS:
                await producer.routes.queues(topic)
        except NoRouteError:
            return False
        return True

    await await_until(routed, ROUND_TIMEOUT_S / 2, "the broker to answer route look-ups")


async def _run_producer(state: RoundState, ledger: Ledger, figures: Figures, rng: random.Random, tag: str) -> None:
    async with (
        open_producer(broker_addrs=[state.broker.addr], retries=0, send_timeout_ms=10_000) as producer,
        trio.open_nursery() as n,
    ):
        await _warm_routes(producer)
        for t in range(TASKS_PER_PRODUCER):
            n.start_soon(_produce, producer, state, ledger, figures, random.Random(rng.random()), f"{tag}t{t}")


# ----------------------------------------------------------------- reading back
async def read_everything(addr: str) -> list[Record]:
    """Every stored message of :data:`TOPICS`, through a broadcasting consumer from the start."""
    ends = await _queue_ends(addr)
    got: list[Record] = []
    next_offset: dict[tuple[str, int], int] = defaultdict(int)
    subscriptions = dict.fromkeys(TOPICS, "*")
    async with open_consumer(
        None,
        "crash-audit",
        subscriptions,
        broker_addrs=[addr],
        mode="broadcasting",
        start_from="earliest",
        pull_wait_ms=200,
    ) as consumer:
        with trio.move_on_after(READ_TIMEOUT_S):
            while any(next_offset[tq] < end for tq, end in ends.items()):
                for rec in await consumer.receive():
                    got.append(rec)
                    tq = (rec.topic, rec.queue_id)
                    next_offset[tq] = max(next_offset[tq], rec.queue_offset + 1)
    return got


def audit(ledger: Ledger, records: list[Record], figures: Figures) -> None:
    """Compare what was read with what was acknowledged; fill in ``figures``."""
    read: dict[Key, bytes] = {}
    places: dict[str, list[Key]] = defaultdict(list)
    for rec in records:
        key = (rec.topic, rec.queue_id, rec.queue_offset)
        if key in read and read[key] != rec.body:
            figures.differing += 1
            figures.examples.append(f"{key} read twice with different bodies")
        read[key] = rec.body
    for key, body in read.items():
        msg_id = msg_id_of(body)
        if ledger.sent.get(msg_id) != digest(body):
            figures.unknown += 1
            figures.examples.append(f"{key}: a body that was never sent ({body[:40]!r})")
        places[msg_id].append(key)
    figures.acked, figures.read = len(ledger.acked), len(read)
    for key, want in ledger.acked.items():
        if key not in read:
            figures.missing += 1
            figures.examples.append(f"{key}: acknowledged, not read back")
        elif digest(read[key]) != want:
            figures.differing += 1
            figures.examples.append(f"{key}: read {msg_id_of(read[key])}, another body was acknowledged there")
    per_queue = Counter((t, q) for t, q, _o in read)
    top = {tq: max(o for t, q, o in read if (t, q) == tq) for tq in per_queue}
    figures.holes = sum(top[tq] + 1 - n for tq, n in per_queue.items())  # offsets start at 0: no retention here
    for msg_id, keys in places.items():
        if len(keys) > 1:
            figures.duplicates += len(keys) - 1
            if msg_id not in ledger.retried:
                figures.unexplained_duplicates += 1
                figures.examples.append(f"{msg_id} stored at {keys}, never resent")
    figures.stored_unacked = sum(1 for msg_id in places if msg_id not in ledger.acked_ids)


async def crash_loop(
    root: Path, mode: str, rounds: int, acks_per_round: tuple[int, int], seed: int, startup_kill_every: int = 0
) -> Figures:
    """``rounds`` kill -9 rounds, then a clean start, the read-back and the audit."""
    started = time.monotonic()
    conf, log = broker_config(root, mode), root / "broker-stderr.log"
    ledger, figures, rng = Ledger(), Figures(), random.Random(seed)
    restored: dict[tuple[str, int], int] = {}  # the group's committed offsets at the last restart
    async with open_admin(broker_addrs=[(first := await start_broker(conf, log)).addr]) as admin:
        for topic, queues in TOPICS.items():
            await admin.create_topic(topic, queues, on=[first.addr])
    await reap(first.proc)
    for r in range(rounds):
        if startup_kill_every and r % startup_kill_every == startup_kill_every - 1:
            figures.startup_kills += await kill_while_starting(conf, log, rng.uniform(0.2, 0.7))
        await one_round(conf, log, ledger, figures, rng, acks_per_round, restored)
    final = await start_broker(conf, log)
    try:
        await _check_ends(final.addr, ledger, figures)
        await _check_group(final.addr, figures, restored)
        audit(ledger, await read_everything(final.addr), figures)
        final.proc.terminate()  # graceful stop after all these crashes
        with trio.fail_after(30):
            assert await final.proc.wait() == 0, f"the broker did not stop cleanly: {tail(log)}"
    finally:
        await reap(final.proc)
    figures.seconds = time.monotonic() - started
    return figures

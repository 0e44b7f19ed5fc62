"""Transactional messages end to end through the public clients and real brokers: commit,
rollback and unknown-then-check on the trio producer, each with a consumer proving what
became visible and when; a listener that raises; the asyncio and blocking producers; a
producer process SIGKILLed between its half message and its commit, checked back by a
second producer process of the group; ``clmq transaction list|show``.

Run as a module (``python -m tests.test_transactions_e2e NAMESRV TOPIC BODY MODE``) it is
the producer process of the crash test: ``half`` stores a half message, prints its id
and hangs in its local transaction; ``checker`` answers checks with COMMIT for BODY and
prints each one it answered."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from clmq.client import (
    BlockingProducer,
    LocalTransactionState,
    Record,
    SendError,
    open_admin,
    open_asyncio_producer,
    open_consumer,
    open_producer,
)
from clmq.client.producer._transaction import send_half
from clmq.common import PROP_TRAN_HALF, Message
from clmq.protocol import RequestCode
from tests.replica_procs import create_topic, open_group
from tests.service_helpers import FAST_CONSUMER, Cluster
from tests.waiting import await_until, wait_until

COMMIT, ROLLBACK, UNKNOWN = LocalTransactionState.COMMIT, LocalTransactionState.ROLLBACK, LocalTransactionState.UNKNOWN
TIMEOUT_MS = 400  # the brokers' transaction_timeout_ms here: a half older than this is checked
FAST = {"transaction_timeout_ms": TIMEOUT_MS, "transaction_check_interval_ms": 50}
TOPIC = "orders"
QUEUES = 2
ROOT = Path(__file__).resolve().parent.parent


class Decisions:
    """A listener whose answers are a table by body: execute's, then check's."""

    def __init__(self, execute: dict[bytes, Any], check: dict[bytes, Any] | None = None) -> None:
        self.execute, self.check = execute, check or {}
        self.checked: list[tuple[bytes, str, int, str]] = []  # body, real topic, queue, tags as the check saw them
        self.checked_at: dict[bytes, float] = {}

    def execute_local_transaction(self, message: Message, arg: Any) -> Any:
        answer = self.execute[message.body]
        if isinstance(answer, Exception):
            raise answer
        return answer

    def check_local_transaction(self, message: Record) -> Any:
        self.checked.append((message.body, message.topic, message.queue_id, message.tags))
        self.checked_at.setdefault(message.body, time.monotonic())
        return self.check.get(message.body, UNKNOWN)


async def _cluster(nursery: trio.Nursery, root: Path) -> Cluster:
    c = Cluster(nursery, root)
    await c.start_nameserver()
    await c.start_broker(**FAST)
    await c.create_topic(TOPIC, QUEUES)
    return c


class Seen:
    """What a consumer group received of TOPIC, and when (monotonic s), by body."""

    def __init__(self) -> None:
        self.at: dict[bytes, float] = {}
        self.records: list[Record] = []
        self.changed = trio.Event()

    async def run(self, c: Cluster, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with open_consumer(c.ns, "readers", {TOPIC: "*"}, start_from="earliest", **FAST_CONSUMER) as consumer:
            task_status.started()
            while True:
                for r in await consumer.receive():
                    self.records.append(r)
                    self.at.setdefault(r.body, time.monotonic())
                self.changed.set()
                self.changed = trio.Event()

    async def wait_for(self, body: bytes, timeout_s: float = 15) -> float:
        with trio.fail_after(timeout_s):
            while body not in self.at:
                await self.changed.wait()
        return self.at[body]

    def count(self, body: bytes) -> int:
        return sum(1 for r in self.records if r.body == body)


async def _max_offsets(c: Cluster) -> int:
    async with open_admin(c.ns) as admin:
        return sum(int(q["max_offset"]) for q in await admin.describe_topic(TOPIC))


async def test_commit_rollback_and_unknown_then_check(nursery: trio.Nursery, tmp_path: Path) -> None:
    c = await _cluster(nursery, tmp_path)
    seen = Seen()
    await nursery.start(seen.run, c)
    listener = Decisions(
        {b"commit": COMMIT, b"rollback": ROLLBACK, b"later-yes": UNKNOWN, b"later-no": "unknown", b"boom": OSError()},
        {b"later-yes": COMMIT, b"later-no": ROLLBACK, b"boom": COMMIT},
    )
    during: list[int] = []

    async def execute(message: Message, arg: Any) -> LocalTransactionState:
        during.append(await _max_offsets(c))  # the half is stored: nothing of it in the real queues
        return arg  # type: ignore[no-any-return]

    async with open_producer(c.ns, transaction_group="pg", transaction_listener=listener) as p:
        before = await _max_offsets(c)
        yes = await p.send_in_transaction(TOPIC, b"commit", keys="k1", tags="TagA", arg=COMMIT, execute=execute)
        assert during == [before] and yes.committed and yes.state is COMMIT and yes.queue_offset >= 0
        assert (await seen.wait_for(b"commit")) and yes.msg_id
        got = next(r for r in seen.records if r.body == b"commit")
        assert (got.tags, got.keys, got.queue_id, got.queue_offset) == ("TagA", "k1", yes.queue.queue_id, 0)
        assert got.properties["UNIQ_KEY"] == yes.uniq_key

        no = await p.send_in_transaction(TOPIC, b"rollback", sharding_key="s")
        assert no.rolled_back and no.msg_id == "" and no.queue_offset == -1
        sent = time.monotonic()
        later = [await p.send_in_transaction(TOPIC, body) for body in (b"later-yes", b"later-no", b"boom")]
        assert [r.state for r in later] == [UNKNOWN, UNKNOWN, UNKNOWN] and not any(r.outcome for r in later)
        # The check-back commits later-yes and boom, rolls later-no back, no sooner than the timeout.
        for body in (b"later-yes", b"boom"):
            assert await seen.wait_for(body) - sent >= TIMEOUT_MS / 1000
        async with open_admin(c.ns) as admin:
            await await_until(lambda: _nothing_pending(admin), 10, "the rolled back later-no to leave the pending set")
        await _markers(p, seen)
    assert {b for b, *_ in listener.checked} >= {b"later-yes", b"later-no", b"boom"}
    assert all(topic == TOPIC and tags == "" and qid in range(QUEUES) for _, topic, qid, tags in listener.checked)
    assert b"commit" not in listener.checked_at and b"rollback" not in listener.checked_at
    assert b"rollback" not in seen.at and b"later-no" not in seen.at
    assert all(seen.count(b) == 1 for b in (b"commit", b"later-yes", b"boom"))


class Flaky(Decisions):
    """Checks answer UNKNOWN (or raise) the first time for some messages, then their final word."""

    def __init__(self, execute: dict[bytes, Any], check: dict[bytes, Any], first: dict[bytes, Any]) -> None:
        super().__init__(execute, check)
        self.first = first

    def check_local_transaction(self, message: Record) -> Any:
        answer = super().check_local_transaction(message)
        early = self.first.pop(message.body, None)
        if isinstance(early, Exception):
            raise early
        return early if early is not None else answer


@pytest.mark.parametrize("seed", [1, 2])
async def test_many_transactions_each_end_as_decided_once(nursery: trio.Nursery, tmp_path: Path, seed: int) -> None:
    """Random decisions for 40 messages (execute: commit, rollback, unknown, raise; checks:
    commit or rollback, some first unknown or raising): every message decided COMMIT is
    received exactly once, every other one never, and nothing stays pending."""
    rnd = random.Random(seed)
    bodies = [b"m%02d" % i for i in range(40)]
    execute = {b: rnd.choice([COMMIT, ROLLBACK, UNKNOWN, RuntimeError("db")]) for b in bodies}
    check = {b: rnd.choice([COMMIT, ROLLBACK]) for b in bodies}
    first = {b: rnd.choice([UNKNOWN, ValueError("not yet")]) for b in bodies if rnd.random() < 0.3}
    final = {b: execute[b] if execute[b] in (COMMIT, ROLLBACK) else check[b] for b in bodies}
    c = await _cluster(nursery, tmp_path)
    seen = Seen()
    await nursery.start(seen.run, c)
    async with open_producer(c.ns, transaction_group="many", transaction_listener=Flaky(execute, check, first)) as p:
        async with trio.open_nursery() as senders:
            for b in bodies:
                senders.start_soon(functools.partial(p.send_in_transaction, TOPIC, b, keys=b.decode()))
        async with open_admin(c.ns) as admin:
            await await_until(lambda: _nothing_pending(admin, "many"), 30, "every transaction to end")
        for b in bodies:
            if final[b] is COMMIT:
                await seen.wait_for(b)
        await _markers(p, seen)
    for b in bodies:
        assert seen.count(b) == (1 if final[b] is COMMIT else 0), (b, execute[b], check[b])


async def test_half_messages_sent_at_once_share_requests_and_a_bad_one_fails_alone(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """20 transactions at once: their half messages go in fewer requests than 20, each
    with its own offset. Then 10 at once, one carrying a mark only the broker may set
    (DELIVER_AT_MS): it is refused with a clear error, and the others of its request are
    sent again alone: every other message is committed and received once."""
    c = await _cluster(nursery, tmp_path)
    seen = Seen()
    await nursery.start(seen.run, c)
    bodies = [b"b%02d" % i for i in range(30)]
    results: dict[bytes, Any] = {}
    async with open_producer(c.ns, transaction_group="batch") as p:
        requests = [0]
        send_to = p.send_to

        async def counted(*args: Any, **kwargs: Any) -> Any:
            requests[0] += 1
            return await send_to(*args, **kwargs)

        p.send_to = counted  # type: ignore[method-assign]  # counts the real requests

        async def one(body: bytes, props: dict[str, str] | None = None) -> None:
            try:
                results[body] = await p.send_in_transaction(TOPIC, body, properties=props, execute=lambda m, a: COMMIT)
            except SendError as e:
                results[body] = e

        async with trio.open_nursery() as senders:  # all good: they share requests
            for body in bodies[:20]:
                senders.start_soon(one, body)
        assert requests[0] < 20, requests
        async with trio.open_nursery() as senders:  # one bad among them
            for i, body in enumerate(bodies[20:]):
                senders.start_soon(one, body, {"DELIVER_AT_MS": "1"} if i == 7 else None)
        p.send_to = send_to  # type: ignore[method-assign]
        bad = results.pop(bodies[27])
        assert isinstance(bad, SendError) and "DELIVER_AT_MS" in str(bad)
        assert all(r.committed for r in results.values()), results
        assert len({r.half_msg_id for r in results.values()}) == len(results) == 29
        for body in results:
            await seen.wait_for(body)
        await _markers(p, seen)
    assert bodies[27] not in seen.at and all(seen.count(b) == 1 for b in results)


async def _markers(p: Any, seen: Seen) -> None:
    """A committed marker into each queue of TOPIC, each received: what was committed
    before is received by now, queue by queue (a queue is read in order)."""
    for qid in range(QUEUES):
        body = b"marker-%d" % qid
        done = await p.send_in_transaction(
            TOPIC, body, execute=lambda m, a: COMMIT, selector=lambda mqs, m, q=qid: mqs[q]
        )
        assert done.committed and done.queue.queue_id == qid
        await seen.wait_for(body)


async def _nothing_pending(admin: Any, group: str = "pg") -> bool:
    return (await admin.list_transactions(group)).total == 0


def test_the_asyncio_producer_runs_its_transaction_and_checks_on_its_loop(tmp_path: Path) -> None:
    seen_loops: list[asyncio.AbstractEventLoop] = []
    checked: asyncio.Event

    class AsyncListener:
        async def execute_local_transaction(self, message: Message, arg: Any) -> LocalTransactionState:
            seen_loops.append(asyncio.get_running_loop())
            await asyncio.sleep(0)
            return UNKNOWN if message.body == b"later" else COMMIT

        async def check_local_transaction(self, message: Record) -> LocalTransactionState:
            seen_loops.append(asyncio.get_running_loop())
            await asyncio.sleep(0)
            checked.set()
            return COMMIT

    async def main(ns: list[str]) -> tuple[Any, Any, asyncio.AbstractEventLoop]:
        nonlocal checked
        checked = asyncio.Event()
        async with open_asyncio_producer(ns, transaction_group="apg", transaction_listener=AsyncListener()) as p:
            now = await p.send_in_transaction(TOPIC, b"now")
            later = await p.send_in_transaction(TOPIC, b"later")
            await asyncio.wait_for(checked.wait(), 15)  # the check of "later"
            return now, later, asyncio.get_running_loop()

    _with_fast_cluster(tmp_path, lambda ns: _check_asyncio(asyncio.run(main(ns)), seen_loops))


def _check_asyncio(out: tuple[Any, Any, asyncio.AbstractEventLoop], loops: list[asyncio.AbstractEventLoop]) -> None:
    now, later, loop = out
    assert now.committed and later.state is UNKNOWN and loops[:3] == [loop, loop, loop]


def test_the_blocking_producer_runs_execute_here_and_checks_in_threads(tmp_path: Path) -> None:
    threads: list[str] = []
    here = threading.current_thread().name

    class Plain:
        def execute_local_transaction(self, message: Message, arg: Any) -> LocalTransactionState:
            threads.append(threading.current_thread().name)
            return arg  # type: ignore[no-any-return]

        def check_local_transaction(self, message: Record) -> LocalTransactionState:
            threads.append(threading.current_thread().name)
            return COMMIT

    def run(ns: list[str]) -> None:
        with BlockingProducer(ns, transaction_group="bpg", transaction_listener=Plain()) as p:
            assert p.send_in_transaction(TOPIC, b"now", arg=COMMIT).committed
            assert p.send_in_transaction(TOPIC, b"no", arg=ROLLBACK).rolled_back
            assert p.send_in_transaction(TOPIC, b"later", arg=UNKNOWN).state is UNKNOWN
            wait_until(lambda: len(threads) >= 4, 15, "the check of the unknown one")
        assert threads[:3] == [here] * 3 and len(threads) >= 4 and threads[3] != here

    _with_fast_cluster(tmp_path, run)


def _with_fast_cluster(root: Path, body: Any) -> None:
    """A name server and a broker with fast check-backs and topic TOPIC, run by trio in a
    thread; ``body(name server addresses)`` runs here."""
    stop, started, ready, failed = threading.Event(), threading.Event(), [], []

    async def serve() -> None:
        try:
            async with trio.open_nursery() as n:
                ready.append(await _cluster(n, root))
                started.set()
                await trio.to_thread.run_sync(stop.wait, 120)
                n.cancel_scope.cancel()
        except BaseException as e:
            failed.append(e)
        finally:
            started.set()

    server = threading.Thread(target=trio.run, args=(serve,))
    server.start()
    try:
        started.wait(30)
        assert ready, f"the cluster did not start: {failed}"
        body(ready[0].ns)
    finally:
        stop.set()
        server.join(30)


def _child(ns: str, mode: str, body: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.test_transactions_e2e", ns, TOPIC, body, mode],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )


async def _line(proc: subprocess.Popen[str], timeout_s: float = 30) -> str:
    assert proc.stdout is not None
    with trio.fail_after(timeout_s):
        line = await trio.to_thread.run_sync(proc.stdout.readline, abandon_on_cancel=True)
    assert line, f"the producer process exited ({proc.poll()}) before it said anything"
    return line.strip()


async def test_a_killed_producer_is_checked_back_by_another_of_its_group(nursery: trio.Nursery, tmp_path: Path) -> None:
    c = await _cluster(nursery, tmp_path)
    seen = Seen()
    await nursery.start(seen.run, c)
    first = _child(c.ns[0], "half", "orphan")
    try:
        half_id = (await _line(first)).removeprefix("HALF ")
        first.send_signal(signal.SIGKILL)  # between its half message and its commit
        first.wait(10)
    finally:
        first.kill()
    async with open_admin(c.ns) as admin:
        view = await admin.transaction(half_id)
        assert view is not None and view.state == "pending" and view.topic == TOPIC
    assert b"orphan" not in seen.at
    second = _child(c.ns[0], "checker", "orphan")
    try:
        assert (await _line(second)) == "READY"
        await seen.wait_for(b"orphan", 20)
        assert (await _line(second)) == "COMMITTED orphan"
    finally:
        second.send_signal(signal.SIGTERM)
        second.wait(10)
    assert seen.count(b"orphan") == 1
    async with open_admin(c.ns) as admin:
        view = await admin.transaction(half_id)
        assert view is not None and view.state in ("committed", "ended")


@pytest.mark.slow
async def test_check_back_follows_a_promoted_leader(tmp_path: Path) -> None:
    """A half message left UNKNOWN on a replicated group; its leader SIGKILLed and the
    in-sync follower promoted: the producer's check-back finds the new leader (the name
    server's routes), which asks it, and the message is committed there, once."""
    listener = Decisions({b"across": UNKNOWN}, {b"across": COMMIT})
    async with open_group(tmp_path) as g:
        settings = {"ack_mode": "sync", "transaction_timeout_ms": 1500, "transaction_check_interval_ms": 50}
        await g.start_broker("g0", 0, **settings)
        await g.start_broker("g1", 1, follow="g0", **settings)
        await create_topic(g, "g0", TOPIC, 2)
        await g.wait_in_sync("g0", ["g1"])
        ns = [g.ns_addr]
        async with open_producer(ns, transaction_group="pg", transaction_listener=listener) as p:
            sent = await p.send_in_transaction(TOPIC, b"across")  # sync acks: the follower holds the half
            assert sent.state is UNKNOWN and sent.queue.addr == g["g0"].addr
            await g["g0"].kill()  # before its check is due
            reply = await g.call("g1", RequestCode.PROMOTE, {})
            assert not reply.error_code, reply.error_text
            await await_until(lambda: b"across" in listener.checked_at, 30, "the new leader to ask the producer")
            got = await _read_all(ns, 1, 30)
        assert [r.body for r in got] == [b"across"] and got[0].properties[PROP_TRAN_HALF] != ""
        assert got[0].store_host[1] == g["g1"].port


async def _read_all(ns: list[str], n: int, timeout_s: float, quiet_s: float = 0.5) -> list[Record]:
    """``n`` records of TOPIC, then whatever else comes within ``quiet_s`` (nothing should)."""
    got: list[Record] = []
    async with open_consumer(ns, "readers", {TOPIC: "*"}, **FAST_CONSUMER) as consumer:
        with trio.fail_after(timeout_s):
            while len(got) < n:
                got += await consumer.receive()
        with trio.move_on_after(quiet_s):
            while True:
                got += await consumer.receive()
    return got


async def test_transaction_list_and_show_print_the_pending(nursery: trio.Nursery, tmp_path: Path) -> None:
    c = await _cluster(nursery, tmp_path)
    async with open_producer(c.ns, transaction_group="cli") as p:  # no listener: nothing answers checks
        pending = await p.send_in_transaction(TOPIC, b"wait for me", keys="order-9", execute=lambda m, a: UNKNOWN)
        done = await p.send_in_transaction(TOPIC, b"done", execute=lambda m, a: COMMIT)
    listed = json.loads(await _clmq("transaction", "list", "--group", "cli", "-o", "json", "--namesrv", c.ns[0]))
    assert [t["msg_id"] for t in listed["pending"]] == [pending.half_msg_id]
    assert listed["pending"][0]["keys"] == "order-9" and listed["pending"][0]["topic"] == TOPIC
    assert sum(b["committed"] for b in listed["brokers"]) == 1
    shown = json.loads(await _clmq("transaction", "show", pending.half_msg_id, "-o", "json", "--namesrv", c.ns[0]))
    assert (shown["state"], shown["group"], shown["real_topic"], shown["keys"]) == ("pending", "cli", TOPIC, "order-9")
    assert shown["real_queue_id"] == pending.queue.queue_id and shown["half"]["body"] == "wait for me"
    async with open_admin(c.ns) as admin:  # the key index is written by the dispatcher, after the commit's answer

        async def indexed() -> bool:
            view = await admin.transaction(done.half_msg_id)
            return view is not None and view.state == "committed"

        await await_until(indexed, 10, "the committed copy in the key index")
    ended = json.loads(await _clmq("transaction", "show", done.half_msg_id, "-o", "json", "--namesrv", c.ns[0]))
    assert (ended["state"], ended["committed_msg_id"]) == ("committed", done.msg_id)  # found by the key index
    table = await _clmq("transaction", "list", "--namesrv", c.ns[0])
    assert pending.half_msg_id in table and "order-9" in table
    not_half = await _clmq("transaction", "show", done.msg_id, "--namesrv", c.ns[0], expect=2)
    assert "is not a half message" in not_half
    addr = done.msg_id.split("@")[0]
    nothing = await _clmq("transaction", "show", f"{addr}@00000000FFFFFFFF", "--namesrv", c.ns[0], expect=1)
    assert "no message at" in nothing


async def _clmq(*argv: str, expect: int = 0) -> str:
    """``clmq argv`` in a process: its stdout (its stderr when it is to fail with ``expect``)."""
    done = await trio.run_process(
        [sys.executable, "-m", "clmq", *argv], capture_stdout=True, capture_stderr=True, check=False, cwd=ROOT
    )
    assert done.returncode == expect, done.stderr.decode()
    return str((done.stderr if expect else done.stdout).decode())


async def _child_main(ns: str, topic: str, body: str, mode: str) -> None:
    if mode == "half":  # send_in_transaction's first step, then the local transaction never ends
        async with open_producer(ns, transaction_group="crash") as p:
            half = await send_half(p, topic, body.encode())
            print(f"HALF {half.msg_id}", flush=True)
            await trio.sleep_forever()  # SIGKILLed here

    class Commit:
        def execute_local_transaction(self, message: Message, arg: Any) -> LocalTransactionState:
            return UNKNOWN

        def check_local_transaction(self, message: Record) -> LocalTransactionState:
            state = COMMIT if message.body == body.encode() else UNKNOWN
            if state is COMMIT:
                print(f"COMMITTED {body}", flush=True)
            return state

    async with open_producer(ns, transaction_group="crash", transaction_listener=Commit()):
        print("READY", flush=True)
        await trio.sleep_forever()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    trio.run(_child_main, *sys.argv[1:5])


@pytest.mark.slow  # a broker process, about 8 s
async def test_the_benchmark_measures_every_figure(tmp_path: Path) -> None:
    """``clmq bench transactions`` with tiny sizes: both kinds' rates, every latency
    message received, the aims judged, the plot drawn (a smoke test, not a measurement)."""
    tiny = ["--runs", "1", "--seconds", "0.3", "--senders", "4", "--latency-messages", "40", "--settle-seconds", "0"]
    paths = ["--json", str(tmp_path / "t.json"), "--plot", str(tmp_path / "t.png"), "--out-dir", str(tmp_path)]
    await _clmq("bench", "transactions", *tiny, *paths)
    result = json.loads((tmp_path / "t.json").read_text())
    t = result["throughput"]
    assert t["plain_msgs_per_s"] > 0 and t["transactional_msgs_per_s"] > 0 and t["failed"] == 0
    assert [(r["kind"], r["received"]) for r in result["latency"]] == [("plain", 40), ("transactional", 40)]
    assert [a["aim"] for a in result["aims"]] == [
        "transactional / plain send rate (median of runs)",
        "commit-to-visible p99, ms",
    ]
    assert (tmp_path / "t.png").stat().st_size > 0

"""Transactions across kill -9 of a real broker process: half messages pending when the
broker dies are all there after the restart; ends in flight when it died are either
done or not, never half done; every half message ends up committed exactly once or
rolled back, never both, never lost."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import trio

from clmq.client import RpcError, open_admin, open_consumer
from clmq.common import TRANS_HALF_TOPIC, Message
from clmq.protocol import ErrorCode, RequestCode, encode_batch
from tests.crash_broker import launch, reap, tail, wait_ready
from tests.failover_procs import FailoverGroup
from tests.replica_procs import open_group, read_queue
from tests.service_helpers import FAST_CONSUMER

N = 400  # half messages
ENDERS = 8  # concurrent END_TRANSACTION tasks
RETRYABLE = (ErrorCode.SYSTEM_BUSY, ErrorCode.NOT_LEADER, ErrorCode.SHUTTING_DOWN)


def _config(root: Path) -> Path:
    conf = root / "broker.toml"
    conf.write_text(
        f'[broker]\nbroker_name = "tx"\nlisten_port = 0\ndata_dir = "{root / "data"}"\n'
        f'flush_mode = "sync"\nsegment_bytes = {64 * 1024}\nmax_message_bytes = {16 * 1024}\n'
        "transaction_check_interval_ms = 50\ntransaction_checkpoint_interval_ms = 50\n"
        "transaction_timeout_ms = 600000\n"
    )
    return conf


def _half(i: int) -> Message:
    body = b"m%04d|" % i + bytes(random.Random(i).randbytes(random.Random(i).randrange(100, 3000)))
    props = {"REAL_TOPIC": "t", "REAL_QID": str(i % 2), "REAL_TAGS": "", "TRAN_GROUP": "pg", "UNIQ_KEY": f"u{i}"}
    return Message(TRANS_HALF_TOPIC, 0, body, "", f"k{i}", props)


def _action(i: int) -> str:
    return "commit" if i % 3 else "rollback"


async def _end(admin: Any, addr: str, offset: int, action: str) -> str:
    """END_TRANSACTION, retried while the broker starts (its service rebuilding)."""
    fields = {"group": "pg", "commitlog_offset": offset, "action": action}
    while True:
        try:
            reply = await admin.rpc.request(addr, RequestCode.END_TRANSACTION, fields, timeout_ms=10_000)
        except RpcError as e:
            if e.code not in RETRYABLE:
                raise
            await trio.sleep(0.02)
            continue
        state: str = reply.fields["state"]
        return state


async def _end_some(addr: str, offsets: list[int], answers: dict[int, str], stop_after: int) -> None:
    """End the halves in random order with ENDERS tasks; return once ``stop_after``
    answers came (the rest still in flight: the kill lands among them)."""
    todo = list(range(len(offsets)))
    random.shuffle(todo)
    enough = trio.Event()

    async def ender(admin: Any) -> None:
        while todo:
            i = todo.pop()
            answers[i] = await _end(admin, addr, offsets[i], _action(i))
            if len(answers) >= stop_after:
                enough.set()

    async with open_admin(None, broker_addrs=[addr]) as admin, trio.open_nursery() as n:
        for _ in range(ENDERS):
            n.start_soon(ender, admin)
        await enough.wait()
        await trio.sleep(random.uniform(0, 0.005))
        n.cancel_scope.cancel()


async def test_pending_and_ending_halves_survive_kill_9_exactly_once(tmp_path: Path) -> None:
    conf, log = _config(tmp_path), tmp_path / "broker.log"
    proc = await launch(conf, log)
    answers: dict[int, str] = {}
    try:
        addr = await wait_ready(proc, log)
        async with open_admin(None, broker_addrs=[addr]) as admin:
            await admin.create_topic("t", 2)
            offsets: list[int] = []
            for start in range(0, N, 20):
                batch = encode_batch([_half(i) for i in range(start, start + 20)])
                reply = await admin.rpc.request(addr, RequestCode.SEND_MESSAGE, {"topic": TRANS_HALF_TOPIC}, batch)
                offsets += reply.fields["commitlog_offsets"]
        await _end_some(addr, offsets, answers, N // 3)
    finally:
        await reap(proc)  # SIGKILL with ends in flight and two thirds pending
    for kill in range(2):  # restart, end everything again (a producer's retries), kill once more midway
        proc = await launch(conf, log)
        try:
            addr = await wait_ready(proc, log)
            if kill == 0:
                await _end_some(addr, offsets, answers, N // 2)
                continue
            async with open_admin(None, broker_addrs=[addr]) as admin:
                for i, off in enumerate(offsets):
                    answers[i] = await _end(admin, addr, off, _action(i))
                listed = await admin.rpc.request(addr, RequestCode.LIST_TRANSACTIONS, {})
                assert listed.fields["total"] == 0, tail(log)
            bodies = await _read_topic(addr, sum(1 for i in range(N) if _action(i) == "commit"))
        finally:
            await reap(proc)
    for i, state in answers.items():  # an end answered before a kill is never undone by it
        ok = {"commit": ("committed", "already_committed"), "rollback": ("rolled_back", "already_rolled_back")}
        assert state in ok[_action(i)], f"half {i} ({_action(i)}) answered {state}"
    expected = sorted(_half(i).body for i in range(N) if _action(i) == "commit")
    assert sorted(bodies) == expected, f"{len(bodies)} read, {len(set(bodies))} distinct, {len(expected)} committed"


async def _read_topic(addr: str, n: int) -> list[bytes]:
    got: list[bytes] = []
    async with open_consumer(None, "reader", {"t": "*"}, broker_addrs=[addr], **FAST_CONSUMER) as consumer:
        with trio.move_on_after(30):
            while len(got) < n:
                got += [r.body for r in await consumer.receive()]
        with trio.move_on_after(1.0):  # anything committed twice would come now
            while True:
                got += [r.body for r in await consumer.receive()]
    return got


# ---------------------------------------------------------------- a ZooKeeper failover
async def _call(
    g: Any, key: str, code: int, fields: dict[str, Any], body: bytes = b"", timeout_ms: int = 10_000
) -> Any:
    """A request to broker ``key``, retried while it is not (yet) a running leader."""
    while True:
        reply = await g.call(key, code, fields, body, timeout_ms=timeout_ms)
        if reply.error_code in RETRYABLE:
            await trio.sleep(0.05)
            continue
        assert not reply.error_code, f"{RequestCode(code).name} on {key}: {reply.error_text}"
        return reply


@pytest.mark.slow
async def test_a_failover_during_the_check_keeps_counts_and_ends_each_half_once(
    tmp_path: Path, zk_connect: str
) -> None:
    """Three brokers under ZooKeeper; pending halves asked about once on the leader,
    which is then killed: the new leader asks the same halves again with their counts
    carried over, the producer's answers end each once, and what was ended before the
    failover stays ended."""
    settings = {
        "transaction_timeout_ms": 300,
        "transaction_check_interval_ms": 50,
        "transaction_checkpoint_interval_ms": 50,
    }
    async with open_group(tmp_path) as g:
        fg = FailoverGroup(g, zk_connect)
        leader = await fg.start({"t": 2}, **settings)
        batch = encode_batch([_half(i) for i in range(12)])
        sent = await _call(g, leader, RequestCode.SEND_MESSAGE, {"topic": TRANS_HALF_TOPIC}, batch)
        offsets: list[int] = sent.fields["commitlog_offsets"]
        for i in range(4):  # ended before the failover
            await _call(g, leader, RequestCode.END_TRANSACTION, _end_fields(offsets[i], _action(i)))
        asked = await _checks(g, leader, 8)
        assert asked == {off: 1 for off in offsets[4:]}
        await fg.wait_settled(leader)
        follower = next(k for k in fg.keys if k != leader)
        refused = await g.call(follower, RequestCode.END_TRANSACTION, _end_fields(offsets[5], "commit"))
        assert refused.error_code == ErrorCode.NOT_LEADER and refused.fields["leader_addr"] == g[leader].addr, refused
        await fg.kill(leader)
        new = await fg.wait_leader(exclude=frozenset({leader}))
        again = await _checks(g, new, 8)
        assert again == {off: 2 for off in offsets[4:]}, "check counts lost in the failover"
        for i, off in enumerate(offsets):
            reply = await _call(g, new, RequestCode.END_TRANSACTION, _end_fields(off, _action(i), from_check=i >= 4))
            want = ("already_" if i < 4 else "") + ("committed" if _action(i) == "commit" else "rolled_back")
            assert reply.fields["state"] == want, (i, reply.fields)
        listed = await _call(g, new, RequestCode.LIST_TRANSACTIONS, {})
        assert listed.fields["total"] == 0
        bodies = sorted(
            [r.body for r in await read_queue(g, new, "t", 0)] + [r.body for r in await read_queue(g, new, "t", 1)]
        )
        assert bodies == sorted(_half(i).body for i in range(12) if _action(i) == "commit")


def _end_fields(offset: int, action: str, from_check: bool = False) -> dict[str, Any]:
    return {"group": "pg", "commitlog_offset": offset, "action": action, "from_check": from_check}


async def _checks(g: Any, key: str, n: int) -> dict[int, int]:
    """CHECK_TRANSACTIONS of group pg on ``key`` until ``n`` halves were asked about."""
    asked: dict[int, int] = {}
    with trio.fail_after(30):
        while len(asked) < n:
            fields = {"group": "pg", "client_id": "p1", "max_wait_ms": 2000}
            reply = await _call(g, key, RequestCode.CHECK_TRANSACTIONS, fields)
            asked.update({off: count for off, count in reply.fields["checks"]})
    return asked

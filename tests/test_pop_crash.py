"""POP across kill -9 of a real broker process (flush_mode sync): every acknowledged
message stays settled (never delivered again, its handle answers "gone"), every
popped-but-unacknowledged message comes back after its deadline and not before, and
the queues' next offsets are kept, with the state rebuilt from a checkpoint plus the
``%POP%`` records after it, or from ``%POP%`` alone (no checkpoint saved yet)."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio

from clmq.client import RpcError, open_admin
from clmq.protocol import ErrorCode
from tests.crash_broker import launch, reap, tail, wait_ready
from tests.failover_procs import FailoverGroup
from tests.pop_helpers import Popper
from tests.replica_procs import open_group
from tests.waiting import await_until

RETRYABLE = (ErrorCode.SYSTEM_BUSY, ErrorCode.NOT_LEADER, ErrorCode.SHUTTING_DOWN)
PER_QUEUE = 30
INVISIBLE_MS = 6000  # long enough for a kill -9 and a restart before any deadline


def _config(root: Path, checkpoint_ms: int) -> Path:
    conf = root / "broker.toml"
    conf.write_text(
        f'[broker]\nbroker_name = "pop"\nlisten_port = 0\ndata_dir = "{root / "data"}"\n'
        f'flush_mode = "sync"\nsegment_bytes = {64 * 1024}\nmax_message_bytes = {16 * 1024}\n'
        f"pop_revive_interval_ms = 20\npop_checkpoint_interval_ms = {checkpoint_ms}\n"
    )
    return conf


async def _retrying(call: Any) -> Any:
    """``await call()``, again while the broker starts (its POP state rebuilding)."""
    with trio.fail_after(20):
        while True:
            try:
                return await call()
            except RpcError as e:
                if e.code not in RETRYABLE:
                    raise
            await trio.sleep(0.02)


@pytest.mark.parametrize("checkpoint_ms", [50, 10**9], ids=["checkpoint", "replay-only"])
async def test_acks_survive_kill_9_and_unacked_come_back_after_their_deadline(
    tmp_path: Path, checkpoint_ms: int
) -> None:
    conf, log = _config(tmp_path, checkpoint_ms), tmp_path / "broker.log"
    proc = await launch(conf, log)
    try:
        addr = await wait_ready(proc, log)
        async with open_admin(None, broker_addrs=[addr]) as admin:
            await admin.create_topic("t", 2)
            p = Popper(admin, addr)
            for q in (0, 1):
                await p.send("t", [b"%d-%03d" % (q, i) for i in range(PER_QUEUE)], queue_id=q)
            popped: dict[bytes, str] = {}
            deadlines: dict[bytes, int] = {}
            while len(popped) < 40:
                got, f = await _retrying(lambda: p.pop(invisible_time_ms=INVISIBLE_MS, max_messages=8))
                popped.update(zip([bytes(r.body) for r in got], f["handles"]))
                deadlines.update((bytes(r.body), f["deadline_ms"]) for r in got)
            acked = sorted(popped)[::2]  # every other one, from both queues
            assert await p.ack([popped[b] for b in acked[:10]]) == ["ok"] * 10
            if checkpoint_ms < 10**6:  # a checkpoint saved, then more acks after it (replayed)
                checkpoint = tmp_path / "data" / "pop" / "checkpoint.json"
                await await_until(checkpoint.exists, 10, "a POP checkpoint")
            assert await p.ack([popped[b] for b in acked[10:]]) == ["ok"] * (len(acked) - 10)
    finally:
        await reap(proc)  # SIGKILL
    proc = await launch(conf, log)
    try:
        addr = await wait_ready(proc, log)
        async with open_admin(None, broker_addrs=[addr]) as admin:
            p = Popper(admin, addr)
            assert await _retrying(lambda: p.ack([popped[b] for b in acked])) == ["gone"] * len(acked), tail(log)
            unacked = sorted(set(popped) - set(acked))
            never = sorted({b"%d-%03d" % (q, i) for q in (0, 1) for i in range(PER_QUEUE)} - set(popped))
            first, _f = await p.pop(invisible_time_ms=60_000, max_messages=100)
            left_ms = min(deadlines.values()) - time.time() * 1000
            assert left_ms > 0, f"the restart took past the first deadline ({-left_ms:.0f} ms): nothing was checked"
            assert sorted(bytes(r.body) for r in first) == never  # before the deadlines: only those never popped
            seen = {bytes(r.body): 1 for r in first}
            with trio.fail_after(20):
                while len(seen) < len(never) + len(unacked):
                    got, f = await p.pop(invisible_time_ms=60_000, max_messages=100, max_wait_ms=1000)
                    now = time.time() * 1000
                    early = [r.body for r in got if now < deadlines.get(bytes(r.body), 0)]
                    assert not early, f"delivered again before their deadline: {early}"
                    seen.update((bytes(r.body), a) for r, a in zip(got, f["attempts"]))
            assert sorted(seen) == sorted(never + unacked), "an acknowledged message came again, or one is lost"
            assert {b: seen[b] for b in unacked} == dict.fromkeys(unacked, 2)
            assert await p.ack([popped[unacked[0]]]) == ["expired"]
            got, _f = await p.pop(max_wait_ms=300, invisible_time_ms=1000)
            assert got == []
    finally:
        await reap(proc)


@pytest.mark.slow
async def test_a_zookeeper_failover_keeps_acks_and_the_new_leader_answers_old_handles(
    tmp_path: Path, zk_connect: str
) -> None:
    """Three brokers under ZooKeeper; the leader is killed with deliveries in flight: the
    new leader settles what was acknowledged (never delivered again), acknowledges a
    handle the old leader gave out, and delivers again only the unacknowledged one."""
    async with open_group(tmp_path) as g:
        fg = FailoverGroup(g, zk_connect)
        leader = await fg.start({"t": 1}, pop_revive_interval_ms=20, pop_checkpoint_interval_ms=50)
        p = Popper(SimpleNamespace(rpc=g.rpc), g[leader].addr)
        await _retrying(p.running)
        await p.send("t", [b"m0", b"m1", b"m2", b"m3", b"m4", b"m5"])
        _got, long = await _retrying(lambda: p.pop(max_messages=2, invisible_time_ms=600_000))
        _got, short = await p.pop(max_messages=2, invisible_time_ms=1000)
        assert await p.ack([long["handles"][0], short["handles"][0]]) == ["ok", "ok"]  # m0, m2
        await fg.wait_settled(leader)
        await fg.kill(leader)
        new = await fg.wait_leader(exclude=frozenset({leader}))
        p = Popper(SimpleNamespace(rpc=g.rpc), g[new].addr)
        acked = [long["handles"][0], short["handles"][0]]
        assert await _retrying(lambda: p.ack(acked)) == ["gone", "gone"]
        assert await p.ack(long["handles"][1:]) == ["ok"]  # m1: the old leader's handle, still in flight
        seen: dict[bytes, int] = {}
        with trio.fail_after(30):
            while len(seen) < 3:
                got, f = await p.pop(max_messages=10, invisible_time_ms=600_000, max_wait_ms=1000)
                seen.update((bytes(r.body), a) for r, a in zip(got, f["attempts"]))
        assert seen == {b"m3": 2, b"m4": 1, b"m5": 1}, tail(g[new].err)
        got, _f = await p.pop(max_wait_ms=300)
        assert got == []

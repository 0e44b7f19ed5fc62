"""The key index through a real broker: QUERY_INDEX, ``Admin.find_by_key`` (keys,
UNIQ_KEY, system topics, time ranges, the bound on results), partition-per-file's
REQUEST_NOT_SUPPORTED, and ``clmq message find`` against a real ``clmq dev``."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import trio

from clmq.client import BlockingAdmin, BlockingProducer, IndexLookup, open_admin, open_producer
from clmq.common import Message
from clmq.protocol import ErrorCode, RequestCode, decode_records
from clmq.protocol.transport import RpcClient, RpcError
from tests.cli_helpers import clmq, running_dev
from tests.service_helpers import Cluster
from tests.waiting import await_until, wait_until


@pytest.fixture
async def cluster(nursery: trio.Nursery, tmp_path: Path) -> Cluster:
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    await c.start_broker("broker-a", index_hash_slots=64, index_max_entries_per_file=40)
    return c


async def test_find_by_key_and_by_unique_id_newest_first(cluster: Cluster) -> None:
    await cluster.create_topic("orders", 3)
    async with open_producer(cluster.ns) as p:
        sent = [await p.send("orders", f"m{i}".encode(), keys=f"order-{i % 5} all") for i in range(60)]
    async with open_admin(cluster.ns) as admin:

        async def indexed() -> bool:  # the dispatcher indexes right after the answer, as it fills queues
            return len((await admin.find_by_key("orders", "all", max_results=100)).records) == 60

        await await_until(indexed, 10, "all 60 messages indexed")
        info = await admin.broker_info(cluster.brokers["broker-a"].addr)
        assert info["index_entries"] >= 180 and info["index_files"] >= 5  # 60 x (2 keys + UNIQ_KEY), 40 a file
        assert info["index_end_offset"] > 0
        found = await admin.find_by_key("orders", "order-3")
        assert [r.body for r in found.records] == [f"m{i}".encode() for i in reversed(range(60)) if i % 5 == 3]
        assert not found.truncated
        ts = [r.store_timestamp_ms for r in found.records]
        assert ts == sorted(ts, reverse=True)
        uniq = sent[17].uniq_keys[0]
        by_id = await admin.find_by_key("orders", uniq)
        assert [r.body for r in by_id.records] == [b"m17"]
        capped = await admin.find_by_key("orders", "all", max_results=7)
        assert len(capped.records) == 7 and capped.truncated
        assert [r.body for r in capped.records] == [f"m{i}".encode() for i in range(59, 52, -1)]
        assert (await admin.find_by_key("orders", "order-9")).records == []
        assert (await admin.find_by_key("other-topic", "order-3")).records == []  # topic#key: another topic's key
        newest = found.records[0].store_timestamp_ms
        later = await admin.find_by_key("orders", "order-3", since_ms=newest + 1)
        assert later.records == []
        upto = await admin.find_by_key("orders", "order-3", until_ms=found.records[-1].store_timestamp_ms)
        assert upto.records and all(r.store_timestamp_ms <= found.records[-1].store_timestamp_ms for r in upto.records)


async def test_system_topics_are_indexed_for_traces(cluster: Cluster) -> None:
    """The trace engineer's use: records in %TRACE% found by their key (a message id)."""
    broker = cluster.brokers["broker-a"]
    store = broker.store
    store.create_topic("%TRACE%", 1)
    trace_key = "10.0.0.1:9876@00000000000000AB"
    store.put_batch([Message("%TRACE%", 0, f"event-{i}".encode(), keys=trace_key) for i in range(3)])
    store.put(Message("%TRACE%", 0, b"other", keys="10.0.0.1:9876@00000000000000AC"))
    async with open_admin(cluster.ns) as admin:

        async def all_three() -> IndexLookup | None:
            found = await admin.find_by_key("%TRACE%", trace_key)
            return found if len(found.records) == 3 else None

        found = await await_until(all_three, 10, "the trace records indexed (once durable)")
        assert sorted(r.body for r in found.records) == [b"event-0", b"event-1", b"event-2"]


@pytest.mark.parametrize(
    "settings", [{"storage_mode": "partition-per-file"}, {"index_enabled": False}], ids=["partition-per-file", "off"]
)
async def test_query_index_is_not_supported_without_an_index(
    nursery: trio.Nursery, tmp_path: Path, settings: dict[str, Any]
) -> None:
    c = Cluster(nursery, tmp_path)
    await c.start_nameserver()
    await c.start_broker("broker-p", **settings)
    await c.create_topic("t", 1)
    async with open_admin(c.ns) as admin:
        with pytest.raises(RpcError) as e:
            await admin.find_by_key("t", "k")
        assert e.value.code == ErrorCode.REQUEST_NOT_SUPPORTED
        assert (await admin.broker_info(c.brokers["broker-p"].addr))["index_files"] == -1
    assert not (tmp_path / "broker-p" / "index").exists()  # nothing built


async def test_query_index_answers_matches_and_records_in_the_same_order(cluster: Cluster) -> None:
    await cluster.create_topic("raw", 1)
    async with open_producer(cluster.ns) as p:
        for i in range(5):
            await p.send("raw", f"r{i}".encode(), keys="same")
    addr = cluster.brokers["broker-a"].addr
    async with trio.open_nursery() as n:
        rpc = RpcClient(n)

        async def all_five() -> bool:
            ask = {"topic": "raw", "key": "same", "max_results": 10}
            return len((await rpc.request(addr, RequestCode.QUERY_INDEX, ask)).fields["matches"]) == 5

        await await_until(all_five, 10, "all 5 messages indexed")
        reply = await rpc.request(addr, RequestCode.QUERY_INDEX, {"topic": "raw", "key": "same", "max_results": 2})
        await rpc.aclose()
    records = decode_records(reply.body)
    assert reply.fields["truncated"] is True
    assert reply.fields["matches"] == [[r.commitlog_offset, r.store_timestamp_ms] for r in records]
    assert [r.body for r in records] == [b"r4", b"r3"]


def _cli(ns: str, cwd: Path, *args: str, code: int = 0) -> subprocess.CompletedProcess[str]:
    out = clmq(*args, "--namesrv", ns, cwd=cwd)
    assert out.returncode == code, (args, out.stdout, out.stderr)
    return out


def _json_lines(out: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["commitlog", "partition-per-file"])
def test_clmq_message_find_uses_the_index_or_says_it_scans(tmp_path: Path, mode: str) -> None:
    with running_dev(tmp_path, f'storage_mode = "{mode}"\n') as ns:
        _cli(ns, tmp_path, "topic", "create", "shop", "--queues", "2")
        # Sent by a producer: `clmq produce` prints message ids, which partition-per-file has not.
        with BlockingProducer(ns) as p:
            for body in ("one", "two", "three"):
                p.send("shop", body.encode(), keys="cart-9 all")
            four = p.send("shop", b"four", keys="cart-10")
        if mode == "commitlog":  # indexed by the dispatcher just after the answer
            with BlockingAdmin(ns) as admin:
                wait_until(lambda: len(admin.find_by_key("shop", "all").records) == 3, 10, "3 messages indexed")
        out = _cli(ns, tmp_path, "message", "find", "shop", "--key", "cart-9", "-o", "json")
        assert sorted(f["body"] for f in _json_lines(out)) == ["one", "three", "two"]
        assert ("found (key index)" in out.stderr) == (mode == "commitlog")
        assert ("scanning" in out.stderr) == (mode != "commitlog")
        capped = _cli(ns, tmp_path, "message", "find", "shop", "--key", "all", "--count", "2", "-o", "json")
        assert len(_json_lines(capped)) == 2
        _cli(ns, tmp_path, "message", "find", "shop", "--key", "cart-1", code=1)  # a prefix is not the key
        _cli(ns, tmp_path, "message", "find", "shop", "--key", "cart-10", "--until", "2001-01-01", code=1)
        if mode == "commitlog":  # a message's unique id (UNIQ_KEY) finds it too, and get stays exact
            got = json.loads(_cli(ns, tmp_path, "message", "get", four.msg_ids[0], "-o", "json").stdout)
            assert got["body"] == "four"
            uniq = got["properties"]["UNIQ_KEY"]
            by_id = _json_lines(_cli(ns, tmp_path, "message", "find", "shop", "--key", uniq, "-o", "json"))
            assert [f["body"] for f in by_id] == ["four"]

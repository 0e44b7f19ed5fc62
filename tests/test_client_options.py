"""The clients' entry points: typed options (a misspelt one is a TypeError at the call,
before anything connects; every option of ProducerOptions/ConsumerOptions is in each
signature with its type and default), addresses as a string or a list, $CLMQ_NAMESRV,
and a BlockingProducer left open (collected, or at interpreter exit) that sends what it
holds or says how many messages it could not send. Against a real ``clmq dev``."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import trio

from clmq.client import (
    BlockingAdmin,
    BlockingConsumer,
    BlockingProducer,
    ConsumerOptions,
    ProducerOptions,
    open_asyncio_consumer,
    open_asyncio_producer,
    open_consumer,
    open_producer,
)
from clmq.client._asyncio import _RUNS
from tests.cli_helpers import ENV, free_port, running_dev

TIMEOUT_S = 30
FAST = {"heartbeat_interval_ms": 100, "rebalance_interval_ms": 200, "commit_interval_ms": 100, "pull_wait_ms": 200}

PRODUCERS: list[Callable[..., Any]] = [open_producer, open_asyncio_producer, BlockingProducer]
CONSUMERS: list[Callable[..., Any]] = [open_consumer, open_asyncio_consumer, BlockingConsumer]


def _client_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "clmq-client"]


# ---------------------------------------------------------------- no broker needed
@pytest.mark.parametrize("entry", PRODUCERS + CONSUMERS, ids=lambda f: f.__name__)
def test_a_misspelt_option_is_a_type_error_at_the_call(entry: Callable[..., Any]) -> None:
    """Nothing listens at the address: an error that came from connecting would be
    ConnectionFailed (or a hang), not the TypeError of the call itself."""
    addr = f"127.0.0.1:{free_port()}"
    args: tuple[Any, ...] = (addr,) if entry in PRODUCERS else (addr, "g", {"t": "*"})
    threads = len(_client_threads())
    with pytest.raises(TypeError, match="lingr_ms"):
        entry(*args, lingr_ms=5)
    with pytest.raises(TypeError, match="pull_wiat_ms"):
        entry(*args, pull_wiat_ms=5)
    assert len(_client_threads()) == threads  # no client thread was started
    assert not _RUNS  # no trio guest run either


@pytest.mark.parametrize(
    ("entries", "options"),
    [(PRODUCERS, ProducerOptions), (CONSUMERS, ConsumerOptions)],
    ids=["producers", "consumers"],
)
def test_each_signature_names_every_option_with_its_type_and_default(
    entries: list[Callable[..., Any]], options: type[Any]
) -> None:
    for entry in entries:
        params = inspect.signature(entry).parameters
        assert not [p for p in params.values() if p.kind is inspect.Parameter.VAR_KEYWORD], entry
        for field in dataclasses.fields(options):
            param = params.get(field.name)
            assert param is not None, f"{entry.__name__} does not name {field.name}"
            assert param.kind is inspect.Parameter.KEYWORD_ONLY, (entry, field.name)
            assert param.default == field.default, (entry, field.name)
            assert param.annotation == field.type, (entry, field.name)  # both strings (postponed annotations)
        for name in ("namesrv_addrs", "broker_addrs"):
            assert params[name].annotation == "str | Sequence[str] | None", (entry, name)


def test_bad_values_and_addresses_are_refused_before_any_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    addr = f"127.0.0.1:{free_port()}"
    threads = len(_client_threads())
    with pytest.raises(ValueError, match="linger_ms"):
        BlockingProducer(addr, linger_ms=-1)
    with pytest.raises(ValueError, match="buffer_full"):
        BlockingProducer(addr, buffer_full="wait")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mode"):
        BlockingConsumer(addr, "g", {"t": "*"}, mode="cluster")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="start_from"):
        BlockingConsumer(addr, "g", {"t": "*"}, start_from="first")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'nameserver' is not host:port"):
        BlockingProducer("nameserver")
    with pytest.raises(ValueError, match=r"broker_addrs: '127\.0\.0\.1:0' is not host:port"):
        BlockingProducer(broker_addrs=["127.0.0.1:0"])
    monkeypatch.delenv("CLMQ_NAMESRV", raising=False)
    with pytest.raises(ValueError, match="CLMQ_NAMESRV"):
        BlockingProducer()
    with pytest.raises(ValueError, match="CLMQ_NAMESRV"):
        BlockingConsumer(None, "g", {"t": "*"})
    assert len(_client_threads()) == threads


# ---------------------------------------------------------------- against clmq dev
@pytest.fixture(scope="module")
def dev(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A ``clmq dev`` (name server and broker); its name server's address."""
    with running_dev(tmp_path_factory.mktemp("options")) as ns:
        yield ns


def _topic(ns: str) -> str:
    topic = f"t{uuid.uuid4().hex[:8]}"
    with BlockingAdmin(ns) as admin:
        admin.create_topic(topic, 2)
    return topic


def _broker_addr(ns: str) -> str:
    with BlockingAdmin(ns) as admin:
        return str(admin.brokers()[0]["addr"])


def _consume(consumer: BlockingConsumer, count: int) -> list[bytes]:
    """Poll until ``count`` messages came (or TIMEOUT_S passed: fewer)."""
    got: list[bytes] = []
    deadline = time.monotonic() + TIMEOUT_S
    while len(got) < count and time.monotonic() < deadline:
        got += [r.body for r in consumer.poll(0.5)]
    return got


def test_string_and_list_addresses_reach_the_broker(dev: str) -> None:
    """A name-server string with two addresses (the first one dead: the client must have
    split the string to get past it), a list, and broker addresses as a string and as a
    list, for producers and consumers."""
    topic = _topic(dev)
    dead = f"127.0.0.1:{free_port()}"
    broker = _broker_addr(dev)
    sent = []
    for i, (namesrv, brokers) in enumerate(
        [(f"{dead}, {dev}", None), ([dead, dev], None), (None, broker), (None, [broker])]
    ):
        with BlockingProducer(namesrv, broker_addrs=brokers) as p:
            body = b"blocking-%d" % i
            p.send(topic, body)
            sent.append(body)

    async def trio_side() -> None:
        async with open_producer(f"{dev},{dead}") as p:
            await p.send(topic, b"trio-string")
        async with open_producer(broker_addrs=[broker]) as p:
            await p.send(topic, b"trio-list")

    trio.run(trio_side)
    sent += [b"trio-string", b"trio-list"]
    with BlockingConsumer(f"{dead},{dev}", "g-string", {topic: "*"}, **FAST) as c:
        assert sorted(_consume(c, len(sent))) == sorted(sent)
    with BlockingConsumer(None, "g-brokers", {topic: "*"}, broker_addrs=broker, **FAST) as c:
        assert sorted(_consume(c, len(sent))) == sorted(sent)


def test_clmq_namesrv_is_used_when_no_address_is_given(dev: str, monkeypatch: pytest.MonkeyPatch) -> None:
    topic = _topic(dev)
    monkeypatch.setenv("CLMQ_NAMESRV", f"127.0.0.1:{free_port()},{dev}")  # comma separated, as for the CLI
    with BlockingProducer() as p:
        p.send(topic, b"blocking")

    async def asyncio_side() -> list[bytes]:
        async with open_asyncio_producer() as p:
            await p.send(topic, b"asyncio")
        got: list[bytes] = []
        async with open_asyncio_consumer(None, "g-env-asyncio", {topic: "*"}, **FAST) as c:
            async with asyncio.timeout(TIMEOUT_S):
                while len(got) < 2:
                    got += [r.body for r in await c.receive()]
        return got

    assert sorted(asyncio.run(asyncio_side())) == [b"asyncio", b"blocking"]

    async def trio_side() -> list[bytes]:
        async with open_producer() as p:
            await p.send(topic, b"trio")
        got: list[bytes] = []
        async with open_consumer(None, "g-env-trio", {topic: "*"}, **FAST) as c:
            with trio.fail_after(TIMEOUT_S):
                while len(got) < 3:
                    got += [r.body for r in await c.receive()]
        return got

    assert sorted(trio.run(trio_side)) == [b"asyncio", b"blocking", b"trio"]
    with BlockingConsumer(None, "g-env-blocking", {topic: "*"}, **FAST) as c:
        assert sorted(_consume(c, 3)) == [b"asyncio", b"blocking", b"trio"]


# ---------------------------------------------------------------- a BlockingProducer left open
LEFT_OPEN = """
import gc
import sys

from clmq.client import BlockingProducer

ns, topic, mode, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
# linger_ms of ten minutes: nothing is sent until a flush (or close) asks
producer = BlockingProducer(ns, linger_ms=600_000, retry_budget_ms=1000, send_timeout_ms=1000)
futures = [producer.submit(topic, b"left-open-%d" % i) for i in range(count)]
print("submitted; done:", sum(f.done() for f in futures), flush=True)
if mode == "gc":
    del producer
    gc.collect()
    print("collected; stored:", sum(f.done() and f.exception() is None for f in futures), flush=True)
elif mode == "wait":
    sys.stdin.readline()
# the end of the script, the producer never closed
"""
COUNT = 5


def _left_open(tmp_path: Path, ns: str, topic: str, mode: str) -> subprocess.Popen[str]:
    script = tmp_path / "left_open.py"
    script.write_text(LEFT_OPEN)
    return subprocess.Popen(
        [sys.executable, str(script), ns, topic, mode, str(COUNT)],
        cwd=tmp_path,
        env=ENV,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _consumed(ns: str, topic: str) -> list[bytes]:
    with BlockingConsumer(ns, "g-left-open", {topic: "*"}, **FAST) as c:
        return sorted(_consume(c, COUNT))


SENT = sorted(b"left-open-%d" % i for i in range(COUNT))


def test_a_blocking_producer_left_open_at_exit_sends_what_it_holds(dev: str, tmp_path: Path) -> None:
    topic = _topic(dev)
    proc = _left_open(tmp_path, dev, topic, "exit")
    out, err = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 0, err
    assert out.splitlines() == ["submitted; done: 0"]  # all still buffered when the script ended
    assert "could not be sent" not in err
    assert _consumed(dev, topic) == SENT


def test_a_blocking_producer_collected_sends_what_it_holds(dev: str, tmp_path: Path) -> None:
    topic = _topic(dev)
    proc = _left_open(tmp_path, dev, topic, "gc")
    out, err = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 0, err
    # stored by the time the last reference went, not only at exit
    assert out.splitlines() == ["submitted; done: 0", f"collected; stored: {COUNT}"]
    assert _consumed(dev, topic) == SENT


def test_a_blocking_producer_left_open_warns_of_what_it_could_not_send(tmp_path: Path) -> None:
    (tmp_path / "dev").mkdir()
    with running_dev(tmp_path / "dev") as ns:
        topic = _topic(ns)
        proc = _left_open(tmp_path, ns, topic, "wait")
        assert proc.stdout is not None
        assert proc.stdout.readline() == "submitted; done: 0\n"
    # the broker (and its name server) stopped; now the script ends
    _, err = proc.communicate("\n", timeout=TIMEOUT_S)
    assert proc.returncode == 0, err
    assert f"{COUNT} of the {COUNT} messages it still held could not be sent" in err, err


def test_a_blocking_producer_collected_on_its_own_client_thread_is_closed_by_another(dev: str) -> None:
    """The last reference may go on the client thread (a done callback held it): its
    finalizer then runs there and must not wait for that thread (it would wait for
    itself: a hang), so another thread closes the producer, sending what it held."""
    topic = _topic(dev)
    producer = BlockingProducer(dev, linger_ms=600_000)
    futures = [producer.submit(topic, b"own-thread-%d" % i) for i in range(COUNT)]
    portal = producer._portal

    async def finalize_on_the_client_thread() -> None:
        producer._finalizer()  # what the collector would call there

    portal.call(finalize_on_the_client_thread)
    assert all(f.result(timeout=TIMEOUT_S).queue_offsets for f in futures)
    portal.thread.join(TIMEOUT_S)
    assert not portal.thread.is_alive()

"""Transactional messages, the client's side alone: the half message's encoding, the
producer's options, how a local transaction's answer becomes a state (exceptions,
wrong types, slow checks), where listeners run (asyncio loop, worker threads), and a
half record shown to a check with its real topic, queue and tags. End to end against
real brokers: tests/test_transactions_e2e.py."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from clmq.client import LocalTransactionState, MessageQueue, ProducerOptions, TransactionListener
from clmq.client.producer._checkback import real_view
from clmq.client.producer._transaction import as_state, decide, decide_sync, encode_half
from clmq.client.producer._transaction_hosts import AsyncioListener, ThreadListener, in_threads, on_asyncio
from clmq.common import (
    PROP_REAL_QID,
    PROP_REAL_TAGS,
    PROP_REAL_TOPIC,
    PROP_TRAN_GROUP,
    TRANS_HALF_TOPIC,
    Message,
    Record,
)
from clmq.protocol import decode_batch

COMMIT, ROLLBACK, UNKNOWN = LocalTransactionState.COMMIT, LocalTransactionState.ROLLBACK, LocalTransactionState.UNKNOWN
REAL = MessageQueue("orders", "broker-a", 3, "127.0.0.1:1")

texts = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00\x01\x02"), max_size=20)


@given(
    body=st.binary(max_size=200),
    tags=texts,
    keys=texts,
    props=st.dictionaries(texts.filter(bool), texts, max_size=4),
    group=texts.filter(lambda g: bool(g) and not g.startswith("%")),
)
def test_a_half_message_carries_its_real_queue_tags_and_group(
    body: bytes, tags: str, keys: str, props: dict[str, str], group: str
) -> None:
    msg = Message("orders", 0, body, tags, keys, {**props, "UNIQ_KEY": "U1"}, 0, 1_700_000_000_000)
    (half,) = decode_batch(encode_half(msg, REAL, group), TRANS_HALF_TOPIC, ("127.0.0.1", 1))
    assert (half.body, half.tags, half.keys) == (body, "", keys)  # the tags travel as REAL_TAGS
    p = half.properties
    assert (p[PROP_REAL_TOPIC], p[PROP_REAL_QID], p[PROP_REAL_TAGS], p[PROP_TRAN_GROUP]) == ("orders", "3", tags, group)
    assert p["UNIQ_KEY"] == "U1"
    reserved = {PROP_REAL_TOPIC, PROP_REAL_QID, PROP_REAL_TAGS, PROP_TRAN_GROUP}
    assert {k: v for k, v in p.items() if k not in reserved | {"UNIQ_KEY"}} == {
        k: v for k, v in props.items() if k not in reserved | {"UNIQ_KEY"}
    }


class Listener:
    def __init__(self, state: Any = COMMIT) -> None:
        self.state = state
        self.threads: list[str] = []

    def execute_local_transaction(self, message: Message, arg: Any) -> Any:
        self.threads.append(threading.current_thread().name)
        return self.state

    def check_local_transaction(self, message: Record) -> Any:
        self.threads.append(threading.current_thread().name)
        return self.state


def test_options_refuse_a_bad_group_or_listener() -> None:
    assert ProducerOptions(transaction_group="orders", transaction_listener=Listener()).transaction_group == "orders"
    for group in ("", "%TRANS", 7):
        with pytest.raises(ValueError, match="transaction_group"):
            ProducerOptions(transaction_group=group)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="transaction_listener"):
        ProducerOptions(transaction_listener=object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="transaction_check_timeout_ms"):
        ProducerOptions(transaction_check_timeout_ms=0)
    assert isinstance(Listener(), TransactionListener)


@pytest.mark.parametrize(
    ("value", "state"),
    [(COMMIT, COMMIT), ("commit", COMMIT), ("ROLLBACK", ROLLBACK), ("unknown", UNKNOWN), (None, UNKNOWN), (1, UNKNOWN)],
)
def test_what_a_local_transaction_returns_becomes_a_state(value: Any, state: LocalTransactionState) -> None:
    assert as_state(value, "test") is state
    assert decide_sync(lambda: value) is state


async def test_a_raising_or_async_local_transaction_is_decided() -> None:
    def boom() -> None:
        raise RuntimeError("db down")

    async def later() -> LocalTransactionState:
        await trio.lowlevel.checkpoint()
        return ROLLBACK

    assert await decide(boom) is UNKNOWN
    assert await decide(later) is ROLLBACK
    assert decide_sync(later) is UNKNOWN  # a blocking producer's listener must be plain


async def test_a_blocking_listener_runs_in_a_worker_thread() -> None:
    inner = Listener(ROLLBACK)
    wrapped = in_threads(inner)
    assert isinstance(wrapped, ThreadListener) and in_threads(None) is None
    assert await decide(wrapped.check_local_transaction, None) is ROLLBACK
    assert inner.threads and inner.threads[0] != threading.current_thread().name


def test_an_asyncio_listener_runs_on_the_loop_trio_is_a_guest_of() -> None:
    seen: list[asyncio.AbstractEventLoop] = []

    class AsyncListener:
        async def execute_local_transaction(self, message: Message, arg: Any) -> LocalTransactionState:
            seen.append(asyncio.get_running_loop())
            await asyncio.sleep(0)
            return COMMIT

        async def check_local_transaction(self, message: Record) -> LocalTransactionState:
            seen.append(asyncio.get_running_loop())
            await asyncio.sleep(0)
            return ROLLBACK

    wrapped = on_asyncio(AsyncListener())
    assert isinstance(wrapped, AsyncioListener)

    async def main() -> tuple[LocalTransactionState, asyncio.AbstractEventLoop]:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[LocalTransactionState] = loop.create_future()

        async def in_trio() -> LocalTransactionState:
            return await decide(wrapped.check_local_transaction, None)

        trio.lowlevel.start_guest_run(
            in_trio,
            run_sync_soon_threadsafe=loop.call_soon_threadsafe,
            done_callback=lambda o: done.set_result(o.unwrap()),
            host_uses_signal_set_wakeup_fd=True,
        )
        return await done, loop

    state, loop = asyncio.run(main())
    assert state is ROLLBACK and seen == [loop]


def test_a_check_sees_the_half_record_as_its_real_message() -> None:
    half = Record(
        TRANS_HALF_TOPIC,
        0,
        12,
        4096,
        100,
        b"order 7",
        "created",
        "order-7",
        {PROP_REAL_TOPIC: "orders", PROP_REAL_QID: "3", PROP_REAL_TAGS: "created", PROP_TRAN_GROUP: "g"},
        0,
        1,
        2,
        ("127.0.0.1", 1),
        ("127.0.0.1", 2),
        0,
    )
    view = real_view(half)
    assert (view.topic, view.queue_id, view.tags, view.body, view.commitlog_offset) == (
        "orders",
        3,
        "created",
        b"order 7",
        4096,
    )

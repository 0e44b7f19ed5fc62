"""The end of a request is accounted once per run of replies written (not once per
reply): whatever mix of requests a connection pipelines (produce, pulls, one-way
requests, codes nobody serves, replies refused for being unencodable), every one of
them ends exactly once: the server's in-flight count and its byte budget go back to
zero, and the connection serves what follows. A reply's header is packed by a Packer
kept per thread: one that failed to pack leaves the next replies intact."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from clmq.broker.service import Broker
from clmq.broker.service._append import PendingPut
from clmq.common import Message, pack_messages
from clmq.protocol import (
    FLAG_ONEWAY,
    ErrorCode,
    Frame,
    RequestCode,
    encode_batch,
    encode_frame,
    response_to,
)
from clmq.protocol.transport import Reply
from clmq.protocol.transport._connection import encode_reply
from tests.transport_helpers import broker_with_topic, exchange, sync_flush_lane
from tests.waiting import await_until

TOPIC = "acc"
UNSERVED = 9_999  # a request code no server serves


@pytest.fixture
async def broker(nursery: trio.Nursery, tmp_path: Path) -> Broker:
    return await broker_with_topic(nursery, tmp_path, TOPIC, 1)


def _frames(kinds: list[str]) -> list[Frame]:
    out = []
    for rid, kind in enumerate(kinds, 1):
        if kind == "produce":
            body = encode_batch([Message(TOPIC, 0, b"m%d" % rid)])
            out.append(Frame(RequestCode.SEND_MESSAGE, rid, {"topic": TOPIC}, body))
        elif kind == "oneway":
            body = encode_batch([Message(TOPIC, 0, b"o%d" % rid)])
            out.append(Frame(RequestCode.SEND_MESSAGE, rid, {"topic": TOPIC}, body, FLAG_ONEWAY))
        elif kind == "pull":
            fields = {"topic": TOPIC, "queue_id": 0, "offset": 0, "max_messages": 4}
            out.append(Frame(RequestCode.PULL_MESSAGE, rid, fields))
        elif kind == "malformed":
            out.append(Frame(RequestCode.SEND_MESSAGE, rid, {"topic": 5}))
        else:
            out.append(Frame(UNSERVED, rid))
    return out


KINDS = ["produce", "oneway", "pull", "malformed", "unserved"]


async def test_every_pipelined_request_ends_once_whatever_the_mix(broker: Broker) -> None:
    kinds = [KINDS[(i * 7 + i // 5) % len(KINDS)] for i in range(240)]
    frames = _frames(kinds)
    for _ in range(2):  # twice on new connections: nothing is left over from the first
        replies = await exchange(broker.addr, frames)
        for f, kind in zip(frames, kinds):
            if kind == "oneway":
                assert f.request_id not in replies
                continue
            code = replies[f.request_id].error_code
            expected = {
                "produce": ErrorCode.OK,
                "pull": ErrorCode.OK,
                "malformed": ErrorCode.MALFORMED_REQUEST,
                "unserved": ErrorCode.REQUEST_NOT_SUPPORTED,
            }[kind]
            assert code == expected, (kind, code)
        await await_until(lambda: broker.rpc.inflight == 0 and broker.rpc.budget.used == 0, 10, "every request ended")
    stored = 2 * sum(1 for k in kinds if k in ("produce", "oneway"))  # one-way ones too, though unanswered
    await await_until(lambda: broker.store.max_offset(TOPIC, 0) == stored, 10, "every message stored")


@settings(max_examples=50, deadline=None)
@given(
    fields=st.dictionaries(
        st.text(max_size=8), st.one_of(st.integers(-(2**63), 2**64 - 1), st.text(max_size=20), st.binary(max_size=20))
    ),
    error=st.sampled_from([0, int(ErrorCode.SYSTEM_ERROR)]),
)
def test_a_reply_that_cannot_be_packed_leaves_the_next_ones_intact(fields: dict[str, object], error: int) -> None:
    request = Frame(RequestCode.SEND_MESSAGE, 77, {"topic": "t"})
    with pytest.raises(TypeError):
        encode_reply(request, Reply({"bad": [1, {"x": object()}]}))
    reply = Reply(fields, error_code=error, error_text="why" if error else "")
    expected = encode_frame(response_to(request, fields, b"", error, reply.error_text))
    assert encode_reply(request, reply) == expected


async def test_sync_flush_callbacks_of_one_group_share_a_waiter_and_each_is_called_once(tmp_path: Path) -> None:
    """The answers of one append group wait for the same end offset and share one
    waiter: each callback is still called exactly once (True once durable), one that
    raises keeps none of the others from being called, and callbacks for bytes never
    written are all called with False at their deadline, a shorter timeout included."""
    with sync_flush_lane(tmp_path / "s", TOPIC) as (store, lane):
        calls: list[tuple[int, int, bool]] = []  # (put, callback, durable)

        def stored(put: PendingPut, i: int) -> None:
            assert put.result is not None and put.result.ok
            for k in range(3):
                if k == 1 and i % 7 == 0:
                    lane.durable.call_when_durable(put.result.end_offset, 10, _raises)
                lane.durable.call_when_durable(put.result.end_offset, 10, lambda ok, k=k: calls.append((i, k, ok)))

        async with trio.open_nursery() as n:
            n.start_soon(lane.append_loop)
            n.start_soon(lane.durable.timeout_loop)
            puts = [
                lane.submit(TOPIC, pack_messages([Message(TOPIC, 0, b"x%d" % i)]), ("127.0.0.1", 1)) for i in range(60)
            ]
            for i, put in enumerate(puts):
                put.add_done_callback(lambda p, i=i: stored(p, i))
            await await_until(lambda: len(calls) >= 180, 10, "every callback called")
            assert sorted(calls) == [(i, k, True) for i in range(60) for k in range(3)]
            never = store.log.write_offset + (1 << 40)
            lane.durable.call_when_durable(never, 0.3, lambda ok: calls.append((-1, 0, ok)))
            lane.durable.call_when_durable(never, 0.3, lambda ok: calls.append((-1, 1, ok)))
            lane.durable.call_when_durable(never, 0.1, lambda ok: calls.append((-1, 2, ok)))  # sooner: its own
            await await_until(lambda: len(calls) > 180, 10, "the shorter timeout")
            assert calls[180:] == [(-1, 2, False)]
            await await_until(lambda: len(calls) >= 183, 10, "the timeouts")
            assert sorted(calls[181:]) == [(-1, 0, False), (-1, 1, False)] and len(calls) == 183
            n.cancel_scope.cancel()


def _raises(ok: bool) -> None:
    raise RuntimeError("a waiter's bug")

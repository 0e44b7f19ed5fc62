"""Replies ready together go out together: many requests in flight on one connection are
answered with far fewer send calls than replies, every reply matched to its request,
and the bytes of different replies (sendfile spans included) never interleave. A
client that does not read its replies stops the server from reading its requests
(``max_connection_send_buffer_bytes``) instead of making it buffer without bound."""

from __future__ import annotations

import socket
import struct
from pathlib import Path

import msgpack
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from clmq.broker.service import Broker
from clmq.broker.service._append import PendingPut
from clmq.common import Message, decode_records_many, pack_messages
from clmq.protocol import (
    ErrorCode,
    Frame,
    FrameDecoder,
    RequestCode,
    encode_batch,
    encode_frame,
    response_to,
)
from clmq.protocol.transport import Later, Peer, Reply, RpcServer
from clmq.protocol.transport._connection import encode_reply
from clmq.protocol.transport._handler import Deliver
from tests.transport_helpers import broker_with_topic, exchange, sync_flush_lane
from tests.waiting import await_until

# Every test here runs with the compiled record decoder and with its pure-Python fallback.
pytestmark = pytest.mark.usefixtures("each_decoder")

TOPIC = "co"


@pytest.fixture
async def broker(nursery: trio.Nursery, tmp_path: Path) -> Broker:
    return await broker_with_topic(nursery, tmp_path, TOPIC, 2)


def _body(i: int) -> bytes:
    return b"message %06d " % i + bytes([i % 251]) * (i % 97)


def _produce_frame(rid: int, queue_id: int = 0) -> Frame:
    data = encode_batch([Message(TOPIC, queue_id, _body(rid))])
    return Frame(RequestCode.SEND_MESSAGE, rid, {"topic": TOPIC}, data)


def _pull_frame(rid: int, queue_id: int, offset: int, count: int) -> Frame:
    fields = {"topic": TOPIC, "queue_id": queue_id, "offset": offset, "max_messages": count, "max_wait_ms": 10_000}
    return Frame(RequestCode.PULL_MESSAGE, rid, fields)


@pytest.mark.parametrize("flush", ["async", "sync"])
async def test_concurrent_produces_on_one_connection_are_answered_together(
    nursery: trio.Nursery, tmp_path: Path, flush: str
) -> None:
    b = await broker_with_topic(nursery, tmp_path, TOPIC, 2, flush_mode=flush)
    n = 200
    before = (b.rpc.stats.replies, b.rpc.stats.writes)
    replies = await exchange(b.addr, [_produce_frame(rid) for rid in range(1, n + 1)])
    # The broker counts a reply once its write returned: the client may hold the last
    # replies before the broker's task comes back to count them (a loaded CI saw 181 of 200).
    await await_until(lambda: b.rpc.stats.replies - before[0] >= n, 10, f"the broker to count {n} replies written")
    sent, writes = b.rpc.stats.replies - before[0], b.rpc.stats.writes - before[1]
    assert sent == n
    assert writes < sent / 4, (writes, sent)
    assert all(r.error_code == ErrorCode.OK for r in replies.values())
    # Each reply names where its own request's message went: read every one back.
    where = {rid: (r.fields["queue_offsets"][0], r.fields["commitlog_offsets"][0]) for rid, r in replies.items()}
    assert sorted(q for q, _ in where.values()) == list(range(n))
    pulled = await exchange(b.addr, [_pull_frame(1, 0, 0, n)])
    records = decode_records_many(pulled[1].body)
    assert len(records) == n
    assert {r.queue_offset: r.body for r in records} == {where[rid][0]: _body(rid) for rid in replies}
    assert {r.queue_offset: r.commitlog_offset for r in records} == dict(where.values())


async def test_produce_and_sendfile_pull_replies_never_interleave(broker: Broker) -> None:
    """Pull replies carry records by sendfile; produce replies are bytes. Many of both in
    flight on one connection: every reply is whole and is the one its request asked for."""
    stored = 300
    await exchange(
        broker.addr,
        [
            Frame(
                RequestCode.SEND_MESSAGE,
                1,
                {"topic": TOPIC},
                encode_batch([Message(TOPIC, 1, _body(k)) for k in range(stored)]),
            )
        ],
    )
    before = (broker.rpc.stats.replies, broker.rpc.stats.writes)
    frames: list[Frame] = []
    asked: dict[int, list[int]] = {}
    for i in range(150):
        want = 1 + i % 5
        frames.append(_pull_frame(2 * i + 1, 1, i, want))
        asked[2 * i + 1] = [k for k in range(i, min(i + want, stored))]
        frames.append(_produce_frame(2 * i + 2))
    replies = await exchange(broker.addr, frames)
    for rid, offsets in asked.items():
        records = decode_records_many(replies[rid].body)  # CRC-checked: a torn or mixed body fails here
        assert [(r.queue_offset, r.body) for r in records] == [(k, _body(k)) for k in offsets], rid
    produced = sorted(r.fields["queue_offsets"][0] for rid, r in replies.items() if rid not in asked)
    assert produced == list(range(150))
    # (counted once each write returned: the client may read the last ones first)
    await await_until(lambda: broker.rpc.stats.replies - before[0] >= 300, 10, "the broker to count 300 replies")
    assert broker.rpc.stats.replies - before[0] == 300


def _raw_produce(rid: int) -> bytes:
    data = encode_batch([Message(TOPIC, 0, b"x" * 512)])
    return encode_frame(Frame(RequestCode.SEND_MESSAGE, rid, {"topic": TOPIC}, data))


async def test_a_client_that_does_not_read_replies_is_not_read_either(nursery: trio.Nursery, tmp_path: Path) -> None:
    """With replies piling up unread past max_connection_send_buffer_bytes, the broker
    stops reading that connection's requests (so it buffers a bounded amount); once the
    client reads, every request is answered."""
    b = await broker_with_topic(nursery, tmp_path, TOPIC, 1, max_connection_send_buffer_bytes=4096)
    host, port = b.addr.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    sock.setblocking(False)
    frames, pending, stalled = 0, b"", 0
    written_before = b.rpc.stats.replies
    with trio.fail_after(60):
        while stalled < 20:  # the client cannot send for a second: the broker no longer reads
            if not pending:
                frames += 1
                pending = _raw_produce(frames)
            try:
                pending = pending[sock.send(pending) :]
                stalled = 0
            except BlockingIOError:
                stalled += 1
                await trio.sleep(0.05)
        # Without the limit the broker would read (and answer into memory) for ever and the
        # loop would not end; the replies written are what the socket buffers took.
        assert b.rpc.stats.replies - written_before < frames
        sock.setblocking(True)
        async with trio.open_nursery() as both:  # read the replies while the rest is sent
            both.start_soon(trio.to_thread.run_sync, sock.sendall, pending)
            replies = await trio.to_thread.run_sync(_read_replies, sock, frames)
    sock.close()
    assert sorted(rid for rid, _ in replies) == list(range(1, frames + 1))  # each answered once
    assert all(code == ErrorCode.OK for _, code in replies)
    await await_until(lambda: b.rpc.inflight == 0, 10, "every request finished")


def _read_replies(sock: socket.socket, count: int) -> list[tuple[int, int]]:
    """(request id, error code) of ``count`` replies read from ``sock``."""
    out, buf = [], b""
    while len(out) < count:
        while len(buf) < 4 or len(buf) < 4 + struct.unpack_from("<I", buf)[0]:
            chunk = sock.recv(1 << 16)
            assert chunk, "connection closed"
            buf += chunk
        length, header_len = struct.unpack_from("<II", buf)
        header = msgpack.unpackb(buf[8 : 8 + header_len])
        out.append((header["i"], header.get("e", ErrorCode.OK)))
        buf = buf[4 + length :]
    return out


async def test_subscribed_laters_are_answered_without_a_task_each_or_through_finish(nursery: trio.Nursery) -> None:
    """A serial handler's Later with ``subscribe``: replies delivered in bulk by whatever
    completes the work reach their requests; one delivered as None is finished by
    ``finish`` instead; requests still in flight when delivered are all accounted for."""
    pending: list[tuple[int, Deliver]] = []

    async def handler(frame: Frame, peer: Peer) -> Reply | Later:
        n = frame.fields["n"]

        async def finish() -> Reply:
            return Reply({"n": n, "how": "finish"})

        return Later(finish, subscribe=lambda deliver: pending.append((n, deliver)))

    async def completer() -> None:  # as the append lane does: every waiting request at once
        await await_until(lambda: len(pending) >= 100, 10, "100 requests waiting")
        for n, deliver in pending:
            deliver(None if n % 10 == 0 else Reply({"n": n, "how": "bulk"}))

    server = RpcServer("t", {1: handler}, max_frame_bytes=1 << 20, idle_timeout_ms=10_000, serial_codes=frozenset({1}))
    port = await nursery.start(server.serve, "127.0.0.1", 0, nursery)
    nursery.start_soon(completer)
    replies = await exchange(f"127.0.0.1:{port}", [Frame(1, rid, {"n": rid}) for rid in range(1, 101)])
    assert {rid: r.fields["n"] for rid, r in replies.items()} == {rid: rid for rid in range(1, 101)}
    assert {rid for rid, r in replies.items() if r.fields["how"] == "finish"} == set(range(10, 101, 10))
    await await_until(lambda: server.inflight == 0, 10, "every request accounted for")


async def test_sync_flush_waiters_are_released_by_the_group_commits(tmp_path: Path) -> None:
    """DurableWaiters: many answers waiting for their fsync, one store callback at a time;
    each is released once its bytes are durable, and at once (False) if the store failed."""
    with sync_flush_lane(tmp_path / "s", TOPIC) as (store, lane):
        results: list[tuple[int, bool]] = []
        async with trio.open_nursery() as n:
            n.start_soon(lane.append_loop)

            async def one(i: int) -> None:
                put = lane.submit(TOPIC, pack_messages([Message(TOPIC, 0, _body(i))]), ("127.0.0.1", 1))
                await put.done.wait()
                assert put.result is not None and put.result.ok
                results.append((put.result.end_offset, await lane.durable.wait(put.result.end_offset, 10)))

            async with trio.open_nursery() as waiters:
                for i in range(200):
                    waiters.start_soon(one, i)
            assert len(results) == 200 and all(ok for _, ok in results)
            assert store.durable_offset >= max(end for end, _ in results)
            n.cancel_scope.cancel()


async def test_sync_flush_callbacks_are_called_once_durable_or_once_timed_out(tmp_path: Path) -> None:
    """DurableWaiters.call_when_durable (answers without a task each): every callback is
    called exactly once, True once its bytes are durable; one waiting for bytes never
    written is called with False after its timeout (DurableWaiters.timeout_loop), and only then."""
    with sync_flush_lane(tmp_path / "s", TOPIC) as (store, lane):
        calls: list[tuple[int, bool]] = []  # (end offset waited for, durable)
        async with trio.open_nursery() as n:
            n.start_soon(lane.append_loop)
            n.start_soon(lane.durable.timeout_loop)

            def stored(put: PendingPut) -> None:
                assert put.result is not None and put.result.ok
                end = put.result.end_offset
                lane.durable.call_when_durable(end, 10, lambda ok: calls.append((end, ok)))

            for i in range(200):
                lane.submit(TOPIC, pack_messages([Message(TOPIC, 0, _body(i))]), ("127.0.0.1", 1)).add_done_callback(
                    stored
                )
            await await_until(lambda: len(calls) >= 200, 10, "every callback called")
            assert len(calls) == 200 and all(ok for _, ok in calls) and store.durable_offset >= max(e for e, _ in calls)
            never = store.log.write_offset + (1 << 40)  # a real waiter's bytes are written: it waits for the fsync
            lane.durable.call_when_durable(never, 0.2, lambda ok: calls.append((never, ok)))
            assert len(calls) == 200
            await await_until(lambda: len(calls) > 200, 10, "the timeout")
            assert calls[200:] == [(never, False)]
            n.cancel_scope.cancel()


@given(
    code=st.integers(0, 1 << 16),
    rid=st.integers(-(1 << 40), 1 << 40),
    error_code=st.integers(0, 300),
    error_text=st.text(max_size=20),
    body=st.binary(max_size=40),
    fields=st.dictionaries(
        st.text(max_size=8),
        st.one_of(
            st.integers(-(1 << 62), 1 << 62),
            st.booleans(),
            st.lists(st.integers(0, 1 << 40), max_size=4),
            st.text(max_size=8),
        ),
        max_size=4,
    ),
)
def test_a_reply_encoded_without_a_frame_is_the_frame_encoding_byte_for_byte(
    code: int, rid: int, error_code: int, error_text: str, body: bytes, fields: dict[str, object]
) -> None:
    request = Frame(code, rid, {"topic": "t"}, b"x")
    reply = Reply(dict(fields), body, error_code=error_code, error_text=error_text)
    expected = encode_frame(response_to(request, fields, body, error_code, error_text))
    assert encode_reply(request, reply) == expected
    decoder = FrameDecoder()
    decoder.receive_data(expected)
    event = decoder.next_event()
    assert isinstance(event, Frame) and event.is_response and (event.request_id, event.body) == (rid, body)

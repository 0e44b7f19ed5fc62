"""The append lane when its task stops (the broker stops, or a test's broker is torn
down by cancellation): a put it never took, and one submitted after, is answered at once
(STORE_CLOSED), never left waiting. A waiter that cannot be cancelled (the POP
service's CK and ACK writes wait shielded) hung for ever before: the cause of
test_pop_client.py's hot-queue test hanging until pytest's timeout at teardown."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio
import trio.testing

from clmq.broker.service._append import AppendLane
from clmq.broker.store import PutStatus, Store, StoreConfig
from clmq.commitlog import CommitLogConfig, FlushMode
from clmq.common import Message, pack_messages

TOPIC = "lane"


async def test_puts_a_stopped_lane_never_appended_are_answered_at_once(tmp_path: Path) -> None:
    log = CommitLogConfig(flush_mode=FlushMode.ASYNC, segment_bytes=1 << 20, max_message_bytes=4096)
    store = Store.open(StoreConfig(tmp_path / "s", log)).start()
    try:
        store.create_topic(TOPIC, 1)
        lane = AppendLane(store, 1 << 20)

        def put(body: bytes) -> Any:  # the broker's own put (as the POP service's): a group of its own
            messages = [Message(TOPIC, 0, body)]
            return lane.submit(TOPIC, pack_messages(messages), ("127.0.0.1", 1), messages)

        async with trio.open_nursery() as n:
            n.start_soon(lane.append_loop)
            first = put(b"appended")
            with trio.fail_after(10):
                await first.done.wait()
            assert first.result is not None and first.result.ok
            await trio.testing.wait_all_tasks_blocked()  # the lane waits for work
            taken = put(b"taken")  # the lane is woken: it appends this one, then meets the cancel
            queued = put(b"never taken")
            n.cancel_scope.cancel()
        late = put(b"after the stop")
        with trio.CancelScope(shield=True), trio.fail_after(5):  # as the POP service waits
            await queued.done.wait()
            await late.done.wait()
        for p in (queued, late):
            assert p.result is not None and p.result.status is PutStatus.STORE_CLOSED, p.result
        assert taken.result is not None and taken.result.ok
        assert lane.queued_bytes == 0
    finally:
        store.close()

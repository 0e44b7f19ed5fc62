"""Raw POP requests to one broker (the native protocol, as a POP client sends them),
shared by the POP broker tests."""

from __future__ import annotations

from typing import Any

import trio

from clmq.client import Record
from clmq.common import Message
from clmq.protocol import RequestCode, decode_records, encode_batch
from clmq.protocol.transport import RpcError
from tests.waiting import await_until

FAST_POP = {"pop_revive_interval_ms": 20, "pop_checkpoint_interval_ms": 100}


class Popper:
    """POP_MESSAGE, ACK_MESSAGE, CHANGE_INVISIBLE_TIME and friends through an admin's RpcClient."""

    def __init__(self, admin: Any, addr: str) -> None:
        self.admin, self.addr = admin, addr

    async def request(self, code: RequestCode, fields: dict[str, Any], body: bytes = b"") -> Any:
        return await self.admin.rpc.request(self.addr, code, fields, body)

    async def send(self, topic: str, bodies: list[bytes], queue_id: int = 0, tags: str = "") -> None:
        """Send, then wait until the queue shows them (dispatched: a pop can take them)."""
        messages = [Message(topic, queue_id, b, tags) for b in bodies]
        sent = await self.request(RequestCode.SEND_MESSAGE, {"topic": topic}, encode_batch(messages))
        end = sent.fields["queue_offsets"][-1] + 1
        await await_until(lambda: self._shows(topic, queue_id, end), 10, f"{topic}/{queue_id} at {end}")

    async def _shows(self, topic: str, queue_id: int, end: int) -> bool:
        reply = await self.request(RequestCode.QUERY_OFFSETS, {"topic": topic, "queue_id": queue_id})
        return bool(reply.fields["max_offset"] >= end)

    async def pop(
        self, group: str = "g", topic: str = "t", invisible_time_ms: int = 2000, client_id: str = "c1", **more: Any
    ) -> tuple[list[Record], dict[str, Any]]:
        fields = {"group": group, "client_id": client_id, "topic": topic, "invisible_time_ms": invisible_time_ms}
        reply = await self.request(RequestCode.POP_MESSAGE, {**fields, **more})
        records = decode_records(reply.body)
        assert len(records) == reply.fields["count"] == len(reply.fields["handles"])
        return records, dict(reply.fields)

    async def pop_all(self, want: int, timeout_s: float = 10, **more: Any) -> tuple[list[Record], list[str]]:
        """Pop until ``want`` records came (each pop long-polled)."""
        records: list[Record] = []
        handles: list[str] = []
        with trio.fail_after(timeout_s):
            while len(records) < want:
                got, f = await self.pop(max_wait_ms=500, **more)
                records += got
                handles += f["handles"]
        return records, handles

    async def ack(self, handles: list[str], group: str = "g") -> list[str]:
        reply = await self.request(RequestCode.ACK_MESSAGE, {"group": group, "handles": handles})
        results: list[str] = reply.fields["results"]
        return results

    async def change(self, handles: list[str], ms: int, group: str = "g") -> list[list[str]]:
        fields = {"group": group, "handles": handles, "invisible_time_ms": ms}
        results: list[list[str]] = (await self.request(RequestCode.CHANGE_INVISIBLE_TIME, fields)).fields["results"]
        return results

    async def info(self) -> dict[str, Any]:
        return dict((await self.request(RequestCode.BROKER_INFO, {})).fields)

    async def describe(self, group: str = "g") -> dict[str, Any]:
        return dict((await self.request(RequestCode.DESCRIBE_GROUP, {"group": group})).fields)

    async def running(self) -> None:
        """Wait for the POP service to run (a leader's start: checkpoint and replay)."""
        await await_until(self._running, 15, "the POP service to start")

    async def _running(self) -> bool:
        try:
            return int((await self.info())["pop_groups"]) >= 0
        except RpcError:
            return False


def bodies(records: list[Record]) -> list[bytes]:
    return [bytes(r.body) for r in records]


async def pulled(p: Popper, topic: str, queue_id: int = 0, max_messages: int = 100) -> list[Record]:
    """The records of a queue from its start (PULL_MESSAGE)."""
    fields = {"topic": topic, "queue_id": queue_id, "offset": 0, "max_messages": max_messages}
    return decode_records((await p.request(RequestCode.PULL_MESSAGE, fields)).body)

"""Operator requests of the broker beyond topics and offsets: deleting a consumer
group, and a message looked up by its id (its CommitLog offset)."""

from __future__ import annotations

import trio

from clmq.common import CorruptRecordError
from clmq.protocol import ErrorCode, Frame
from clmq.protocol.auth import Operation, ResourceType
from clmq.protocol.transport import Peer, Reply, RequestError, need

from ._context import BrokerContext


class AdminRequests:
    """DELETE_GROUP and GET_MESSAGE (see ``protocol/_codes.py``)."""

    def __init__(self, ctx: BrokerContext) -> None:
        self.ctx = ctx

    async def delete_group(self, frame: Frame, peer: Peer) -> Reply:
        """Drop a group's committed offsets; refused while members are connected (they
        would commit again at once, as Kafka refuses to delete an active group)."""
        group = need(frame.fields, "group", str)
        self.ctx.replica.check_writable()
        members = self.ctx.groups.members(group)
        if members:
            names = ", ".join(m.client_id for m in members[:5])
            raise RequestError(
                ErrorCode.GROUP_ACTIVE,
                f"group {group!r} has {len(members)} member(s) connected ({names}): stop them first",
            )
        if not self.ctx.offsets.of_group(group):
            raise RequestError(ErrorCode.NOT_FOUND, f"group {group!r} does not exist on {self.ctx.config.broker_name}")
        dropped = self.ctx.offsets.drop_group(group)
        self.ctx.metadata.bump()
        return Reply({"queues": dropped})

    async def get_message(self, frame: Frame, peer: Peer) -> Reply:
        """The record at a CommitLog offset (what a message id names), CRC-checked."""
        offset = need(frame.fields, "commitlog_offset", int)
        log = getattr(self.ctx.store, "log", None)
        if log is None:
            raise RequestError(
                ErrorCode.REQUEST_NOT_SUPPORTED,
                f"message ids name CommitLog offsets: this broker runs {self.ctx.config.storage_mode}",
            )

        def record_bytes() -> tuple[str, bytes] | None:
            record = log.read_record(offset)  # CRC-checked: a made-up offset is no record
            return None if record is None else (record.topic, log.read_bytes(offset, record.size))

        try:
            found = await trio.to_thread.run_sync(record_bytes)
        except CorruptRecordError as e:  # not the start of a record (a made-up id), or damage
            raise RequestError(ErrorCode.NOT_FOUND, f"no message starts at CommitLog offset {offset}: {e}") from None
        if found is None:
            raise RequestError(
                ErrorCode.NOT_FOUND, f"CommitLog offset {offset} is not in the log (retention may have removed it)"
            )
        topic, raw = found
        self.ctx.security.check(peer, [(Operation.READ, ResourceType.TOPIC, topic)], "GET_MESSAGE")
        return Reply(body=raw)

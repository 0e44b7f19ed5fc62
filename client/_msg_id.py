"""A message id: ``host:port@HEXOFFSET``, the broker that stored the message and its
CommitLog offset (RocketMQ's offset message id). One place makes it and one reads it:
a send's result, a dead letter, ``clmq consume`` and ``Admin.message_by_id``."""

from __future__ import annotations


def format_msg_id(addr: str, commitlog_offset: int) -> str:
    """The id of the message stored at ``commitlog_offset`` by the broker at ``addr``."""
    return f"{addr}@{commitlog_offset:016X}"


def parse_msg_id(msg_id: str) -> tuple[str, int]:
    """``host:port@HEXOFFSET`` (what a send returns) -> (broker address, CommitLog offset)."""
    addr, sep, hexoff = msg_id.rpartition("@")
    try:
        if not sep or ":" not in addr:
            raise ValueError
        return addr, int(hexoff, 16)
    except ValueError:
        raise ValueError(f"message id {msg_id!r} is not host:port@HEXOFFSET (as a send returns it)") from None

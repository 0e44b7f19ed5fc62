"""What the timer delivers and how: a due scheduled record read back from the log and
turned into the message its real queue gets, appended through the append lane.

A delivery must never stop the deliveries after it: a damaged record, a real queue
that no longer exists, or a message the store refuses as it is are logged, counted in
``undeliverable`` and dropped; a full lane or a failing disk make the batch wait.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import trio

from clmq.broker.store import PutResult, PutStatus, Store
from clmq.common import (
    PROP_REAL_QID,
    PROP_REAL_TAGS,
    PROP_REAL_TOPIC,
    PROP_TIMER_SRC,
    CorruptRecordError,
    InvalidInputError,
    Message,
    Record,
)

from .._append import _BAD_INPUT, BusyError
from .._context import BrokerContext
from .._system_put import put_messages

log = logging.getLogger("clmq.timer")

Due = tuple[int, int, int, int]  # due ms, queue offset, commit-log offset, size
_STORED = (PutStatus.OK, PutStatus.FLUSH_DISK_TIMEOUT)


@dataclass
class TimerStats:
    delivered: int = 0
    cancelled: int = 0
    undeliverable: int = 0  # real topic or queue gone, damaged, or refused by the store


class Delivery:
    """The timer's way into the store (its ``stats`` count what could not be delivered)."""

    def __init__(self, ctx: BrokerContext, store: Store, stats: TimerStats) -> None:
        self.ctx, self.store, self.stats = ctx, store, stats
        self.tick_s = ctx.config.timer_tick_ms / 1000

    def messages(self, todo: list[Due]) -> list[Message]:
        """The deliveries of ``todo`` (in a thread): each record read back from the log."""
        out = []
        for _due, _q, off, size in todo:
            try:
                record = self.store.log.read_record(off, size)
            except CorruptRecordError as e:  # one damaged record must not stop every other delivery
                log.error("timer: the scheduled message at %d is damaged, not delivered: %s", off, e)
                record = None
            msg = None if record is None else self._delivery(record)
            if msg is None:
                self.stats.undeliverable += 1
            else:
                out.append(msg)
        return out

    def _delivery(self, record: Record) -> Message | None:
        """The message the scheduled record stands for, as its real queue gets it."""
        props = dict(record.properties)
        topic, qid = props.pop(PROP_REAL_TOPIC, ""), props.pop(PROP_REAL_QID, "")
        tags = props.pop(PROP_REAL_TAGS, "")
        count = self.ctx.store.topics.queue_count(topic) if topic else None
        if count is None or not qid.isdigit() or int(qid) >= count:
            log.warning(
                "timer: scheduled message at %d is for %s/%s, which does not exist: dropped",
                record.commitlog_offset,
                topic,
                qid,
            )
            return None
        props[PROP_TIMER_SRC] = str(record.commitlog_offset)
        return Message(
            topic,
            int(qid),
            record.body,
            tags,
            record.keys,
            props,
            record.flags,
            record.born_timestamp_ms,
            record.born_host,
            record.reconsume_times,
        )

    async def append(self, messages: list[Message]) -> str | None:
        """Append through the lane; why not, or None once stored. A message the store
        refuses as it is (one that passed the door's checks and still cannot be stored)
        is dropped, logged and counted, never allowed to stop every later delivery."""
        try:
            result = await put_messages(self.ctx, messages)
        except BusyError as e:  # producers filled the lane: the batch waits, nothing is lost
            return str(e)
        except InvalidInputError:
            result = None
        if result is not None and result.status in _STORED:
            return None
        if result is not None and result.status not in _BAD_INPUT:
            return f"{result.status.value}: {result.error}"
        await self._append_one_by_one(messages)
        return None

    async def _append_one_by_one(self, messages: list[Message]) -> None:
        for m in messages:
            while True:  # a full lane or a failing disk waits here: what went before is stored
                try:
                    result = await put_messages(self.ctx, [m])
                except BusyError:
                    await trio.sleep(self.tick_s)
                    continue
                except InvalidInputError as e:
                    result = PutResult(PutStatus.INVALID_MESSAGE, str(e))
                if result.status in _BAD_INPUT:
                    log.error(
                        "timer: a scheduled message for %s/%d cannot be stored (%s: %s): dropped",
                        m.topic,
                        m.queue_id,
                        result.status.value,
                        result.error,
                    )
                    self.stats.undeliverable += 1
                elif result.status not in _STORED:
                    await trio.sleep(self.tick_s)
                    continue
                break

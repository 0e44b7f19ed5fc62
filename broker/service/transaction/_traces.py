"""The trace events of transactions (docs/traces.md), with the broker's
``trace_enabled``: ``committed`` when an END_TRANSACTION commit was stored (the
committed message's id, its queue and offset; the half message's id as
``origin_msg_id``), ``rolled_back`` when a rollback was (an END's, or the checker's
after ``transaction_check_max`` checks; the half message's id). Recorded into the
broker's trace buffer after the records were appended; a trace never fails an end."""

from __future__ import annotations

import logging

from clmq.broker.store import Store
from clmq.common import CorruptRecordError, Record, transaction_event

from .._context import BrokerContext
from .._trace_buffer import UNIQ_KEY
from ._pending import COMMITTED, Ended, Half
from ._polls import wall_ms

log = logging.getLogger("clmq.transactions")


def trace_end(ctx: BrokerContext, half: Half, record: Record | None, ended: Ended, detail: str = "") -> None:
    """Record the end of ``half`` (``record``: the half message as stored, for its keys
    and ``UNIQ_KEY``; None if it could not be read) as ended by ``ended``."""
    tracer = ctx.tracer
    if not tracer.enabled:
        return
    committed = ended.state == COMMITTED
    half_id = f"{ctx.addr()}@{half.offset:016X}"
    msg_id = f"{ctx.addr()}@{ended.commitlog_offset:016X}" if committed and ended.commitlog_offset >= 0 else half_id
    try:
        event = transaction_event(
            committed,
            msg_id,
            wall_ms(),
            topic=half.topic,
            queue_id=ended.queue_id if committed else half.queue_id,
            queue_offset=ended.queue_offset if committed else -1,
            keys=record.keys if record is not None else "",
            uniq_key=record.properties.get(UNIQ_KEY, "") if record is not None else "",
            group=half.group,
            broker=ctx.config.broker_name,
            half_msg_id=half_id,
        )
        tracer.record(event._replace(detail=detail) if detail else event)
    except (ValueError, TypeError) as e:  # a trace never fails the end it describes
        log.warning("transactions: no trace event for the end of %s: %s", half_id, e)


def read_half(store: Store, half: Half) -> Record | None:
    """The half message's record (in a worker thread), None if it cannot be read."""
    try:
        return store.log.read_record(half.offset, half.size)
    except (CorruptRecordError, OSError):
        return None

"""System topics and the message properties that route messages through them.

Names start with ``%`` (RocketMQ's convention), which is a legal topic character, so a
system topic is an ordinary topic of the one CommitLog: replicated, retained and
recovered like any other. ``LIST_TOPICS`` hides them unless asked.

- ``%TIMER%`` (one queue): scheduled messages waiting for their time. Each record's
  tags field holds its delivery time in epoch milliseconds as decimal digits, and the
  dispatcher stores that *number* as the consume-queue entry's tag code (RocketMQ does
  the same for its schedule topic), so the broker's timer builds its wheel from the
  20-byte entries alone, never reading a record until it is due.
  The real topic, queue id and tags travel as properties (``REAL_*``).
- ``%RETRY%<group>`` (one queue): messages the group failed on, redelivered to that
  group only; the original topic is property ``ORIGIN_TOPIC``.
- ``%DLQ%<group>`` (one queue): messages the group failed on ``max_reconsume_times``
  times; nothing consumes them unless someone asks.
"""

from __future__ import annotations

from typing import Final

TIMER_TOPIC: Final = "%TIMER%"
RETRY_PREFIX: Final = "%RETRY%"
DLQ_PREFIX: Final = "%DLQ%"
SYSTEM_PREFIX: Final = "%"

# Properties of a scheduled message (set by the producer, checked by the broker).
PROP_DELIVER_AT: Final = "DELIVER_AT_MS"  # epoch ms, decimal: when to deliver
PROP_REAL_TOPIC: Final = "REAL_TOPIC"  # where to deliver
PROP_REAL_QID: Final = "REAL_QID"  # the queue there (decimal)
PROP_REAL_TAGS: Final = "REAL_TAGS"  # the message's own tags (the timer record's tags hold the time)
PROP_CANCEL_OF: Final = "CANCEL_OF"  # a cancel marker: the commit-log offset of the timer record it cancels
# Properties the broker sets on what the timer delivers, and on retries.
PROP_TIMER_SRC: Final = "TIMER_SRC"  # on a delivered message: its timer record's commit-log offset
PROP_ORIGIN_TOPIC: Final = "ORIGIN_TOPIC"  # on a retry / dead letter: the topic it was first sent to
PROP_ORIGIN_QID: Final = "ORIGIN_QID"
PROP_ORIGIN_OFFSET: Final = "ORIGIN_QUEUE_OFFSET"
PROP_ORIGIN_MSG_ID: Final = "ORIGIN_MSG_ID"  # the first message's id (broker address + commit-log offset)
PROP_ORIGIN_ADDR: Final = "ORIGIN_ADDR"  # the broker that stored the first message
PROP_DLQ_GROUP: Final = "DLQ_GROUP"  # on a dead letter: the group that gave up on it
# On a dead letter too large to copy: the id (broker address + commit-log offset) of the
# record that holds its body, which the dead letter then lacks (resend reads it there).
PROP_DLQ_BODY_OF: Final = "DLQ_BODY_OF"


def retry_topic(group: str) -> str:
    return RETRY_PREFIX + group


def dlq_topic(group: str) -> str:
    return DLQ_PREFIX + group


def is_system_topic(topic: str) -> bool:
    return topic.startswith(SYSTEM_PREFIX)


def timer_tag(deliver_at_ms: int) -> str:
    """The tags of a ``%TIMER%`` record: its delivery time, which the dispatcher turns
    into the entry's tag code (:func:`timer_tag_code`)."""
    return str(deliver_at_ms)


def timer_tag_code(raw: bytes) -> int:
    """A ``%TIMER%`` record's tag code: the delivery time its tags hold (0 if they do
    not hold one: the broker refuses such records, so only a damaged log has them)."""
    return int(raw) if raw.isdigit() and len(raw) <= 15 else 0


# Transactional messages (RocketMQ's model, docs/transactions.md). A half message is
# stored in %TRANS_HALF% (one queue) with its real topic, queue and tags as REAL_*
# properties and its producer group as TRAN_GROUP; nothing consumes it. Ending it writes
# an op record to %TRANS_OP%: queue 0 commit, 1 rollback, 2 a check asked; the op's tags
# hold the half message's commit-log offset as digits (the dispatcher stores that number
# as the entry's tag code, as for %TIMER%), so the pending set is rebuilt from 20-byte
# entries. A commit appends the real message, carrying TRAN_HALF, in the same store call
# as its op record.
TRANS_HALF_TOPIC: Final = "%TRANS_HALF%"
TRANS_OP_TOPIC: Final = "%TRANS_OP%"
TRANS_OP_COMMIT: Final = 0  # %TRANS_OP% queue ids
TRANS_OP_ROLLBACK: Final = 1
TRANS_OP_CHECK: Final = 2
PROP_TRAN_GROUP: Final = "TRAN_GROUP"  # on a half message: the producer group that checks it
PROP_TRAN_HALF: Final = "TRAN_HALF"  # on a committed message: its half message's commit-log offset
# Message traces (docs/traces.md): trace events recorded by clients and brokers.
TRACE_TOPIC: Final = "%TRACE%"
# POP consumption (docs/consuming.md): each pop writes a checkpoint (CK) record and each
# accepted acknowledgement an ACK record into %POP% queue 0 (RocketMQ's revive log); a
# leader's in-flight set is its last checkpoint file plus these records read from it.
POP_TOPIC: Final = "%POP%"


# Messages produced through the Kafka listener (docs/kafka.md): what a clmq record has
# no field of its own for travels in properties under this prefix, which Kafka
# consumers never see as headers. A Kafka key that is UTF-8 text is the record's
# ``keys``; headers whose keys are unique and whose values are UTF-8 text are plain
# properties (so clmq's own consumers see them as such).
KAFKA_PROP_PREFIX: Final = "__kafka."
PROP_KAFKA_KEY_B64: Final = "__kafka.key"  # the key, base64: bytes that are not UTF-8 text, or an empty key
PROP_KAFKA_NULL_VALUE: Final = "__kafka.null"  # "1": the value was null (a tombstone); the body is empty
PROP_KAFKA_HEADERS: Final = "__kafka.headers"  # every header, as JSON [[key, base64 value or null], ...]
PROP_KAFKA_TIMESTAMP: Final = "__kafka.ts"  # the record's timestamp when not a positive ms value (e.g. -1)
PROP_KAFKA_PRODUCER: Final = "__kafka.producer"  # "pid epoch first_seq last_seq" on a batch's first message
HEADER_TAGS: Final = "clmq.tags"  # a Kafka header naming the record's tags (what tag filters match)

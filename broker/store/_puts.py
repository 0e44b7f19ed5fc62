"""The put path of both storage modes: the checks before anything is assigned, the
mode's append (an :class:`Appender`), and the wait for durability after it (whether to
wait: :attr:`CommitLogConfig.acks_wait_for_fsync`, the one place that decides it)."""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

from clmq.commitlog import BatchEncoder
from clmq.common import Message, PackedMessages, PackError, unpack_messages

from ._results import PutResult, PutStatus
from ._state import StoreState
from ._topics import topic_name_error


class Appender(Protocol):
    """A mode's append: all or nothing, in order, the queue offsets assigned."""

    @property
    def checks_fields(self) -> bool:
        """True if :meth:`append` refuses a message with a field of the wrong type or range
        before any side effect, so that a put need not check first (the check costs
        about 0.4 us a message, a sixth of a put)."""
        ...

    def append(self, messages: Sequence[Message]) -> PutResult:
        """Append a checked batch."""
        ...

    def append_packed(self, batches: Sequence[PackedMessages], queue_counts: Sequence[int]) -> PutResult:
        """Append packed batches whose topics were checked (``queue_counts``: each one's)."""
        ...


class PutPath:
    """Puts of a store: checked against the topics and the store's state, appended by
    the mode's :class:`Appender`, settled once durable when they are to wait."""

    def __init__(self, state: StoreState, appender: Appender) -> None:
        self._state = state
        self._appender = appender

    @property
    def append_checks_fields(self) -> bool:
        """See :attr:`Appender.checks_fields`."""
        return self._appender.checks_fields

    def put_batch(self, messages: Sequence[Message], wait_durable: bool | None) -> PutResult:
        """Check, append and settle a batch (see :meth:`StoreBase.put_batch`)."""
        bad = check_batch(self._state, messages, self._appender.checks_fields)
        if bad is not None:
            return bad
        return self.settle(self._appender.append(messages), wait_durable)

    def put_packed(self, batches: Sequence[PackedMessages], wait_durable: bool | None) -> PutResult:
        """Check the topics, append and settle packed batches (see :meth:`StoreBase.put_packed`)."""
        bad = refused(self._state)
        if bad is not None:
            return bad
        counts = []
        for batch in batches:
            count, bad = queue_count(self._state, batch.topic)
            if bad is not None:
                return bad
            counts.append(count)
        return self.settle(self._appender.append_packed(batches, counts), wait_durable)

    def settle(self, result: PutResult, wait_durable: bool | None) -> PutResult:
        """The put's result once it is durable, if it is to wait (``wait_durable``; None:
        as :attr:`CommitLogConfig.acks_wait_for_fsync` says): else FLUSH_DISK_TIMEOUT
        after ``sync_flush_timeout_ms``, or STORE_FAILED when the store failed meanwhile."""
        state = self._state
        if wait_durable is None:
            wait_durable = state.config.commitlog.acks_wait_for_fsync
        if result.ok and wait_durable:
            timeout_ms = state.config.commitlog.sync_flush_timeout_ms
            if not state.durable.wait(result.end_offset, timeout_ms / 1000) and state.failure is not None:
                result.status = PutStatus.STORE_FAILED
                result.error = str(state.failure)
            elif state.durable.value < result.end_offset:
                result.status = PutStatus.FLUSH_DISK_TIMEOUT
                result.error = f"not fsynced within sync_flush_timeout_ms={timeout_ms}"
        return result


def append_unpacked(
    state: StoreState, batches: Sequence[PackedMessages], append: Callable[[Sequence[Message]], PutResult]
) -> PutResult:
    """Packed batches appended through message objects, every field checked first (for
    a mode that cannot append packed bytes as they are); MALFORMED_BATCH if one does
    not unpack."""
    try:
        unpacked = [unpack_messages(batch) for batch in batches]
    except PackError as e:
        return PutResult(PutStatus.MALFORMED_BATCH, str(e))
    messages = [m for ms in unpacked for m in ms]
    bad = check_batch(state, messages, checks_fields=False)
    if bad is not None:
        return bad
    result = append(messages)
    result.batch_sizes = [len(ms) for ms in unpacked]
    return result


def refused(state: StoreState) -> PutResult | None:
    """Why no put can be taken now (closed, failed), or None."""
    if state.closed:
        return PutResult(PutStatus.STORE_CLOSED, "the store is closed")
    failure = state.failure
    if failure is not None:
        return PutResult(PutStatus.STORE_FAILED, str(failure))
    return None


def check_batch(state: StoreState, messages: Sequence[Message], checks_fields: bool) -> PutResult | None:
    """Why this batch cannot be put (closed, failed, empty, a field of the wrong type or
    range, bad topic or queue), or None. Nothing is assigned before this passes.
    ``checks_fields``: the append checks every field itself (see :class:`Appender`)."""
    bad = refused(state)
    if bad is not None:
        return bad
    if not messages:
        return PutResult(PutStatus.INVALID_MESSAGE, "empty batch")
    topics = _topics_of(messages)  # None: a topic that is no str (or no message at all)
    if topics is None or not checks_fields:  # every field, before any queue offset is taken
        invalid = BatchEncoder.batch_error(messages)
        if invalid is not None:
            return PutResult(PutStatus.INVALID_MESSAGE, invalid)
    counts: dict[str, int] = {}
    for topic in topics or ():  # per topic, not per message: the hot path
        counts[topic], bad = queue_count(state, topic)
        if bad is not None:
            return bad
    return _queue_ids_error(messages, counts)


def queue_count(state: StoreState, topic: object) -> tuple[int, PutResult | None]:
    """The topic's queue count (creating the topic when allowed), or why not."""
    error = topic_name_error(topic)
    if error:
        return 0, PutResult(PutStatus.INVALID_TOPIC, error)
    assert isinstance(topic, str)  # topic_name_error refuses anything else
    config, topics = state.config, state.topics
    count = topics.queue_count(topic)
    if count is None:
        if not config.auto_create_topics:
            return 0, PutResult(PutStatus.UNKNOWN_TOPIC, f"topic {topic!r} does not exist")
        topics.create(topic, config.default_queue_count)
        count = config.default_queue_count
    return count, None


def _queue_ids_error(messages: Sequence[Message], counts: dict[str, int]) -> PutResult | None:
    """Why a message's queue id is wrong (no int, or not a queue of its topic), or None."""
    if len(counts) == 1:
        ((_topic, count),) = counts.items()
        qids = [m.queue_id for m in messages]
        if all(type(q) is int for q in qids) and min(qids) >= 0 and max(qids) < count:
            return None
    for i, m in enumerate(messages):
        count = counts[m.topic]
        if type(m.queue_id) is not int:  # a bool, a float...: the field is wrong, not the queue
            return PutResult(PutStatus.INVALID_MESSAGE, BatchEncoder.batch_error(messages) or f"message {i}")
        if not 0 <= m.queue_id < count:
            return PutResult(
                PutStatus.INVALID_QUEUE_ID, f"queue id {m.queue_id} not in 0..{count - 1} of topic {m.topic!r}"
            )
    return None


def _topics_of(messages: Sequence[Message]) -> set[str] | None:
    """The topics of a batch, or None if one is no string (unhashable, or no message)."""
    try:
        topics = {m.topic for m in messages}
    except (TypeError, AttributeError):
        return None
    return topics if all(type(t) is str for t in topics) else None

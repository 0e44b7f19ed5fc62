"""Transactional messages, the producer's side (RocketMQ's model, docs/transactions.md).

:meth:`Producer.send_in_transaction` sends a *half* message: a SEND_MESSAGE to the
``%TRANS_HALF%`` topic of the broker that holds the real queue, picked as for a plain
send, with the real topic, queue and tags and the producer's ``transaction_group`` as
properties (the wire contract: END_TRANSACTION in ``protocol/_codes.py``). The broker
stores it and shows it to nobody. Then the local transaction runs (``execute``, or the
producer's :class:`TransactionListener`), and its answer ends the half message there:
COMMIT makes the message visible once in its real queue, ROLLBACK drops it, UNKNOWN
sends nothing, and the broker asks a live producer of the group later (the check-back,
``_checkback``). The steps are separate functions so that the asyncio and blocking
producers can run the local transaction on their own side (their loop, their thread).
"""

from __future__ import annotations

import enum
import inspect
import logging
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Protocol, TypedDict, runtime_checkable

import trio

from clmq.common import (
    MAX_TAGS_BYTES,
    PROP_REAL_QID,
    PROP_REAL_TAGS,
    PROP_REAL_TOPIC,
    PROP_TRAN_GROUP,
    TRANS_HALF_TOPIC,
    Message,
    PackError,
    Record,
    encode_properties,
    pack_parts,
)
from clmq.protocol import ErrorCode, Frame, RequestCode
from clmq.protocol.transport import ConnectionFailed, RpcClient, RpcError

from .._msg_id import format_msg_id
from .._routes import MessageQueue, NoRouteError, Routes
from ._encode import MessageIds
from ._future import UNIQ_KEY, SendResult
from ._transaction_batches import SendAlone, half_batches
from ._tries import RETRIABLE, NotLeader, QueueSelector, RetryPolicy, Targets, Tries

log = logging.getLogger("clmq.producer")

END_RETRY_DELAY_MS = 100  # at least this pause before an END_TRANSACTION is tried again


class LocalTransactionState(str, enum.Enum):
    """What a local transaction decided (RocketMQ's ``LocalTransactionState``)."""

    COMMIT = "commit"  # the message becomes visible, once, in its real queue
    ROLLBACK = "rollback"  # the message is dropped
    UNKNOWN = "unknown"  # nothing is sent: the broker asks a producer of the group again later


@runtime_checkable
class TransactionListener(Protocol):
    """The producer's local transactions (RocketMQ's ``TransactionListener``). Either
    method may be a plain function or a coroutine function (on the asyncio producer,
    an asyncio one; on the blocking producer, plain, called in a worker thread for
    checks). An exception, a result that is not a :class:`LocalTransactionState`, or a
    check slower than ``transaction_check_timeout_ms`` counts as UNKNOWN (logged)."""

    def execute_local_transaction(self, message: Message, arg: Any) -> Any:
        """Run the local transaction of the half message just stored; return its state."""

    def check_local_transaction(self, message: Record) -> Any:
        """What became of the transaction of ``message`` (a half message the broker
        asks about, shown with its real topic, queue id and tags); return its state."""


Execute = Callable[[Message, Any], Any]  # execute(message, arg) -> state (or an awaitable of one)


class TransactionSend(TypedDict, total=False):
    """The keyword arguments of :meth:`Producer.send_in_transaction`."""

    tags: str
    keys: str
    properties: Mapping[str, str] | None
    sharding_key: str | None
    selector: QueueSelector | None
    arg: Any
    execute: Execute | None


@dataclass(frozen=True)
class HalfMessage:
    """A half message stored: the real queue it is for and where the half copy is."""

    queue: MessageQueue  # the real queue (its broker holds the half copy)
    commitlog_offset: int  # the half copy's, in that broker group's CommitLog
    message: Message  # as sent: real topic, tags, keys, properties (with UNIQ_KEY), body

    @property
    def msg_id(self) -> str:
        """The half message's id (END_TRANSACTION and ``clmq transaction show`` take it)."""
        return format_msg_id(self.queue.addr, self.commitlog_offset)


@dataclass(frozen=True)
class TransactionResult:
    """What :meth:`Producer.send_in_transaction` did. ``outcome`` is the broker's answer
    to END_TRANSACTION ("committed", "rolled_back", "already_committed",
    "already_rolled_back"), "" when none was sent (UNKNOWN) or it failed (``error``):
    in both cases the broker checks back with a producer of the group later."""

    half_msg_id: str
    state: LocalTransactionState  # what the local transaction decided
    queue: MessageQueue  # the real queue
    uniq_key: str  # the message's UNIQ_KEY ("" without unique_ids)
    outcome: str = ""
    msg_id: str = ""  # once committed: the message in its real queue
    queue_offset: int = -1  # once committed: its offset there
    error: str = ""  # END_TRANSACTION could not be delivered

    @property
    def committed(self) -> bool:
        return self.outcome in ("committed", "already_committed")

    @property
    def rolled_back(self) -> bool:
        return self.outcome in ("rolled_back", "already_rolled_back")


class _Options(Protocol):
    @property
    def transaction_group(self) -> str | None: ...

    @property
    def send_timeout_ms(self) -> int: ...


class TransactionalProducer(Protocol):
    """What the transaction steps use of a :class:`Producer`."""

    rpc: RpcClient
    routes: Routes
    targets: Targets
    policy: RetryPolicy
    ids: MessageIds

    @property
    def options(self) -> _Options: ...

    async def send_to(self, mq: MessageQueue, body: bytes, count: int, *, dedup: bool = False) -> SendResult: ...


_RESERVED = frozenset({PROP_REAL_TOPIC, PROP_REAL_QID, PROP_REAL_TAGS, PROP_TRAN_GROUP})


def encode_half(msg: Message, real: MessageQueue, group: str) -> bytes:
    """The SEND_MESSAGE body of ``msg`` as a half message for queue ``real`` of group
    ``group``: REAL_TOPIC, REAL_QID, REAL_TAGS and TRAN_GROUP first, then the message's
    own properties (a user property of a reserved name is left out). The half record
    has no tags of its own: they travel as REAL_TAGS (the committed message's tags)."""
    own = msg.properties
    if own and not _RESERVED.isdisjoint(own):
        own = {k: v for k, v in own.items() if k not in _RESERVED}
    tags = msg.tags.encode()
    if len(tags) > MAX_TAGS_BYTES:
        raise PackError(f"tags of {len(tags)} bytes: at most {MAX_TAGS_BYTES}")
    lead = {PROP_REAL_TOPIC: real.topic, PROP_REAL_QID: str(real.queue_id), PROP_REAL_TAGS: msg.tags}
    props = encode_properties({**lead, PROP_TRAN_GROUP: group, **own})
    return b"".join(pack_parts(0, msg.flags, msg.born_timestamp_ms, b"", msg.keys.encode(), props, msg.body))


def group_of(producer: TransactionalProducer) -> str:
    """The producer's transaction group; a ValueError without one."""
    group = producer.options.transaction_group
    if not group:
        raise ValueError("send_in_transaction needs the producer's transaction_group (open it with one)")
    return group


async def send_half(
    producer: TransactionalProducer,
    topic: str,
    body: bytes,
    *,
    tags: str = "",
    keys: str = "",
    properties: Mapping[str, str] | None = None,
    sharding_key: str | None = None,
    selector: QueueSelector | None = None,
) -> HalfMessage:
    """Store ``body`` as a half message for a queue of ``topic`` picked as for a plain
    send (in one request with other half messages to that broker, ``_transaction_batches``),
    retried as a plain send is (same queue after an unknown outcome, with dedup).
    Raises :class:`SendError` when it could not be stored (nothing to end then)."""
    group = group_of(producer)
    msg, _uniq, _plain = producer.ids.message(topic, body, tags, keys, properties)
    tries, alone = Tries(producer.policy, time.monotonic()), False
    while tries.more():
        real = await producer.targets.target(topic, msg, sharding_key, selector, tries)
        if real is not None:
            msg.queue_id = real.queue_id
            half = MessageQueue(TRANS_HALF_TOPIC, real.broker_name, 0, real.addr)
            encoded = encode_half(msg, real, group)
            try:
                if alone or tries.dedup:  # a retry goes alone, marked dedup after an unknown outcome
                    offset = (await producer.send_to(half, encoded, 1, dedup=tries.dedup)).commitlog_offsets[0]
                else:
                    offset = await half_batches(producer).send(half, encoded)
                return HalfMessage(real, offset, msg)
            except SendAlone:
                alone = True  # a request of several was refused: this one alone, at once
                continue
            except (RpcError, ConnectionFailed, trio.TooSlowError) as e:
                producer.targets.failed(real, e, tries)  # raises SendError for an error not worth another try
        await trio.sleep(tries.delay())
    raise tries.error(topic)


def as_state(value: Any, what: str) -> LocalTransactionState:
    """``value`` as a state: a :class:`LocalTransactionState` or its name/value
    ("commit", "COMMIT", ...); anything else is UNKNOWN, logged."""
    if isinstance(value, LocalTransactionState):
        return value
    if isinstance(value, str):
        for state in LocalTransactionState:
            if value.lower() == state.value:
                return state
    log.warning("%s returned %r, not a LocalTransactionState: UNKNOWN (the broker will check back)", what, value)
    return LocalTransactionState.UNKNOWN


async def decide(fn: Callable[..., Any], *args: Any, what: str = "the local transaction") -> LocalTransactionState:
    """Call ``fn(*args)`` (awaiting its result if it is awaitable) in the caller's event
    loop; an exception is UNKNOWN, logged with its stack."""
    try:
        value = fn(*args)
        if inspect.isawaitable(value):
            value = await value
    except Exception:
        log.exception("%s raised: UNKNOWN (the broker will check back)", what)
        return LocalTransactionState.UNKNOWN
    return as_state(value, what)


def decide_sync(fn: Callable[..., Any], *args: Any, what: str = "the local transaction") -> LocalTransactionState:
    """:func:`decide` for a plain function (the blocking producer, a worker thread)."""
    try:
        value = fn(*args)
    except Exception:
        log.exception("%s raised: UNKNOWN (the broker will check back)", what)
        return LocalTransactionState.UNKNOWN
    if inspect.isawaitable(value):
        log.warning("%s returned an awaitable where a plain state was expected: UNKNOWN", what)
        if inspect.iscoroutine(value):
            value.close()
        return LocalTransactionState.UNKNOWN
    return as_state(value, what)


async def end_transaction(
    producer: TransactionalProducer,
    queue: MessageQueue,
    commitlog_offset: int,
    state: LocalTransactionState,
    *,
    from_check: bool = False,
    addr: str = "",
) -> dict[str, Any]:
    """END_TRANSACTION(commit|rollback) of the half message at ``commitlog_offset`` in
    ``queue``'s broker group (at ``addr``, default ``queue.addr``); the answer's fields.
    A retriable answer (SYSTEM_BUSY: a broker starting its transactions, ...), an
    unreachable or silent broker: tried again within the producer's retry policy (after
    NOT_LEADER or a broken connection, at the leader the answer or fresh routes name);
    then the last error is raised (RpcError, ConnectionFailed, trio.TooSlowError): the
    broker checks back."""
    fields = {
        "group": group_of(producer),
        "commitlog_offset": commitlog_offset,
        "action": "commit" if state is LocalTransactionState.COMMIT else "rollback",
        "from_check": from_check,
    }
    addr = addr or queue.addr
    tries = Tries(producer.policy, time.monotonic())
    while True:
        try:
            reply = await producer.rpc.request(
                addr, RequestCode.END_TRANSACTION, fields, timeout_ms=producer.options.send_timeout_ms, check=False
            )
            error = reply_error(addr, reply)
            if error is None:
                return dict(reply.fields)
            if error.code not in RETRIABLE or not tries.more():
                raise error
            tries.note(str(error), error.code)
            if error.code == ErrorCode.NOT_LEADER:
                addr = (error.leader_addr if isinstance(error, NotLeader) else "") or await _leader(producer, queue)
        except (ConnectionFailed, trio.TooSlowError) as e:
            if not tries.more():
                raise
            tries.note(f"{addr}: {e or 'timed out'}", None)
            addr = await _leader(producer, queue)
        await trio.sleep(max(tries.delay(), END_RETRY_DELAY_MS / 1000))


def reply_error(addr: str, reply: Frame) -> RpcError | None:
    """The error an END_TRANSACTION answer carries (NOT_LEADER as :class:`NotLeader`)."""
    if not reply.error_code:
        return None
    if reply.error_code == ErrorCode.NOT_LEADER:
        leader = reply.fields.get("leader_addr")
        return NotLeader(addr, reply.error_code, reply.error_text, leader if isinstance(leader, str) else "")
    return RpcError(addr, reply.error_code, reply.error_text)


async def _leader(producer: TransactionalProducer, queue: MessageQueue) -> str:
    """The current leader of ``queue``'s broker group, from fresh routes (its address
    as known if the routes do not name the group)."""
    try:
        mqs = await producer.routes.queues(queue.topic, refresh=True)
    except NoRouteError:
        return queue.addr
    return next((mq.addr for mq in mqs if mq.broker_name == queue.broker_name), queue.addr)


async def finish(producer: TransactionalProducer, half: HalfMessage, state: LocalTransactionState) -> TransactionResult:
    """End ``half`` as ``state`` decided (UNKNOWN: nothing is sent); a failure to deliver
    the end is the result's ``error`` (the broker checks back), never raised."""
    result = TransactionResult(half.msg_id, state, half.queue, half.message.properties.get(UNIQ_KEY, ""))
    if state is LocalTransactionState.UNKNOWN:
        return result
    try:
        f = await end_transaction(producer, half.queue, half.commitlog_offset, state)
    except (RpcError, ConnectionFailed, trio.TooSlowError) as e:
        log.warning("ending transaction %s (%s) failed: %s; the broker will check back", half.msg_id, state.value, e)
        return replace(result, error=str(e) or "timed out")
    queue = half.queue if "queue_id" not in f else half.queue._replace(queue_id=int(f["queue_id"]))
    return replace(
        result,
        queue=queue,
        outcome=str(f.get("state", "")),
        msg_id=str(f.get("msg_id", "")),
        queue_offset=int(f.get("queue_offset", -1)),
    )


async def send_in_transaction(
    producer: TransactionalProducer,
    listener: TransactionListener | None,
    topic: str,
    body: bytes,
    **how: Any,
) -> TransactionResult:
    """:meth:`Producer.send_in_transaction` for trio: half message, local transaction
    (``execute``, else ``listener.execute_local_transaction``), end."""
    arg, execute = how.pop("arg", None), how.pop("execute", None) or executor(listener)
    half = await send_half(producer, topic, body, **how)
    state = await decide(execute, half.message, arg)
    return await finish(producer, half, state)


def executor(listener: TransactionListener | None) -> Execute:
    """The listener's ``execute_local_transaction``; a ValueError without one."""
    if listener is None:
        raise ValueError("send_in_transaction needs execute= or the producer's transaction_listener")
    return listener.execute_local_transaction


def check_wrapped(listener: Any) -> None:
    """A ValueError unless ``listener`` has both methods of :class:`TransactionListener`."""
    if not isinstance(listener, TransactionListener):
        raise ValueError(
            f"transaction_listener={listener!r}: must have execute_local_transaction and check_local_transaction"
        )


__all__ = [
    "HalfMessage",
    "LocalTransactionState",
    "TransactionListener",
    "TransactionResult",
    "TransactionSend",
]

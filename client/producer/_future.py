"""What the producer's ``submit`` gives back: a :class:`SendFuture`, resolved once the
broker answered the message's batch (or the producer gave up on it); and the producer's
result and error types."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import trio

from clmq.common import ClientError

from .._msg_id import format_msg_id
from .._routes import MessageQueue

log = logging.getLogger("clmq.producer")

UNIQ_KEY = "UNIQ_KEY"  # the message property naming a message uniquely (RocketMQ's name)


class SendError(ClientError):
    """A send that failed for good (after retries, or not retriable)."""

    def __init__(self, text: str, code: int | None = None) -> None:
        super().__init__(text)
        self.code = code


class BufferFullError(SendError):
    """The producer's buffer (``buffer_max_bytes``) had no room for the message: at once
    with ``buffer_full="raise"``, else after ``buffer_block_max_ms``."""


class BatchTooLargeError(SendError):
    """One batch larger than the producer's ``buffer_max_bytes`` or the transport's
    frame limit: it could never be sent."""


@dataclass(frozen=True)
class SendResult:
    queue: MessageQueue
    queue_offsets: list[int]
    commitlog_offsets: list[int]
    durable: bool  # fsynced before the answer (always, with sync flush, unless flush_timeout)
    flush_timeout: bool = False  # stored, but the broker's fsync did not finish in time
    duplicate: bool = False  # a retry the broker found stored already (by UNIQ_KEY): these are the first try's offsets
    uniq_keys: tuple[str, ...] = ()  # the messages' UNIQ_KEY properties, in order (empty without unique_ids)

    @property
    def queue_offset(self) -> int:
        return self.queue_offsets[0]

    @property
    def msg_ids(self) -> list[str]:
        """Broker address and commit-log offset: where the message can be found."""
        return [format_msg_id(self.queue.addr, o) for o in self.commitlog_offsets]


class Answer(NamedTuple):
    """The broker's answer for one batch: the request's offsets (not sliced per batch:
    most batches' futures never build a result), the batch's from ``base`` on."""

    queue: MessageQueue
    queue_offsets: list[int]
    commitlog_offsets: list[int]
    durable: bool
    flush_timeout: bool
    duplicate: bool
    base: int = 0  # the batch's first message in the offsets


DoneCallback = Callable[["SendFuture"], object]


class SendFuture:
    """The outcome of one ``submit`` (one message) or ``submit_batch`` (one batch).

    Resolved by the producer on its trio thread: ``done()``, ``result()`` (the
    :class:`SendResult`; raises the :class:`SendError` if it failed, RuntimeError if not
    done), ``exception()``, ``await wait()``, ``add_done_callback(fn)`` (``fn(future)``
    on the producer's thread once done; at once if done already). The result is built
    when first asked for: a fire-and-forget producer does not pay for it.
    """

    # Class-level defaults, no __init__: a producer makes one future per message, and
    # an instance that sets nothing until it is resolved costs a third as much to make.
    _answer: Answer | None = None
    _keys: Sequence[str] = ()
    _start = 0
    _count = 0
    _result: SendResult | None = None
    _error: SendError | None = None
    _callbacks: list[DoneCallback] | None = None
    _event: trio.Event | None = None

    def done(self) -> bool:
        return self._answer is not None or self._error is not None

    def result(self) -> SendResult:
        """The result; raises the :class:`SendError` if the send failed."""
        if self._error is not None:
            raise self._error
        if self._result is None:
            answer = self._answer
            if answer is None:
                raise RuntimeError("the send is not done yet: await wait() or add a done callback")
            s, e = self._start, self._start + self._count
            b = answer.base
            self._result = SendResult(
                answer.queue,
                answer.queue_offsets[b + s : b + e],
                answer.commitlog_offsets[b + s : b + e],
                answer.durable,
                answer.flush_timeout,
                answer.duplicate,
                tuple(self._keys[s:e]),
            )
        return self._result

    def exception(self) -> SendError | None:
        """The error if the send failed, None if it succeeded; RuntimeError if not done."""
        if not self.done():
            raise RuntimeError("the send is not done yet: await wait() or add a done callback")
        return self._error

    async def wait(self) -> SendResult:
        """Wait until done; the result, or raises the :class:`SendError`."""
        if not self.done():
            if self._event is None:
                self._event = trio.Event()
            await self._event.wait()
        return self.result()

    def add_done_callback(self, fn: DoneCallback) -> None:
        """Call ``fn(self)`` once done (at once if done already)."""
        if self.done():
            _call(fn, self)
        elif self._callbacks is None:
            self._callbacks = [fn]
        else:
            self._callbacks.append(fn)

    def _resolve(self, answer: Answer, keys: Sequence[str], start: int, count: int) -> None:
        """Answered: its messages are slice ``start``.. of ``answer`` (and of ``keys``,
        the batch's UNIQ_KEYs: empty without unique ids)."""
        if self._answer is not None or self._error is not None:
            return
        self._answer, self._keys, self._start, self._count = answer, keys, start, count
        if self._event is not None or self._callbacks is not None:
            self._finish()

    def _fail(self, error: SendError) -> None:
        if self.done():
            return
        self._error = error
        self._finish()

    def _finish(self) -> None:
        if self._event is not None:
            self._event.set()
        if self._callbacks is not None:
            callbacks, self._callbacks = self._callbacks, None
            for fn in callbacks:
                _call(fn, self)


def resolve_each(futures: list[SendFuture], answer: Answer, keys: Sequence[str]) -> None:
    """A batch of single messages answered: future ``i`` is message ``i`` (one loop, no
    call per future unless someone waits on it)."""
    for i, fut in enumerate(futures):
        if fut._answer is None and fut._error is None:
            fut._answer, fut._keys, fut._start, fut._count = answer, keys, i, 1
            if fut._event is not None or fut._callbacks is not None:
                fut._finish()


def _call(fn: DoneCallback, fut: SendFuture) -> None:
    try:
        fn(fut)
    except Exception:  # a user's callback must not break the producer
        log.exception("a send's done callback raised")

"""What the producer's ``submit`` gives back: a :class:`SendFuture`, resolved once the
broker answered the message's batch (or the producer gave up on it); and the producer's
result and error types."""

from __future__ import annotations

import functools
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

    # What ``SendFutures`` asks of the future of several of its messages (``_span``'s
    # ``SpanFuture`` answers it for messages of many queues).
    def _outcome(self, k: int) -> SendOutcome:
        """Message ``k`` of this (done) future's messages: its result or its error."""
        if self._error is not None:
            return self._error
        return _one(self.result(), k)

    def _message(self, k: int) -> SendFuture:
        """Message ``k``'s own future (made anew)."""
        view = SendFuture()
        if self.done():
            _copy(self, view, k)
        else:
            self.add_done_callback(functools.partial(_into, view, k))
        return view

    def _failed_count(self, count: int) -> int:
        """How many of its ``count`` messages failed so far."""
        return count if self._error is not None else 0

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


def resolve_runs(futures: list[SendFuture], starts: list[int], answer: Answer, keys: Sequence[str], count: int) -> None:
    """A batch of ``submit_many`` runs answered: future ``i`` is messages
    ``starts[i]`` up to ``starts[i + 1]`` (the last: up to ``count``)."""
    ends = [*starts[1:], count]
    for fut, start, end in zip(futures, starts, ends, strict=True):
        fut._resolve(answer, keys, start, end - start)


def _call(fn: DoneCallback, fut: SendFuture) -> None:
    try:
        fn(fut)
    except Exception:  # a user's callback must not break the producer
        log.exception("a send's done callback raised")


SendOutcome = SendResult | SendError


class SendFutures(Sequence[SendFuture]):
    """What ``submit_many`` gives back: message ``i``'s :class:`SendFuture` at ``[i]``
    (made when first asked for), and the call as a whole: ``done()`` once every message
    is, ``await wait()`` and ``result()``: each message's :class:`SendResult` or
    :class:`SendError`, in order (a failed message is a result, never raised);
    ``exception()`` is always None once done; ``add_done_callback(fn)``: ``fn(self)``
    once all are done; ``failed()`` counts the failed messages.

    Inside, one future per batch (the messages of the call sent together to one queue,
    ``parts``: their indices in the call) and the errors of messages that were never
    buffered: a message costs no object of its own until someone asks for it."""

    def __init__(self, count: int = 0) -> None:
        self.total = count
        self.parts: list[tuple[range, SendFuture]] = []  # a batch's messages and its future
        self.refused: dict[int, SendError] = {}  # messages never buffered, and why
        self._views: dict[int, SendFuture] | None = None

    def __len__(self) -> int:
        return self.total

    def __getitem__(self, i: int) -> SendFuture:  # type: ignore[override]
        if not isinstance(i, int):
            raise TypeError("SendFutures takes an int index")
        if i < 0:
            i += self.total
        if not 0 <= i < self.total:
            raise IndexError(f"message {i} of {self.total}")
        views = self._views
        if views is None:
            views = self._views = {}
        view = views.get(i)
        if view is None:
            view = views[i] = self._view(i)
        return view

    def _view(self, i: int) -> SendFuture:
        error = self.refused.get(i)
        if error is not None:
            return failed_future(error)
        for run, fut in self.parts:
            if i in run:
                return fut._message(run.index(i))
        raise IndexError(f"message {i}: not submitted")  # not reached: every message is in one

    def refuse(self, indices: Sequence[int] | range, error: SendError) -> None:
        """These messages were never buffered: ``error`` is their outcome."""
        for i in indices:
            self.refused[i] = error

    def done(self) -> bool:
        return all(f.done() for _r, f in self.parts)

    def failed(self) -> int:
        """Messages failed so far."""
        return len(self.refused) + sum(f._failed_count(len(run)) for run, f in self.parts)

    def result(self) -> list[SendOutcome]:
        """Each message's result or error, in order; RuntimeError if one is not done."""
        out: list[SendOutcome | None] = [None for _ in range(self.total)]
        for i, error in self.refused.items():
            out[i] = error
        for run, fut in self.parts:
            if not fut.done():
                raise RuntimeError("the sends are not done yet: await wait() or add a done callback")
            outcome = fut._outcome
            for k, i in enumerate(run):
                out[i] = outcome(k)
        return out  # type: ignore[return-value]  # every slot set: each message is refused or in a part

    def exception(self) -> None:
        """None: the call as a whole never fails (see :meth:`result`); RuntimeError if not done."""
        if not self.done():
            raise RuntimeError("the sends are not done yet: await wait() or add a done callback")

    async def wait(self) -> list[SendOutcome]:
        """Wait until every message is done; :meth:`result`."""
        for _run, f in self.parts:
            if not f.done():
                if f._event is None:
                    f._event = trio.Event()
                await f._event.wait()
        return self.result()

    def add_done_callback(self, fn: Callable[[SendFutures], object]) -> None:
        """Call ``fn(self)`` once every message is done (at once if they are)."""
        pending = [f for _r, f in self.parts if not f.done()]
        if not pending:
            _call_many(fn, self)
            return
        left = [len(pending)]

        def one_done(_f: SendFuture) -> None:
            left[0] -= 1
            if left[0] == 0:
                _call_many(fn, self)

        for f in pending:
            f.add_done_callback(one_done)


def _one(whole: SendResult, k: int) -> SendResult:
    """Message ``k`` of a batch's result."""
    coffs = whole.commitlog_offsets
    return SendResult(
        whole.queue,
        whole.queue_offsets[k : k + 1],
        coffs[k : k + 1],
        whole.durable,
        whole.flush_timeout,
        whole.duplicate,
        whole.uniq_keys[k : k + 1],
    )


def _into(view: SendFuture, k: int, batch: SendFuture) -> None:
    _copy(batch, view, k)


def _copy(batch: SendFuture, view: SendFuture, k: int) -> None:
    """Message ``k`` of a done batch future, into its own future (resolved or failed)."""
    if batch._error is not None:
        view._fail(batch._error)
        return
    answer = batch._answer
    assert answer is not None
    view._resolve(answer, batch._keys, batch._start + k, 1)


def failed_future(error: SendError) -> SendFuture:
    """A future failed at once (a message ``submit_many`` could not buffer)."""
    fut = SendFuture()
    fut._error = error
    return fut


def _call_many(fn: Callable[[SendFutures], object], futs: SendFutures) -> None:
    try:
        fn(futs)
    except Exception:  # a user's callback must not break the producer
        log.exception("a submit_many done callback raised")

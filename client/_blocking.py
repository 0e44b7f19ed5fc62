"""Blocking facades for plain synchronous Python: the trio clients run in a
background thread with their own event loop; each call waits for its result."""

from __future__ import annotations

import concurrent.futures
import functools
import queue
import threading
from contextlib import AbstractAsyncContextManager
from typing import Any, Awaitable, Callable, TypeVar

import trio

from commitlog import Record

from ._admin import Admin, open_admin
from ._consumer import Consumer, open_consumer
from ._fetcher import DamagedQueueError
from ._producer import Producer, SendResult, open_producer
from ._routes import MessageQueue

T = TypeVar("T")


class _Portal:
    """A trio event loop in a daemon thread, holding one async context open."""

    def __init__(self, context: Callable[[], AbstractAsyncContextManager[Any]]) -> None:
        self._ready: queue.Queue[tuple[Any, BaseException | None]] = queue.Queue()
        self._stop: trio.Event | None = None
        self._thread = threading.Thread(target=trio.run, args=(self._main, context), daemon=True, name="clmq-client")
        self._thread.start()
        value, error = self._ready.get()
        if error is not None:
            self._thread.join()
            raise error
        self.value = value

    async def _main(self, context: Callable[[], AbstractAsyncContextManager[Any]]) -> None:
        self.token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        try:
            async with context() as value:
                self._ready.put((value, None))
                await self._stop.wait()
        except BaseException as e:
            if self._ready.empty():
                self._ready.put((None, e))
            else:
                raise

    def run(self, fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        return trio.from_thread.run(functools.partial(fn, *args, **kwargs), trio_token=self.token)

    def close(self) -> None:
        if self._thread.is_alive() and self._stop is not None:
            trio.from_thread.run_sync(self._stop.set, trio_token=self.token)
            self._thread.join()


SendCallback = Callable[["concurrent.futures.Future[SendResult]"], object]


def _settle(out: concurrent.futures.Future[SendResult], fut: Any) -> None:
    """Copy a ``SendFuture``'s outcome to a ``concurrent.futures.Future``."""
    error = fut.exception()
    if error is not None:
        out.set_exception(error)
    else:
        out.set_result(fut.result())


class BlockingProducer:
    """``BlockingProducer(["127.0.0.1:9876"]).send("topic", b"body")``; see :class:`Producer`
    (every keyword argument is one of its options, e.g. ``linger_ms``)."""

    def __init__(self, namesrv_addrs: list[str] | None = None, **kwargs: Any) -> None:
        self._portal = _Portal(lambda: open_producer(namesrv_addrs, **kwargs))
        self.producer: Producer = self._portal.value

    def send(self, topic: str, body: bytes, **kwargs: Any) -> SendResult:
        return self._portal.run(self.producer.send, topic, body, **kwargs)

    def send_batch(self, topic: str, messages: list[Any], **kwargs: Any) -> SendResult:
        return self._portal.run(self.producer.send_batch, topic, messages, **kwargs)

    def send_oneway(self, topic: str, body: bytes, **kwargs: Any) -> None:
        self._portal.run(self.producer.send_oneway, topic, body, **kwargs)

    def submit(self, topic: str, body: bytes, *, callback: SendCallback | None = None,
               **kwargs: Any) -> concurrent.futures.Future[SendResult]:  # fmt: skip
        """:meth:`Producer.submit`: returns once the message is buffered (blocking only
        for buffer room). The future's ``result(timeout)`` is the :class:`SendResult`
        or raises :class:`SendError`. ``callback(future)`` and the future's done
        callbacks run on the client's thread: keep them short and do not call this
        producer from them (it would wait for itself)."""
        return self._submit(self.producer.submit, topic, body, callback, kwargs)

    def submit_batch(self, topic: str, messages: list[Any], *, callback: SendCallback | None = None,
                     **kwargs: Any) -> concurrent.futures.Future[SendResult]:  # fmt: skip
        """:meth:`Producer.submit_batch`: :meth:`submit` for a batch to one queue."""
        return self._submit(self.producer.submit_batch, topic, messages, callback, kwargs)

    def _submit(self, submit: Callable[..., Awaitable[Any]], topic: str, what: Any, callback: SendCallback | None,
                kwargs: dict[str, Any]) -> concurrent.futures.Future[SendResult]:  # fmt: skip
        out: concurrent.futures.Future[SendResult] = concurrent.futures.Future()
        out.set_running_or_notify_cancel()  # running already: it cannot be cancelled from here
        if callback is not None:
            out.add_done_callback(callback)

        async def buffered() -> None:
            fut = await submit(topic, what, **kwargs)
            fut.add_done_callback(functools.partial(_settle, out))

        self._portal.run(buffered)
        return out

    def flush(self) -> None:
        """:meth:`Producer.flush`: until every message submitted before is answered."""
        self._portal.run(self.producer.flush)

    def close(self) -> None:
        self._portal.close()

    def __enter__(self) -> BlockingProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BlockingConsumer:
    """``poll()`` returns the next batch (acknowledging the previous); see :class:`Consumer`."""

    def __init__(self, namesrv_addrs: list[str] | None, group: str, subscriptions: dict[str, str], **kwargs: Any) -> None:
        self._portal = _Portal(lambda: open_consumer(namesrv_addrs, group, subscriptions, **kwargs))
        self.consumer: Consumer = self._portal.value

    def poll(self, timeout_s: float = 1.0) -> list[Record]:
        """The next batch, or [] if none came within ``timeout_s``."""

        async def receive() -> list[Record]:
            with trio.move_on_after(timeout_s):
                return await self.consumer.receive()
            return []

        return self._portal.run(receive)

    @property
    def errors(self) -> dict[MessageQueue, DamagedQueueError]:
        """A copy of :attr:`Consumer.errors`: the queues stopped at a damaged record."""

        async def copy() -> dict[MessageQueue, DamagedQueueError]:
            return dict(self.consumer.errors)

        return self._portal.run(copy)

    def commit(self) -> None:
        self.consumer.ack()
        self._portal.run(self.consumer.commit)

    def close(self) -> None:
        self._portal.close()

    def __enter__(self) -> BlockingConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BlockingAdmin:
    """The :class:`Admin` calls, blocking: ``BlockingAdmin(ns).create_topic("t", 8)``."""

    def __init__(self, namesrv_addrs: list[str] | None = None, *, broker_addrs: list[str] | None = None) -> None:
        self._portal = _Portal(lambda: open_admin(namesrv_addrs, broker_addrs=broker_addrs))
        self.admin: Admin = self._portal.value

    def __getattr__(self, name: str) -> Callable[..., Any]:
        fn = getattr(self.admin, name)
        return lambda *a, **k: self._portal.run(fn, *a, **k)

    def close(self) -> None:
        self._portal.close()

    def __enter__(self) -> BlockingAdmin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""Blocking facades for plain synchronous Python: the trio clients run in a
background thread with their own event loop; each call waits for its result."""

from __future__ import annotations

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


class BlockingProducer:
    """``BlockingProducer(["127.0.0.1:9876"]).send("topic", b"body")``; see :class:`Producer`."""

    def __init__(self, namesrv_addrs: list[str] | None = None, **kwargs: Any) -> None:
        self._portal = _Portal(lambda: open_producer(namesrv_addrs, **kwargs))
        self.producer: Producer = self._portal.value

    def send(self, topic: str, body: bytes, **kwargs: Any) -> SendResult:
        return self._portal.run(self.producer.send, topic, body, **kwargs)

    def send_batch(self, topic: str, messages: list[Any], **kwargs: Any) -> SendResult:
        return self._portal.run(self.producer.send_batch, topic, messages, **kwargs)

    def send_oneway(self, topic: str, body: bytes, **kwargs: Any) -> None:
        self._portal.run(self.producer.send_oneway, topic, body, **kwargs)

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

"""Waiting for a state that sends no notification (a name server's broker list, a
subprocess's files, a clock): poll it with a short, growing interval, and fail with a
message naming what was awaited. Where a real event exists (an Event, a store's
``wait_for_entries``/``wait_durable``, ``nursery.start``, a subprocess's output line),
wait on that instead."""

from __future__ import annotations

import inspect
import time
from typing import Awaitable, Callable, TypeVar

import trio

T = TypeVar("T")

FIRST_INTERVAL_S = 0.001
GROWTH = 2.0
MAX_INTERVAL_S = 0.1


def wait_until(predicate: Callable[[], T], timeout_s: float, what: str) -> T:
    """Block until ``predicate()`` is truthy and return its value; ``TimeoutError``
    naming ``what`` if it is not within ``timeout_s`` (checked once more at the deadline)."""
    deadline = time.monotonic() + timeout_s
    interval = FIRST_INTERVAL_S
    while True:
        result = predicate()
        if result:
            return result
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"gave up after {timeout_s} s waiting for {what}")
        time.sleep(min(interval, left))
        interval = min(interval * GROWTH, MAX_INTERVAL_S)


async def await_until(predicate: Callable[[], T | Awaitable[T]], timeout_s: float, what: str) -> T:
    """:func:`wait_until` for trio: ``predicate`` may be a plain or an async function
    (e.g. one asking a server); it is cancelled if it is still running at the deadline."""
    interval = FIRST_INTERVAL_S
    with trio.move_on_after(timeout_s):
        while True:
            result = predicate()
            if inspect.isawaitable(result):
                result = await result
            if result:
                return result  # type: ignore[return-value]
            await trio.sleep(interval)
            interval = min(interval * GROWTH, MAX_INTERVAL_S)
    raise TimeoutError(f"gave up after {timeout_s} s waiting for {what}")

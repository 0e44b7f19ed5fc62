"""Where a :class:`TransactionListener`'s methods run when the producer's trio side
calls them (the check-back): the asyncio producer's listener on its asyncio loop (a
coroutine function as an asyncio task), the blocking producer's in a worker thread.
Each wrapper is itself a listener whose methods trio awaits; ``inner`` is the user's."""

from __future__ import annotations

import asyncio
import functools
import inspect
from typing import Any, Awaitable, Callable

import trio

from clmq.common import Message, Record

from ._transaction import (
    TransactionListener,
    TransactionResult,
    check_wrapped,
    decide,
    decide_sync,
    executor,
    finish,
    send_half,
)


class AsyncioListener:
    """Runs a listener's coroutine methods as tasks of the asyncio loop trio runs in
    (guest mode: the same thread), plain ones directly; cancelling the trio side cancels
    the asyncio task."""

    def __init__(self, inner: TransactionListener) -> None:
        self.inner = inner

    async def execute_local_transaction(self, message: Message, arg: Any) -> Any:
        return await _on_loop(self.inner.execute_local_transaction, message, arg)

    async def check_local_transaction(self, message: Record) -> Any:
        return await _on_loop(self.inner.check_local_transaction, message)


async def _on_loop(fn: Any, *args: Any) -> Any:
    value = fn(*args)
    if not inspect.isawaitable(value):
        return value
    loop = asyncio.get_running_loop()  # trio's guest run: the host loop is running on this thread
    token = trio.lowlevel.current_trio_token()
    done = trio.Event()
    task = asyncio.ensure_future(value, loop=loop)
    task.add_done_callback(lambda _t: token.run_sync_soon(done.set))
    try:
        await done.wait()
    except trio.Cancelled:
        task.cancel()
        raise
    return task.result()


class ThreadListener:
    """Runs a plain listener's methods in a worker thread (the blocking producer: its
    trio loop never blocks on them); a check abandoned at its timeout keeps its thread
    until it returns, and its answer is ignored."""

    def __init__(self, inner: TransactionListener) -> None:
        self.inner = inner

    async def execute_local_transaction(self, message: Message, arg: Any) -> Any:
        fn = functools.partial(self.inner.execute_local_transaction, message, arg)
        return await trio.to_thread.run_sync(fn, abandon_on_cancel=True)

    async def check_local_transaction(self, message: Record) -> Any:
        fn = functools.partial(self.inner.check_local_transaction, message)
        return await trio.to_thread.run_sync(fn, abandon_on_cancel=True)


def on_asyncio(listener: TransactionListener | None) -> AsyncioListener | None:
    """The asyncio producer's ``transaction_listener`` as trio calls it (checked first)."""
    if listener is None:
        return None
    check_wrapped(listener)
    return AsyncioListener(listener)


def in_threads(listener: TransactionListener | None) -> ThreadListener | None:
    """The blocking producer's ``transaction_listener`` as trio calls it (checked first)."""
    if listener is None:
        return None
    check_wrapped(listener)
    return ThreadListener(listener)


def user_listener(listener: Any) -> Any:
    """The listener the user gave (a wrapper's ``inner``, or ``listener`` itself)."""
    return getattr(listener, "inner", listener)


async def transact_on_loop(
    call: Callable[[Callable[[], Awaitable[Any]]], Awaitable[Any]], producer: Any, topic: str, body: bytes, how: Any
) -> TransactionResult:
    """The asyncio producer's ``send_in_transaction``: the half message and the end in
    trio (``call``: the guest run's), ``execute`` (or the listener's) on the asyncio
    loop, a coroutine function awaited there."""
    how = dict(how)
    arg, execute = how.pop("arg", None), how.pop("execute", None)
    execute = execute or executor(user_listener(producer.options.transaction_listener))
    half = await call(functools.partial(send_half, producer, topic, body, **how))
    state = await decide(execute, half.message, arg)
    result: TransactionResult = await call(functools.partial(finish, producer, half, state))
    return result


def transact_in_thread(call: Callable[..., Any], producer: Any, topic: str, body: bytes, how: Any) -> TransactionResult:
    """The blocking producer's ``send_in_transaction``: the half message and the end in
    the client thread (``call``: its portal's), ``execute`` (or the listener's, plain
    functions) in the calling thread."""
    how = dict(how)
    arg, execute = how.pop("arg", None), how.pop("execute", None)
    execute = execute or executor(user_listener(producer.options.transaction_listener))
    half = call(send_half, producer, topic, body, **how)
    state = decide_sync(execute, half.message, arg)
    result: TransactionResult = call(finish, producer, half, state)
    return result

"""Progress bars (rate and ETA) of a service's start: the CommitLog validated after a
crash (reported by the storage layer through ``clmq.commitlog.set_progress_sink``) and the
consume queues catching up with the log (the broker's dispatch lag). Shown only on a
terminal; nothing is printed into pipes and logs."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import trio
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from clmq.commitlog import set_progress_sink

CATCH_UP_POLL_S = 0.2  # how often the dispatch lag is looked at while it shrinks
CATCH_UP_SHOW_BYTES = 64 << 20  # a smaller lag at start is gone before a bar would help


def _bar(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    )


@contextmanager
def start_progress() -> Iterator[Progress]:
    """While a service starts: the storage layer's reports become bars on stderr."""
    progress = _bar(Console(stderr=True))
    tasks: dict[str, TaskID] = {}

    def sink(phase: str, done: int, total: int) -> None:
        if phase not in tasks:
            tasks[phase] = progress.add_task(phase, total=total)
        progress.update(tasks[phase], completed=done, total=total)

    with progress:
        set_progress_sink(sink)
        try:
            yield progress
        finally:
            set_progress_sink(None)


async def show_catch_up(store: Any) -> None:
    """A bar of the consume queues catching up with the log (a rebuild at start), until
    the dispatch lag is gone; nothing if it is small."""
    lag = store.dispatch_lag_bytes
    if lag < CATCH_UP_SHOW_BYTES:
        return
    progress = _bar(Console(stderr=True))
    with progress:
        task = progress.add_task("rebuilding consume queues from the CommitLog", total=lag)
        while (now := store.dispatch_lag_bytes) > 0:
            progress.update(task, completed=lag - now)
            await trio.sleep(CATCH_UP_POLL_S)  # polling a counter of another thread: no event to wait for


@contextmanager
def bench_progress(name: str) -> Iterator[None]:
    """While a benchmark runs: a line at the bottom of the terminal with its elapsed
    time (its own lines print above it). The number of steps is not known ahead for
    every benchmark, so no ETA."""
    from rich.progress import SpinnerColumn, TimeElapsedColumn

    console = Console(stderr=True)
    progress = Progress(
        SpinnerColumn(),
        TextColumn(f"clmq bench {name}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    )
    with progress:
        progress.add_task(name, total=None)
        yield

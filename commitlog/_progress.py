"""Progress of long work at open (validating the log after a crash, rebuilding queues),
for whoever shows it: a command line registers a sink; storage code only calls it.

One process-wide sink, because the store is opened deep inside a service's start and
the work it reports happens in the opening thread; ``None`` (the default) costs one
attribute read per report.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

# sink(phase, done, total): ``phase`` names the work ("validating the CommitLog"), done
# and total in the same unit (bytes). Called from the thread doing the work.
ProgressSink = Callable[[str, int, int], None]

_sink: list[ProgressSink | None] = [None]
_lock = threading.Lock()


def set_progress_sink(sink: ProgressSink | None) -> None:
    """Send progress reports to ``sink`` from now on (None: nowhere)."""
    with _lock:
        _sink[0] = sink


def report_progress(phase: str, done: int, total: int) -> None:
    """Report ``done`` of ``total`` for ``phase``; a failing sink never fails the work."""
    sink = _sink[0]
    if sink is None:
        return
    try:
        sink(phase, done, total)
    except Exception:
        set_progress_sink(None)

"""Event-loop stalls: a trio instrument that times every task step and records each
one longer than the broker's ``stall_threshold_ms`` (docs/operations.md "Event-loop
stalls").

One trio thread serves every connection of a broker, so a step that runs long (a
checkpoint written on the loop, a long dispatcher round, a metrics scrape, a cyclic
garbage collection) delays every request queued behind it: that is where tail latency
comes from. Each such step is counted per *task kind* (the task's name without its
module, plus the request code for a request's task), kept among the last few with its
duration and what it was awaiting when it yielded, logged (WARNING, at most one line
per ``STALL_LOG_INTERVAL_S``, with the count of the ones not logged) and exported as
``clmq_loop_stalls_total{task=...}`` and a histogram of stall durations.

Garbage collections are timed through ``gc.callbacks`` (in any thread: a collection
holds the GIL, so the loop waits for it too); a stall at least half of which was
collection is counted under the kind ``gc`` and says which task it interrupted.

Whether a stall was the broker's own work is judged by the loop thread's CPU time over
a window that ends with the stall and starts at most ``STALL_CPU_WINDOW_SLACK`` of the
threshold before it (``getrusage`` is read again at the first step boundary that much
after the last reading): CPU time since the loop's last I/O wait would count the busy
steps of the same loop iteration as the stall's own.

Cost: one call, a clock read and a comparison per task step, two calls and one
``getrusage`` per loop iteration, and a ``getrusage`` at most every quarter of the
threshold while steps run (measured with ``clmq bench request-cost``,
docs/benchmarks.md); nothing else runs unless a step is a stall.
"""

from __future__ import annotations

import collections
import gc
import logging
import resource
import threading
import time
from typing import Any, Iterator

import trio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from clmq.protocol import RequestCode
from clmq.protocol.transport import cumulative_buckets

log = logging.getLogger("clmq.broker.stalls")

STALL_LOG_INTERVAL_S = 1.0  # at most one stall WARNING this often (the others are counted in the next line)
STALL_RECENT_MAX = 10  # stalls kept for BROKER_INFO (the most recent)
STALL_KINDS_MAX = 200  # task kinds counted apart; further kinds count as "other" (bounded metric labels)
STALL_BUCKETS_S = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)  # the stall duration histogram's bounds
STALL_CPU_WINDOW_SLACK = 0.25  # a stall's CPU window starts at most this fraction of the threshold before it
GC_SPANS_KEPT = 64  # the last collections whose spans are kept (to tell which stalls they made)
GC_KIND = "gc"  # the kind of a stall at least half of which a garbage collection took
_getrusage, _RUSAGE_THREAD = (
    resource.getrusage,
    getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF),
)


class _GcClock:
    """Cyclic garbage collections in this process (any thread: a collection holds the
    GIL, so the loop waits for it too), from ``gc.callbacks``: their count, total time
    and the spans of the last ``GC_SPANS_KEPT``; installed while a detector runs."""

    def __init__(self) -> None:
        self.total_ns = 0
        self.collections = 0
        self.spans: collections.deque[tuple[int, int]] = collections.deque(maxlen=GC_SPANS_KEPT)
        self._started: dict[int, int] = {}  # thread id -> start of its collection
        self._users = 0
        self._lock = threading.Lock()

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        now = time.perf_counter_ns()
        ident = threading.get_ident()
        if phase == "start":
            self._started[ident] = now
            return
        began = self._started.pop(ident, None)
        if began is not None:
            self.total_ns += now - began
            self.collections += 1
            self.spans.append((began, now))

    def within(self, start_ns: int, end_ns: int) -> int:
        """Nanoseconds of collection between ``start_ns`` and ``end_ns``."""
        return sum(max(0, min(end, end_ns) - max(began, start_ns)) for began, end in list(self.spans))

    def use(self) -> None:
        """A detector starts: time collections (installed in ``gc.callbacks`` by the first user)."""
        with self._lock:
            if not self._users:
                gc.callbacks.append(self)
            self._users += 1

    def release(self) -> None:
        """A detector stops: the last one removes the clock from ``gc.callbacks``."""
        with self._lock:
            self._users -= 1
            if not self._users and self in gc.callbacks:
                gc.callbacks.remove(self)


GC_CLOCK = _GcClock()
# The detectors timing each trio run now, the first installed first (by the run's token).
_INSTALLED: dict[trio.lowlevel.TrioToken | None, list[StallDetector]] = {}


def task_kind(task: trio.lowlevel.Task) -> str:
    """A task's name without its module path (``Broker._housekeeping_loop``); a
    request's task adds its request code (``Connection._handle[PULL_MESSAGE]``)."""
    name = task.name
    if "." in name and not name.startswith("<"):
        name = ".".join([part for part in name.split(".") if part != "<locals>"][-2:])
    frame = getattr(task.coro, "cr_frame", None)
    request = frame.f_locals.get("frame") if frame is not None else None
    code = getattr(request, "code", None)
    if isinstance(code, int):
        try:
            name += f"[{RequestCode(code).name}]"
        except ValueError:
            name += f"[{code}]"
    return name


def awaiting(task: trio.lowlevel.Task, depth_max: int = 8) -> str:
    """The chain of coroutines ``task`` is suspended in, outermost first (where the
    long step ended)."""
    names: list[str] = []
    coro: Any = task.coro
    while coro is not None and len(names) < depth_max:
        code = getattr(coro, "cr_code", None) or getattr(coro, "gi_code", None)
        if code is None:
            break
        names.append(code.co_qualname)
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return " > ".join(names)


class StallDetector(trio.abc.Instrument):
    """Times every task step of the trio run it is added to; a step of at least
    ``threshold_ms`` is a stall (0: off, nothing is added to the run)."""

    def __init__(self, threshold_ms: int, name: str = "broker") -> None:
        self.threshold_ms = threshold_ms
        self.name = name
        self._threshold_ns = threshold_ms * 1_000_000
        self._step_started = 0
        self._task: trio.lowlevel.Task | None = None  # the task of the step that started last
        self._token: trio.lowlevel.TrioToken | None = None  # the run it times (once installed)
        self._usage = _getrusage(_RUSAGE_THREAD)  # the loop thread's, read at _usage_at
        self._usage_at = time.perf_counter_ns()
        self._reread_ns = int(self._threshold_ns * STALL_CPU_WINDOW_SLACK)  # read again at a step this much later
        self.off_cpu = 0  # stalls for most of which the loop thread did not run
        self.by_kind: dict[str, int] = {}
        self.on_cpu_by_kind: dict[str, int] = {}  # of by_kind, the stalls the loop thread was on a CPU for
        self.total = 0
        self.max_ns = 0
        self.sum_ns = 0
        self.buckets = [0] * (len(STALL_BUCKETS_S) + 1)
        self.recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=STALL_RECENT_MAX)
        self._logged_at = 0.0
        self._unlogged = 0

    @property
    def enabled(self) -> bool:
        return self.threshold_ms > 0

    # ------------------------------------------------------------ the hot path
    # One hook per task step: a step lasts from its start to the next step's start, or
    # to the loop's next I/O wait (trio's own work in between is a few microseconds).
    # Hooks before and after each step would cost twice as much on every request.
    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        """The step of ``task`` starts: the one before it ended (a stall if long)."""
        now = time.perf_counter_ns()
        if self._task is not None and now - self._step_started >= self._threshold_ns:
            self._stall(self._task, self._step_started, now)
        elif now - self._usage_at >= self._reread_ns:  # keep the CPU window of a stall short
            self._read_usage()
        self._step_started = now
        self._task = task

    def before_io_wait(self, timeout: float) -> None:
        """The loop waits for I/O: the last step ended (a stall if long)."""
        if self._task is not None:
            now = time.perf_counter_ns()
            if now - self._step_started >= self._threshold_ns:
                self._stall(self._task, self._step_started, now)
            self._task = None  # no step runs until the next one starts

    def after_io_wait(self, timeout: float) -> None:
        """The loop's I/O wait ended: read the loop thread's CPU time and context
        switches (after the wait, so that its own switch is not counted)."""
        self._read_usage()

    def _read_usage(self) -> None:
        self._usage = _getrusage(_RUSAGE_THREAD)
        self._usage_at = time.perf_counter_ns()

    def _window_usage(self) -> dict[str, Any]:
        """The loop thread's CPU time and context switches since the last reading (the
        window: the stall and at most ``STALL_CPU_WINDOW_SLACK`` of the threshold before
        it), and the window's length; the next window starts now."""
        before, window_start = self._usage, self._usage_at
        self._read_usage()
        usage, window_ns = self._usage, max(self._usage_at - window_start, 1)
        cpu_ns = int((usage.ru_utime + usage.ru_stime - before.ru_utime - before.ru_stime) * 1e9)
        return {
            "cpu_ms": round(min(cpu_ns, window_ns) / 1e6, 2),
            "cpu_window_ms": round(window_ns / 1e6, 2),
            "preempted": usage.ru_nivcsw - before.ru_nivcsw,  # involuntary context switches (the OS took its core)
            "blocked": usage.ru_nvcsw - before.ru_nvcsw,  # voluntary: a blocking call (fsync, a read), the GIL
        }

    # ------------------------------------------------------------ a stall
    def _stall(self, task: trio.lowlevel.Task, start_ns: int, end_ns: int) -> None:
        took_ns = end_ns - start_ns
        gc_ns = GC_CLOCK.within(start_ns, end_ns)
        usage = self._window_usage()
        off_cpu = usage["cpu_ms"] * 2 < usage["cpu_window_ms"]  # ran for under half of it: preempted, blocked, GIL
        self.off_cpu += off_cpu
        try:
            name, where = task_kind(task), awaiting(task)
        except Exception:  # never let a look at a task disable the instrument
            name, where = task.name, ""
        kind = GC_KIND if gc_ns * 2 >= took_ns else name
        if kind not in self.by_kind and len(self.by_kind) >= STALL_KINDS_MAX:
            kind = "other"
        self.by_kind[kind] = self.by_kind.get(kind, 0) + 1
        if not off_cpu:  # the broker's own work: what to remove
            self.on_cpu_by_kind[kind] = self.on_cpu_by_kind.get(kind, 0) + 1
        self.total += 1
        self.sum_ns += took_ns
        self.max_ns = max(self.max_ns, took_ns)
        self.buckets[_bucket(took_ns / 1e9)] += 1
        record = {
            "kind": kind,
            "task": name,
            "ms": round(took_ns / 1e6, 2),
            "gc_ms": round(gc_ns / 1e6, 2),
            **usage,
            "on_cpu": not off_cpu,
            "awaiting": where,
            "at": round(time.time(), 3),
        }
        self.recent.append(record)
        self._log(record)

    def _log(self, record: dict[str, Any]) -> None:
        owners = _INSTALLED.get(self._token)
        if owners and owners[0] is not self:
            return  # several brokers in one process share one loop: its first broker says it
        now = time.monotonic()
        if now - self._logged_at < STALL_LOG_INTERVAL_S:
            self._unlogged += 1
            return
        more = f" ({self._unlogged} more stalls not logged since the last line)" if self._unlogged else ""
        gc_part = f", {record['gc_ms']} ms of it garbage collection" if record["gc_ms"] else ""
        log.warning(
            "%s: event loop stalled %.1f ms (over stall_threshold_ms=%d) in task %s (on CPU %.1f of %.1f ms, "
            "preempted %d times, blocked %d times)%s, then awaiting %s%s",
            self.name,
            record["ms"],
            self.threshold_ms,
            record["task"],
            record["cpu_ms"],
            record["cpu_window_ms"],
            record["preempted"],
            record["blocked"],
            gc_part,
            record["awaiting"] or "-",
            more,
        )
        self._logged_at = now
        self._unlogged = 0

    # ------------------------------------------------------------ reports
    def fields(self) -> dict[str, Any]:
        """BROKER_INFO's stall fields."""
        return {
            "stall_threshold_ms": self.threshold_ms,
            "loop_stalls": self.total,
            "loop_stall_max_ms": round(self.max_ns / 1e6, 2),
            "loop_stalls_by_task": dict(sorted(self.by_kind.items())),
            "loop_stalls_off_cpu": self.off_cpu,
            "loop_stalls_on_cpu_by_task": dict(sorted(self.on_cpu_by_kind.items())),
            "loop_stalls_recent": list(self.recent),
            "gc_collections": GC_CLOCK.collections,
            "gc_total_ms": round(GC_CLOCK.total_ns / 1e6, 1),
        }

    def metrics(self) -> Iterator[Metric]:
        """``clmq_loop_stalls_total{task}``, the duration histogram, and the GC time."""
        counts = CounterMetricFamily(
            "clmq_loop_stalls", "Event-loop steps longer than stall_threshold_ms, per task kind", labels=["task"]
        )
        for kind, n in sorted(self.by_kind.items()):
            counts.add_metric([kind], n)
        yield counts
        on_cpu = CounterMetricFamily(
            "clmq_loop_stalls_on_cpu",
            "Of clmq_loop_stalls, the ones the loop thread was on a CPU for (the broker's own work)",
            labels=["task"],
        )
        for kind, n in sorted(self.on_cpu_by_kind.items()):
            on_cpu.add_metric([kind], n)
        yield on_cpu
        durations = HistogramMetricFamily(
            "clmq_loop_stall_duration_seconds", "Event-loop steps longer than stall_threshold_ms"
        )
        durations.add_metric([], cumulative_buckets(STALL_BUCKETS_S, self.buckets), self.sum_ns / 1e9)
        yield durations
        yield CounterMetricFamily(
            "clmq_loop_stalls_off_cpu",
            "Stalls for most of which the loop thread did not run (preempted, or waiting for the GIL)",
            value=self.off_cpu,
        )
        yield GaugeMetricFamily(
            "clmq_loop_stall_max_seconds", "The longest event-loop stall since start", value=self.max_ns / 1e9
        )
        yield CounterMetricFamily(
            "clmq_gc_seconds", "Time in cyclic garbage collection (the whole process)", value=GC_CLOCK.total_ns / 1e9
        )

    # ------------------------------------------------------------ lifetime
    def install(self) -> None:
        """Time the current trio run's steps (nothing when off)."""
        if self.enabled:
            GC_CLOCK.use()
            self._step_started = time.perf_counter_ns()  # the step running now began no later
            self._task = trio.lowlevel.current_task()
            self._read_usage()
            trio.lowlevel.add_instrument(self)
            self._token = trio.lowlevel.current_trio_token()
            _INSTALLED.setdefault(self._token, []).append(self)

    def uninstall(self) -> None:
        """Stop timing the run's steps (when the broker stops); the figures stay readable."""
        if self.enabled:
            owners = _INSTALLED.get(self._token, [])
            if self in owners:
                owners.remove(self)
            if not owners:
                _INSTALLED.pop(self._token, None)
            GC_CLOCK.release()
            try:
                trio.lowlevel.remove_instrument(self)
            except KeyError:  # already removed (trio removes an instrument that raised)
                pass


def _bucket(seconds: float) -> int:
    for i, bound in enumerate(STALL_BUCKETS_S):
        if seconds <= bound:
            return i
    return len(STALL_BUCKETS_S)

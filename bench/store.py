"""``clmq bench store``: the storage engine's throughput, measured on this machine.

Measures, on the store alone (no network): batched append throughput for several
message sizes, queue counts and flush modes while the dispatcher runs alongside (and
how far it lags); the rebuild of the consume queues of a store of a million messages
(records of one size, and optionally of sizes varying record to record); and read-back
by queue. Every figure is the median of ``--runs`` runs.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

from clmq.broker.store import Store, StoreConfig
from clmq.commitlog import CommitLogConfig, FlushMode
from clmq.common import Message


@dataclass
class AppendFigures:
    size: int
    queues: int
    flush: str
    msgs_per_s: float
    mb_per_s: float
    max_dispatch_lag_mb: float
    catch_up_ms: float


@dataclass
class RebuildFigures:
    messages: int
    queues: int
    log_mb: float
    rebuild_s: float  # open with every queue file deleted
    redispatch_s: float  # of which: dispatching the whole log again
    redispatch_records_per_s: float
    queue_files_s: float  # of which: creating and writing the queue files
    recovery_s: float  # open with no checkpoint: CRC-validate the whole log, then rebuild
    log_validation_s: float
    log_validation_records_per_s: float
    body_bytes: str = "100"  # "100": every body that size; "50-1000": uniform, record to record


@dataclass
class ScaleFigures:
    queues: int
    messages: int
    append_msgs_per_s: float
    reopen_s: float
    read_msgs_per_s: float
    max_open_fds: int
    max_open_files_setting: int


@dataclass
class ReadFigures:
    queues: int
    messages: int
    msgs_per_s: float


Figures = TypeVar("Figures", AppendFigures, RebuildFigures, ScaleFigures, ReadFigures)


def _config(path: Path, flush: str, cq_entries_per_file: int = 300_000) -> StoreConfig:
    return StoreConfig(
        path,
        CommitLogConfig(flush_mode=FlushMode(flush), segment_bytes=256 << 20),
        cq_entries_per_file=cq_entries_per_file,
        max_open_files=1024,
    )


def _batches(
    size: int, queues: int, batch: int, count: int, body_range: tuple[int, int] | None = None
) -> list[list[Message]]:
    """``count`` batches of ``batch`` messages over ``queues`` queues; bodies of ``size``
    bytes, or of a size drawn uniformly from ``body_range`` for each message (seeded)."""
    body = b"x" * size
    rnd = random.Random(42)
    out, q = [], 0
    for _ in range(count):
        msgs = []
        for _ in range(batch):
            if body_range is not None:
                body = b"x" * rnd.randint(*body_range)
            msgs.append(Message("bench", q, body, tags="TagA"))
            q = (q + 1) % queues
        out.append(msgs)
    return out


def bench_append(
    root: Path, size: int, queues: int, flush: str, seconds: float, batch: int, producers: int
) -> AppendFigures:
    """Append for ``seconds`` from ``producers`` threads; the dispatcher runs meanwhile."""
    path = Path(tempfile.mkdtemp(dir=root))
    store = Store.open(_config(path, flush)).start()
    store.create_topic("bench", queues)
    # The same number of distinct batches whatever the queue count, so that the CPU
    # caches treat every case alike (only the queue ids differ).
    batches = _batches(size, queues, batch, max(128, -(-queues // batch)))
    counts = [0] * producers
    lags: list[int] = []
    stop = time.perf_counter() + seconds

    def produce(i: int) -> None:
        k = i
        while time.perf_counter() < stop:
            res = store.put_batch(batches[k % len(batches)])
            assert res.ok, res.error
            counts[i] += batch
            k += producers
            if i == 0:
                lags.append(store.dispatch_lag_bytes)

    start_offset = store.log.write_offset
    began = time.perf_counter()
    threads = [threading.Thread(target=produce, args=(i,)) for i in range(producers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - began
    written = store.log.write_offset - start_offset
    t0 = time.perf_counter()
    while store.dispatch_lag_bytes:
        time.sleep(0.001)
    catch_up = time.perf_counter() - t0
    store.close()
    shutil.rmtree(path)
    n = sum(counts)
    return AppendFigures(
        size, queues, flush, n / elapsed, written / elapsed / 1e6, max(lags, default=0) / 1e6, catch_up * 1000
    )


def bench_rebuild(
    root: Path, messages: int, size: int, queues: int, body_range: tuple[int, int] | None = None
) -> RebuildFigures:
    """Build a store, then time (a) a consume-queue rebuild and (b) a full recovery.

    With ``body_range``, body sizes vary record to record (as real traffic does), so the
    header walk meets no long run of one record size."""
    path = Path(tempfile.mkdtemp(dir=root))
    store = Store.open(_config(path, "async")).start()
    store.create_topic("bench", queues)
    batches = _batches(size, queues, 1000, 16, body_range)
    for i in range(messages // 1000):
        store.put_batch(batches[i % len(batches)])
    store.close()
    log_mb = sum(p.stat().st_size for p in (path / "commitlog").glob("*.log")) / 1e6
    shutil.rmtree(path / "consumequeue")  # queue files gone: rebuilt from the log
    rebuild, rs = _timed_open(path)
    shutil.rmtree(path / "consumequeue")
    (path / "checkpoint").unlink()  # no checkpoint: CRC-validate the whole log too
    recovery, vs = _timed_open(path)
    shutil.rmtree(path)
    return RebuildFigures(
        messages,
        queues,
        log_mb,
        rebuild,
        rs["redispatch_s"],
        messages / rs["redispatch_s"],
        rs["queue_files_s"],
        recovery,
        vs["log_open_s"],
        messages / vs["log_open_s"],
        f"{body_range[0]}-{body_range[1]}" if body_range else str(size),
    )


def bench_read(root: Path, messages: int, size: int, queues: int, pull: int = 32) -> ReadFigures:
    """Read every queue back in pulls of ``pull`` messages."""
    path = Path(tempfile.mkdtemp(dir=root))
    store = Store.open(_config(path, "async"))
    store.create_topic("bench", queues)
    for b in _batches(size, queues, 1000, max(1, messages // 1000)):
        store.put_batch(b)
    store.dispatcher.catch_up()
    t0 = time.perf_counter()
    got = 0
    for q in range(queues):
        offset = 0
        while True:
            res = store.get("bench", q, offset, pull)
            if not res.messages:
                break
            got += len(res.messages)
            offset = res.next_offset
    elapsed = time.perf_counter() - t0
    store.close()
    shutil.rmtree(path)
    return ReadFigures(queues, got, got / elapsed)


def bench_scale(root: Path, queues: int, per_queue: int = 3, max_open_files: int = 1024) -> ScaleFigures:
    """Many queues: append ``per_queue`` messages to each, reopen, read every queue back."""
    path = Path(tempfile.mkdtemp(dir=root))
    cfg = StoreConfig(
        path, CommitLogConfig(segment_bytes=256 << 20), cq_entries_per_file=300_000, max_open_files=max_open_files
    )
    fds = [_open_fds()]
    store = Store.open(cfg).start()
    per_topic = 50_000  # topics hold at most 65,536 queues: spread the queues over several
    names = [f"bench{t}" for t in range(-(-queues // per_topic))]
    for n, name in enumerate(names):
        store.create_topic(name, min(per_topic, queues - n * per_topic))
    where = [(names[q // per_topic], q % per_topic) for q in range(queues)]
    t0 = time.perf_counter()
    for r in range(per_queue):
        for lo in range(0, queues, 1000):
            res = store.put_batch([Message(t, q, b"m%d" % r, tags="TagA") for t, q in where[lo : lo + 1000]])
            assert res.ok, res.error
            fds.append(_open_fds())
    append_s = time.perf_counter() - t0
    store.close()
    reopen = time.perf_counter()
    store = Store.open(cfg)
    reopen_s = time.perf_counter() - reopen
    t0, got = time.perf_counter(), 0
    for i, (t, q) in enumerate(where):
        got += len(store.get(t, q, 0, 32).messages)
        if i % 1000 == 0:
            fds.append(_open_fds())
    read_s = time.perf_counter() - t0
    store.close()
    shutil.rmtree(path)
    assert got == queues * per_queue, (got, queues * per_queue)
    return ScaleFigures(queues, got, got / append_s, reopen_s, got / read_s, max(fds), max_open_files)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _timed_open(path: Path) -> tuple[float, dict[str, float]]:
    """How long opening (recovering) the store takes, and its phases; closing is not counted."""
    t0 = time.perf_counter()
    store = Store.open(_config(path, "async"))
    elapsed = time.perf_counter() - t0
    store.close()
    return elapsed, store.open_stats


def _median(runs: list[Figures], key: str) -> float:
    median: float = statistics.median(getattr(r, key) for r in runs)
    return median


def median_of(runs: list[Figures]) -> Figures:
    """A figures object whose numeric fields are medians over ``runs``."""
    first = runs[0]
    fields: dict[str, Any] = {k: (_median(runs, k) if isinstance(v, float) else v) for k, v in asdict(first).items()}
    return type(first)(**fields)


def run_all(
    root: Path,
    *,
    sizes: list[int],
    queue_counts: list[int],
    flushes: list[str],
    seconds: float,
    runs: int,
    batch: int,
    rebuild_messages: int,
    scale_queues: int,
    report: Callable[[str], None],
    rebuild_varied: tuple[int, int] | None = None,
    save: Callable[[dict[str, Any]], None] = lambda r: None,
) -> dict[str, Any]:
    """Every measurement, alternating cases within a run so that drift hits all alike."""
    root.mkdir(parents=True, exist_ok=True)
    cases = [(s, q, f) for f in flushes for s in sizes for q in queue_counts]
    samples: dict[tuple[int, int, str], list[AppendFigures]] = {c: [] for c in cases}
    for r in range(runs):
        for s, q, f in cases:
            producers = 4 if f == "sync" else 1
            samples[(s, q, f)].append(bench_append(root, s, q, f, seconds, batch, producers))
            report(
                f"run {r + 1}/{runs}: append {s} B x {q} queues, {f} flush: "
                f"{samples[(s, q, f)][-1].msgs_per_s:,.0f} msgs/s"
            )
    result: dict[str, Any] = {
        "runs": runs,
        "seconds_per_case": seconds,
        "batch": batch,
        "append": [asdict(median_of(samples[c])) for c in cases],
    }
    save(result)  # each stage is kept as soon as it is measured
    if rebuild_messages:  # 0 skips the case
        rebuild = [bench_rebuild(root, rebuild_messages, 100, 1000) for _ in range(runs)]
        result["rebuild"] = asdict(median_of(rebuild))
        save(result)
        report(
            f"rebuild of {rebuild_messages:,} messages: "
            f"re-dispatch {rebuild[-1].redispatch_records_per_s:,.0f} records/s"
        )
        if rebuild_varied:  # the same store size, body sizes varying record to record
            varied = [bench_rebuild(root, rebuild_messages, 100, 1000, rebuild_varied) for _ in range(runs)]
            result["rebuild_varied"] = asdict(median_of(varied))
            save(result)
            report(
                f"rebuild of {rebuild_messages:,} messages of {rebuild_varied[0]}-{rebuild_varied[1]} B bodies: "
                f"re-dispatch {varied[-1].redispatch_records_per_s:,.0f} records/s"
            )
    reads = [bench_read(root, 200_000, 1024, q) for q in (1, 1000) for _ in range(runs)]
    result["read"] = [asdict(median_of([x for x in reads if x.queues == q])) for q in (1, 1000)]
    save(result)
    scale = bench_scale(root, scale_queues) if scale_queues else None
    if scale:
        report(f"{scale_queues:,} queues: reopen {scale.reopen_s:.2f} s, at most {scale.max_open_fds} fds open")
    result["scale"] = asdict(scale) if scale else None
    save(result)
    return result


def write_json(result: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(result, indent=2))

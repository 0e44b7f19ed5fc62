"""``clmq bench store``: the storage engine's throughput, measured on this machine.

Measures, on the store alone (no network): batched append throughput for several
message sizes, queue counts and flush modes while the dispatcher runs alongside (and
how far it lags); the rebuild of the consume queues of a store of a million messages;
and read-back by queue. Every figure is the median of ``--runs`` runs.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from commitlog import CommitLogConfig, FlushMode, Message

from ._store import Store, StoreConfig


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
    log_mb: float
    rebuild_s: float
    rebuild_records_per_s: float
    recovery_s: float
    recovery_records_per_s: float


@dataclass
class ReadFigures:
    queues: int
    messages: int
    msgs_per_s: float


def _config(path: Path, flush: str, cq_entries_per_file: int = 300_000) -> StoreConfig:
    return StoreConfig(path, CommitLogConfig(flush_mode=FlushMode(flush), segment_bytes=256 << 20),
                       cq_entries_per_file=cq_entries_per_file, max_open_files=1024)  # fmt: skip


def _batches(size: int, queues: int, batch: int, count: int) -> list[list[Message]]:
    body = b"x" * size
    out, q = [], 0
    for _ in range(count):
        msgs = []
        for _ in range(batch):
            msgs.append(Message("bench", q, body, tags="TagA"))
            q = (q + 1) % queues
        out.append(msgs)
    return out


def bench_append(root: Path, size: int, queues: int, flush: str, seconds: float, batch: int,
                 producers: int) -> AppendFigures:  # fmt: skip
    """Append for ``seconds`` from ``producers`` threads; the dispatcher runs meanwhile."""
    path = Path(tempfile.mkdtemp(dir=root))
    store = Store.open(_config(path, flush)).start()
    store.create_topic("bench", queues)
    batches = _batches(size, queues, batch, max(1, 64 * queues // batch // max(1, producers)) or 1)
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
    return AppendFigures(size, queues, flush, n / elapsed, written / elapsed / 1e6, max(lags, default=0) / 1e6, catch_up * 1000)


def bench_rebuild(root: Path, messages: int, size: int, queues: int) -> RebuildFigures:
    """Build a store, then time (a) a consume-queue rebuild and (b) a full recovery."""
    path = Path(tempfile.mkdtemp(dir=root))
    store = Store.open(_config(path, "async")).start()
    store.create_topic("bench", queues)
    batches = _batches(size, queues, 1000, 16)
    for i in range(messages // 1000):
        store.put_batch(batches[i % len(batches)])
    store.close()
    log_mb = sum(p.stat().st_size for p in (path / "commitlog").glob("*.log")) / 1e6
    shutil.rmtree(path / "consumequeue")  # queue files gone: rebuilt from the log
    rebuild = _timed(lambda: Store.open(_config(path, "async")).close())
    shutil.rmtree(path / "consumequeue")
    (path / "checkpoint").unlink()  # no checkpoint: CRC-validate the whole log too
    recovery = _timed(lambda: Store.open(_config(path, "async")).close())
    shutil.rmtree(path)
    return RebuildFigures(messages, log_mb, rebuild, messages / rebuild, recovery, messages / recovery)


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


def _timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _median(runs: list, key: str) -> float:  # type: ignore[type-arg]
    return statistics.median(getattr(r, key) for r in runs)


def median_of(runs: list) -> object:  # type: ignore[type-arg]
    """A figures object whose numeric fields are medians over ``runs``."""
    first = runs[0]
    fields = {k: (_median(runs, k) if isinstance(v, float) else v) for k, v in asdict(first).items()}
    return type(first)(**fields)


def run_all(root: Path, *, sizes: list[int], queue_counts: list[int], flushes: list[str], seconds: float,
            runs: int, batch: int, rebuild_messages: int, report: Callable[[str], None]) -> dict:  # fmt: skip
    """Every measurement, alternating cases within a run so that drift hits all alike."""
    root.mkdir(parents=True, exist_ok=True)
    cases = [(s, q, f) for f in flushes for s in sizes for q in queue_counts]
    samples: dict[tuple, list] = {c: [] for c in cases}
    for r in range(runs):
        for s, q, f in cases:
            producers = 4 if f == "sync" else 1
            samples[(s, q, f)].append(bench_append(root, s, q, f, seconds, batch, producers))
            report(f"run {r + 1}/{runs}: append {s} B x {q} queues, {f} flush: {samples[(s, q, f)][-1].msgs_per_s:,.0f} msgs/s")
    rebuild = [bench_rebuild(root, rebuild_messages, 100, 1000) for _ in range(runs)]
    report(f"rebuild of {rebuild_messages:,} messages: {rebuild[-1].rebuild_records_per_s:,.0f} records/s")
    reads = [bench_read(root, 200_000, 1024, q) for q in (1, 1000) for _ in range(runs)]
    return {
        "append": [asdict(median_of(samples[c])) for c in cases],
        "rebuild": asdict(median_of(rebuild)),
        "read": [asdict(median_of([x for x in reads if x.queues == q])) for q in (1, 1000)],
        "runs": runs,
        "seconds_per_case": seconds,
        "batch": batch,
    }


def write_json(result: dict, path: Path) -> None:
    path.write_text(json.dumps(result, indent=2))

"""``clmq bench index``: what the key index costs and how fast it answers (issue 32).

- Dispatch with and without the index, same log, same run: ``--messages`` messages of
  ``--size-bytes`` (each with one key ``order-<n>`` and a producer's 32-character
  UNIQ_KEY, so two index entries) are written once to a store; then, ``--runs`` times
  in alternating order, the store's derived files (queues, index, checkpoint) are
  deleted and the store opened, which re-dispatches the whole log (the dispatcher's
  own path, timed by the open as ``redispatch_s``), with ``index_enabled`` off and on.
  The log is read once before, so both read it from the page cache. Medians and the
  on / off ratio.
- Appends with the store's threads running (``Store.start``: the dispatcher indexes
  on its own thread while this one appends batches of 256 such messages), for
  ``--append-seconds``, index off and on alternated, ``--runs`` times; everything
  dispatched before the clock stops. Medians and the ratio: what the index costs a
  store that is busy appending (the threads share the GIL).
- Look-ups through the store (``Store.find_by_key``: index, then every candidate's
  record read and compared) for ``--lookups`` random keys of that store: p50 and p99.
- Look-ups at ``--index-sizes`` indexed messages: index files built directly through
  the index writer (:class:`clmq.consumequeue.KeyIndex`, one entry per message,
  synthetic 12-digit keys, 1,000 messages per ms of store time, the broker's default
  1 M slots and 4 M entries per file: RocketMQ's ratio of 4, a fifth of its sizes)
  because writing 100 M messages through the log would take hours here; each look-up
  is the index part of a query (every file's slot, its chain walked, hashes compared),
  without the record reads (one ``pread`` per match in a real query, measured above).
  Random existing keys, no time range (every file searched) and a one-second range
  (files outside it skipped).
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from clmq.broker.store import Store, StoreConfig
from clmq.commitlog import CommitLogConfig
from clmq.common import Message, MiB
from clmq.consumequeue import IndexSettings, KeyIndex, hash_rows, key_hash, topic_seed

from .index_report import markdown, plot
from .replication_load import percentile

TOPIC = "orders"
QUEUES = 8
WRITE_BATCH = 1000  # messages per put_batch while writing the dispatch log
BUILD_CHUNK = 1_000_000  # entries per KeyIndex.add while building synthetic files
SYNTHETIC_MSGS_PER_MS = 1000
SYNTHETIC_START_MS = 1_700_000_000_000
KEY_DIGITS = 12
APPEND_BATCH = 256  # messages per put_batch in the append case (as clmq bench store)
APPEND_POOL_BATCHES = 64  # distinct batches the append case cycles through


def _counts(text: str) -> list[int]:
    """``10000000,100_000_000`` -> [10000000, 100000000]."""
    return [int(x.replace("_", "")) for x in text.split(",") if x]


def add_command(bench_sub: Any) -> None:
    """Add ``clmq bench index`` to the parser."""
    p = bench_sub.add_parser("index", help="key index: dispatch with and without it, look-up latency at scale")
    a = p.add_argument
    a("--dir", type=Path, default=None, help="where to build stores and index files (default: a temporary dir)")
    a("--messages", type=int, default=1_000_000, help="dispatch: messages in the log (default 1000000)")
    a("--size-bytes", type=int, default=200, help="dispatch: body size (default 200)")
    a("--runs", type=int, default=5, help="dispatch: runs of each, alternated; medians (default 5)")
    a("--append-seconds", type=float, default=3.0, help="appends: seconds per run (0: skip; default 3)")
    a("--lookups", type=int, default=2000, help="look-ups per case (default 2000)")
    a(
        "--index-sizes",
        type=_counts,
        default=[10_000_000, 100_000_000],
        help="indexed messages of the synthetic look-up cases, comma-separated (default 10000000,100000000)",
    )
    a("--slots", type=int, default=1_000_000, help="hash slots per index file (default 1000000)")
    a("--entries-per-file", type=int, default=4_000_000, help="entries per index file (default 4000000)")
    a("--json", type=Path, default=None, help="every figure as JSON")
    a("--markdown", type=Path, default=None, help="also write the tables as Markdown here")
    p.set_defaults(func=cmd_bench_index)


def _config(root: Path, on: bool, args: argparse.Namespace) -> StoreConfig:
    log = CommitLogConfig(segment_bytes=256 * MiB)
    return StoreConfig(
        root, log, index_enabled=on, index_hash_slots=args.slots, index_max_entries_per_file=args.entries_per_file
    )


def _write_log(root: Path, args: argparse.Namespace) -> list[str]:
    """The dispatch store's log; the keys it holds, in order."""
    rnd = random.Random(32)
    keys = [f"order-{rnd.randrange(10**9):09d}" for _ in range(args.messages)]  # one size: the walk is vectorised
    body = b"x" * args.size_bytes
    store = Store.open(_config(root, False, args))
    try:
        store.create_topic(TOPIC, QUEUES)
        for lo in range(0, args.messages, WRITE_BATCH):
            batch = [
                Message(TOPIC, i % QUEUES, body, keys=keys[i], properties={"UNIQ_KEY": f"{i:032X}"})
                for i in range(lo, min(args.messages, lo + WRITE_BATCH))
            ]
            store.put_batch(batch)
    finally:
        store.close()
    return keys


def _redispatch(root: Path, on: bool, args: argparse.Namespace) -> dict[str, Any]:
    """Drop the derived files and open: the open re-dispatches the whole log."""
    for name in ("consumequeue", "index"):
        shutil.rmtree(root / name, ignore_errors=True)
    for name in ("checkpoint", "checkpoint.prev"):
        (root / name).unlink(missing_ok=True)
    store = Store.open(_config(root, on, args))
    stats = dict(store.open_stats)
    store.close()
    records = int(stats["redispatched_records"])
    return {
        "index": on,
        "records": records,
        "seconds": stats["redispatch_s"],
        "msgs_per_s": records / stats["redispatch_s"],
    }


def _warm(root: Path) -> None:
    for seg in (root / "commitlog").glob("*.log"):
        with seg.open("rb") as f:
            while f.read(16 * MiB):
                pass


def dispatch_case(root: Path, args: argparse.Namespace, report: Callable[[str], None]) -> dict[str, Any]:
    report(f"writing {args.messages:,} messages of {args.size_bytes} B ...")
    keys = _write_log(root, args)
    _warm(root)
    samples = []
    for run in range(args.runs):
        for on in (False, True) if run % 2 == 0 else (True, False):
            s = _redispatch(root, on, args)
            samples.append({**s, "run": run})
            report(f"run {run} index {'on ' if on else 'off'}: {s['msgs_per_s']:,.0f} messages/s")
    off = statistics.median(s["msgs_per_s"] for s in samples if not s["index"])
    on_ = statistics.median(s["msgs_per_s"] for s in samples if s["index"])
    lookups = _store_lookups(root, keys, args)
    return {"off_msgs_per_s": off, "on_msgs_per_s": on_, "ratio": on_ / off, "samples": samples, "lookups": lookups}


def append_case(base: Path, args: argparse.Namespace, report: Callable[[str], None]) -> dict[str, Any]:
    """Appends of batches with the store's threads running (the dispatcher indexing
    on the other thread, sharing the GIL), index off and on, alternated; medians."""
    body = b"x" * args.size_bytes
    pool = [  # built once: the loop measures the store, not building messages
        [
            Message(TOPIC, j % QUEUES, body, keys=f"order-{b:04d}{j:05d}", properties={"UNIQ_KEY": f"{b:016X}{j:016X}"})
            for j in range(APPEND_BATCH)
        ]
        for b in range(APPEND_POOL_BATCHES)
    ]
    samples = []
    for run in range(args.runs):
        for on in (False, True) if run % 2 == 0 else (True, False):
            root = base / f"append-{run}-{int(on)}"
            store = Store.open(_config(root, on, args)).start()
            try:
                store.create_topic(TOPIC, QUEUES)
                i, t0 = 0, time.perf_counter()
                while time.perf_counter() - t0 < args.append_seconds:
                    store.put_batch(pool[(i // APPEND_BATCH) % APPEND_POOL_BATCHES])
                    i += APPEND_BATCH
                store.catch_up()  # dispatched (and indexed) before the clock stops
                seconds = time.perf_counter() - t0
                sent = i
            finally:
                store.close()
            shutil.rmtree(root)
            samples.append({"index": on, "run": run, "messages": sent, "msgs_per_s": sent / seconds})
            report(f"append run {run} index {'on ' if on else 'off'}: {sent / seconds:,.0f} messages/s")
    off = statistics.median(s["msgs_per_s"] for s in samples if not s["index"])
    on_ = statistics.median(s["msgs_per_s"] for s in samples if s["index"])
    return {"off_msgs_per_s": off, "on_msgs_per_s": on_, "ratio": on_ / off, "samples": samples}


def _store_lookups(root: Path, keys: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """Store.find_by_key (index and record reads) for random keys of the store."""
    rnd = random.Random(7)
    store = Store.open(_config(root, True, args))
    try:
        times, misses = [], 0
        for key in rnd.sample(keys, min(args.lookups, len(keys))):
            t0 = time.perf_counter()
            got = store.find_by_key(TOPIC, key, max_results=32)
            times.append((time.perf_counter() - t0) * 1000)
            misses += got is None or not got.records
    finally:
        store.close()
    return _latency(times, misses, args.messages, "store (index + record reads)")


def _latency(times_ms: list[float], misses: int, size: int, kind: str) -> dict[str, Any]:
    return {
        "kind": kind,
        "indexed_messages": size,
        "lookups": len(times_ms),
        "p50_ms": percentile(times_ms, 50),
        "p99_ms": percentile(times_ms, 99),
        "max_ms": max(times_ms, default=float("nan")),
        "misses": misses,
    }


def _synthetic_rows(lo: int, hi: int) -> np.ndarray:
    """Keys ``lo..hi-1`` as 12-digit decimal strings, one row of bytes each."""
    n = np.arange(lo, hi, dtype=np.int64)
    powers = 10 ** np.arange(KEY_DIGITS - 1, -1, -1, dtype=np.int64)
    return ((n[:, None] // powers) % 10 + 48).astype(np.uint8)


def synthetic_case(
    root: Path, size: int, args: argparse.Namespace, report: Callable[[str], None]
) -> list[dict[str, Any]]:
    directory = root / f"index-{size}"
    index = KeyIndex(directory, IndexSettings(args.slots, args.entries_per_file))
    seed = topic_seed(TOPIC.encode())
    t0 = time.perf_counter()
    for lo in range(0, size, BUILD_CHUNK):
        hi = min(size, lo + BUILD_CHUNK)
        hashes = hash_rows(np.full(hi - lo, seed, dtype=np.uint64), _synthetic_rows(lo, hi))
        offsets = np.arange(lo, hi, dtype=np.int64) * 256
        index.add(hashes, offsets, SYNTHETIC_START_MS + np.arange(lo, hi, dtype=np.int64) // SYNTHETIC_MSGS_PER_MS)
    index.persist()
    build_s = time.perf_counter() - t0
    report(f"built {size:,} entries in {len(index.files)} files in {build_s:.1f} s")
    rnd = random.Random(size)
    out = []
    for ranged in (False, True):
        times, misses = [], 0
        for _ in range(args.lookups):
            i = rnd.randrange(size)
            key = f"{i:0{KEY_DIGITS}d}"
            at = SYNTHETIC_START_MS + i // SYNTHETIC_MSGS_PER_MS
            since, until = (at - 500, at + 500) if ranged else (None, None)
            t = time.perf_counter()
            found = [c for c in index.candidates(TOPIC, key, since, until) if c.offset == i * 256]
            times.append((time.perf_counter() - t) * 1000)
            misses += not found
        kind = "index only, 1 s range" if ranged else "index only, no range"
        out.append({**_latency(times, misses, size, kind), "build_s": build_s, "files": len(index.files)})
        report(f"{size:,} {kind}: p50 {out[-1]['p50_ms']:.3f} ms p99 {out[-1]['p99_ms']:.3f} ms")
    index.close()
    shutil.rmtree(directory)
    return out


def run_all(args: argparse.Namespace, report: Callable[[str], None]) -> dict[str, Any]:
    base = args.dir or Path(tempfile.mkdtemp(prefix="clmq-bench-index-"))
    base.mkdir(parents=True, exist_ok=True)
    try:
        store_root = base / "store"
        dispatch = dispatch_case(store_root, args, report)
        shutil.rmtree(store_root)
        appends = append_case(base, args, report) if args.append_seconds > 0 else None
        lookups = [dispatch["lookups"]]
        for size in args.index_sizes:
            lookups += synthetic_case(base, size, args, report)
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    assert key_hash(TOPIC, "000000000000") == int(
        hash_rows(np.array([topic_seed(TOPIC.encode())], dtype=np.uint64), _synthetic_rows(0, 1))[0]
    )
    settings = {k: getattr(args, k) for k in ("messages", "size_bytes", "runs", "lookups", "slots", "entries_per_file")}
    return {"settings": settings, "dispatch": dispatch, "appends": appends, "lookups": lookups}


def cmd_bench_index(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .report import save
    from .results import draw

    console = Console(soft_wrap=True, stderr=True)
    result = run_all(args, lambda line: console.print(line, highlight=False))
    save(result, markdown(result), args.json, args.markdown, console)
    if args.plot is not None:
        draw(plot, result, args.plot, console)
    return 0

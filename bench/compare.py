"""``clmq bench compare``: CommitLog mode against partition-per-file mode, same workload.

Each case (mode, message size, queue count, traffic pattern, flush mode) runs in a fresh
subprocess so that its peak memory and open descriptors are its own, and the two modes
alternate case by case within every run so that drift of this noisy machine hits both
alike. Figures are medians over ``--runs`` runs; the ratio column is commit-log /
partition-per-file in the same run set.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

from clmq.commitlog import CommitLogConfig, FlushMode
from clmq.common import Message

from .cases import BATCH, MODES, Case, Figures, queue_sequence
from .via_broker import run_case_via_broker


def run_case(case: Case) -> Figures:
    """Measure one case in this process (called in a fresh subprocess)."""
    from clmq.broker.store import Store, StoreConfig

    path = Path(tempfile.mkdtemp(dir=case.root))
    cfg = StoreConfig(
        path,
        CommitLogConfig(flush_mode=FlushMode(case.flush), segment_bytes=256 << 20),
        storage_mode=case.mode,
        max_open_files=1024,
    )
    store = Store.open(cfg).start()
    store.create_topic("bench", case.queues)
    body = b"x" * case.size
    n_batches = max(128, -(-case.queues // BATCH))  # alike for every queue count: only queue ids differ
    seq = queue_sequence(case.pattern, case.queues, n_batches * BATCH)
    batches = [
        [Message("bench", q, body, tags="TagA") for q in seq[i * BATCH : (i + 1) * BATCH]] for i in range(n_batches)
    ]
    producers = 4 if case.flush == "sync" else 1
    latencies: list[float] = []
    fds = [_open_fds()]
    counts = [0] * producers
    start_offset, deadline = store.end_offset, time.perf_counter() + case.seconds

    def produce(p: int) -> None:
        k = p
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            res = store.put_batch(batches[k % n_batches])
            if not res.ok:
                raise RuntimeError(f"{case}: {res.status.value}: {res.error}")
            if case.flush == "sync":
                latencies.append(time.perf_counter() - t0)
            else:  # async: the time until the flusher has made this batch durable

                def durable(t0: float = t0) -> None:  # this batch's t0, not the loop's latest
                    latencies.append(time.perf_counter() - t0)

                store.on_durable(res.end_offset, durable)
            counts[p] += BATCH
            k += producers
            if p == 0 and k % 64 == 0:
                fds.append(_open_fds())

    began = time.perf_counter()
    threads = [threading.Thread(target=produce, args=(p,)) for p in range(producers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - began
    written = store.end_offset - start_offset
    store.wait_durable(store.end_offset, 30)
    fds.append(_open_fds())
    store.close()
    shutil.rmtree(path)
    lat = sorted(latencies) or [0.0]
    return Figures(
        sum(counts) / elapsed,
        written / elapsed / 1e6,
        lat[len(lat) // 2] * 1000,
        lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000,
        max(fds),
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    )


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def run_in_subprocess(case: Case) -> Figures:
    out = subprocess.run(
        [sys.executable, "-m", "clmq.bench.compare", json.dumps(asdict(case))],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"case {case} failed:\n{out.stderr[-2000:]}")
    return Figures(**json.loads(out.stdout.strip().splitlines()[-1]))


def compare(
    root: Path,
    *,
    sizes: list[int],
    queue_counts: list[int],
    patterns: list[str],
    flushes: list[str],
    seconds: float,
    runs: int,
    report: Callable[[str], None],
    via: str = "store",
) -> dict[str, Any]:
    """Every case in both modes, alternating, ``runs`` times; medians per case.

    ``via="store"`` appends in a fresh process per case; ``via="broker"`` sends the same
    batches to a fresh broker process per case over loopback."""
    run_one = run_case_via_broker if via == "broker" else run_in_subprocess
    root.mkdir(parents=True, exist_ok=True)
    keys = [(s, q, p, f) for f in flushes for p in patterns for s in sizes for q in queue_counts]
    samples: dict[tuple[int, int, str, str], dict[str, list[Figures]]] = {k: {m: [] for m in MODES} for k in keys}
    for r in range(runs):
        for s, q, p, f in keys:
            for mode in MODES if r % 2 == 0 else reversed(MODES):  # alternate who goes first, too
                fig = run_one(Case(mode, s, q, p, f, seconds, str(root)))
                samples[(s, q, p, f)][mode].append(fig)
                report(
                    f"run {r + 1}/{runs} {mode:>18} {s:>5} B {q:>6} queues {p:>11} {f:>5}: "
                    f"{fig.msgs_per_s:>10,.0f} msgs/s p99 {fig.p99_ms:7.1f} ms"
                )
    rows = []
    for (s, q, p, f), by_mode in samples.items():
        row: dict[str, Any] = {"size": s, "queues": q, "pattern": p, "flush": f}
        for mode, figs in by_mode.items():
            row[mode] = {k: statistics.median(getattr(x, k) for x in figs) for k in asdict(figs[0])}
        row["ratio"] = row["commitlog"]["msgs_per_s"] / max(1e-9, row["partition-per-file"]["msgs_per_s"])
        rows.append(row)
    return {"runs": runs, "seconds_per_case": seconds, "batch": BATCH, "via": via, "rows": rows}


def plot(result: dict[str, Any], path: Path) -> None:
    """Throughput against queue count (log scale), one line per mode and flush policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    sizes = sorted({r["size"] for r in rows})
    patterns = sorted({r["pattern"] for r in rows}, reverse=True)
    fig, axes = plt.subplots(len(patterns), len(sizes), figsize=(6 * len(sizes), 4.2 * len(patterns)), squeeze=False)
    styles = {"commitlog": "-", "partition-per-file": "--"}
    for i, pattern in enumerate(patterns):
        for j, size in enumerate(sizes):
            ax = axes[i][j]
            for flush in sorted({r["flush"] for r in rows}):
                for mode in MODES:
                    pts = sorted(
                        (r["queues"], r[mode]["msgs_per_s"])
                        for r in rows
                        if r["size"] == size and r["pattern"] == pattern and r["flush"] == flush
                    )
                    ax.plot(
                        [p[0] for p in pts],
                        [p[1] for p in pts],
                        styles[mode],
                        marker="o",
                        label=f"{mode}, {flush} flush",
                    )
            ax.set_xscale("log")
            ax.set_yscale("log")  # partition-per-file's rates are far below: a linear axis hides them
            ax.set_title(f"{size} B messages, {pattern}")
            ax.set_xlabel("queues")
            ax.set_ylabel("messages/s")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    via = " through a broker" if result.get("via") == "broker" else ""
    fig.suptitle(
        f"clmq: CommitLog vs partition-per-file{via}\n(median of {result['runs']} runs, batches of {result['batch']})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    figures = run_case(Case(**json.loads(sys.argv[1])))
    print(json.dumps(asdict(figures)))

"""Where a benchmark's results go: ``--out-dir`` (default ``./clmq-bench-results/``),
as ``<bench>-<UTC time>.json`` and a plot ``.png`` beside it, unless ``--json`` or
``--plot`` name other files. Never loose files in the current directory."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

DEFAULT_OUT_DIR = Path("clmq-bench-results")


def add_out_dir_args(bench_parsers: dict[str, Any]) -> None:
    """``--out-dir`` on every ``clmq bench`` command, and ``--plot`` where it has none."""
    for parser in bench_parsers.values():
        parser.add_argument(
            "--out-dir",
            type=Path,
            default=DEFAULT_OUT_DIR,
            help=f"where the JSON and the plot go (default ./{DEFAULT_OUT_DIR}/, created)",
        )
        if not any("--plot" in a.option_strings for a in parser._actions):
            parser.add_argument(
                "--plot", type=Path, default=None, help="where to draw the plot (default: beside the JSON)"
            )


def resolve_result_paths(args: argparse.Namespace) -> None:
    """Fill ``args.json`` and ``args.plot`` (when not given) with files in ``--out-dir``."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    args.out_dir.mkdir(parents=True, exist_ok=True)
    base = args.out_dir / f"{args.bench}-{stamp}"
    if getattr(args, "json", None) is None:
        args.json = base.with_suffix(".json")
    if getattr(args, "plot", None) is None:
        args.plot = base.with_suffix(".png")


def draw(plot: Any, result: dict[str, Any], path: Path, console: Any) -> None:
    """``plot(result, path)`` if matplotlib (the ``bench`` extra) is here, else say so."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        console.print("[yellow]no plot: it needs matplotlib (pip install 'clmq[bench]')")
        return
    plot(result, path)
    console.print(f"plot: {path}")


def bar_plot(path: Path, title: str, bars: dict[str, float], unit: str, *, log: bool = False) -> None:
    """One horizontal bar per label (the simple plot of a benchmark with few figures)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.5 * len(bars) + 1.6))
    labels = list(bars)
    ax.barh(labels, [bars[k] for k in labels], color="#4C72B0")
    for i, k in enumerate(labels):
        ax.annotate(f" {bars[k]:,.0f}", (bars[k], i), va="center", fontsize=8)
    if log:
        ax.set_xscale("log")
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    ax.set_title(title)
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_store(result: dict[str, Any], path: Path) -> None:
    """``clmq bench store``: append rate per case, and the re-dispatch and read figures."""
    bars = {
        f"append {r['size']} B, {r['queues']:,} queues, {r.get('flush', '')}".rstrip(", "): r["msgs_per_s"]
        for r in result.get("append", [])
    }
    for r in result.get("read") or []:
        bars[f"read back, {r['queues']:,} queues"] = r.get("msgs_per_s", 0)
    if result.get("rebuild"):
        bars["re-dispatch (rebuild), records"] = result["rebuild"]["redispatch_records_per_s"]
        bars["log validation (recovery), records"] = result["rebuild"]["log_validation_records_per_s"]
    if result.get("rebuild_varied"):
        varied = result["rebuild_varied"]
        bars[f"re-dispatch, {varied['body_bytes']} B bodies, records"] = varied["redispatch_records_per_s"]
    if result.get("scale"):
        bars[f"append at {result['scale']['queues']:,} queues"] = result["scale"]["append_msgs_per_s"]
    bar_plot(path, "clmq bench store (medians)", bars, "messages/s", log=True)


def plot_spark(result: dict[str, Any], path: Path) -> None:
    """``clmq bench spark``: rows/s of each workload, clmq beside Parquet, per body size."""
    from .spark_report import plot

    plot(result, path)

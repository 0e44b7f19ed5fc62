"""``clmq bench e2e --plot``: produce and consume msgs/s per queue count for each API
(grouped bars), the sparse case, the produce latency, and the issue's aims as lines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .e2e_report import (
    AIM_CONSUME_MSGS_PER_S,
    AIM_P99_MS,
    AIM_PRODUCE_MANY_OVER_ONE,
    AIM_PRODUCE_ONE_QUEUE_MSGS_PER_S,
    AIM_SIZE,
)


def _pick(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The plaintext rows of the aims' size and async flush, else of the first size and
    flush there are (a run with --tls or --auth is drawn by ``e2e_security.plot``)."""
    rows = [r for r in rows if r.get("mode", "plain") == "plain"]
    if not rows:
        return []
    size = AIM_SIZE if any(r["size"] == AIM_SIZE for r in rows) else rows[0]["size"]
    flush = "async" if any(r["flush"] == "async" for r in rows) else rows[0]["flush"]
    return [r for r in rows if r["size"] == size and r["flush"] == flush]


def _short(value: float) -> str:
    return f"{value / 1000:.0f}k" if value >= 10_000 else f"{value:,.0f}"


def _bars(ax: Any, rows: list[dict[str, Any]], fields: list[tuple[str, str]], apis: list[str]) -> None:
    """Grouped bars: a group per queue count, a bar per (api, field), one colour per api
    (produce hatched where consume is drawn too); black ticks mark the consume fetch
    rate (first batch to last) over the whole-life consume bars."""
    queues = sorted({r["queues"] for r in rows})
    series = [(a, api, field, label) for a, api in enumerate(apis) for field, label in fields]
    width = 0.8 / max(1, len(series))
    for k, (a, api, field, label) in enumerate(series):
        xs, ys, fetch = [], [], []
        for i, q in enumerate(queues):
            r = next((r for r in rows if r["api"] == api and r["queues"] == q), None)
            if r is not None:
                xs.append(i - 0.4 + width * (k + 0.5))
                ys.append(r[field])
                fetch.append(r["consume_fetch_msgs_per_s"])
        hatched = field.startswith("produce") and len(fields) > 1
        bars = ax.bar(
            xs,
            ys,
            width,
            label=f"{api} {label}".strip(),
            color=f"C{a}",
            alpha=0.55 if hatched else 1.0,
            hatch="//" if hatched else None,
        )
        ax.bar_label(bars, [_short(y) for y in ys], fontsize=6)
        if field == "consume_msgs_per_s":
            ax.scatter(xs, fetch, marker="_", color="black", s=80, zorder=3)
    ax.set_xticks(range(len(queues)), [f"{q:,}" for q in queues])
    ax.set_xlabel("queues")
    ax.set_ylabel("msgs/s")


def plot(result: dict[str, Any], path: Path) -> None:
    """Draw the figure to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    apis = list(result["apis"])
    timed, sparse = _pick(result["rows"]), _pick(result.get("sparse", []))
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.6), gridspec_kw={"width_ratios": [3, 3, 4, 2]})
    _bars(axes[0], timed, [("produce_msgs_per_s", "")], apis)
    axes[0].axhline(
        AIM_PRODUCE_ONE_QUEUE_MSGS_PER_S,
        color="red",
        linestyle="--",
        linewidth=0.8,
        label=f"aim: {AIM_PRODUCE_ONE_QUEUE_MSGS_PER_S:,} at 1 queue",
    )
    one = next((r for r in timed if r["api"] == "public" and r["queues"] == 1), None)
    if one:
        axes[0].axhline(
            one["produce_msgs_per_s"] * AIM_PRODUCE_MANY_OVER_ONE,
            color="orange",
            linestyle=":",
            linewidth=0.9,
            label=f"aim: {AIM_PRODUCE_MANY_OVER_ONE} x public at 1 queue",
        )
    axes[0].set_title("timed: produce", fontsize=9)
    _bars(axes[1], timed, [("consume_msgs_per_s", "")], apis)
    axes[1].set_title("timed: consume (bar: whole life, tick: first batch to last)", fontsize=9)
    _bars(axes[2], sparse, [("produce_msgs_per_s", "produce"), ("consume_msgs_per_s", "consume")], apis)
    axes[2].set_title(
        f"sparse: {result.get('sparse_total', 0):,} messages over the queues (tick: consume fetch)", fontsize=9
    )
    for ax in axes[1:3]:
        ax.axhline(
            AIM_CONSUME_MSGS_PER_S,
            color="red",
            linestyle="--",
            linewidth=0.8,
            label=f"aim: consume {AIM_CONSUME_MSGS_PER_S:,}",
        )
    _latency(axes[3], result.get("latency", {}))
    for ax in axes:
        ax.legend(fontsize=7)
    size = timed[0]["size"] if timed else AIM_SIZE
    fig.suptitle(
        f"clmq bench e2e: {size} B messages, async flush, one broker over loopback, medians of {result['runs']} runs",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _latency(ax: Any, latency: dict[str, dict[str, Any]]) -> None:
    apis = list(latency)
    for k, (field, label) in enumerate((("p50_ms", "p50"), ("p99_ms", "p99"), ("max_ms", "max"))):
        ax.bar(
            [i - 0.3 + 0.2 * (k + 0.5) for i in range(len(apis))], [latency[a][field] for a in apis], 0.2, label=label
        )
    ax.axhline(AIM_P99_MS, color="red", linestyle="--", linewidth=0.8, label=f"aim: p99 {AIM_P99_MS:g} ms")
    ax.set_xticks(range(len(apis)), apis)
    ax.set_yscale("log")  # a client that cannot keep up has seconds, one that can has milliseconds
    ax.set_ylabel("ms (log scale)")
    rate = next(iter(latency.values()))["rate_msgs_per_s"] if latency else 0
    ax.set_title(f"produce latency, sync flush, {rate:,.0f} msgs/s", fontsize=9)

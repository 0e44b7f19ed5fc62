"""The figures of ``clmq bench failover`` (JSON) and their table."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from .failover_load import Acks
from .replication_load import percentile


def median_p99(values: list[float]) -> tuple[float | None, float | None]:
    """The median and the nearest-rank p99 (None for no values)."""
    if not values:
        return None, None
    s = sorted(values)
    mid = len(s) // 2
    median = s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2
    return median, percentile(s, 99)


def _rate(acks: Acks, window: tuple[float, float]) -> float | None:
    seconds = window[1] - window[0]
    return acks.messages_between(*window) / seconds if seconds > 0 else None


def summarize(
    args: argparse.Namespace,
    rows: list[dict[str, Any]],
    acks: Acks,
    during: tuple[float, float],
    after: tuple[float, float],
) -> dict[str, Any]:
    """Every figure of the run, JSON-ready (None where there is no value)."""
    kinds: dict[str, Any] = {}
    for kind in args.kinds:
        mine = [r for r in rows if r["kind"] == kind]
        med, p99 = median_p99([r["failover_s"] for r in mine])
        pause_med, pause_p99 = median_p99([r["pause_s"] for r in mine])
        kinds[kind] = {
            "count": len(mine),
            "median_s": med,
            "p99_s": p99,
            "max_s": max((r["failover_s"] for r in mine), default=None),
            "pause_median_s": pause_med,
            "pause_p99_s": pause_p99,
            "errors": sum(r["errors"] for r in mine),
        }
    settings = {
        "failovers": args.failovers,
        "kinds": list(args.kinds),
        "session_ms": args.session_ms,
        "tick_ms": args.tick_ms,
        "senders": args.senders,
        "queues": args.queues,
        "size_bytes": args.size_bytes,
        "batch_messages": args.batch_messages,
        "retry_budget_ms": args.retry_budget_ms,
        "ack_mode": "sync",
        "min_insync_replicas": 2,
        "brokers": 3,
    }
    throughput = {
        "during_msgs_per_s": _rate(acks, during),
        "during_s": during[1] - during[0],
        "after_msgs_per_s": _rate(acks, after),
        "after_s": after[1] - after[0],
    }
    return {
        "settings": settings,
        "failovers": rows,
        "summary": kinds,
        "throughput": throughput,
        "client_errors": len(acks.errors),
        "client_error_samples": acks.errors[:5],
        "acknowledged_messages": sum(acks.messages),
    }


def _s(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.3f}"


def print_report(console: Console, result: dict[str, Any]) -> None:
    """The per-kind table, then throughput and errors."""
    st = result["settings"]
    table = Table(
        title=f"failover: {st['brokers']} brokers, ZooKeeper session {st['session_ms']} ms "
        f"(tickTime {st['tick_ms']} ms), sync acks by {st['min_insync_replicas']}"
    )
    for col in ("kind", "failovers", "median s", "p99 s", "max s", "pause median s", "pause p99 s", "client errors"):
        table.add_column(col, justify="left" if col == "kind" else "right")
    for kind, k in result["summary"].items():
        table.add_row(
            kind,
            str(k["count"]),
            _s(k["median_s"]),
            _s(k["p99_s"]),
            _s(k["max_s"]),
            _s(k["pause_median_s"]),
            _s(k["pause_p99_s"]),
            str(k["errors"]),
        )
    console.print(table)
    tp = result["throughput"]
    rate = {k: "-" if v is None else f"{v:,.0f}" for k, v in tp.items() if k.endswith("msgs_per_s")}
    console.print(
        f"produce: {rate['during_msgs_per_s']} msgs/s during the failovers ({tp['during_s']:.1f} s), "
        f"{rate['after_msgs_per_s']} msgs/s after ({tp['after_s']:.1f} s)"
    )
    console.print(
        f"client errors: {result['client_errors']}"
        + (f" (first: {result['client_error_samples'][0]})" if result["client_errors"] else "")
    )
    for problem in result.get("problems", []):
        console.print(f"[yellow]{problem}")


def plot(result: dict[str, Any], path: Path) -> None:
    """Each failover's time to the new leader's first ack and its write pause, per
    kind, with the issue's aims (SIGKILL: median 3 s, p99 6 s; graceful: pause 1 s)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(result["summary"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, field, title in (
        (axes[0], "failover_s", "death/switch -> first ack of the new leader"),
        (axes[1], "pause_s", "longest write pause around the failover"),
    ):
        for i, kind in enumerate(kinds):
            values = [r[field] for r in result["failovers"] if r["kind"] == kind and r[field] is not None]
            ax.scatter([i + (j % 7 - 3) * 0.03 for j in range(len(values))], values, s=14, alpha=0.7, label=kind)
            med, p99 = median_p99(values)
            if med is not None and p99 is not None:
                ax.hlines([med, p99], i - 0.3, i + 0.3, colors=["black", "grey"], linestyles=["-", ":"])
        ax.axhline(3.0, color="red", linestyle="--", linewidth=0.8, label="aim: SIGKILL median 3 s")
        ax.axhline(6.0, color="red", linestyle=":", linewidth=0.8, label="aim: SIGKILL p99 6 s")
        ax.axhline(1.0, color="green", linestyle="--", linewidth=0.8, label="aim: graceful pause 1 s")
        ax.set_xticks(range(len(kinds)), kinds)
        ax.set_ylabel("seconds")
        ax.set_title(title, fontsize=9)
    axes[0].legend(fontsize=7)
    st = result["settings"]
    fig.suptitle(
        f"clmq bench failover: {st['brokers']} brokers, session {st['session_ms']} ms, tickTime "
        f"{st['tick_ms']} ms, sync acks by {st['min_insync_replicas']} (bar: median, dotted: p99)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)

"""The tables, Markdown and plot of ``clmq bench replication``."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
from pathlib import Path
from typing import Any

from rich.table import Table

HEAD = [
    "queues (written)",
    "followers",
    "ack",
    "flush",
    "msgs/s",
    "MB/s",
    "p50 ms",
    "p99 ms",
    "vs 0 followers",
    "vs sync flush",
    "errors",
    "CPU % client / leader / followers",
]


def _cpu(r: dict[str, Any]) -> str:
    c = r.get("cpu_pct", {})
    followers = [f"{v:.0f}" for k, v in sorted(c.items()) if k.startswith("follower")]
    return f"{c.get('client', 0):.0f} / {c.get('leader', 0):.0f} / {' + '.join(followers) or '-'}"


def _f(x: float, fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def throughput_cells(r: dict[str, Any]) -> list[str]:
    return [
        f"{r['queues']:,} ({r['queues_written']:,.0f})",
        str(r["followers"]),
        r["ack_mode"],
        r["flush_mode"],
        _f(r["msgs_per_s"], ",.0f"),
        _f(r["mb_per_s"], ".1f"),
        _f(r["p50_ms"], ".1f"),
        _f(r["p99_ms"], ".1f"),
        _f(r["vs_0_followers"], ".2f"),
        _f(r["vs_sync_flush"], ".2f"),
        f"{r['errors']:.0f}",
        _cpu(r),
    ]


LAG_HEAD = [
    "queues",
    "target msgs/s",
    "got msgs/s",
    "lag p50 ms",
    "lag p99 ms",
    "lag max ms",
    "lag p50 kB",
    "lag p99 kB",
    "leader's lag_ms p99",
    "CPU % client / leader / followers",
]


def lag_cells(r: dict[str, Any]) -> list[str]:
    return [
        f"{r['queues']:,}",
        _f(r["target_msgs_per_s"], ",.0f"),
        _f(r["msgs_per_s"], ",.0f"),
        _f(r["lag_p50_ms"], ".0f"),
        _f(r["lag_p99_ms"], ".0f"),
        _f(r["lag_max_ms"], ".0f"),
        _f(r["lag_p50_bytes"] / 1e3, ",.0f"),
        _f(r["lag_p99_bytes"] / 1e3, ",.0f"),
        _f(r["leader_lag_ms_p99"], ".0f"),
        _cpu(r),
    ]


def _title(result: dict[str, Any]) -> str:
    s, m = result["settings"], result["machine"]
    return (
        f"{s['size_bytes']} B messages in sends of {s['batch_messages']}, {s['senders']} in flight; median of "
        f"{s['runs']} runs of {s['seconds']:g} s; {m['cpus']} CPUs shared (client on {m['client_cpus']}, "
        f"services {m['broker_cpus']})"
    )


def _catchup_line(c: dict[str, Any]) -> str:
    return (
        f"catch-up of an empty follower: {c['log_mb']:,.0f} MB at {c['mb_per_s']:,.0f} MB/s from its first byte "
        f"({c['copy_s']:.2f} s; {c['mb_per_s_from_listening']:,.0f} MB/s counting from the follower listening), "
        f"replica_catchup_bytes_per_s = {c['catchup_bytes_per_s_setting']:,}"
    )


def print_tables(result: dict[str, Any], console: Any) -> None:
    """The rich tables: throughput, lag, catch-up, aims."""
    table = Table(title=_title(result))
    for col in HEAD:
        table.add_column(col, justify="right")
    for r in result["throughput"]:
        table.add_row(*throughput_cells(r))
    console.print(table)
    if result["lag"]:
        lag = Table(
            title=f"follower lag ({result['settings']['lag_followers']} followers, async acks; lag ms: age of the "
            "oldest byte a follower lacks)"
        )
        for col in LAG_HEAD:
            lag.add_column(col, justify="right")
        for r in result["lag"]:
            lag.add_row(*lag_cells(r))
        console.print(lag)
    if result["catchup"]:
        console.print(_catchup_line(result["catchup"]))
    for a in result["aims"]:
        console.print(
            f"{'[green]met' if a['met'] else '[red]missed'}[/]: {a['aim']}: {a['value']:.2f} (aim {a['target']:g})"
        )


def _md_table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---:" for _ in head) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


def markdown(result: dict[str, Any]) -> str:
    """Every table as Markdown (for docs/benchmarks.md)."""
    out = [_title(result) + ":\n", _md_table(HEAD, [throughput_cells(r) for r in result["throughput"]])]
    if result["lag"]:
        out += [
            f"Follower lag, {result['settings']['lag_followers']} followers, async acks:\n",
            _md_table(LAG_HEAD, [lag_cells(r) for r in result["lag"]]),
        ]
    if result["catchup"]:
        out.append(_catchup_line(result["catchup"]) + ".\n")
    out.append(
        _md_table(
            ["aim", "measured", "met"],
            [[a["aim"], f"{a['value']:.2f}", "yes" if a["met"] else "**no**"] for a in result["aims"]],
        )
    )
    return "\n".join(out)


def plot(result: dict[str, Any], path: Path) -> None:
    """Throughput and ack p99 per case, one panel per queue count; the line is half the
    single broker's sync-flush rate (the aim for sync replication to 2 followers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    queue_counts = sorted({r["queues"] for r in result["throughput"]})
    fig, axes = plt.subplots(2, len(queue_counts), figsize=(6 * len(queue_counts), 7), squeeze=False)
    for col, q in enumerate(queue_counts):
        rows = [r for r in result["throughput"] if r["queues"] == q]
        labels = ["sync flush" if r["flush_mode"] == "sync" else f"{r['followers']}F {r['ack_mode']}" for r in rows]
        colors = [
            "grey" if r["flush_mode"] == "sync" else "tab:blue" if r["ack_mode"] == "async" else "tab:orange"
            for r in rows
        ]
        ax = axes[0][col]
        ax.bar(labels, [r["msgs_per_s"] for r in rows], color=colors)
        ref = [r["msgs_per_s"] for r in rows if r["flush_mode"] == "sync"]
        if ref:
            ax.axhline(ref[0] / 2, color="red", linestyle="--", label="0.5 x sync flush (aim)")
            ax.legend()
        ax.set_title(f"produce, 1 topic of {q:,} queues")
        ax.set_ylabel("msgs/s")
        ax2 = axes[1][col]
        ax2.bar(labels, [r["p99_ms"] for r in rows], color=colors)
        ax2.set_ylabel("ack p99 ms (per send)")
        for a in (ax, ax2):
            a.tick_params(axis="x", rotation=30)
    fig.suptitle(_title(result), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def save(result: dict[str, Any], args: argparse.Namespace, console: Any) -> None:
    """Write the JSON (every figure), the Markdown and the plot if asked."""
    args.json.write_text(json.dumps(result, indent=2))
    if args.markdown:
        args.markdown.write_text(markdown(result))
    if args.plot:
        if importlib.util.find_spec("matplotlib") is not None:  # the bench extra
            plot(result, args.plot)
        else:
            console.print("[yellow]no plot: it needs matplotlib (pip install 'clmq[bench]')")
    console.print(f"JSON written to {args.json}")

"""The figures of ``clmq bench peers``: medians per (load, system, queues, flush), the
ratios clmq / RocketMQ and clmq / Kafka per case, a Markdown table and a plot (grouped
bars per case, one colour per system)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

FIGURES = {  # per load: the figures whose medians are reported; the first is the headline
    "produce": ("msgs_per_s", "broker_cpu_us_per_msg", "client_cpu_us_per_msg", "created_s"),
    "consume": ("msgs_per_s", "broker_cpu_us_per_msg", "client_cpu_us_per_msg"),
    "latency": ("p99_ms", "p50_ms", "p999_ms", "max_ms", "broker_cpu_us_per_msg"),
}
COLOURS = {"clmq": "#4C72B0", "clmq-kafka": "#8172B3", "rocketmq": "#DD8452", "kafka": "#55A868"}


def _median(values: list[Any]) -> float | None:
    vs = [float(v) for v in values if v is not None]
    return statistics.median(vs) if vs else None


def summarize(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """``medians`` (one row per load, system, queues and flush) and ``ratios`` (per case,
    clmq's headline figure over RocketMQ's and Kafka's; for latency a ratio < 1 is better)."""
    groups: dict[tuple[str, str, int, str], list[dict[str, Any]]] = {}
    for s in samples:
        groups.setdefault((s["kind"], s["system"], s["queues"], s["flush"]), []).append(s)
    medians = []
    for (kind, system, queues, flush), group in groups.items():
        row: dict[str, Any] = {"kind": kind, "system": system, "queues": queues, "flush": flush, "runs": len(group)}
        row.update({f: _median([g.get(f) for g in group]) for f in FIGURES[kind]})
        row["incomplete_runs"] = sum(1 for g in group if g["incomplete"])
        medians.append(row)
    return {"medians": medians, "ratios": _ratios(medians)}


def _ratios(medians: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by = {(m["kind"], m["system"], m["queues"], m["flush"]): m for m in medians}
    out = []
    for (kind, system, queues, flush), m in by.items():
        if system != "clmq":
            continue
        head = FIGURES[kind][0]
        row: dict[str, Any] = {"kind": kind, "queues": queues, "flush": flush, "figure": head}
        for peer in ("rocketmq", "kafka"):
            other = by.get((kind, peer, queues, flush))
            mine, theirs = m.get(head), other.get(head) if other else None
            row[f"clmq_over_{peer}"] = mine / theirs if mine is not None and theirs else None
        out.append(row)
    return out


def _fmt(v: Any, digits: int = 0) -> str:
    return "–" if v is None else f"{v:,.{digits}f}"


def markdown(result: dict[str, Any]) -> str:
    """One table per load: the median figures of every system, then clmq's ratios."""
    parts = []
    for kind, figures in FIGURES.items():
        rows = [m for m in result["medians"] if m["kind"] == kind]
        if not rows:
            continue
        rows.sort(key=lambda m: (m["flush"], m["queues"], m["system"]))
        head = ["flush", "queues", "system", *figures]
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        for m in rows:
            cells = [
                m["flush"],
                f"{m['queues']:,}",
                m["system"],
                *(_fmt(m.get(f), 0 if f == "msgs_per_s" else 2) for f in figures),
            ]
            lines.append("| " + " | ".join(cells) + " |")
        parts.append(f"**{kind}** (medians of the runs)\n\n" + "\n".join(lines))
    ratio_lines = ["| load | flush | queues | figure | clmq / RocketMQ | clmq / Kafka |", "|---|---|---|---|---|---|"]
    for r in sorted(result["ratios"], key=lambda r: (r["kind"], r["flush"], r["queues"])):
        cells = [
            r["kind"],
            r["flush"],
            f"{r['queues']:,}",
            r["figure"],
            _fmt(r["clmq_over_rocketmq"], 2),
            _fmt(r["clmq_over_kafka"], 2),
        ]
        ratio_lines.append("| " + " | ".join(cells) + " |")
    parts.append("**ratios** (clmq's own client; for latency below 1 is better)\n\n" + "\n".join(ratio_lines))
    failed = [
        f"- {f['system']}, {f['queues']:,} queues, {f['flush']} flush, run {f['run']}: {f['error']}"
        for f in result.get("failures", [])
    ]
    if failed:
        parts.append("**failed cases** (no figures)\n\n" + "\n".join(failed))
    return "\n\n".join(parts) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    """One panel per load: grouped bars per case (flush, queues), one colour per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [k for k in FIGURES if any(m["kind"] == k for m in result["medians"])]
    fig, axes = plt.subplots(len(kinds), 1, figsize=(10, 3.6 * len(kinds)), squeeze=False)
    for ax, kind in zip(axes[:, 0], kinds):
        rows = [m for m in result["medians"] if m["kind"] == kind]
        cases = sorted({(m["flush"], m["queues"]) for m in rows})
        systems = [s for s in COLOURS if any(m["system"] == s for m in rows)]
        width = 0.8 / max(len(systems), 1)
        head = FIGURES[kind][0]
        for i, system in enumerate(systems):
            values = {(m["flush"], m["queues"]): m.get(head) or 0.0 for m in rows if m["system"] == system}
            xs = [c + i * width for c in range(len(cases))]
            ax.bar(xs, [values.get(case, 0.0) for case in cases], width, label=system, color=COLOURS[system])
        ax.set_xticks([c + width * (len(systems) - 1) / 2 for c in range(len(cases))])
        ax.set_xticklabels([f"{q:,} queues\n{f} flush" for f, q in cases], fontsize=8)
        ax.set_yscale("log")  # the systems differ by up to 1,000 x: a linear scale hides the small bars
        ax.set_ylabel("ms (p99, log scale)" if kind == "latency" else "messages/s (log scale)")
        ax.set_title(f"{kind}: {'p99 latency, lower is better' if kind == 'latency' else 'throughput'} (medians)")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("clmq bench peers: 1 KiB messages, each system with its own official client")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

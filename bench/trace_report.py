"""``clmq bench trace``'s figures: medians per case and kind, the traced / untraced
ratios, the aim of issue 32 (tracing costs at most 10 % of throughput), the Markdown
tables and the plot."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from .report import _table

AIM_TRACED_OVER_UNTRACED = 0.9  # throughput with tracing at least 90 % of without
CASES = ("produce", "consume")


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def summary(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Per case: the median rate and CPU of each kind, the traced / untraced ratio of
    each run (both measured one after the other) and their median."""
    out: dict[str, Any] = {}
    for case in CASES:
        rows = [s for s in samples if s["case"] == case]
        by = {(s["run"], s["kind"]): s for s in rows}
        ratios = [
            by[(r, "traced")]["msgs_per_s"] / by[(r, "untraced")]["msgs_per_s"]
            for r in sorted({s["run"] for s in rows})
            if (r, "traced") in by and by.get((r, "untraced"), {}).get("msgs_per_s")
        ]
        case_out: dict[str, Any] = {"ratios_by_run": ratios, "ratio_median_of_runs": _median(ratios)}
        for kind in ("untraced", "traced"):
            mine = [s for s in rows if s["kind"] == kind]
            case_out[kind] = {
                f: _median([s[f] for s in mine])
                for f in ("msgs_per_s", "client_cpu_us_per_msg", "broker_cpu_us_per_msg")
            }
        traced = [s["trace_events"] for s in rows if s["kind"] == "traced"]
        case_out["trace_events"] = {k: sum(t.get(k, 0) for t in traced) for k in ("recorded", "written", "dropped")}
        out[case] = case_out
    return out


def aims(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The aim, per case, on the median of the per-run ratios."""
    return [
        {
            "aim": f"{case}: traced / untraced msgs/s (median of runs)",
            "value": result["summary"][case]["ratio_median_of_runs"],
            "target": AIM_TRACED_OVER_UNTRACED,
            "met": bool(result["summary"][case]["ratio_median_of_runs"] >= AIM_TRACED_OVER_UNTRACED),
        }
        for case in CASES
    ]


def markdown(result: dict[str, Any]) -> str:
    s, m = result["settings"], result["summary"]
    rows = []
    for case in CASES:
        for kind in ("untraced", "traced"):
            k = m[case][kind]
            ev = m[case]["trace_events"] if kind == "traced" else None
            rows.append(
                [
                    case,
                    kind,
                    f"{k['msgs_per_s']:,.0f}",
                    f"{k['client_cpu_us_per_msg']:.1f}",
                    f"{k['broker_cpu_us_per_msg']:.1f}",
                    f"{ev['written']:,} / {ev['dropped']:,}" if ev else "-",
                ]
            )
    out = [
        f"### Produce ({s['senders']} sends in flight, one {s['size_bytes']} B message per send, {s['seconds']} s) "
        f"and consume ({s['consume_messages']:,} messages, a fresh group per run); {s['runs']} runs, alternated\n",
        _table(
            ["case", "kind", "msgs/s (median)", "client CPU us/msg", "broker CPU us/msg", "events written / dropped"],
            rows,
        ),
        "\n"
        + "".join(
            f"Ratio traced / untraced, {case}: median of runs {m[case]['ratio_median_of_runs']:.2f} "
            f"(runs: {', '.join(f'{r:.2f}' for r in m[case]['ratios_by_run'])})\n\n"
            for case in CASES
        ),
        f"%TRACE% records at the end: {result['trace_records']:,}\n",
        "\n### Aims\n",
        _table(
            ["aim", "value", "target", "met"],
            [[a["aim"], f"{a['value']:.2f}", f"{a['target']:g}", "yes" if a["met"] else "no"] for a in result["aims"]],
        ),
    ]
    return "".join(out)


def plot(result: dict[str, Any], path: Path) -> None:
    """Per case, the median rate untraced and traced, with the aim's line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m, s = result["summary"], result["settings"]
    fig, axes = plt.subplots(1, len(CASES), figsize=(10, 4.2))
    for ax, case in zip(axes, CASES):
        values = [m[case][k]["msgs_per_s"] for k in ("untraced", "traced")]
        bars = ax.bar(["untraced", "traced"], values, color=["C0", "C1"])
        ax.bar_label(bars, [f"{v:,.0f}" for v in values], fontsize=8)
        ax.axhline(
            values[0] * AIM_TRACED_OVER_UNTRACED,
            color="red",
            linestyle="--",
            linewidth=0.8,
            label=f"aim: {AIM_TRACED_OVER_UNTRACED} x untraced",
        )
        ax.set_title(f"{case} (ratio {m[case]['ratio_median_of_runs']:.2f}, median of runs)", fontsize=9)
        ax.set_ylabel("msgs/s")
        ax.legend(fontsize=7)
    fig.suptitle(
        f"clmq bench trace: {s['size_bytes']} B, {s['senders']} senders, one broker process over loopback", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

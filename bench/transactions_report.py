"""``clmq bench transactions``'s figures: the medians of the send rates, the aims of
issue 32, the Markdown tables and the plot."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from .report import _table

AIM_TRANSACTIONAL_OVER_PLAIN = 0.5  # transactional sends at least half as fast as plain ones
AIM_P99_COMMIT_TO_VISIBLE_MS = 100.0  # a long-polling consumer sees a commit within this, p99


def throughput_summary(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of the plain and transactional rates; the median of the per-run ratios
    (each run measured both, one after the other) and the ratio of the medians."""
    kinds = ("plain", "transactional")
    rate = {k: [s["msgs_per_s"] for s in samples if s["kind"] == k] for k in kinds}
    by_kind = {(s["run"], s["kind"]): s["msgs_per_s"] for s in samples}
    by_run = [
        by_kind[(r, "transactional")] / by_kind[(r, "plain")]
        for r in sorted({s["run"] for s in samples})
        if by_kind.get((r, "plain")) and (r, "transactional") in by_kind
    ]
    med = {k: statistics.median(rate[k]) if rate[k] else math.nan for k in kinds}
    cpu = {
        f"{k}_{w}_cpu_us_per_msg": statistics.median(s[f"{w}_cpu_us_per_msg"] for s in samples if s["kind"] == k)
        for k in kinds
        for w in ("client", "broker")
        if rate[k]
    }
    return {
        **cpu,
        "plain_msgs_per_s": med["plain"],
        "transactional_msgs_per_s": med["transactional"],
        "ratio_of_medians": med["transactional"] / med["plain"] if med["plain"] else math.nan,
        "ratio_median_of_runs": statistics.median(by_run) if by_run else math.nan,
        "ratios_by_run": by_run,
        "failed": sum(s["failed"] for s in samples),
        "samples": samples,
    }


def _aim(name: str, value: float, target: float, met: bool) -> dict[str, Any]:
    return {"aim": name, "value": value, "target": target, "met": bool(met)}


def aims(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Each aim with the figure it is judged on; a message never received fails the latency aim."""
    t = result["throughput"]
    tx = next(r for r in result["latency"] if r["kind"] == "transactional")
    ratio = t["ratio_median_of_runs"]
    p99 = tx["p99_ms"] if tx["received"] == tx["messages"] else math.inf
    return [
        _aim(
            "transactional / plain send rate (median of runs)",
            ratio,
            AIM_TRANSACTIONAL_OVER_PLAIN,
            ratio >= AIM_TRANSACTIONAL_OVER_PLAIN,
        ),
        _aim("commit-to-visible p99, ms", p99, AIM_P99_COMMIT_TO_VISIBLE_MS, p99 <= AIM_P99_COMMIT_TO_VISIBLE_MS),
    ]


def markdown(result: dict[str, Any]) -> str:
    t, s = result["throughput"], result["settings"]
    out = [
        f"### Send rate ({s['size_bytes']} B bodies, {s['senders']} sends in flight, one message per send, "
        f"{s['runs']} runs of {s['seconds']} s each)\n",
        _table(
            ["kind", "msgs/s (median)", "client CPU us/msg", "broker CPU us/msg"],
            [
                [
                    k,
                    f"{t[f'{k}_msgs_per_s']:,.0f}",
                    f"{t.get(f'{k}_client_cpu_us_per_msg', math.nan):.1f}",
                    f"{t.get(f'{k}_broker_cpu_us_per_msg', math.nan):.1f}",
                ]
                for k in ("plain", "transactional")
            ],
        ),
        f"\nRatio transactional / plain: median of runs {t['ratio_median_of_runs']:.2f} "
        f"(runs: {', '.join(f'{r:.2f}' for r in t['ratios_by_run'])}); failed: {t['failed']}\n",
        f"\n### Send (plain) or commit (transactional) to receipt by a long-polling consumer "
        f"({s['latency_messages']} messages, {s['latency_senders']} in flight)\n",
        _table(
            ["kind", "received", "p50 ms", "p90 ms", "p99 ms", "max ms"],
            [
                [
                    r["kind"],
                    f"{r['received']:,} / {r['messages']:,}",
                    *(f"{r[f]:.1f}" for f in ("p50_ms", "p90_ms", "p99_ms", "max_ms")),
                ]
                for r in result["latency"]
            ],
        ),
        "\n### Aims\n",
        _table(
            ["aim", "value", "target", "met"],
            [[a["aim"], f"{a['value']:.2f}", f"{a['target']:g}", "yes" if a["met"] else "no"] for a in result["aims"]],
        ),
    ]
    return "".join(out)


def plot(result: dict[str, Any], path: Path) -> None:
    """Two panels: send rates with the aim, latency percentiles with the aim."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rates, lat) = plt.subplots(1, 2, figsize=(11, 4.4))
    t = result["throughput"]
    values = [t["plain_msgs_per_s"], t["transactional_msgs_per_s"]]
    bars = rates.bar(["plain", "transactional"], values, color=["C0", "C1"])
    rates.bar_label(bars, [f"{v:,.0f}" for v in values], fontsize=8)
    rates.axhline(
        t["plain_msgs_per_s"] * AIM_TRANSACTIONAL_OVER_PLAIN,
        color="red",
        linestyle="--",
        linewidth=0.8,
        label=f"aim: {AIM_TRANSACTIONAL_OVER_PLAIN} x plain",
    )
    rates.set_title(f"send rate (ratio {t['ratio_median_of_runs']:.2f}, median of runs)", fontsize=9)
    rates.set_ylabel("msgs/s")
    rows = result["latency"]
    xs = list(range(len(rows)))
    for k, (field, name) in enumerate((("p50_ms", "p50"), ("p99_ms", "p99"), ("max_ms", "max"))):
        lat.bar([x - 0.3 + 0.2 * (k + 0.5) for x in xs], [r[field] for r in rows], 0.2, label=name)
    lat.axhline(
        AIM_P99_COMMIT_TO_VISIBLE_MS,
        color="red",
        linestyle="--",
        linewidth=0.8,
        label=f"aim: p99 {AIM_P99_COMMIT_TO_VISIBLE_MS:g} ms",
    )
    lat.set_xticks(xs, ["plain: send to receipt", "transactional: commit to receipt"])
    lat.set_ylabel("ms")
    lat.set_title("to visible, with a long-polling consumer", fontsize=9)
    for ax in (rates, lat):
        ax.legend(fontsize=7)
    s = result["settings"]
    fig.suptitle(
        f"clmq bench transactions: {s['size_bytes']} B, {s['senders']} senders, one broker process over loopback",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

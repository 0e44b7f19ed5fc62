"""``clmq bench delay``'s figures: the medians of the send rates, the aims of issue 20,
the Markdown tables and the plot."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from .report import _table

AIM_SCHEDULED_OVER_PLAIN = 0.5  # scheduled sends at least half as fast as plain ones
AIM_P99_LATENESS_MS = 1000.0  # at the largest pending count
AIM_BYTES_PER_PENDING = 64.0  # broker memory per pending message


def throughput_summary(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of the plain and scheduled rates; the median of the per-run ratios (each
    run measured both, one after the other) and the ratio of the medians."""
    rate = {k: [s["msgs_per_s"] for s in samples if s["kind"] == k] for k in ("plain", "scheduled")}
    by_kind = {(s["run"], s["kind"]): s["msgs_per_s"] for s in samples}
    by_run = [
        by_kind[(r, "scheduled")] / by_kind[(r, "plain")]
        for r in sorted({s["run"] for s in samples})
        if by_kind.get((r, "plain")) and (r, "scheduled") in by_kind
    ]
    plain = statistics.median(rate["plain"]) if rate["plain"] else math.nan
    sched = statistics.median(rate["scheduled"]) if rate["scheduled"] else math.nan
    cpu = {
        f"{k}_{w}_cpu_us_per_msg": statistics.median(s[f"{w}_cpu_us_per_msg"] for s in samples if s["kind"] == k)
        for k in ("plain", "scheduled")
        for w in ("client", "broker")
        if rate[k]
    }
    return {
        **cpu,
        "plain_msgs_per_s": plain,
        "scheduled_msgs_per_s": sched,
        "ratio_of_medians": sched / plain if plain else math.nan,
        "ratio_median_of_runs": statistics.median(by_run) if by_run else math.nan,
        "ratios_by_run": by_run,
        "failed": sum(s["failed"] for s in samples),
        "samples": samples,
    }


def _aim(name: str, value: float, target: float, met: bool) -> dict[str, Any]:
    return {"aim": name, "value": value, "target": target, "met": bool(met)}


def aims(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Each aim with the figure it is judged on; the precision and memory aims at the
    largest pending count measured. A message that never arrived fails the lateness aim."""
    t = result["throughput"]
    out = [
        _aim(
            "scheduled / plain send rate (median of runs)",
            t["ratio_median_of_runs"],
            AIM_SCHEDULED_OVER_PLAIN,
            t["ratio_median_of_runs"] >= AIM_SCHEDULED_OVER_PLAIN and t["failed"] == 0,
        )
    ]
    if result["precision"]:
        big = max(result["precision"], key=lambda r: r["pending"])
        out.append(
            _aim(
                f"lateness p99 at {big['pending']:,} pending (ms)",
                big["p99_ms"],
                AIM_P99_LATENESS_MS,
                big["p99_ms"] <= AIM_P99_LATENESS_MS and big["missing"] == 0,
            )
        )
        m = big["memory"]
        out.append(
            _aim(
                f"broker VmRSS growth per pending message at {big['pending']:,} (B)",
                m["rss_bytes_per_pending"],
                AIM_BYTES_PER_PENDING,
                m["rss_bytes_per_pending"] <= AIM_BYTES_PER_PENDING,
            )
        )
        out.append(
            _aim(
                f"timer_memory_bytes per pending message at {big['pending']:,} (B)",
                m["timer_memory_bytes_per_pending"],
                AIM_BYTES_PER_PENDING,
                m["timer_memory_bytes_per_pending"] <= AIM_BYTES_PER_PENDING,
            )
        )
    return out


def markdown(result: dict[str, Any]) -> str:
    t = result["throughput"]
    s = result["settings"]
    out = [
        f"Send rate, {s['size_bytes']} B bodies, batches of {s['batch']}, {s['senders']} senders, "
        f"{s['runs']} runs of {s['seconds']:g} s each (alternated), "
        f"scheduled {s['schedule_delay_ms'] / 60000:g} min ahead:\n",
        _table(
            [
                "plain msgs/s",
                "scheduled msgs/s",
                "scheduled / plain (median of runs)",
                "ratio of medians",
                "failed",
                "CPU us/msg plain: client / broker",
                "CPU us/msg scheduled: client / broker",
            ],
            [
                [
                    f"{t['plain_msgs_per_s']:,.0f}",
                    f"{t['scheduled_msgs_per_s']:,.0f}",
                    f"**{t['ratio_median_of_runs']:.2f}**",
                    f"{t['ratio_of_medians']:.2f}",
                    str(t["failed"]),
                    _cpu(t, "plain"),
                    _cpu(t, "scheduled"),
                ]
            ],
        ),
    ]
    if result["precision"]:
        out.append("\nDelivery precision (lateness = consumer receive time - DELIVER_AT_MS) and memory:\n")
        out.append(
            _table(
                [
                    "pending",
                    "scheduled in s (msgs/s)",
                    "pending at window",
                    "due in window",
                    "received",
                    "p50 ms",
                    "p99 ms",
                    "max ms",
                    "VmRSS B / pending",
                    "RssAnon B / pending",
                    "timer_memory_bytes / pending",
                ],
                [
                    [
                        f"{r['pending']:,}",
                        f"{r['schedule_s']:.1f} ({r['schedule_msgs_per_s']:,.0f})",
                        f"{r['pending_at_window']:,}",
                        f"{r['expected']:,}",
                        f"{r['samples']:,}",
                        f"{r['p50_ms']:.0f}",
                        f"**{r['p99_ms']:.0f}**",
                        f"{r['max_ms']:.0f}",
                        f"{r['memory']['rss_bytes_per_pending']:.1f}",
                        f"{r['memory']['rss_anon_bytes_per_pending']:.1f}",
                        f"{r['memory']['timer_memory_bytes_per_pending']:.1f}",
                    ]
                    for r in result["precision"]
                ],
            )
        )
    out.append("\nAims:\n")
    out.append(
        _table(
            ["aim", "measured", "target", "met"],
            [
                [a["aim"], f"{a['value']:,.2f}", f"{a['target']:g}", "yes" if a["met"] else "**no**"]
                for a in result["aims"]
            ],
        )
    )
    return "\n".join(out)


def _cpu(t: dict[str, Any], kind: str) -> str:
    client, broker = t.get(f"{kind}_client_cpu_us_per_msg"), t.get(f"{kind}_broker_cpu_us_per_msg")
    return "-" if client is None or broker is None else f"{client:.1f} / {broker:.1f}"


def plot(result: dict[str, Any], path: Path) -> None:
    """Three panels: send rates, lateness per pending count, bytes per pending message."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    t = result["throughput"]
    bars = axes[0].bar(["plain", "scheduled"], [t["plain_msgs_per_s"], t["scheduled_msgs_per_s"]], color=["C0", "C1"])
    axes[0].bar_label(bars, [f"{v:,.0f}" for v in (t["plain_msgs_per_s"], t["scheduled_msgs_per_s"])], fontsize=8)
    axes[0].axhline(
        t["plain_msgs_per_s"] * AIM_SCHEDULED_OVER_PLAIN,
        color="red",
        linestyle="--",
        linewidth=0.8,
        label=f"aim: {AIM_SCHEDULED_OVER_PLAIN} x plain",
    )
    axes[0].set_title(f"send_batch rate (ratio {t['ratio_median_of_runs']:.2f})", fontsize=9)
    axes[0].set_ylabel("msgs/s")
    _precision(axes[1], axes[2], result["precision"])
    for ax in axes:
        ax.legend(fontsize=7)
    s = result["settings"]
    fig.suptitle(
        f"clmq bench delay: {s['size_bytes']} B, batches of {s['batch']}, {s['senders']} senders, one broker "
        "process over loopback",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _precision(lat: Any, mem: Any, rows: list[dict[str, Any]]) -> None:
    labels = [f"{r['pending']:,}" for r in rows]
    xs = list(range(len(rows)))
    for k, (field, name) in enumerate((("p50_ms", "p50"), ("p99_ms", "p99"), ("max_ms", "max"))):
        lat.bar([x - 0.3 + 0.2 * (k + 0.5) for x in xs], [r[field] for r in rows], 0.2, label=name)
    lat.axhline(
        AIM_P99_LATENESS_MS, color="red", linestyle="--", linewidth=0.8, label=f"aim: p99 {AIM_P99_LATENESS_MS:g} ms"
    )
    lat.set_xticks(xs, labels)
    lat.set_xlabel("messages pending")
    lat.set_ylabel("lateness, ms")
    lat.set_title("delivery lateness (receive - DELIVER_AT_MS)", fontsize=9)
    fields = (
        ("rss_bytes_per_pending", "VmRSS growth"),
        ("rss_anon_bytes_per_pending", "RssAnon growth"),
        ("timer_memory_bytes_per_pending", "timer_memory_bytes"),
    )
    for k, (field, name) in enumerate(fields):
        mem.bar([x - 0.3 + 0.2 * (k + 0.5) for x in xs], [max(r["memory"][field], 0.1) for r in rows], 0.2, label=name)
    mem.axhline(
        AIM_BYTES_PER_PENDING, color="red", linestyle="--", linewidth=0.8, label=f"aim: {AIM_BYTES_PER_PENDING:g} B"
    )
    mem.set_yscale("log")  # 10k pending carries the wheel's fixed slots: hundreds of bytes each
    mem.set_xticks(xs, labels)
    mem.set_xlabel("messages pending")
    mem.set_ylabel("bytes per pending message (log)")
    mem.set_title("broker memory per pending message", fontsize=9)

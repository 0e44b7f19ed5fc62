"""``clmq bench index``'s Markdown tables and plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .report import _table

AIM_DISPATCH_RATIO = 0.8  # dispatch with the index at least 0.8 x without
AIM_LOOKUP_P99_MS = 50.0


def markdown(result: dict[str, Any]) -> str:
    d, s = result["dispatch"], result["settings"]
    head = (
        f"Dispatch of {s['messages']:,} messages of {s['size_bytes']} B (one key and a UNIQ_KEY each), "
        f"{s['runs']} runs each, medians:\n\n"
    )
    dispatch = _table(
        ["index", "messages/s (median)", "ratio on / off", f"aim >= {AIM_DISPATCH_RATIO}"],
        [
            ["off", f"{d['off_msgs_per_s']:,.0f}", "", ""],
            [
                "on",
                f"{d['on_msgs_per_s']:,.0f}",
                f"{d['ratio']:.2f}",
                "met" if d["ratio"] >= AIM_DISPATCH_RATIO else "not met",
            ],
        ],
    )
    a = result.get("appends")
    if a:
        dispatch += "\n" + _table(
            ["index", "appends msgs/s, threads running (median)", "ratio on / off"],
            [["off", f"{a['off_msgs_per_s']:,.0f}", ""], ["on", f"{a['on_msgs_per_s']:,.0f}", f"{a['ratio']:.2f}"]],
        )
    rows = [
        [
            f"{r['indexed_messages']:,}",
            r["kind"],
            str(r["lookups"]),
            f"{r['p50_ms']:.3f}",
            f"{r['p99_ms']:.3f}",
            f"{r['max_ms']:.3f}",
            str(r["misses"]),
            "met" if r["p99_ms"] <= AIM_LOOKUP_P99_MS and not r["misses"] else "not met",
        ]
        for r in result["lookups"]
    ]
    lookups = _table(
        [
            "indexed messages",
            "look-up",
            "look-ups",
            "p50 ms",
            "p99 ms",
            "max ms",
            "misses",
            f"p99 <= {AIM_LOOKUP_P99_MS:.0f} ms",
        ],
        rows,
    )
    return head + dispatch + "\n" + lookups


def plot(result: dict[str, Any], path: Path) -> None:
    """Dispatch rates (left) and look-up p50/p99 per case (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = result["dispatch"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [1, 2]})
    bars = {"dispatch\nindex off": d["off_msgs_per_s"], "dispatch\nindex on": d["on_msgs_per_s"]}
    a = result.get("appends")
    if a:
        bars.update({"appends\nindex off": a["off_msgs_per_s"], "appends\nindex on": a["on_msgs_per_s"]})
    left.bar(list(bars), list(bars.values()), color=["#999999", "#4C72B0"] * (len(bars) // 2))
    for i, v in enumerate(bars.values()):
        left.annotate(f"{v:,.0f}", (i, v), ha="center", va="bottom", fontsize=7)
    left.set_ylabel("messages/s (median)")
    left.set_yscale("log")
    left.tick_params(axis="x", labelsize=7)
    ratios = f"dispatch {d['ratio']:.2f}" + (f", appends {a['ratio']:.2f}" if a else "")
    left.set_title(f"on / off: {ratios}", fontsize=9)
    labels = [f"{r['indexed_messages'] / 1e6:g} M\n{r['kind']}" for r in result["lookups"]]
    xs = range(len(labels))
    right.bar([x - 0.2 for x in xs], [r["p50_ms"] for r in result["lookups"]], 0.4, label="p50")
    right.bar([x + 0.2 for x in xs], [r["p99_ms"] for r in result["lookups"]], 0.4, label="p99")
    right.set_xticks(list(xs), labels, fontsize=7)
    right.set_ylabel("ms")
    right.set_yscale("log")
    right.set_title("look-up latency")
    right.legend()
    right.grid(True, axis="y", alpha=0.3)
    fig.suptitle("clmq bench index")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

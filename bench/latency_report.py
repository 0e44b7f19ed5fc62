"""``clmq bench latency``'s figures: one case's processes combined, the issue's aims,
the Markdown table and the plots (a summary, and latency over time per case)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from . import latency_hist

KINDS = ("broker", "replicated", "e2e")
STALL_KINDS_SHOWN = 3  # the table names the task kinds that stalled most (the JSON has all)
SATURATED_CPU_SHARE = 0.9  # a producer process busier than this share of one core is the bottleneck
SATURATED_RATE_SHARE = 0.98  # ... as is one that submitted below this share of the rate
# (aim, kind, rate msgs/s, histogram, percentile field, limit ms); all with sync flush
AIMS = [
    ("10k msgs/s, one broker: p99 <= 2 ms", "broker", 10_000, "ack", "p99_ms", 2.0),
    ("10k msgs/s, one broker: p99.9 <= 5 ms", "broker", 10_000, "ack", "p99_9_ms", 5.0),
    ("50k msgs/s, one broker: p99 <= 5 ms", "broker", 50_000, "ack", "p99_ms", 5.0),
    ("10k msgs/s, sync replication to 2 followers: p99 <= 5 ms", "replicated", 10_000, "ack", "p99_ms", 5.0),
    ("10k msgs/s, end to end to a long-polling consumer: p99 <= 5 ms", "e2e", 10_000, "e2e", "p99_ms", 5.0),
]


def _merged(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return latency_hist.summary(latency_hist.merge(d["hist"][name] for d in docs))


def _generator(case: dict[str, Any], docs: list[dict[str, Any]], t0_ns: int) -> dict[str, Any]:
    """How the load processes kept up: the rate they achieved, their CPU, whether saturated."""
    submitted = sum(d["submitted"] for d in docs)
    span_s = (max(d["last_submit_ns"] for d in docs) - t0_ns) / 1e9 + 1 / case["rate"]
    achieved = submitted / span_s if span_s > 0 else 0.0
    cpu_s = sum(d["cpu_s"] for d in docs)
    # CPU share of one core while the producer was submitting (from t0 to its last submit)
    busiest = max(d["gen_cpu_s"] / max(1e-9, (d["last_submit_ns"] - t0_ns) / 1e9) for d in docs)
    return {
        "achieved_msgs_per_s": achieved,
        "client_cpu_us_per_msg": cpu_s * 1e6 / submitted if submitted else None,
        "busiest_producer_cpu_share": busiest,
        "generator_saturated": busiest > SATURATED_CPU_SHARE or achieved < SATURATED_RATE_SHARE * case["rate"],
    }


def combine(case: dict[str, Any], raw: dict[str, Any], args: argparse.Namespace, problems: list[str]) -> dict[str, Any]:
    """One case's figures from its processes' results."""
    docs, consumer = raw["producers"], raw["consumer"]
    submitted, scheduled = sum(d["submitted"] for d in docs), sum(d["scheduled"] for d in docs)
    out: dict[str, Any] = {
        **case,
        "seconds": args.seconds,
        "warmup_seconds": args.warmup_seconds,
        "message_bytes": args.message_bytes,
        "scheduled": scheduled,
        "submitted": submitted,  # fewer: the generator fell --behind-max-seconds behind and stopped
        "measured": sum(d["measured"] for d in docs),
        "acked": sum(d["acked"] for d in docs),
        "failed": sum(d["failed"] for d in docs),
        "first_error": next((d["first_error"] for d in docs if d["first_error"]), ""),
        "ack": _merged(docs, "ack"),
        "ack_from_submit": _merged(docs, "ack_from_submit"),
        "generator_late": _merged(docs, "late"),
        **_generator(case, docs, raw["t0_ns"]),
        "service_cpu_s": raw["service_cpu_s"],
        "broker_cpu_us_per_msg": raw["service_cpu_s"].get("leader", 0.0) * 1e6 / max(1, submitted),
        "stalls": raw["stalls"],
        "service_problems": problems,
        "timeline": latency_hist.timeline(d["per_second"] for d in docs),
    }
    if consumer is not None:
        out["e2e"] = _merged([consumer], "e2e")
        out["delivered"] = consumer["delivered"]
        out["duplicates"] = consumer["duplicates"]
        out["e2e_timeline"] = latency_hist.timeline([consumer["per_second"]])
    out["complete"] = out["failed"] == 0 and out["acked"] == scheduled and out.get("delivered", scheduled) == scheduled
    return out


def aims(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's aims, each met, not met, or not measured by this run; with the disk's
    floor measured right before the aim's case (``latency_floor``): above the aim, no
    broker would have reached it on this disk then."""
    out = []
    for text, kind, rate, hist, field, limit in AIMS:
        r = next((r for r in results if (r["kind"], r["rate"], r["flush"]) == (kind, rate, "sync")), None)
        value = (r.get(hist) or {}).get(field) if r else None
        status = "not measured" if value is None else ("met" if value <= limit else "not met")
        if r is not None and r["generator_saturated"]:
            status += " (generator saturated)"
        floor = ((r or {}).get("disk_floor") or {}).get("floor", {}).get(field)
        if floor is not None and floor > limit:
            status += " (below the disk's floor)"
        out.append({"aim": text, "value_ms": value, "limit_ms": limit, "disk_floor_ms": floor, "status": status})
    return out


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _stall_text(stalls: dict[str, Any]) -> str:
    """``N, longest X ms (task n, ...)`` from the broker's stall detector (stalls while the
    load ran; the longest since the broker started); n/a without one."""
    if "loop_stalls" not in stalls:
        return "n/a"
    by_task = stalls.get("loop_stalls_by_task_during_load") or {}
    top = sorted(by_task.items(), key=lambda kv: -kv[1])[:STALL_KINDS_SHOWN]
    kinds = ", ".join(f"{k} {n}" for k, n in top) + (", ..." if len(by_task) > len(top) else "")
    count = stalls.get("loop_stalls_during_load", stalls["loop_stalls"])
    off = stalls.get("loop_stalls_off_cpu_during_load")
    head = f"{count}" + (f" ({off} off CPU)" if off else "")
    return f"{head}, longest {stalls.get('loop_stall_max_ms')} ms" + (f": {kinds}" if kinds else "")


def _row(r: dict[str, Any]) -> str:
    ack, e2e, late = r["ack"], r.get("e2e") or {}, r["generator_late"]
    cells = [
        r["kind"],
        r["flush"],
        f"{r['rate']:,}",
        str(r["producers"]),
        f"{r['achieved_msgs_per_s']:,.0f}" + (" (saturated)" if r["generator_saturated"] else ""),
        *(_ms(ack[k]) for k in ("p50_ms", "p99_ms", "p99_9_ms", "max_ms")),
        " / ".join(_ms(e2e.get(k)) for k in ("p50_ms", "p99_ms", "p99_9_ms", "max_ms")) if e2e else "-",
        f"{r['acked']:,}/{r['scheduled']:,}"
        + (f", {r['scheduled'] - r['submitted']:,} not sent" if r["scheduled"] > r["submitted"] else "")
        + (f", {r['failed']:,} failed" if r["failed"] else "")
        + (f", {r['delivered']:,} delivered" if "delivered" in r else ""),
        _ms(late["p99_ms"]),
        f"{r['client_cpu_us_per_msg']:.1f} ({r['busiest_producer_cpu_share']:.0%})",
        f"{r['broker_cpu_us_per_msg']:.1f}",
        _stall_text(r["stalls"]),
    ]
    return "| " + " | ".join(cells) + " |"


def markdown(result: dict[str, Any]) -> str:
    """The table of every case and the aims."""
    head = [
        "case",
        "flush",
        "rate/s",
        "producers",
        "achieved/s",
        "ack p50 ms",
        "p99",
        "p99.9",
        "max",
        "e2e p50 / p99 / p99.9 / max ms",
        "acked/sent",
        "generator late p99 ms",
        "client CPU µs/msg (busiest producer's share of a core)",
        "broker CPU µs/msg",
        "broker loop stalls in the load, longest",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += [_row(r) for r in result["cases"]]
    lines += [f"| {f['kind']} | {f['flush']} | {f['rate']:,} | FAILED: {f['error']} |" for f in result["failed_cases"]]
    lines += ["", "| aim (1 KiB, sync flush, open loop) | measured ms | the disk's floor ms | |", "|---|---:|---:|---|"]
    lines += [
        f"| {a['aim']} | {_ms(a['value_ms'])} | {_ms(a.get('disk_floor_ms'))} | {a['status']} |" for a in result["aims"]
    ]
    floors = result.get("disk_floor") or []
    if floors:
        lines += ["", "| the disk's floor before the case (no broker) | fdatasyncs | fdatasync p50 / p99 / max ms |"
                  " arrival's wait p50 / p99 / p99.9 / max ms |", "|---|---:|---|---|"]  # fmt: skip
        lines += [_floor_row(f) for f in floors]
    return "\n".join(lines) + "\n"


def _floor_row(f: dict[str, Any]) -> str:
    d, w = f["fdatasync"], f["floor"]
    syncs = " / ".join(_ms(d[k]) for k in ("p50_ms", "p99_ms", "max_ms"))
    waits = " / ".join(_ms(w[k]) for k in ("p50_ms", "p99_ms", "p99_9_ms", "max_ms"))
    return f"| {f['kind']} sync {f['rate']:,} msgs/s | {f['fdatasyncs']:,} | {syncs} | {waits} |"


def _label(r: dict[str, Any]) -> str:
    rate = f"{r['rate'] // 1000}k" if r["rate"] % 1000 == 0 else f"{r['rate']:,}"
    return f"{r['kind']} {r['flush']} {rate}/s"


def plot(result: dict[str, Any], path: Path) -> None:
    """The summary (p50, p99, p99.9, max of each case) here, latency over time beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = result["cases"]
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(cases) * 2 + 1.8))
    names = ("p50_ms", "p99_ms", "p99_9_ms", "max_ms")
    height = 0.8 / len(names)
    for n, name in enumerate(names):
        ys = [i + n * height for i in range(len(cases))]
        ax.barh(ys, [(r["ack"][name] or 0) for r in cases], height=height, label=name.replace("_ms", ""))
    ax.set_yticks([i + 0.4 - height / 2 for i in range(len(cases))], [_label(r) for r in cases])
    ax.set_xscale("log")
    ax.invert_yaxis()
    ax.set_xlabel("send-to-ack latency from the intended send time, ms (log)")
    ax.set_title("clmq bench latency: open loop, 1 KiB (shared machine)")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    plot_timeline(result, timeline_path(path))


def timeline_path(path: Path) -> Path:
    """Where the latency-over-time plot goes, beside the summary plot."""
    return path.with_name(f"{path.stem}-timeline{path.suffix}")


def plot_timeline(result: dict[str, Any], path: Path) -> None:
    """One panel per case: per-second p50, p99 and max (send to ack; e2e dashed), log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = result["cases"]
    cols = min(3, len(cases))
    rows = (len(cases) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols + 1.5, 2.8 * rows + 0.8), squeeze=False, sharey=True)
    for ax, r in zip(axes.flat, cases, strict=False):
        for key, style in (("timeline", "-"), ("e2e_timeline", "--")):
            points = r.get(key) or []
            xs = [p["second"] for p in points]
            for name, color in (("p50_ms", "#4C72B0"), ("p99_ms", "#DD8452"), ("max_ms", "#C44E52")):
                label = f"{'e2e ' if key != 'timeline' else ''}{name.replace('_ms', '')}"
                ax.plot(xs, [p[name] for p in points], style, color=color, label=label, linewidth=1)
        ax.axvspan(0, r["warmup_seconds"], color="grey", alpha=0.15)
        ax.set_yscale("log")
        ax.set_title(_label(r), fontsize=9)
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(cases) :]:
        ax.set_visible(False)
    axes[0][0].legend(fontsize=7)
    fig.supxlabel("second of the run (grey: warm-up, left out of the histograms)", fontsize=9)
    fig.supylabel("ms from the intended send time", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

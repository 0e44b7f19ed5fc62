"""``clmq bench pop``'s figures: rates from the members' reports, medians, the POP /
queue-based ratios, redelivery lateness after a crash, the aims of issue 33, the
Markdown tables and the plot."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from .replication_load import percentile
from .report import _table

AIM_POP_OVER_QUEUE = 0.7  # POP at least 0.7 x queue-based throughput at equal members
AIM_SCALING = 2.0  # POP with the most members at least this x POP with the fewest above the queue count
AIM_REDELIVERY_LATE_MS = 1000.0  # a crashed member's messages back within invisible time + this


def rate_of(timeline: list[tuple[float, int]], target: int, skip_s: float = 0.0) -> dict[str, float]:
    """From (CLOCK_MONOTONIC s, messages acknowledged) reports, the first at the go:
    the rate from the first report with any message (``skip_s`` later, if a report
    comes that late: the members' ramp left out) to the one that reached ``target``
    (or the last), the time to that first report and the count."""
    t_go = timeline[0][0]
    points = sorted(timeline)
    first = next((p for p in points if p[1] > 0), None)
    if first is None:
        return {"msgs_per_s": 0.0, "acked": 0, "elapsed_s": points[-1][0] - t_go, "startup_s": math.nan}
    startup_s = first[0] - t_go
    first = next((p for p in points if p[0] >= first[0] + skip_s and p[1] < target), first)
    end = next((p for p in points if p[1] >= target), points[-1])
    if end[0] > first[0]:
        rate = (end[1] - first[1]) / (end[0] - first[0])
    else:
        rate = end[1] / max(1e-9, end[0] - t_go)
    return {
        "msgs_per_s": rate,
        "acked": max(p[1] for p in points),
        "elapsed_s": end[0] - first[0],
        "startup_s": startup_s,
    }


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def throughput_summary(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (handler time, member count): each kind's median rate and broker
    CPU per message, the POP / queue-based ratio of each run and their median."""
    rows = []
    for h, m in sorted({(s["handler_ms"], s["members"]) for s in samples}):
        mine = [s for s in samples if s["handler_ms"] == h and s["members"] == m]
        rate = {(s["run"], s["kind"]): s["msgs_per_s"] for s in mine}
        runs = sorted({s["run"] for s in mine})
        ratios = [rate[(r, "pop")] / rate[(r, "queue")] for r in runs if rate.get((r, "queue")) and (r, "pop") in rate]
        row: dict[str, Any] = {"handler_ms": h, "members": m, "ratios_by_run": ratios, "ratio": _median(ratios)}
        for kind in ("queue", "pop"):
            of = [s for s in mine if s["kind"] == kind]
            row[f"{kind}_msgs_per_s"] = _median([s["msgs_per_s"] for s in of])
            row[f"{kind}_broker_cpu_us_per_msg"] = _median(
                [s["broker_cpu_s"] * 1e6 / s["acked"] for s in of if s["acked"]]
            )
            row[f"{kind}_member_cpu_us_per_msg"] = _median(
                [s["member_cpu_s"] * 1e6 / s["acked"] for s in of if s["acked"]]
            )
        rows.append(row)
    return rows


def crash_summary(
    held: dict[tuple[int, int], Any], got: dict[tuple[int, int], Any], invisible_ms: int, killed_ms: float
) -> dict[str, Any]:
    """For each message the killed member held: its receipt by a survivor against the
    deadline the broker gave the dead member (its pop time + the invisible time)."""
    late, attempts = [], []
    for key, h in held.items():
        deadline = h["deadline_ms"] if h.get("deadline_ms") else h["popped_ms"] + invisible_ms
        if key in got:
            late.append(got[key]["received_ms"] - deadline)
            attempts.append(got[key].get("attempt") or 0)
    deadlines = [h["deadline_ms"] or h["popped_ms"] + invisible_ms for h in held.values()]
    return {
        "held": len(held),
        "redelivered": len(late),
        "missing": len(held) - len(late),
        "invisible_ms": invisible_ms,
        "killed_before_first_deadline_ms": min(deadlines, default=math.nan) - killed_ms,
        "second_attempts": sum(1 for a in attempts if a == 2),
        "early": sum(1 for x in late if x < 0),
        "p50_ms": percentile(late, 50),
        "p90_ms": percentile(late, 90),
        "p99_ms": percentile(late, 99),
        "max_ms": max(late, default=math.nan),
        "min_ms": min(late, default=math.nan),
        "late_ms": late,
    }


def _aim(name: str, value: float, target: float, met: bool) -> dict[str, Any]:
    return {"aim": name, "value": value, "target": target, "met": bool(met)}


def aims(result: dict[str, Any]) -> list[dict[str, Any]]:
    """POP / queue-based at each member count (no handler time), POP's scaling past the
    queue count (the longest handler time), redelivery after the crash."""
    rows, queues = result["throughput"], result["settings"]["queues"]
    out = [
        _aim(f"POP / queue-based, {r['members']} members, handler 0 ms", r["ratio"], AIM_POP_OVER_QUEUE,
             r["ratio"] >= AIM_POP_OVER_QUEUE)
        for r in rows
        if r["handler_ms"] == 0
    ]  # fmt: skip
    h = max(r["handler_ms"] for r in rows) if rows else 0
    above = sorted((r for r in rows if r["handler_ms"] == h and r["members"] > queues), key=lambda r: r["members"])
    if len(above) >= 2:
        scale = above[-1]["pop_msgs_per_s"] / above[0]["pop_msgs_per_s"] if above[0]["pop_msgs_per_s"] else math.nan
        name = f"POP {above[-1]['members']} / {above[0]['members']} members ({queues} queues), handler {h:g} ms"
        out.append(_aim(name, scale, AIM_SCALING, scale >= AIM_SCALING))
    c = result["crash"]
    worst = c["max_ms"] if c["missing"] == 0 else math.inf
    out.append(
        _aim("crashed member's messages back, max ms past the invisible time", worst, AIM_REDELIVERY_LATE_MS,
             worst <= AIM_REDELIVERY_LATE_MS)
    )  # fmt: skip
    return out


def _throughput_table(result: dict[str, Any]) -> str:
    return _table(
        [
            "handler ms",
            "members",
            "queue-based msgs/s",
            "POP msgs/s",
            "POP / queue (runs)",
            "broker CPU µs/msg q / POP",
        ],
        [
            [
                f"{r['handler_ms']:g}",
                str(r["members"]),
                f"{r['queue_msgs_per_s']:,.0f}",
                f"{r['pop_msgs_per_s']:,.0f}",
                f"**{r['ratio']:.2f}** ({', '.join(f'{x:.2f}' for x in r['ratios_by_run'])})",
                f"{r['queue_broker_cpu_us_per_msg']:.1f} / {r['pop_broker_cpu_us_per_msg']:.1f}",
            ]
            for r in result["throughput"]
        ],
    )


def markdown(result: dict[str, Any]) -> str:
    """The tables and the aims."""
    s, c = result["settings"], result["crash"]
    return "".join(
        [
            f"### Throughput ({s['messages']:,} messages of {s['size_bytes']} B on {s['queues']} queues, "
            f"medians of {s['runs']} runs; POP batches of {s['pop_batch']})\n",
            _throughput_table(result),
            f"\n### Redelivery after kill -9 of a member holding {c['held']:,} messages "
            f"(invisible time {c['invisible_ms']:,} ms, {s['crash_survivors']} members left)\n",
            _table(
                ["back", "early", "p50 ms late", "p90 ms late", "p99 ms late", "max ms late"],
                [
                    [f"{c['redelivered']:,} / {c['held']:,}", str(c["early"])]
                    + [f"{c[k]:.0f}" for k in ("p50_ms", "p90_ms", "p99_ms", "max_ms")]
                ],
            ),
            "\n### Aims\n",
            _table(
                ["aim", "value", "target", "met"],
                [
                    [a["aim"], f"{a['value']:.2f}", f"{a['target']:g}", "yes" if a["met"] else "no"]
                    for a in result["aims"]
                ],
            ),
        ]
    )


def plot(result: dict[str, Any], path: Path) -> None:
    """One panel of rates per handler time (queue-based and POP by member count, log
    scale), and the crash's lateness past the invisible time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["throughput"]
    handlers = sorted({r["handler_ms"] for r in rows})
    fig, axes = plt.subplots(1, len(handlers) + 1, figsize=(5 * (len(handlers) + 1), 4.4))
    for ax, h in zip(axes, handlers, strict=False):
        mine = [r for r in rows if r["handler_ms"] == h]
        xs = list(range(len(mine)))
        for k, (kind, name) in enumerate((("queue", "queue-based"), ("pop", "POP"))):
            values = [r[f"{kind}_msgs_per_s"] for r in mine]
            bars = ax.bar([x - 0.2 + 0.4 * k for x in xs], values, 0.4, label=name)
            ax.bar_label(bars, [f"{v:,.0f}" for v in values], fontsize=7)
        ax.set_xticks(xs, [f"{r['members']} members\nPOP/q {r['ratio']:.2f}" for r in mine], fontsize=8)
        ax.set_ylabel("messages/s handled and acknowledged")
        ax.set_title(f"handler {h:g} ms per message, {result['settings']['queues']} queues", fontsize=9)
        ax.legend(fontsize=7)
    c, ax = result["crash"], axes[-1]
    ax.hist(c["late_ms"] or [0], bins=30, color="C2")
    ax.axvline(AIM_REDELIVERY_LATE_MS, color="red", linestyle="--", linewidth=0.8, label="aim: 1 s late")
    ax.set_xlabel("ms after the invisible time ran out")
    ax.set_ylabel("messages")
    ax.set_title(
        f"kill -9 of a member: {c['redelivered']:,} / {c['held']:,} back, max {c['max_ms']:.0f} ms", fontsize=9
    )
    ax.legend(fontsize=7)
    s = result["settings"]
    fig.suptitle(f"clmq bench pop: {s['size_bytes']} B, one broker process over loopback", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

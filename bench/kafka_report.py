"""The figures of ``clmq bench kafka``: one sample per case and run, their medians, the
broker-CPU ratios Kafka / native, the issue's aims computed from them, the Markdown
tables and the plot."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PRODUCE_KEY = ("client", "partitions", "flush")
CONSUME_KEY = ("client", "partitions")
LATENCY_KEY = ("client", "flush")

AIM_PRODUCE_ONE_MSGS_PER_S = 150_000  # librdkafka, 1 partition, 1 KiB
AIM_PRODUCE_MANY_OVER_ONE = 0.8  # at 10,000 partitions (the most measured) over 1
AIM_CONSUME_MSGS_PER_S = 200_000
AIM_P99_MS = 10.0  # at 10,000 msgs/s, acks=all
AIM_CPU_RATIO = 1.3  # broker CPU per message, Kafka listener / native listener


@dataclass
class ProduceSample:
    client: str  # "kafka" (librdkafka), "native" (clmq's client) or "kafka-java" (kafka-producer-perf-test)
    partitions: int
    flush: str
    messages: int  # stored: sent and not reported failed (the warm-up message not counted)
    failed: int
    msgs_per_s: float
    mb_per_s: float
    broker_cpu_us_per_msg: float
    client_cpu_us_per_msg: float
    elapsed_s: float


@dataclass
class ConsumeSample:
    client: str
    partitions: int
    messages: int  # read back (warm-up message included)
    msgs_per_s: float  # from the consumer's start (subscribe, group join) to its last message
    fetch_msgs_per_s: float  # first message to last (kafka-consumer-perf-test's fetch.nMsg.sec)
    first_s: float  # start to the first message
    broker_cpu_us_per_msg: float
    client_cpu_us_per_msg: float


@dataclass
class LatencySample:
    client: str
    flush: str
    rate_msgs_per_s: int
    partitions: int
    sent: int
    answered: int
    failed: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    broker_cpu_us_per_msg: float


def medians(samples: list[dict[str, Any]], key: tuple[str, ...]) -> list[dict[str, Any]]:
    """One row per case (``key``), in first-seen order: numbers are medians over the
    runs (``runs``: how many), text is the first run's."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for s in samples:
        groups.setdefault(tuple(s.get(k) for k in key), []).append(s)
    rows = []
    for group in groups.values():
        row: dict[str, Any] = {}
        for k, v in group[0].items():
            numeric = isinstance(v, (int, float)) and not isinstance(v, bool) and k not in key
            row[k] = statistics.median(g[k] for g in group) if numeric else v
        row["runs"] = len(group)
        rows.append(row)
    return rows


def _find(rows: list[dict[str, Any]], **where: Any) -> dict[str, Any] | None:
    return next((r for r in rows if all(r.get(k) == v for k, v in where.items())), None)


def cpu_ratios(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Broker CPU per message, Kafka listener (librdkafka) over native listener (clmq's
    client), for each case both measured: the ratio of the medians."""
    out: list[dict[str, Any]] = []
    for k in result["produce"]:
        if k["client"] != "kafka":
            continue
        n = _find(result["produce"], client="native", partitions=k["partitions"], flush=k["flush"])
        if n and n["broker_cpu_us_per_msg"] > 0:
            out.append(_ratio("produce", k["partitions"], k["flush"], k, n))
    for k in result["consume"]:
        if k["client"] != "kafka":
            continue
        n = _find(result["consume"], client="native", partitions=k["partitions"])
        if n and n["broker_cpu_us_per_msg"] > 0:
            out.append(_ratio("consume", k["partitions"], "async", k, n))
    return out


def _ratio(phase: str, partitions: int, flush: str, k: dict[str, Any], n: dict[str, Any]) -> dict[str, Any]:
    return {
        "phase": phase,
        "partitions": partitions,
        "flush": flush,
        "kafka_us_per_msg": k["broker_cpu_us_per_msg"],
        "native_us_per_msg": n["broker_cpu_us_per_msg"],
        "ratio": k["broker_cpu_us_per_msg"] / n["broker_cpu_us_per_msg"],
    }


def _aim(aim: str, measured: float, target: float, at_least: bool) -> dict[str, Any]:
    return {
        "aim": aim,
        "measured": measured,
        "want": "≥" if at_least else "≤",
        "target": target,
        "ratio": measured / target,
        "met": measured >= target if at_least else measured <= target,
    }


def _parts(n: int) -> str:
    return f"{n:,} partition" + ("" if n == 1 else "s")


def aims(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's aims, each from this run set's medians (librdkafka through the Kafka
    listener; the CPU aim compares it with clmq's client through the native listener)."""
    out: list[dict[str, Any]] = []
    for flush in result["flushes"]:
        one = _find(result["produce"], client="kafka", partitions=1, flush=flush)
        if one:
            out.append(
                _aim(
                    f"librdkafka produce at 1 partition, 1 KiB, acks=all, {flush} flush (msgs/s)",
                    one["msgs_per_s"],
                    AIM_PRODUCE_ONE_MSGS_PER_S,
                    True,
                )
            )
        most = max((r["partitions"] for r in result["produce"] if r["client"] == "kafka"), default=1)
        many = _find(result["produce"], client="kafka", partitions=most, flush=flush)
        if one and many and most > 1:
            out.append(
                _aim(
                    f"librdkafka produce at {_parts(most)} / at 1, {flush} flush",
                    many["msgs_per_s"] / one["msgs_per_s"],
                    AIM_PRODUCE_MANY_OVER_ONE,
                    True,
                )
            )
    for r in result["consume"]:
        if r["client"] == "kafka":
            out.append(
                _aim(
                    f"librdkafka consume at {_parts(r['partitions'])} (msgs/s from subscribe; first message to last "
                    f"{r['fetch_msgs_per_s']:,.0f})",
                    r["msgs_per_s"],
                    AIM_CONSUME_MSGS_PER_S,
                    True,
                )
            )
    for r in result["latency"]:
        if r["client"] == "kafka":
            a = _aim(
                f"librdkafka produce p99 at {r['rate_msgs_per_s']:,.0f} msgs/s, acks=all, {r['flush']} flush (ms; "
                f"{r['failed']:,.0f} failed)",
                r["p99_ms"],
                AIM_P99_MS,
                False,
            )
            a["met"] = a["met"] and not r["failed"]
            out.append(a)
    for c in result["cpu_ratios"]:
        out.append(
            _aim(
                f"broker CPU per message Kafka / native, {c['phase']}, {_parts(c['partitions'])}, {c['flush']} flush",
                c["ratio"],
                AIM_CPU_RATIO,
                False,
            )
        )
    return out


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    text = {"client", "flush", "aim", "phase", "verdict"}
    return [
        "| " + " | ".join(head) + " |",
        "|" + "|".join("---" if h in text else "---:" for h in head) + "|",
        *("| " + " | ".join(r) + " |" for r in rows),
    ]


def markdown(result: dict[str, Any]) -> str:
    """The produce, consume, latency and CPU tables and the aims, as Markdown."""
    runs = result["runs"]
    lines = [
        f"Produce: {result['size']} B messages, message i to partition i mod P; medians of {runs} runs.",
        "",
        *_table(
            [
                "client",
                "partitions",
                "flush",
                "msgs/s",
                "MB/s",
                "broker CPU µs/msg",
                "client CPU µs/msg",
                "failed",
            ],
            [
                [
                    r["client"],
                    f"{r['partitions']:,}",
                    r["flush"],
                    f"{r['msgs_per_s']:,.0f}",
                    f"{r['mb_per_s']:.0f}",
                    f"{r['broker_cpu_us_per_msg']:.1f}",
                    f"{r['client_cpu_us_per_msg']:.1f}" if r["client_cpu_us_per_msg"] >= 0 else "–",
                    f"{r['failed']:,.0f}",
                ]
                for r in result["produce"]
            ],
        ),
    ]
    if result["consume"]:
        lines += [
            "",
            "Consume (async-flush broker, everything the produce case stored, from the earliest offsets):",
            "",
            *_table(
                ["client", "partitions", "msgs/s", "first msg to last msgs/s", "first msg s", "broker CPU µs/msg"],
                [
                    [
                        r["client"],
                        f"{r['partitions']:,}",
                        f"{r['msgs_per_s']:,.0f}",
                        f"{r['fetch_msgs_per_s']:,.0f}",
                        f"{r['first_s']:.2f}",
                        f"{r['broker_cpu_us_per_msg']:.1f}",
                    ]
                    for r in result["consume"]
                ],
            ),
        ]
    if result["latency"]:
        lines += [
            "",
            "Produce latency at a fixed rate, 1 KiB, acks=all (call to acknowledgement):",
            "",
            *_table(
                ["client", "flush", "msgs/s", "partitions", "p50 ms", "p99 ms", "max ms", "answered", "failed"],
                [
                    [
                        r["client"],
                        r["flush"],
                        f"{r['rate_msgs_per_s']:,.0f}",
                        f"{r['partitions']:,}",
                        f"{r['p50_ms']:.2f}",
                        f"{r['p99_ms']:.2f}",
                        f"{r['max_ms']:.2f}",
                        f"{r['answered']:,.0f}",
                        f"{r['failed']:,.0f}",
                    ]
                    for r in result["latency"]
                ],
            ),
        ]
    if result["cpu_ratios"]:
        lines += [
            "",
            "Broker CPU per message (the broker process's utime + stime over the messages):",
            "",
            *_table(
                ["phase", "partitions", "flush", "Kafka listener µs/msg", "native listener µs/msg", "Kafka / native"],
                [
                    [
                        c["phase"],
                        f"{c['partitions']:,}",
                        c["flush"],
                        f"{c['kafka_us_per_msg']:.1f}",
                        f"{c['native_us_per_msg']:.1f}",
                        f"**{c['ratio']:.2f}**",
                    ]
                    for c in result["cpu_ratios"]
                ],
            ),
        ]
    lines += ["", "Aims:", ""]
    rows = [
        [
            a["aim"],
            f"{a['measured']:,.2f}",
            f"{a['want']} {a['target']:,}",
            "met" if a["met"] else "**not met**",
        ]
        for a in result["aims"]
    ]
    lines += _table(["aim", "measured", "target", "verdict"], rows) if rows else ["(no case for an aim)"]
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    """Produce and consume msgs/s per partition count and client, the latency
    percentiles, and broker CPU per message, against the aims."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(18, 4.6))
    colors = {"kafka": "#4C72B0", "native": "#55A868", "kafka-java": "#C44E52"}
    flushes = result["flushes"]
    parts = sorted({r["partitions"] for r in result["produce"]})
    series = [(c, f) for f in flushes for c in colors if _find(result["produce"], client=c, flush=f)]
    width = 0.8 / max(1, len(series))
    ax = axes[0]
    for j, (client, flush) in enumerate(series):
        xs, ys = [], []
        for i, p in enumerate(parts):
            r = _find(result["produce"], client=client, partitions=p, flush=flush)
            if r:
                xs.append(i - 0.4 + width * (j + 0.5))
                ys.append(r["msgs_per_s"])
        ax.bar(xs, ys, width, color=colors[client], alpha=1.0 if flush == "async" else 0.55, label=f"{client} {flush}")
    ax.axhline(AIM_PRODUCE_ONE_MSGS_PER_S, color="red", linestyle="--", linewidth=0.8, label="aim: 150k at 1")
    ax.set_xticks(range(len(parts)), [f"{p:,}" for p in parts])
    ax.set_xlabel("partitions")
    ax.set_ylabel("msgs/s")
    ax.set_title("produce (light: sync flush)", fontsize=9)

    ax = axes[1]
    cparts = sorted({r["partitions"] for r in result["consume"]})
    clients = [c for c in colors if _find(result["consume"], client=c)]
    cw = 0.8 / max(1, len(clients))
    for j, client in enumerate(clients):
        rows = [(i, _find(result["consume"], client=client, partitions=p)) for i, p in enumerate(cparts)]
        ax.bar(
            [i - 0.4 + cw * (j + 0.5) for i, r in rows if r],
            [r["msgs_per_s"] for _, r in rows if r],
            cw,
            color=colors[client],
            label=client,
        )
    ax.axhline(AIM_CONSUME_MSGS_PER_S, color="red", linestyle="--", linewidth=0.8, label="aim: 200k")
    ax.set_xticks(range(len(cparts)), [f"{p:,}" for p in cparts])
    ax.set_xlabel("partitions")
    ax.set_title("consume, from subscribe to the last message", fontsize=9)

    ax = axes[2]
    lat = result["latency"]
    labels = [f"{r['client']}\n{r['flush']}" for r in lat]
    for k, (field, name) in enumerate((("p50_ms", "p50"), ("p99_ms", "p99"), ("max_ms", "max"))):
        ax.bar([i - 0.3 + 0.2 * (k + 0.5) for i in range(len(lat))], [r[field] for r in lat], 0.2, label=name)
    ax.axhline(AIM_P99_MS, color="red", linestyle="--", linewidth=0.8, label=f"aim: p99 {AIM_P99_MS:g} ms")
    ax.set_xticks(range(len(lat)), labels)
    ax.set_yscale("log")
    ax.set_ylabel("ms (log scale)")
    rate = lat[0]["rate_msgs_per_s"] if lat else 0
    ax.set_title(f"produce latency at {rate:,.0f} msgs/s, acks=all", fontsize=9)

    ax = axes[3]
    ratios = result["cpu_ratios"]
    labels = [f"{c['phase'][:4]} {c['partitions']:,}\n{c['flush']}" for c in ratios]
    ax.bar([i - 0.2 for i in range(len(ratios))], [c["kafka_us_per_msg"] for c in ratios], 0.4, label="Kafka listener")
    ax.bar([i + 0.2 for i in range(len(ratios))], [c["native_us_per_msg"] for c in ratios], 0.4, label="native")
    for i, c in enumerate(ratios):
        ax.annotate(f"{c['ratio']:.2f}×", (i, max(c["kafka_us_per_msg"], c["native_us_per_msg"])), ha="center")
    ax.set_xticks(range(len(ratios)), labels, fontsize=7)
    ax.set_ylabel("broker CPU µs per message")
    ax.set_title(f"broker CPU per message (label: Kafka / native, aim ≤ {AIM_CPU_RATIO})", fontsize=9)
    for a in axes:
        a.legend(fontsize=7)
    fig.suptitle(
        f"clmq bench kafka: {result['size']} B messages, one broker process over loopback, medians of "
        f"{result['runs']} runs",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

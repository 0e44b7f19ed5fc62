"""The Markdown table and the plot of ``clmq bench spark``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

LABELS = {
    "clmq_full": "clmq source, every column",
    "clmq_full_no_crc": "clmq source, every column, checkCrc=false",
    "arrow_replay_full": "ready Arrow batches replayed (any Python source's ceiling)",
    "parquet_full": "Parquet, every column",
    "clmq_narrow": "clmq source, narrow aggregate (body_length)",
    "clmq_narrow_no_crc": "clmq source, narrow aggregate (body_length), checkCrc=false",
    "clmq_narrow_default_schema": "clmq source, narrow aggregate (default schema)",
    "parquet_narrow": "Parquet, narrow aggregate",
    "kafka_full": "Spark's Kafka source via the Kafka listener, every column",
    "kafka_narrow": "Spark's Kafka source via the Kafka listener, narrow aggregate",
    "clmq_export": "clmq export to Parquet",
    "parquet_copy": "Spark Parquet-to-Parquet copy",
}


def markdown(result: dict[str, Any]) -> str:
    # with Spark's Kafka source: the broker's CPU too (its process is not Spark's)
    kafka = any(n.startswith("kafka_") for s in result["sizes"] for n in s["cases"])
    head = (
        f"| workload ({result['master']}, {result['queues']} queues) | body B | rows | rows/s | CPU µs/row |"
        + (" broker CPU µs/row |" if kafka else "")
        + "\n|---|---:|---:|---:|---:|"
        + ("---:|" if kafka else "")
    )
    lines = [head]
    for size in result["sizes"]:
        for name, label in LABELS.items():
            c = size["cases"].get(name)
            if c:
                broker = ""
                if kafka:
                    broker = f" {c['broker_cpu_us_per_row']:.2f} |" if name.startswith("kafka_") else " - |"
                lines.append(
                    f"| {label} | {size['body_bytes']} | {size['messages']:,} | {c['rows_per_s']:,.0f} | "
                    f"{c['cpu_us_per_row']:.2f} |{broker}"
                )
    lines += [
        "",
        "| body B | full scan clmq / Parquet | full, checkCrc=false | replayed Arrow / Parquet | "
        "narrow aggregate | narrow, checkCrc=false | narrow, default schema | export / copy |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for size in result["sizes"]:
        r = size["ratios"]
        lines.append(
            f"| {size['body_bytes']} | {fmt(r['full'])} | {fmt(r.get('full_no_crc'))} | {fmt(r.get('replay'))} | "
            f"{fmt(r['narrow'])} | {fmt(r.get('narrow_no_crc'))} | {fmt(r['narrow_default_schema'])} | "
            f"{fmt(r['export'])} |"
        )
    if kafka:
        lines += [
            "",
            "| body B | Kafka source full / Parquet | Kafka source full / clmq source | "
            "Kafka narrow / Parquet narrow | Kafka narrow / clmq narrow (default schema) |",
            "|---:|---:|---:|---:|---:|",
        ]
        for size in result["sizes"]:
            r = size["ratios"]
            lines.append(
                f"| {size['body_bytes']} | {fmt(r.get('kafka_full'))} | {fmt(r.get('kafka_full_over_clmq'))} | "
                f"{fmt(r.get('kafka_narrow'))} | {fmt(r.get('kafka_narrow_over_clmq'))} |"
            )
    lines += [
        "",
        "| body B | Python parse ns/row (in process) | of which CRC32C | walk + headers + mask | columns |",
        "|---:|---:|---:|---:|---:|",
    ]
    for size in result["sizes"]:
        p = size["parse_ns_per_row"]
        cols = sum(v for k, v in p.items() if k.startswith("column") or k == "fields")
        lines.append(
            f"| {size['body_bytes']} | {sum(p.values()):.0f} | {p['crc32c']:.0f} | "
            f"{p['walk'] + p['headers'] + p['mask']:.0f} | {cols:.0f} |"
        )
    index = result.get("index")
    if index:
        c = index["cases"]
        lines += [
            "",
            f"| {index['messages']:,} messages of 600 B over {index['queues']:,} queues | rows/s | CPU µs/row |",
            "|---|---:|---:|",
        ]
        for name, label in (
            ("scan_all_queues", "every queue, readPath=scan"),
            ("index_all_queues", "every queue, readPath=index"),
            ("auto_10_queues", "10 queues, readPath=auto (index)"),
        ):
            lines.append(f"| {label} | {c[name]['rows_per_s']:,.0f} | {c[name]['cpu_us_per_row']:.2f} |")
        lines.append(f"\nindex / scan over every queue: **{index['index_over_scan']:.2f}×**")
    return "\n".join(lines) + "\n"


def fmt(ratio: float | None) -> str:
    return "-" if ratio is None else f"**{ratio:.2f}×**"


def plot(result: dict[str, Any], path: Path) -> None:
    """Grouped bars: rows/s of each workload, clmq beside Parquet, per body size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in LABELS if any(n in s["cases"] for s in result["sizes"])]
    fig, ax = plt.subplots(figsize=(10, 5))
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        xs = [j + i * width for j in range(len(result["sizes"]))]
        ys = [s["cases"].get(name, {}).get("rows_per_s", 0) for s in result["sizes"]]
        hatch = "//" if "parquet" in name else ".." if name.startswith("kafka_") else None
        ax.bar(xs, ys, width, label=LABELS[name], hatch=hatch)
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(result["sizes"]))])
    ax.set_xticklabels([f"{s['body_bytes']} B bodies" for s in result["sizes"]])
    ax.set_yscale("log")
    ax.set_ylabel("rows/s (median)")
    kafka = " and Spark's Kafka source" if "kafka_full" in names else ""
    ax.set_title(f"clmq bench spark ({result['master']}): the clmq source{kafka} against Parquet of the same rows")
    ax.legend(fontsize=7)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

"""Markdown tables of benchmark results (``--markdown``), for docs and reports."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def save(result: dict[str, Any], markdown: str, json_path: Path, markdown_path: Path | None, console: Any) -> None:
    """Write a benchmark's JSON, print its Markdown and write that too if asked."""
    json_path.write_text(json.dumps(result, indent=2))
    console.print(markdown)
    if markdown_path:
        markdown_path.write_text(markdown)


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---:" for _ in head) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def store_markdown(result: dict[str, Any]) -> str:
    append = _table(
        ["size B", "queues", "flush", "msgs/s", "MB/s", "vs 1 queue", "max dispatch lag MB", "catch-up ms"],
        [
            [
                str(r["size"]),
                f"{r['queues']:,}",
                r["flush"],
                f"{r['msgs_per_s']:,.0f}",
                f"{r['mb_per_s']:.0f}",
                f"{r['msgs_per_s'] / _one_queue(result, r):.2f}",
                f"{r['max_dispatch_lag_mb']:.1f}",
                f"{r['catch_up_ms']:.0f}",
            ]
            for r in result["append"]
        ],
    )
    out = [append]
    rebuilds = [result[k] for k in ("rebuild", "rebuild_varied") if result.get(k)]
    if rebuilds:
        out.append(
            _table(
                [
                    "messages",
                    "body B",
                    "queues",
                    "log MB",
                    "rebuild s",
                    "re-dispatch s",
                    "re-dispatch records/s",
                    "queue files s",
                    "recovery s (no checkpoint)",
                    "CRC validation s",
                    "validation records/s",
                ],
                [
                    [
                        f"{rb['messages']:,}",
                        str(rb.get("body_bytes", "100")),
                        f"{rb['queues']:,}",
                        f"{rb['log_mb']:.0f}",
                        f"{rb['rebuild_s']:.2f}",
                        f"{rb['redispatch_s']:.2f}",
                        f"{rb['redispatch_records_per_s']:,.0f}",
                        f"{rb['queue_files_s']:.2f}",
                        f"{rb['recovery_s']:.2f}",
                        f"{rb['log_validation_s']:.2f}",
                        f"{rb['log_validation_records_per_s']:,.0f}",
                    ]
                    for rb in rebuilds
                ],
            )
        )
    if result.get("read"):
        out.append(
            _table(
                ["read-back over queues", "msgs/s (pulls of 32)"],
                [[f"{r['queues']:,}", f"{r['msgs_per_s']:,.0f}"] for r in result["read"]],
            )
        )
    sc = result.get("scale")
    if sc:
        out.append(
            _table(
                [
                    "queues",
                    "messages",
                    "append msgs/s",
                    "clean reopen s",
                    "read-back msgs/s",
                    "max open fds",
                    "max_open_files",
                ],
                [
                    [
                        f"{sc['queues']:,}",
                        f"{sc['messages']:,}",
                        f"{sc['append_msgs_per_s']:,.0f}",
                        f"{sc['reopen_s']:.2f}",
                        f"{sc['read_msgs_per_s']:,.0f}",
                        str(sc["max_open_fds"]),
                        str(sc["max_open_files_setting"]),
                    ]
                ],
            )
        )
    return "\n".join(out)


def _one_queue(result: dict[str, Any], row: dict[str, Any]) -> float:
    for r in result["append"]:
        if r["size"] == row["size"] and r["flush"] == row["flush"] and r["queues"] == 1:
            rate: float = r["msgs_per_s"]
            return rate
    return float("nan")


def compare_markdown(result: dict[str, Any]) -> str:
    one = {
        (r["size"], r["pattern"], r["flush"]): r["commitlog"]["msgs_per_s"] for r in result["rows"] if r["queues"] == 1
    }
    rows = []
    for r in result["rows"]:
        cl, pp = r["commitlog"], r["partition-per-file"]
        base = one.get((r["size"], r["pattern"], r["flush"]))
        flat = f"{cl['msgs_per_s'] / base:.2f}" if base else "-"
        rows.append(
            [
                str(r["size"]),
                f"{r['queues']:,}",
                r["pattern"],
                r["flush"],
                f"{cl['msgs_per_s']:,.0f}",
                f"{pp['msgs_per_s']:,.0f}",
                f"**{r['ratio']:.2f}**",
                flat,
                f"{cl['p50_ms']:.1f} / {cl['p99_ms']:.1f}",
                f"{pp['p50_ms']:.1f} / {pp['p99_ms']:.1f}",
                f"{cl['max_open_fds']:.0f} / {pp['max_open_fds']:.0f}",
                f"{cl['peak_rss_mb']:.0f} / {pp['peak_rss_mb']:.0f}",
            ]
        )
    return _table(
        [
            "size B",
            "queues",
            "pattern",
            "flush",
            "CL msgs/s",
            "PPF msgs/s",
            "CL / PPF",
            "CL vs 1 queue",
            "CL p50 / p99 ms",
            "PPF p50 / p99 ms",
            "fds CL / PPF",
            "peak MB CL / PPF",
        ],
        rows,
    )

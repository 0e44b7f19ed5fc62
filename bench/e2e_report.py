"""The figures of ``clmq bench e2e``: one sample per case and run, their medians, the
issue's aims computed from them, and the Markdown tables."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

KEY = ("api", "case", "size", "queues", "flush", "mode")  # what names a case; every other number is a median
AIM_SIZE = 1024  # the aims are for 1 KiB messages
AIM_PRODUCE_ONE_QUEUE_MSGS_PER_S = 150_000  # async flush
AIM_PRODUCE_MANY_OVER_ONE = 0.8  # produce at the most queues / at 1 queue
AIM_CONSUME_MSGS_PER_S = 250_000  # at every queue count, sparse case included
AIM_P99_MS = 5.0  # produce p99 at 10,000 msgs/s, sync flush
AIM_LATENCY_RATE = 10_000
AIM_PUBLIC_OVER_RAW = 0.8  # issue 34: a public API's produce rate / raw's, same case, same run
AIM_SPARSE_OVER_ONE = 0.8  # issue 34: the sparse case at the most queues / at 1 queue, produce and consume


@dataclass
class Throughput:
    api: str  # "public", "public-many", "public-batches" or "raw"
    case: str  # "timed" (produce for --seconds) or "sparse" (a fixed total over the queues)
    size: int
    queues: int
    flush: str
    produce_msgs_per_s: float
    produce_mb_per_s: float
    consume_msgs_per_s: float  # from opening the consumer to closing it: joining, look-ups and commits included
    consume_fetch_msgs_per_s: float  # from the first batch to the last (Kafka's fetch.nMsg.sec)
    consumer_start_s: float  # from opening the consumer to its first batch
    messages: int  # stored (sent and not reported failed)
    failed: int  # reported failed to the producer
    consumed: int  # read back by the consumer
    produce_client_cpu_us_per_msg: float
    produce_broker_cpu_us_per_msg: float
    consume_client_cpu_us_per_msg: float
    consume_broker_cpu_us_per_msg: float
    producer_call: str
    mode: str = "plain"  # security: "plain", "tls", "auth" or "tls+auth" (e2e_security)


@dataclass
class Latency:
    api: str
    rate_msgs_per_s: int
    batch: int  # messages per send
    p50_ms: float
    p99_ms: float
    max_ms: float
    sends: int  # answered (the percentiles are theirs)
    failed: int  # sends that failed (SendError)


def latency_of(api: str, rate: int, batch: int, lat_ms: list[float], failed: int) -> Latency:
    s = sorted(lat_ms) or [float("nan")]
    return Latency(
        api, rate, batch, statistics.median(s), s[max(0, int(len(s) * 0.99) - 1)], s[-1], len(lat_ms), failed
    )


def medians(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per case (``KEY``), in first-seen order: numbers are medians over the
    runs, text is the first run's (a sample's ``run`` number is left out)."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for s in samples:
        groups.setdefault(tuple(s.get(k) for k in KEY), []).append(s)
    rows = []
    for group in groups.values():
        row: dict[str, Any] = {}
        for k, v in group[0].items():
            if k == "run":
                continue
            numeric = isinstance(v, (int, float)) and not isinstance(v, bool) and k not in KEY
            row[k] = statistics.median(g[k] for g in group) if numeric else v
        rows.append(row)
    return rows


def _row(result: dict[str, Any], api: str, case: str, queues: int, flush: str = "async") -> dict[str, Any] | None:
    table = result["rows"] if case == "timed" else result.get("sparse", [])
    return next(
        (
            r
            for r in table
            if r["api"] == api
            and r["size"] == AIM_SIZE
            and r["queues"] == queues
            and r["flush"] == flush
            and r.get("mode", "plain") == "plain"
        ),
        None,
    )


def _queues(n: int) -> str:
    return f"{n:,} queue" + ("" if n == 1 else "s")


def _aim(api: str, aim: str, measured: float, target: float, at_least: bool) -> dict[str, Any]:
    return {
        "api": api,
        "aim": aim,
        "measured": measured,
        "want": "≥" if at_least else "≤",
        "target": target,
        "ratio": measured / target,
        "met": measured >= target if at_least else measured <= target,
    }


def aims(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 17's aims, each computed from this run's medians of the plaintext cases,
    for every API measured (the aims are for ``public``; the others are there to
    compare). The security modes' aims are ``e2e_security``'s."""
    out: list[dict[str, Any]] = []
    for api in result["apis"]:
        one = _row(result, api, "timed", 1)
        most = max((r["queues"] for r in result["rows"] if r["queues"] > 1), default=None)
        many = _row(result, api, "timed", most) if most else None
        if one:
            out.append(
                _aim(
                    api,
                    "produce at 1 queue, 1 KiB, async flush (msgs/s)",
                    one["produce_msgs_per_s"],
                    AIM_PRODUCE_ONE_QUEUE_MSGS_PER_S,
                    True,
                )
            )
        if one and many and most:
            out.append(
                _aim(
                    api,
                    f"produce at {_queues(most)} / at 1 queue",
                    many["produce_msgs_per_s"] / one["produce_msgs_per_s"],
                    AIM_PRODUCE_MANY_OVER_ONE,
                    True,
                )
            )
        for case in ("timed", "sparse"):
            table = result["rows"] if case == "timed" else result.get("sparse", [])
            for r in table:
                if (
                    r["api"] == api
                    and r["size"] == AIM_SIZE
                    and r["flush"] == "async"
                    and r.get("mode", "plain") == "plain"
                ):
                    out.append(
                        _aim(
                            api,
                            f"consume, {case}, {_queues(r['queues'])} (msgs/s, whole life; first batch to "
                            f"last {r['consume_fetch_msgs_per_s']:,.0f})",
                            r["consume_msgs_per_s"],
                            AIM_CONSUME_MSGS_PER_S,
                            True,
                        )
                    )
        out += _ratio_aims(result, api)
        lat = result.get("latency", {}).get(api)
        if lat:
            aim = _aim(
                api,
                f"produce p99 at {lat['rate_msgs_per_s']:,.0f} msgs/s, sync flush, 1 KiB (ms; "
                f"{lat['failed']:,.0f} sends failed)",
                lat["p99_ms"],
                AIM_P99_MS,
                False,
            )
            aim["met"] = aim["met"] and not lat["failed"]  # a failed send took send_timeout_ms at least
            out.append(aim)
    return out


def _ratio_aims(result: dict[str, Any], api: str) -> list[dict[str, Any]]:
    """Issue 34's: ``api``'s produce rate over raw's in every 1 KiB case that both ran,
    and the sparse case at its most queues over 1 queue (produce and consume)."""
    out: list[dict[str, Any]] = []
    for case in ("timed", "sparse"):
        table = result["rows"] if case == "timed" else result.get("sparse", [])
        for r in table:
            if api == "raw" or r["api"] != api or r["size"] != AIM_SIZE or r.get("mode", "plain") != "plain":
                continue
            raw = _row(result, "raw", case, r["queues"], r["flush"])
            if raw:
                out.append(
                    _aim(
                        api,
                        f"produce {api} / raw, {case}, {_queues(r['queues'])}, {r['flush']} flush",
                        r["produce_msgs_per_s"] / raw["produce_msgs_per_s"],
                        AIM_PUBLIC_OVER_RAW,
                        True,
                    )
                )
    sparse = [r for r in result.get("sparse", []) if r["api"] == api and r.get("mode", "plain") == "plain"]
    most = max((r["queues"] for r in sparse), default=1)
    one, many = _row(result, api, "sparse", 1), _row(result, api, "sparse", most)
    if one and many and most > 1:
        for what in ("produce", "consume"):
            out.append(
                _aim(
                    api,
                    f"sparse case, {what} at {_queues(most)} / at 1 queue",
                    many[f"{what}_msgs_per_s"] / one[f"{what}_msgs_per_s"],
                    AIM_SPARSE_OVER_ONE,
                    True,
                )
            )
    return out


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(head) + " |",
        "|" + "|".join("---" if h in ("api", "flush", "aim", "mode") else "---:" for h in head) + "|",
        *("| " + " | ".join(r) + " |" for r in rows),
    ]


def _throughput_rows(rows: list[dict[str, Any]], sparse: bool) -> list[str]:
    modes = any(r.get("mode", "plain") != "plain" for r in rows)  # a column only in a run with --tls or --auth
    head = [
        "api",
        "size B",
        "queues",
        *(["per queue"] if sparse else []),
        "flush",
        *(["mode"] if modes else []),
        "produce msgs/s",
        "produce MB/s",
        "consume msgs/s",
        "consume fetch msgs/s",
        "first batch s",
        "produce CPU µs/msg client / broker",
        "consume CPU µs/msg client / broker",
    ]
    body = [
        [
            r["api"],
            str(r["size"]),
            f"{r['queues']:,}",
            *([f"{r['messages'] / r['queues']:,.0f}"] if sparse else []),
            r["flush"],
            *([r.get("mode", "plain")] if modes else []),
            f"{r['produce_msgs_per_s']:,.0f}",
            f"{r['produce_mb_per_s']:.0f}",
            f"{r['consume_msgs_per_s']:,.0f}",
            f"{r['consume_fetch_msgs_per_s']:,.0f}",
            f"{r['consumer_start_s']:.2f}",
            f"{r['produce_client_cpu_us_per_msg']:.1f} / {r['produce_broker_cpu_us_per_msg']:.1f}",
            f"{r['consume_client_cpu_us_per_msg']:.1f} / {r['consume_broker_cpu_us_per_msg']:.1f}",
        ]
        for r in rows
    ]
    return _table(head, body)


def markdown(result: dict[str, Any]) -> str:
    """The timed and sparse tables, the latency figures and the aims, as Markdown."""
    lines = [
        f"Timed cases: produce for {result['seconds']} s, then consume everything; medians of {result['runs']} runs.",
        "",
        *_throughput_rows(result["rows"], sparse=False),
    ]
    if result.get("sparse"):
        lines += [
            "",
            f"Sparse case: {result['sparse_total']:,} messages spread over the queues, produced then consumed.",
            "",
            *_throughput_rows(result["sparse"], sparse=True),
        ]
    for api, lat in result.get("latency", {}).items():
        lines += [
            "",
            f"Produce latency ({api}), sync flush, 1 KiB, {lat['rate_msgs_per_s']:,.0f} msgs/s in sends of "
            f"{lat['batch']:.0f}: p50 {lat['p50_ms']:.2f} ms, p99 {lat['p99_ms']:.2f} ms, max {lat['max_ms']:.2f} ms "
            f"({lat['sends']:,.0f} sends answered, {lat['failed']:,.0f} failed).",
        ]
    lines += ["", "### Aims", ""]
    rows = [
        [
            a["aim"],
            a["api"],
            f"{a['measured']:,.2f}",
            f"{a['want']} {a['target']:,}",
            f"{a['ratio']:.2f}",
            "met" if a["met"] else "**not met**",
        ]
        for a in result.get("aims", [])
    ]
    lines += (
        _table(["aim", "api", "measured", "target", "measured / target", "verdict"], rows)
        if rows
        else ["(no 1 KiB async case)"]
    )
    if "security" in result:
        from .e2e_security import markdown as security_markdown

        lines += ["", security_markdown(result["security"]).rstrip("\n")]
    return "\n".join(lines) + "\n"

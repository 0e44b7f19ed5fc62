"""Histograms of ``clmq bench latency`` (HdrHistogram, microseconds): built from the raw
values a load process kept, encoded to travel between processes, merged, summarised."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any, Iterable

from clmq.common import ClmqError

if TYPE_CHECKING:  # hdrh is the bench extra's: imported when a histogram is made
    from hdrh.histogram import HdrHistogram

LOWEST_US = 1
HIGHEST_US = 3_600_000_000  # one hour: anything slower is clamped to it
SIGNIFICANT_DIGITS = 3  # values kept to 0.1 %
PERCENTILES = {"p50": 50.0, "p99": 99.0, "p99_9": 99.9}


def _hdr() -> Any:
    """HdrHistogram's class, imported on first use so that ``clmq`` starts without the
    bench extra; a clear error when it is missing."""
    try:
        from hdrh.histogram import HdrHistogram
    except ImportError as e:
        raise ClmqError("clmq bench latency needs hdrhistogram (pip install 'clmq[bench]')") from e
    return HdrHistogram


def new() -> HdrHistogram:
    """An empty histogram of microseconds."""
    return _hdr()(LOWEST_US, HIGHEST_US, SIGNIFICANT_DIGITS)


def of(values_us: Iterable[int]) -> HdrHistogram:
    """A histogram of these values (µs; values below 1 count as 1, above an hour as an hour).
    Counted first, then each distinct value recorded once: recording every value costs
    about 2.5 µs each, which a load process at 50k msgs/s cannot spare."""
    h = new()
    for value, count in Counter(values_us).items():
        h.record_value(min(max(value, LOWEST_US), HIGHEST_US), count)
    return h


def encode(h: HdrHistogram) -> str:
    """The histogram as text (HdrHistogram's compressed base64 form)."""
    return bytes(h.encode()).decode("ascii")


def merge(encoded: Iterable[str]) -> HdrHistogram:
    """The sum of encoded histograms (one per load process)."""
    total = new()
    for text in encoded:
        if text:
            total.add(_hdr().decode(text.encode("ascii")))
    return total


def summary(h: HdrHistogram) -> dict[str, Any]:
    """Count, p50, p99, p99.9 and max in milliseconds (None for an empty histogram)."""
    count = h.get_total_count()
    out: dict[str, Any] = {"count": count}
    for name, q in PERCENTILES.items():
        out[f"{name}_ms"] = h.get_value_at_percentile(q) / 1000 if count else None
    out["max_ms"] = h.get_max_value() / 1000 if count else None
    out["mean_ms"] = h.get_mean_value() / 1000 if count else None
    return out


def per_second(values_us: Iterable[int], seconds: Iterable[int]) -> dict[int, str]:
    """Encoded histograms of the values, one per second of the run (``seconds[i]`` is the
    second value ``i`` belongs to, by its intended send time)."""
    groups: dict[int, list[int]] = {}
    for value, second in zip(values_us, seconds, strict=True):
        groups.setdefault(second, []).append(value)
    return {second: encode(of(vals)) for second, vals in sorted(groups.items())}


def timeline(per_process: Iterable[dict[str, str]]) -> list[dict[str, Any]]:
    """Per-second p50/p99/max over every process: ``[{"second": s, "count", "p50_ms", ...}]``."""
    by_second: dict[int, list[str]] = {}
    for doc in per_process:
        for second, text in doc.items():
            by_second.setdefault(int(second), []).append(text)
    return [{"second": s, **summary(merge(texts))} for s, texts in sorted(by_second.items())]

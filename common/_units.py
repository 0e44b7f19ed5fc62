"""Units of size, so that a limit reads as ``64 * MiB``, never as a bare shift."""

from __future__ import annotations

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

# Upper bounds of duration histograms, in seconds (Prometheus' defaults from 100 us to
# 10 s): fsyncs (from a quiet SSD's tens of microseconds to a stalled disk's seconds)
# and request latencies share them.
DURATION_BUCKETS_S: tuple[float, ...] = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)

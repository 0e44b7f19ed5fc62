"""The cases of ``clmq bench compare`` and their figures, shared by the in-process and
the through-a-broker runners."""

from __future__ import annotations

import random
from dataclasses import dataclass

MODES = ("commitlog", "partition-per-file")
BATCH = 256


@dataclass(frozen=True)
class Case:
    mode: str
    size: int
    queues: int
    pattern: str  # "round-robin" or "skewed"
    flush: str  # "async" or "sync"
    seconds: float
    root: str


@dataclass
class Figures:
    msgs_per_s: float
    mb_per_s: float
    p50_ms: float
    p99_ms: float
    max_open_fds: int
    peak_rss_mb: float


def queue_sequence(pattern: str, queues: int, n: int, seed: int = 7) -> list[int]:
    """Which queue each message goes to: round robin, or skewed (80% to a few hot queues)."""
    if pattern == "round-robin":
        return [i % queues for i in range(n)]
    rng = random.Random(seed)
    hot = max(1, queues // 100)
    return [rng.randrange(hot) if rng.random() < 0.8 else rng.randrange(queues) for _ in range(n)]

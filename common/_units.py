"""Units of size, so that a limit reads as ``64 * MiB``, never as a bare shift."""

from __future__ import annotations

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

"""Errors raised by the storage layer.

Expected outcomes (a full segment, an oversized message, an offset that fell out of
retention) are *results*, not exceptions; these classes are for the unexpected:
damaged bytes and broken invariants.
"""

from __future__ import annotations


class StoreError(Exception):
    """Base class of clmq's storage errors."""


class CorruptRecordError(StoreError):
    """Bytes on disk that do not form a valid record.

    Carries the file, the log offset, which check failed, and the expected and actual
    values, so that an operator can look at exactly those bytes.
    """

    def __init__(self, file: str, offset: int, check: str, expected: str, actual: str) -> None:
        self.file = file
        self.offset = offset
        self.check = check
        self.expected = expected
        self.actual = actual
        super().__init__(
            f"corrupt record in {file} at offset {offset}: {check} expected {expected}, got {actual}"
        )


class ConfigError(StoreError, ValueError):
    """A setting that cannot work (for example a message limit larger than a segment)."""

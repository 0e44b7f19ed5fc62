"""The consume-queue entry: 20 bytes, ``<QIQ``: the record's commit-log offset, its size,
its tag hash. Two markers have size 0: a *hole* (an offset whose record the dispatcher
never saw) and, in slot 0 of a queue's first file, the *start* of a queue that began
inside that file (its offset field: the first queue offset). An all-zero entry is never
written: read inside a queue's extent, it is damage."""

from __future__ import annotations

import struct

import numpy as np

ENTRY = struct.Struct("<QIQ")  # commit-log offset, size, tag hash
ENTRY_SIZE = ENTRY.size
ENTRY_DTYPE = np.dtype([("offset", "<u8"), ("size", "<u4"), ("tag", "<u8")])
assert ENTRY_SIZE == 20 and ENTRY_DTYPE.itemsize == 20

Entry = tuple[int, int, int]

HOLE_TAG = 0x454C4F48_514D4C43  # b"CLMQHOLE": the tag of a hole marker (size 0)
HOLE_ENTRY = ENTRY.pack(0, 0, HOLE_TAG)
START_TAG = 0x54524154_534D4C43  # b"CLMSTART": slot 0 of a first file whose queue begins later
ZERO_ENTRY = bytes(ENTRY_SIZE)


def file_name(start: int) -> str:
    """The name of the entry file whose first queue offset is ``start`` (20 digits)."""
    return f"{start:020d}"

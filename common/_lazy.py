"""Records whose properties are decoded when first read (consumers decode thousands of
records per answer, and most applications never look at most records' properties:
the producer's ``UNIQ_KEY`` alone cost a dict and two string decodes per message).

A :class:`LazyRecord` is a :class:`Record` (``isinstance`` holds, every field has its
usual type when read, and it compares equal to the eagerly decoded record of the same
bytes). Until ``properties`` is read, the field holds the encoded bytes (a copy of a
few dozen bytes: a record never keeps its fetch answer alive). The record's CRC was
checked when it was decoded, so the bytes are the ones stored; encoded properties that
do not parse (written so by a faulty producer) raise :class:`CorruptRecordError`, with
the record's log offset, when read.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Any

from ._errors import CorruptRecordError
from ._record import Record, decode_properties

# The slot that holds ``properties`` in a Record (a member descriptor): read and written
# directly here, under the property that decodes on first access.
_SLOT: Any = Record.__dict__["properties"]
_FIELDS = tuple(f.name for f in dataclasses.fields(Record))


def _decoded(rec: LazyRecord) -> dict[str, str]:
    value = _SLOT.__get__(rec, LazyRecord)
    if type(value) is not bytes:  # decoded already, or set by the application (a dict of any kind)
        return value  # type: ignore[no-any-return]
    try:
        props = decode_properties(value) if value else {}
    except (ValueError, struct.error, UnicodeDecodeError) as e:
        where = f"properties of {rec.topic}/{rec.queue_id} offset {rec.queue_offset}"
        raise CorruptRecordError(where, rec.commitlog_offset, "properties", "a string map", str(e)) from None
    _SLOT.__set__(rec, props)
    return props


def _assign(rec: LazyRecord, value: Any) -> None:
    _SLOT.__set__(rec, value)


class LazyRecord(Record):
    """A :class:`Record` built with its ``properties`` still encoded (``bytes``), decoded
    into the usual ``dict[str, str]`` the first time they are read (then kept)."""

    __slots__ = ()

    properties = property(_decoded, _assign)

    def __eq__(self, other: object) -> bool:
        """Equal to any :class:`Record` (lazy or not) with equal fields."""
        if not isinstance(other, Record):
            return NotImplemented
        return all(getattr(self, name) == getattr(other, name) for name in _FIELDS)

    __hash__ = None  # type: ignore[assignment]  # as Record's: mutable, compared by value

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in _FIELDS)
        return f"Record({fields})"

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as a plain :class:`Record` (Spark ships records between processes)."""
        return (Record, tuple(getattr(self, name) for name in _FIELDS))

"""The generated tables of ``_schemas`` as typed objects, and what a field is at one version.

A :class:`Field` carries all versions; the codecs ask it, for one version, whether it is
present, nullable, tagged, in a flexible (compact) encoding, and what its default is.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from typing import Any

from . import _schemas
from ._primitives import FIXED, ZERO_UUID

Range = tuple[int, ...]  # (low, high), () for "none"


def in_range(span: Range | None, version: int) -> bool:
    """Whether ``version`` is in a (low, high) range (None and () are empty)."""
    return bool(span) and span[0] <= version <= span[1]  # type: ignore[index]


@dataclass(frozen=True, slots=True)
class Field:
    """One field of a Kafka message or struct, over all its versions."""

    name: str
    type: str
    versions: Range | None
    nullable_versions: Range | None
    tag: int | None
    tagged_versions: Range | None
    default: str | None
    flexible_versions: Range | None  # the field's own override, else None
    fields: tuple[Field, ...] | None

    @property
    def element(self) -> str:
        """The type of an array's elements (the type itself if not an array)."""
        return self.type[2:] if self.type.startswith("[]") else self.type

    @property
    def is_array(self) -> bool:
        return self.type.startswith("[]")

    @property
    def is_struct(self) -> bool:
        """A struct or an array of structs (its fields are ``fields``)."""
        return self.fields is not None

    def present(self, version: int) -> bool:
        return in_range(self.versions, version)

    def nullable(self, version: int) -> bool:
        return in_range(self.nullable_versions, version)

    def tagged(self, version: int) -> bool:
        return self.tag is not None and in_range(self.tagged_versions, version)

    def compact(self, flexible: bool) -> bool:
        """Whether lengths are compact (varints): the message's flexibility unless overridden."""
        return flexible if self.flexible_versions is None else False if not self.flexible_versions else flexible


@dataclass(frozen=True, slots=True)
class Message:
    """A request, response or header schema."""

    name: str
    valid_versions: Range
    flexible_versions: Range | None
    latest_version_unstable: bool
    fields: tuple[Field, ...]

    def flexible(self, version: int) -> bool:
        return in_range(self.flexible_versions, version)


def _field(row: tuple[Any, ...]) -> Field:
    children = None if row[8] is None else tuple(_field(child) for child in row[8])
    name, kind, versions, nullable, tag, tagged, text, flexible = row[:8]
    return Field(name, kind, versions, nullable, tag, tagged, text, flexible, children)


def _message(name: str, row: tuple[Any, ...]) -> Message:
    return Message(name, row[0], row[1], row[2], tuple(_field(f) for f in row[3]))


REQUEST_HEADER = _message("RequestHeader", _schemas.REQUEST_HEADER)
RESPONSE_HEADER = _message("ResponseHeader", _schemas.RESPONSE_HEADER)
API_NAMES: dict[int, str] = {key: row[0] for key, row in _schemas.MESSAGES.items()}


@functools.cache
def message(api_key: int, response: bool) -> Message:
    """The request or response schema of an API (KeyError if clmq does not speak it)."""
    name, request_row, response_row = _schemas.MESSAGES[api_key]
    suffix, row = ("Response", response_row) if response else ("Request", request_row)
    return _message(name + suffix, row)


def fixed_code(kind: str) -> str | None:
    """The struct code of a fixed-size type, None for the others."""
    return FIXED.get(kind)


def min_size(field: Field, version: int, flexible: bool) -> int:
    """The fewest bytes a (present, non-tagged) field can take."""
    if field.is_array:
        return 1 if field.compact(flexible) else 4
    return element_min_size(field, version, flexible)


def element_min_size(field: Field, version: int, flexible: bool) -> int:
    """The fewest bytes one element of the field takes (the field itself if not an array):
    what bounds an array's count before anything is allocated."""
    compact = field.compact(flexible)
    if field.is_struct:
        fields = [f for f in field.fields or () if f.present(version) and not f.tagged(version)]
        return sum(min_size(f, version, flexible) for f in fields) + (1 if flexible else 0)
    code = FIXED.get(field.element)
    if code is not None:
        return struct.calcsize(">" + code)
    if field.element == "string":
        return 1 if compact else 2
    return 1 if compact else 4  # bytes, records


def default(field: Field, version: int) -> Any:
    """A field's value when a body leaves it out: its JSON default, else None if nullable
    at this version, else the type's zero (0, "", b"", False, [], the zero UUID, a struct of
    defaults). A new object each call (lists and dicts are mutable)."""
    text = field.default
    nullable = field.nullable(version)
    if text == "null" or (text is None and nullable and field.type != "bool"):
        if nullable:
            return None
        text = None
    if field.is_array:
        return []
    if field.is_struct:
        return {f.name: default(f, version) for f in field.fields or () if f.present(version)}
    kind = field.type
    if kind in ("string",):
        return "" if text is None else text
    if kind in ("bytes", "records"):
        return b""
    if kind == "bool":
        return text == "true"
    if kind == "uuid":
        return ZERO_UUID
    if kind == "float64":
        return float(text or 0)
    return int(text or "0", 0)

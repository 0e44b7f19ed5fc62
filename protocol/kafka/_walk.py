"""The careful, slow codec paths: a schema walk that says exactly where and why.

The compiled codecs (``_compile``) run without bookkeeping; when one fails, the message
is walked again here: :func:`diagnose_decode` decodes with a bounds-checked
:class:`Reader`, tracking the field path, and raises the precise KafkaDecodeError;
:func:`diagnose_encode` checks a body against the schema and raises the precise
KafkaEncodeError. Both double as reference implementations for the tests.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from ._errors import KafkaDecodeError, KafkaEncodeError
from ._primitives import FIXED, INT_RANGES, MAX_STRING_BYTES, Buffer, Reader
from ._schema import Field, default, element_min_size


def decode_struct(r: Reader, fields: tuple[Field, ...], version: int, flexible: bool) -> dict[str, Any]:
    """A struct's fields (present at ``version``) read in order, then its tagged fields."""
    out: dict[str, Any] = {}
    tagged: dict[int, Field] = {}
    for f in fields:
        if not f.present(version):
            continue
        if f.tagged(version):
            tagged[f.tag] = f  # type: ignore[index]
            out[f.name] = default(f, version)
            continue
        try:
            out[f.name] = read_field(r, f, version, flexible)
        except KafkaDecodeError as e:
            raise e.within(f.name) from None
    if flexible:
        read_tagged(r, tagged, out, version)
    return out


def read_tagged(r: Reader, tagged: dict[int, Field], out: dict[str, Any], version: int) -> None:
    """A tagged-field section: known tags decoded into ``out`` (each exactly its size), others skipped."""
    for _ in range(r.uvarint()):
        tag = r.uvarint()
        size = r.uvarint()
        begin = r.take(size, f"tagged field {tag}")
        f = tagged.get(tag)
        if f is None:
            continue
        sub = Reader(r.buf, begin, begin + size)
        try:
            out[f.name] = read_field(sub, f, version, True)
        except KafkaDecodeError as e:
            raise e.within(f.name) from None
        if sub.pos != sub.end:
            raise KafkaDecodeError(f"tagged field {tag} has {sub.end - sub.pos} bytes left over", sub.pos, f.name)


def read_field(r: Reader, f: Field, version: int, flexible: bool) -> Any:
    """One field's value: an array (its count checked against the bytes left) or one element."""
    if not f.is_array:
        return read_element(r, f, version, flexible, f.nullable(version))
    start = r.pos
    count = r.length(compact=f.compact(flexible), wide=True, nullable=f.nullable(version), what="array")
    if count is None:
        return None
    least = max(1, element_min_size(f, version, flexible))
    if count * least > r.end - r.pos:
        raise r.error(f"array count {count} needs at least {count * least} bytes, {r.end - r.pos} left", start)
    items = []
    for i in range(count):
        try:
            items.append(read_element(r, f, version, flexible, False))
        except KafkaDecodeError as e:
            raise e.within(f"[{i}]") from None
    return items


def read_element(r: Reader, f: Field, version: int, flexible: bool, nullable: bool) -> Any:
    """A struct (a nullable one behind Kafka's int8 marker: -1 null, 1 present), a fixed-size
    value, a string or bytes."""
    if f.fields is not None:
        if nullable and r.fixed("int8") == -1:
            return None
        return decode_struct(r, f.fields, version, flexible)
    kind = f.element
    if kind in FIXED:
        return r.fixed(kind)
    if kind == "string":
        return r.string(compact=f.compact(flexible), nullable=nullable)
    return r.blob(compact=f.compact(flexible), nullable=nullable)


def diagnose_decode(
    buf: Buffer, pos: int, fields: tuple[Field, ...], version: int, flexible: bool, whole: bool = True
) -> tuple[dict[str, Any], int]:
    """Decode carefully: (value, next position); the precise KafkaDecodeError if the bytes are not
    the struct (or, when ``whole``, if bytes are left after it)."""
    r = Reader(buf, pos)
    try:
        out = decode_struct(r, fields, version, flexible)
    except KafkaDecodeError:
        raise
    except Exception as e:  # a bug of the walk must still surface as a decode error
        raise KafkaDecodeError(f"undecodable ({e!r})", r.pos) from e
    if whole and r.pos != r.end:
        raise KafkaDecodeError(f"{r.end - r.pos} trailing bytes after the body", r.pos)
    return out, r.pos


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_struct(value: Any, fields: tuple[Field, ...], version: int) -> None:
    """Raise KafkaEncodeError at the first value of ``value`` the schema cannot take."""
    if not isinstance(value, Mapping):
        raise KafkaEncodeError(f"expected a struct (dict), got {_show(value)}")
    for f in fields:
        if f.present(version) and f.name in value:
            try:
                check_field(value[f.name], f, version)
            except KafkaEncodeError as e:
                raise e.within(f.name) from None


def check_field(value: Any, f: Field, version: int) -> None:
    """Check one field's value (None only where nullable at this version)."""
    if value is None:
        if f.nullable(version):
            return
        raise KafkaEncodeError(f"expected {f.type}, got None (not nullable in version {version})")
    if not f.is_array:
        check_element(value, f, version)
        return
    if not isinstance(value, list | tuple):
        raise KafkaEncodeError(f"expected a list for {f.type}, got {_show(value)}")
    for i, item in enumerate(value):
        try:
            if item is None:
                raise KafkaEncodeError(f"expected {f.element}, got None")
            check_element(item, f, version)
        except KafkaEncodeError as e:
            raise e.within(f"[{i}]") from None


def check_element(value: Any, f: Field, version: int) -> None:
    """Check a struct, number, bool, uuid, string or bytes value."""
    kind = f.element
    if f.fields is not None:
        check_struct(value, f.fields, version)
    elif kind in INT_RANGES:
        low, high = INT_RANGES[kind]
        if not isinstance(value, int):
            raise KafkaEncodeError(f"expected {kind}, got {_show(value)}")
        if not low <= value <= high:
            raise KafkaEncodeError(f"{kind} out of range: {value}")
    elif kind == "float64" and not isinstance(value, int | float):
        raise KafkaEncodeError(f"expected float64, got {_show(value)}")
    elif kind == "bool" and not isinstance(value, bool):
        raise KafkaEncodeError(f"expected bool, got {_show(value)}")
    elif kind == "uuid" and not isinstance(value, uuid.UUID):
        raise KafkaEncodeError(f"expected uuid.UUID, got {_show(value)}")
    elif kind == "string":
        check_string(value)
    elif kind in ("bytes", "records") and not isinstance(value, bytes | bytearray | memoryview):
        raise KafkaEncodeError(f"expected bytes, got {_show(value)}")


def check_string(value: Any) -> None:
    """A str that encodes to UTF-8 in at most 32767 bytes."""
    if not isinstance(value, str):
        raise KafkaEncodeError(f"expected string, got {_show(value)}")
    try:
        size = len(value.encode())
    except UnicodeEncodeError as e:
        raise KafkaEncodeError(f"string is not encodable as UTF-8: {e.reason}") from None
    if size > MAX_STRING_BYTES:
        raise KafkaEncodeError(f"string of {size} bytes is over {MAX_STRING_BYTES}")


def diagnose_encode(body: Any, fields: tuple[Field, ...], version: int, failure: BaseException) -> KafkaEncodeError:
    """The precise error for a body the compiled encoder failed on."""
    try:
        check_struct(body, fields, version)
    except KafkaEncodeError as e:
        return e
    return KafkaEncodeError(f"cannot encode ({failure!r})")

"""Compiled codecs: Python source generated from a schema at one version, run by ``exec``.

A broker decodes every request, so the per-call cost matters: rather than walk the
schema tables on every call, each (message, version) gets straight-line functions (one
per struct) with consecutive fixed-size fields packed/unpacked by one ``struct`` call.
The functions do no bookkeeping: on anything they will not take they raise (a private
``_Bad``, or whatever Python raises), and the caller runs the careful walk of ``_walk``
to say which field failed and why. The model is how ``dataclasses`` generates methods.
"""

from __future__ import annotations

import struct
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from ._primitives import FIXED, Buffer, read_uvarint, write_uvarint
from ._schema import Field

Decoder = Callable[[Buffer, int], tuple[dict[str, Any], int]]
Encoder = Callable[[Mapping[str, Any], bytearray], None]


class _Bad(Exception):
    """The compiled fast path met bytes or a value it will not take; the careful walk says why."""


def _as_bytes(value: Any) -> bytes:
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    raise _Bad


def _read_tags(buf: Buffer, pos: int, count: int, out: dict[str, Any], table: dict[int, tuple[str, Any]]) -> int:
    """A tagged-field section after its count: known tags decoded (each exactly its size), others skipped."""
    end = len(buf)
    for _ in range(count):
        tag, pos = read_uvarint(buf, pos)
        size, pos = read_uvarint(buf, pos)
        stop = pos + size
        if stop > end:
            raise _Bad
        entry = table.get(tag)
        if entry is not None:
            value, pos = entry[1](buf, pos)
            if pos != stop:
                raise _Bad
            out[entry[0]] = value
        pos = stop
    return pos


_MISSING = object()
NULLS = {  # a null's encoding: (type is string, compact) → bytes
    (True, False): b"\xff\xff",
    (False, False): b"\xff\xff\xff\xff",
    (True, True): b"\x00",
    (False, True): b"\x00",
}
_BASE: dict[str, Any] = {
    "BAD": _Bad,
    "UV": read_uvarint,
    "UVW": write_uvarint,
    "UUID": uuid.UUID,
    "UNPACK": struct.unpack_from,
    "PACK": struct.pack,
    "ASB": _as_bytes,
    "TAGS": _read_tags,
    "MISSING": _MISSING,
    "I16": struct.Struct(">h").unpack_from,
    "I32": struct.Struct(">i").unpack_from,
    "P16": struct.Struct(">h").pack,
    "P32": struct.Struct(">i").pack,
}


def fixed_single(f: Field) -> bool:
    """A field read or written as part of a run of fixed-size values."""
    return not f.is_array and f.fields is None and f.type in FIXED


class Source:
    """Generated source and the namespace it runs in (constants, helpers, the other functions)."""

    def __init__(self, version: int) -> None:
        self.version = version
        self.ns: dict[str, Any] = dict(_BASE)
        self.lines: list[str] = []
        self.tail: list[str] = []  # module-level statements that need every function defined
        self.count = 0

    def fresh(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}{self.count}"

    def const(self, value: Any) -> str:
        name = self.fresh("K")
        self.ns[name] = value
        return name

    def define(self, name: str, args: str, body: list[str]) -> None:
        self.lines += [f"def {name}({args}):", *body]

    def build(self, name: str) -> Any:
        """Run the source; return the function ``name``."""
        code = compile("\n".join(self.lines + self.tail) + "\n", f"<kafka codec v{self.version}>", "exec")
        exec(code, self.ns)
        return self.ns[name]


def length_reads(n: str, compact: bool, wide: bool) -> list[str]:
    """Read a length (or count) into ``n``: -1 is null."""
    if compact:
        return [f"{n} = buf[pos]", "pos += 1", f"if {n} > 127: {n}, pos = UV(buf, pos - 1)", f"{n} -= 1"]
    return [f"{n}, = {'I32' if wide else 'I16'}(buf, pos)", f"pos += {4 if wide else 2}"]


def length_writes(n: str, compact: bool, wide: bool) -> list[str]:
    if compact:
        return [f"if {n} < 127: out.append({n} + 1)", f"else: out += UVW({n} + 1)"]
    return [f"out += {'P32' if wide else 'P16'}({n})"]


def indent(lines: list[str], depth: int = 1) -> list[str]:
    return ["    " * depth + line for line in lines]

"""Generating a message's encoder: ``encode(body, out)`` appends the body to a bytearray.

A key missing from a body takes the schema's default; keys the version lacks are ignored.
Type checks are the cheap ones Python does anyway (``struct.pack`` refuses a str or an
out-of-range int, ``str.encode`` a non-str); bools, lists and bytes are checked by class.
"""

from __future__ import annotations

import struct

from ._compile import NULLS, Encoder, Source, fixed_single, indent, length_writes
from ._primitives import FIXED, MAX_STRING_BYTES, write_uvarint
from ._schema import Field, default


class EncoderSource(Source):
    """The encoder functions of one message version, one per struct."""

    def struct_fn(self, fields: tuple[Field, ...], flexible: bool) -> str:
        """Define a function encoding one struct; return its name."""
        name = self.fresh("e")
        body = ["g = r.get"]
        run: list[Field] = []
        tagged: list[Field] = []
        for f in fields:
            if not f.present(self.version):
                continue
            if f.tagged(self.version):
                tagged.append(f)
                continue
            if fixed_single(f):
                run.append(f)
                continue
            body += self.fixed_run(run)
            run = []
            x = self.fresh("x")
            body.append(f"{x} = g({f.name!r}, {self.missing(f)})")
            body += self.field(f, x, flexible)
        body += self.fixed_run(run)
        if flexible:
            body += self.tag_section(tagged)
        self.define(name, "r, out", indent(body))
        return name

    def missing(self, f: Field) -> str:
        """The value a missing key stands for: the default (an empty tuple or dict for lists and structs)."""
        value = default(f, self.version)
        if isinstance(value, list):
            return self.const(())
        if isinstance(value, dict):
            return self.const({})
        return self.const(value)

    def fixed_run(self, run: list[Field]) -> list[str]:
        """Consecutive fixed-size fields written by one ``pack``; bools must be bools."""
        if not run:
            return []
        lines, args = [], []
        for f in run:
            expr = f"g({f.name!r}, {self.missing(f)})"
            if f.type == "bool":
                var = self.fresh("b")
                lines += [f"{var} = {expr}", f"if {var}.__class__ is not bool: raise BAD"]
                expr = var
            args.append(expr + ".bytes" if f.type == "uuid" else expr)
        packer = struct.Struct(">" + "".join(FIXED[f.type] for f in run))
        return lines + [f"out += {self.const(packer.pack)}({', '.join(args)})"]

    def value(self, kind: str, x: str) -> list[str]:
        """One fixed-size value held in ``x``."""
        lines = [f"if {x}.__class__ is not bool: raise BAD"] if kind == "bool" else []
        arg = f"{x}.bytes" if kind == "uuid" else x
        return lines + [f"out += {self.const(struct.Struct('>' + FIXED[kind]).pack)}({arg})"]

    def field(self, f: Field, x: str, flexible: bool) -> list[str]:
        """Write one field's value, held in ``x``."""
        if f.is_array:
            return self.array(f, x, flexible)
        if f.fields is not None and f.nullable(self.version):  # Kafka's nullable struct: int8 -1 (null) or 1
            return [
                f"if {x} is None: out += b'\\xff'",
                "else:",
                f"    out += b'\\x01'; {self.struct_fn(f.fields, flexible)}({x}, out)",
            ]
        if f.fields is not None:
            return [f"{self.struct_fn(f.fields, flexible)}({x}, out)"]
        if f.type in FIXED:
            return self.value(f.type, x)
        return self.sized(f.type, x, f.compact(flexible), f.nullable(self.version))

    def null_or(self, x: str, null: bytes, nullable: bool, then: list[str]) -> list[str]:
        """``null`` for None where nullable (else refuse None), else the lines ``then``."""
        on_none = f"out += {null!r}" if nullable else "raise BAD"
        return [f"if {x} is None: {on_none}", "else:", *indent(then)]

    def sized(self, kind: str, x: str, compact: bool, nullable: bool) -> list[str]:
        """A string (UTF-8, at most 32767 bytes) or bytes/records."""
        n = self.fresh("n")
        is_string = kind == "string"
        if is_string:
            then = [f"{x} = {x}.encode()", f"{n} = len({x})", f"if {n} > {MAX_STRING_BYTES}: raise BAD"]
        else:
            then = [f"if {x}.__class__ is not bytes: {x} = ASB({x})", f"{n} = len({x})"]
        then += length_writes(n, compact, wide=not is_string) + [f"out += {x}"]
        return self.null_or(x, NULLS[is_string, compact], nullable, then)

    def array(self, f: Field, x: str, flexible: bool) -> list[str]:
        """An array: a list or tuple, its count, then its elements."""
        n, y = self.fresh("n"), self.fresh("y")
        compact = f.compact(flexible)
        then = [f"if {x}.__class__ is not list and {x}.__class__ is not tuple: raise BAD", f"{n} = len({x})"]
        then += length_writes(n, compact, wide=True)
        code = FIXED.get(f.element)
        if f.fields is None and code is not None and f.element not in ("bool", "uuid"):
            then.append(f"out += PACK('>%d{code}' % {n}, *{x})")
        elif f.fields is not None:
            then += [f"for {y} in {x}:", f"    {self.struct_fn(f.fields, flexible)}({y}, out)"]
        else:
            item = self.value(f.element, y) if code else self.sized(f.element, y, compact, False)
            then += [f"for {y} in {x}:", *indent(item)]
        return self.null_or(x, NULLS[False, compact], f.nullable(self.version), then)

    def tag_section(self, tagged: list[Field]) -> list[str]:
        """The tagged fields that differ from their defaults, tags ascending, after their count."""
        if not tagged:
            return ["out.append(0)"]
        k, section = self.fresh("k"), self.fresh("s")
        lines = [f"{k} = 0", f"{section} = bytearray()"]
        for f in sorted(tagged, key=lambda f: f.tag or 0):
            fn, x = self.fresh("t"), self.fresh("x")
            self.define(fn, "x", indent(["out = bytearray()", *self.field(f, "x", True), "return out"]))
            usual = self.const(default(f, self.version))
            lines += [f"{x} = g({f.name!r}, MISSING)", f"if {x} is not MISSING and {x} != {usual}:"]
            data = self.fresh("b")
            lines += indent([f"{data} = {fn}({x})", f"{section} += {self.const(write_uvarint(f.tag or 0))}"])
            lines += indent([f"{section} += UVW(len({data}))", f"{section} += {data}", f"{k} += 1"])
        return lines + [f"out += UVW({k})", f"out += {section}"]


def compile_encoder(fields: tuple[Field, ...], version: int, flexible: bool) -> Encoder:
    """The encoder of a message (or header) at one version."""
    source = EncoderSource(version)
    top = source.struct_fn(fields, flexible)
    encoder: Encoder = source.build(top)
    return encoder

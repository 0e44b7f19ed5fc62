"""Generating a message's decoder: ``decode(buf, pos) -> (dict, next position)``.

Every length is checked against the bytes left before anything is sliced or allocated
(an array count must fit its elements' least size), so a hostile count fails at once.
"""

from __future__ import annotations

import re
import struct

from ._compile import Decoder, Source, fixed_single, indent, length_reads
from ._primitives import FIXED, MAX_STRING_BYTES
from ._schema import Field, default, element_min_size

_USES_END = re.compile(r"\bend\b")


class DecoderSource(Source):
    """The decoder functions of one message version, one per struct."""

    def struct_fn(self, fields: tuple[Field, ...], flexible: bool) -> str:
        """Define a function decoding one struct; return its name."""
        name = self.fresh("d")
        body: list[str] = []
        values: list[tuple[str, str]] = []
        run: list[tuple[Field, str]] = []
        tagged: list[Field] = []
        for f in fields:
            if not f.present(self.version):
                continue
            if f.tagged(self.version):
                tagged.append(f)
                values.append((f.name, self.default_expr(f)))
                continue
            var = self.fresh("v")
            values.append((f.name, var))
            if fixed_single(f):
                run.append((f, var))
                continue
            body += self.fixed_run(run)
            run = []
            body += self.field(f, var, flexible)
        body += self.fixed_run(run)
        body.append("r = {" + ", ".join(f"{key!r}: {expr}" for key, expr in values) + "}")
        if flexible:
            body += self.tag_section(tagged)
        body.append("return r, pos")
        prologue = ["end = len(buf)"] if any(_USES_END.search(line) for line in body) else []
        self.define(name, "buf, pos", indent(prologue + body))
        return name

    def default_expr(self, f: Field) -> str:
        """An expression for a tagged field's default (a fresh object when mutable)."""
        value = default(f, self.version)
        if isinstance(value, list):
            return "[]"
        if isinstance(value, dict):
            version = self.version
            return self.const(lambda: default(f, version)) + "()"
        return self.const(value)

    def fixed_run(self, run: list[tuple[Field, str]]) -> list[str]:
        """Consecutive fixed-size fields read by one ``unpack_from``."""
        if not run:
            return []
        packer = struct.Struct(">" + "".join(FIXED[f.type] for f, _ in run))
        names = ", ".join(var for _, var in run)
        lines = [f"{names}, = {self.const(packer.unpack_from)}(buf, pos)", f"pos += {packer.size}"]
        return lines + [f"{var} = UUID(bytes={var})" for f, var in run if f.type == "uuid"]

    def field(self, f: Field, var: str, flexible: bool) -> list[str]:
        """Read one field's value into ``var``."""
        if f.is_array:
            return self.array(f, var, flexible)
        if f.fields is not None and f.nullable(self.version):  # Kafka's nullable struct: int8 -1 (null) or 1
            fn = self.struct_fn(f.fields, flexible)
            return [f"if buf[pos] == 255: {var} = None; pos += 1", f"else: {var}, pos = {fn}(buf, pos + 1)"]
        if f.fields is not None:
            return [f"{var}, pos = {self.struct_fn(f.fields, flexible)}(buf, pos)"]
        if f.type in FIXED:
            return self.fixed_run([(f, var)])
        return self.sized(f.type, var, f.compact(flexible), f.nullable(self.version))

    def null_or(self, n: str, var: str, nullable: bool, then: list[str]) -> list[str]:
        """``var`` = None for a length of -1 where nullable, else the lines ``then``."""
        if nullable:
            return [f"if {n} < 0:", f"    if {n} != -1: raise BAD", f"    {var} = None", "else:", *indent(then)]
        return [f"if {n} < 0: raise BAD", *then]

    def sized(self, kind: str, var: str, compact: bool, nullable: bool) -> list[str]:
        """A string (UTF-8, at most 32767 bytes) or bytes/records."""
        n, e = self.fresh("n"), self.fresh("e")
        is_string = kind == "string"
        then = [f"if {n} > {MAX_STRING_BYTES}: raise BAD"] if is_string and compact else []
        then += [f"{e} = pos + {n}", f"if {e} > end: raise BAD"]
        then.append(f"{var} = str(buf[pos:{e}], 'utf-8')" if is_string else f"{var} = bytes(buf[pos:{e}])")
        then.append(f"pos = {e}")
        return length_reads(n, compact, wide=not is_string) + self.null_or(n, var, nullable, then)

    def array(self, f: Field, var: str, flexible: bool) -> list[str]:
        """An array: its count bounded by the bytes left, then its elements."""
        n = self.fresh("n")
        least = max(1, element_min_size(f, self.version, flexible))
        then = [f"if {n} * {least} > end - pos: raise BAD"]
        code = FIXED.get(f.element)
        if f.fields is None and code is not None and code != "16s":
            size = struct.calcsize(">" + code)
            then += [f"{var} = list(UNPACK('>%d{code}' % {n}, buf, pos))", f"pos += {n} * {size}"]
        else:
            item = self.fresh("y")
            then += [f"{var} = []", f"for _ in range({n}):"]
            then += indent(self.element(f, item, flexible) + [f"{var}.append({item})"])
        return length_reads(n, f.compact(flexible), wide=True) + self.null_or(n, var, f.nullable(self.version), then)

    def element(self, f: Field, var: str, flexible: bool) -> list[str]:
        """One element of an array (never null)."""
        if f.fields is not None:
            return [f"{var}, pos = {self.struct_fn(f.fields, flexible)}(buf, pos)"]
        if f.element == "uuid":
            return [f"{var} = UUID(bytes=bytes(buf[pos:pos + 16]))", "pos += 16"]
        if f.element in FIXED:
            return self.fixed_run([(Field("", f.element, None, None, None, None, None, None, None), var)])
        return self.sized(f.element, var, f.compact(flexible), False)

    def tag_section(self, tagged: list[Field]) -> list[str]:
        """The tagged fields: known tags decoded by name into ``r``, others skipped."""
        table = self.fresh("T")
        entries = []
        for f in tagged:
            fn = self.fresh("t")
            self.define(fn, "buf, pos", indent(["end = len(buf)", *self.field(f, "x", True), "return x, pos"]))
            entries.append(f"{f.tag}: ({f.name!r}, {fn})")
        self.tail.append(f"{table} = {{{', '.join(entries)}}}")
        t = self.fresh("c")
        count = [f"{t} = buf[pos]", "pos += 1", f"if {t} > 127: {t}, pos = UV(buf, pos - 1)"]
        return count + [f"if {t}: pos = TAGS(buf, pos, {t}, r, {table})"]


def compile_decoder(fields: tuple[Field, ...], version: int, flexible: bool) -> Decoder:
    """The decoder of a message (or header) at one version."""
    source = DecoderSource(version)
    top = source.struct_fn(fields, flexible)
    decoder: Decoder = source.build(top)
    return decoder

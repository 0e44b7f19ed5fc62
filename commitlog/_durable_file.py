"""Crash-safe, checked metadata files, keeping the previous generation.

Topics, consumer offsets, the checkpoint and partition mode's recovery points are small
JSON objects, replaced whole. :func:`write_json` writes one so that a crash at any
point leaves a good copy:

1. the new content goes to ``<name>.tmp``, which is fsynced;
2. the current ``<name>`` (if its checksum is good) is renamed to ``<name>.prev``;
3. ``<name>.tmp`` is renamed to ``<name>``; the directory is fsynced.

A crash between 2 and 3 leaves no ``<name>`` and ``<name>.prev`` as the newest good
copy. A current file that is damaged is never rotated over a good ``.prev``.

**Format 2** (the file stays a JSON object, so readers that ignore the checksum, such
as the Spark connector or ``jq``, still find every field)::

    {"crc32c":"<8 lower-case hex digits>",<the members of the body>}

where the body is the compact JSON of the value (``{...}``) and the checksum is the
CRC32C of ``<name>`` + ``"\\n"`` + the body's bytes, ``<name>`` being the file's name
without ``.prev``: a file copied over another kind of metadata file does not check.
Files of earlier versions (plain JSON objects starting ``{"version":``) still load,
unchecked. :func:`load_json` reads the current file if it checks, else the previous
generation (with a warning naming the file and the damage), else says so.
"""

from __future__ import annotations

import enum
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import crc32c as _crc32c

from . import fileops
from ._segment import fsync_dir

log = logging.getLogger("clmq.store")

PREVIOUS_SUFFIX = ".prev"
TEMPORARY_SUFFIX = ".tmp"
_CHECKED_PREFIX = b'{"crc32c":"'  # format 2
_LEGACY_PREFIX = b'{"version":'  # what every earlier version wrote
_HEX_DIGITS = 8
_HEADER_BYTES = len(_CHECKED_PREFIX) + _HEX_DIGITS + 1  # up to and including the closing quote

Validator = Callable[[Any], "str | None"]  # why a parsed value is unusable, or None


class MetadataSource(enum.Enum):
    """Where :func:`load_json` found the value."""

    CURRENT = "current"  # the file itself checked
    PREVIOUS = "previous"  # the file is missing or damaged; its previous generation checked
    MISSING = "missing"  # neither generation exists: nothing was ever written
    DAMAGED = "damaged"  # something exists, but no generation checks: the caller must decide


@dataclass(frozen=True)
class LoadedJson:
    """A metadata file as read: the value (None unless CURRENT or PREVIOUS), where it
    came from and what was wrong with the generations that were passed over."""

    path: Path
    value: Any
    source: MetadataSource
    problems: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.source in (MetadataSource.CURRENT, MetadataSource.PREVIOUS)

    def describe(self) -> str:
        """The problems found, one sentence (for log lines and errors)."""
        return "; ".join(self.problems) or "no problem"


def previous_path(path: Path) -> Path:
    """Where the previous generation of ``path`` is kept."""
    return path.with_name(path.name + PREVIOUS_SUFFIX)


def _kind(path: Path) -> bytes:
    """What the checksum binds a file to: its name without ``.prev``."""
    name = path.name.removesuffix(PREVIOUS_SUFFIX)
    return name.encode() + b"\n"


def encode(path: Path, value: dict[str, Any]) -> bytes:
    """The format-2 bytes of ``value`` for the file ``path``."""
    return _encode_body(path, json.dumps(value, separators=(",", ":")).encode())


def _encode_body(path: Path, body: bytes) -> bytes:
    """The format-2 bytes of ``body``, a JSON object already encoded."""
    crc = b"%08x" % _crc32c.crc32c(_kind(path) + body)
    rest = b"}" if body == b"{}" else b"," + body[1:]
    return _CHECKED_PREFIX + crc + b'"' + rest


def decode(path: Path, data: bytes) -> tuple[Any, str | None]:
    """The value in ``data`` (the content of ``path``) and None, or None and what is wrong."""
    body, problem = _checked_body(path, data)
    return (None, problem) if body is None else _parse(path, body)


def _checked_body(path: Path, data: bytes) -> tuple[bytes | None, str | None]:
    """The JSON body of ``data`` if its checksum is good (files of earlier versions:
    all of it, unchecked), else None and what is wrong."""
    if data.startswith(_LEGACY_PREFIX):
        return data, None
    if not data.startswith(_CHECKED_PREFIX):
        return None, f"{path}: not a metadata file (starts {data[:16]!r}, {len(data)} bytes)"
    stored = data[len(_CHECKED_PREFIX) : _HEADER_BYTES - 1]
    rest = data[_HEADER_BYTES - 1 :]
    # The separator after the checksum is outside it: it must be exactly what encode()
    # writes ('"}' ends an empty object, '",' starts the members), or a flipped byte
    # there (',' -> '}') would pass unseen.
    if rest == b'"}':
        body = b"{}"
    elif rest.startswith(b'",'):
        body = b"{" + rest[2:]
    else:
        return None, f"{path}: damaged header ({data[: _HEADER_BYTES + 1]!r}, {len(data)} bytes)"
    actual = b"%08x" % _crc32c.crc32c(_kind(path) + body)
    if stored != actual:
        return None, (
            f"{path}: checksum mismatch (crc32c stored {stored.decode(errors='replace')}, "
            f"computed {actual.decode()} over {len(data)} bytes)"
        )
    return body, None


def _parse(path: Path, data: bytes) -> tuple[Any, str | None]:
    try:
        value = json.loads(data)
    except ValueError as e:
        return None, f"{path}: not valid JSON ({e})"
    if not isinstance(value, dict):
        return None, f"{path}: not a JSON object"
    return value, None


def _check(path: Path, validate: Validator | None) -> tuple[Any, str | None]:
    """One generation: its value and None, or None and what is wrong ("missing" if absent)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None, f"{path}: missing"
    except OSError as e:
        return None, f"{path}: unreadable ({e})"
    value, problem = decode(path, data)
    if problem is None and validate is not None:
        why = validate(value)
        if why is not None:
            return None, f"{path}: {why}"
    return value, problem


def load_json(path: Path, validate: Validator | None = None) -> LoadedJson:
    """Read ``path``: the current generation if it checks (and ``validate`` finds no
    fault with it), else the previous one, else MISSING (neither exists) or DAMAGED.
    Falling back or finding nothing good is logged as a warning naming the files."""
    value, problem = _check(path, validate)
    if problem is None:
        return LoadedJson(path, value, MetadataSource.CURRENT)
    prev = previous_path(path)
    prev_value, prev_problem = _check(prev, validate)
    if prev_problem is None:
        log.warning("metadata %s; using the previous generation %s", problem, prev)
        return LoadedJson(path, prev_value, MetadataSource.PREVIOUS, (problem,))
    if not path.exists() and not prev.exists():
        return LoadedJson(path, None, MetadataSource.MISSING)
    log.warning("metadata %s; and %s", problem, prev_problem)
    return LoadedJson(path, None, MetadataSource.DAMAGED, (problem, prev_problem))


def read_json(path: Path) -> Any | None:
    """The value of ``path`` (or of its previous generation), or None if neither is
    there or good. Callers that must tell "never written" from "damaged" use :func:`load_json`."""
    return load_json(path).value


def write_json(path: Path, value: dict[str, Any]) -> None:
    """Replace ``path`` with ``value`` (format 2), keeping the current file as the
    previous generation if it checks. Raises OSError with the old content in place."""
    _replace(path, encode(path, value), keep_previous=_intact(path))


def write_json_body(path: Path, body: bytes) -> None:
    """:func:`write_json` of a JSON object the caller encoded itself (compact, as
    ``json.dumps(value, separators=(",", ":"))`` gives it): for a large file most of
    whose parts the caller keeps encoded between writes."""
    if not (body.startswith(b"{") and body.endswith(b"}")):
        raise ValueError("write_json_body: body must be one JSON object")
    _replace(path, _encode_body(path, body), keep_previous=_intact(path))


def _intact(path: Path) -> bool:
    """Whether ``path`` exists and checks (a damaged one must not push out a good .prev).
    The checksum suffices: no need to parse the JSON of a file this process wrote."""
    try:
        data = path.read_bytes()
    except OSError:
        return False
    body, _problem = _checked_body(path, data)
    return body is not None and (not data.startswith(_LEGACY_PREFIX) or _parse(path, data)[1] is None)


def write_atomic(path: Path, data: bytes, keep_previous: bool = False) -> None:
    """Replace ``path`` with ``data`` so that a crash leaves the old or the new content
    (``keep_previous``: the old one is kept as ``<name>.prev``). No checksum is added:
    metadata goes through :func:`write_json`."""
    _replace(path, data, keep_previous and path.exists())


def delete_json(path: Path) -> None:
    """Remove ``path`` with its previous generation (and any temporary), durably. A
    metadata file that is no longer needed must go this way: removing only ``path``
    would make :func:`load_json` fall back to the previous generation."""
    # The older generations first: a crash part-way leaves the current file (not yet
    # deleted) or nothing (deleted), never the .prev alone (which would come back).
    path.with_name(path.name + TEMPORARY_SUFFIX).unlink(missing_ok=True)
    previous_path(path).unlink(missing_ok=True)
    fsync_dir(path.parent)
    path.unlink(missing_ok=True)
    fsync_dir(path.parent)


def _replace(path: Path, data: bytes, keep_previous: bool) -> None:
    tmp = path.with_name(path.name + TEMPORARY_SUFFIX)
    try:
        _write_synced(tmp, data)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a half-written temporary must not linger
        raise
    if keep_previous:
        os.replace(path, previous_path(path))  # a crash here leaves .prev as the newest good copy
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _write_synced(path: Path, data: bytes) -> None:
    """Write ``data`` to a new ``path`` and fsync it (through the file-operation seam)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            n = fileops.OPS.write(fd, view)
            if n <= 0:
                raise OSError(f"write to {path} wrote {n} bytes with {len(view)} to go")
            view = view[n:]
        fileops.OPS.fsync(fd)
    finally:
        os.close(fd)

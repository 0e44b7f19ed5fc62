"""Loading a service's settings: a dataclass, filled from a TOML file, then
environment variables (``CLMQ_<FIELD NAME>``), then explicit overrides (flags).

Shared by the broker and the name server, which is why it lives beside the protocol
they share. Unknown keys and values of the wrong type are errors that name the key.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, TypeVar

from commitlog import ClmqError

if TYPE_CHECKING:  # typeshed's name for "any dataclass"; not importable at run time
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")


class SettingsError(ClmqError, ValueError):
    """A configuration a person has to fix; the message says where and what."""


def _convert(name: str, raw: Any, kind: Any, source: str) -> Any:
    origin = typing.get_origin(kind)
    if origin is list or kind is list:
        items = raw.split(",") if isinstance(raw, str) else raw
        if not isinstance(items, list):
            raise SettingsError(f"{source}: {name} must be a list, got {raw!r}")
        return [str(i).strip() for i in items if str(i).strip()]
    if kind is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.lower() in {"1", "true", "yes", "on", "0", "false", "no", "off"}:
            return raw.lower() in {"1", "true", "yes", "on"}
        raise SettingsError(f"{source}: {name} must be true or false, got {raw!r}")
    if kind in (int, float):
        try:
            return kind(raw) if not isinstance(raw, bool) else _fail(name, raw, kind, source)
        except (TypeError, ValueError):
            raise SettingsError(f"{source}: {name} must be {'an integer' if kind is int else 'a number'}, got {raw!r}") from None
    return str(raw)


def _fail(name: str, raw: Any, kind: type, source: str) -> Any:
    raise SettingsError(f"{source}: {name} must be {kind.__name__}, got {raw!r}")


def load_settings(cls: type[T], path: str | Path | None = None, *, section: str | None = None,
                  env: Mapping[str, str] | None = None, overrides: Mapping[str, Any] | None = None,
                  defaults: Mapping[str, Any] | None = None) -> T:  # fmt: skip
    """Build ``cls`` (a dataclass) from ``defaults`` (a command's own, e.g. ``clmq
    dev``'s), ``path`` (its ``[section]`` if given, else the top level), the ``CLMQ_*``
    variables of ``env`` and ``overrides`` (flags; None values are ignored), in
    increasing precedence."""
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    values: dict[str, Any] = dict(defaults or {})
    if path is not None:
        values.update(_from_file(Path(path), section, fields, hints))
    env = os.environ if env is None else env
    for name in fields:
        var = f"CLMQ_{name.upper()}"
        if var in env:
            values[name] = _convert(name, env[var], hints[name], f"environment variable {var}")
    for name, raw in (overrides or {}).items():
        if raw is None:
            continue
        if name not in fields:
            raise SettingsError(f"unknown setting {name!r}")
        values[name] = _convert(name, raw, hints[name], f"--{name.replace('_', '-')}")
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise SettingsError(str(e)) from None


def _from_file(path: Path, section: str | None, fields: set[str], hints: dict[str, Any]) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise SettingsError(f"configuration file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise SettingsError(f"{path}: not valid TOML: {e}") from None
    if section is not None and isinstance(data.get(section), dict):
        data = data[section]
    unknown = sorted(set(data) - fields)
    if unknown:
        raise SettingsError(f"{path}: unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(fields))}")
    return {k: _convert(k, v, hints[k], str(path)) for k, v in data.items()}

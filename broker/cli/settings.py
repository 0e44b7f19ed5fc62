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

from clmq.common import ClmqError

if TYPE_CHECKING:  # typeshed's name for "any dataclass"; not importable at run time
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")


class SettingsError(ClmqError, ValueError):
    """A configuration a person has to fix; the message says where and what."""


def _convert(name: str, raw: Any, kind: Any, source: str) -> Any:
    origin = typing.get_origin(kind)
    if origin is list or kind is list:
        return _convert_list(name, raw, kind, source)
    if origin is dict or kind is dict:
        return _convert_dict(name, raw, kind, source)
    if kind is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.lower() in {"1", "true", "yes", "on", "0", "false", "no", "off"}:
            return raw.lower() in {"1", "true", "yes", "on"}
        raise SettingsError(f"{source}: {name} must be true or false, got {raw!r}")
    if kind in (int, float):
        if isinstance(raw, bool) or (kind is int and isinstance(raw, float)):  # TOML's 1.5 is no integer
            return _fail(name, raw, kind, source)
        try:
            return kind(raw)
        except (TypeError, ValueError):
            raise SettingsError(
                f"{source}: {name} must be {'an integer' if kind is int else 'a number'}, got {raw!r}"
            ) from None
    return str(raw)


def _convert_list(name: str, raw: Any, kind: Any, source: str) -> list[Any]:
    """A TOML array, or a comma-separated string (environment variables and flags);
    each item converted to the element type (``list[int]``: integers)."""
    items = raw.split(",") if isinstance(raw, str) else raw
    if not isinstance(items, list):
        raise SettingsError(f"{source}: {name} must be a list, got {raw!r}")
    (item_kind,) = typing.get_args(kind) or (str,)
    out = []
    for item in items:
        text = item.strip() if isinstance(item, str) else item
        if text == "":
            continue  # "a,,b" or a trailing comma: nothing meant
        try:
            out.append(_convert(f"{name} item", text, item_kind, source))
        except SettingsError:
            raise SettingsError(
                f"{source}: {name} must be a list of {_kind_name(item_kind)}, got {raw!r} ({item!r} is not)"
            ) from None
    return out


def _convert_dict(name: str, raw: Any, kind: Any, source: str) -> dict[Any, Any]:
    """A TOML table, or ``key=value,key2=value2`` (environment variables and flags)."""
    key_kind, value_kind = typing.get_args(kind) or (str, str)
    if isinstance(raw, str):
        pairs = []
        for part in (p.strip() for p in raw.split(",")):
            if not part:
                continue
            key, sep, value = part.partition("=")
            if not sep or not key.strip():
                raise SettingsError(
                    f"{source}: {name} must be key=value pairs separated by commas, got {raw!r} "
                    f"({part!r} is not key=value)"
                )
            pairs.append((key.strip(), value.strip()))
    elif isinstance(raw, dict):
        pairs = list(raw.items())
    else:
        raise SettingsError(f"{source}: {name} must be a table (or key=value,key2=value2), got {raw!r}")
    return {
        _convert(f"{name} key", k, key_kind, source): _convert(f"{name}[{k!r}]", v, value_kind, source)
        for k, v in pairs
    }


def _kind_name(kind: Any) -> str:
    return {int: "integers", float: "numbers", bool: "booleans", str: "strings"}.get(kind, str(kind))


def _fail(name: str, raw: Any, kind: type, source: str) -> Any:
    raise SettingsError(f"{source}: {name} must be {kind.__name__}, got {raw!r}")


def load_settings(
    cls: type[T],
    path: str | Path | None = None,
    *,
    section: str | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> T:
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

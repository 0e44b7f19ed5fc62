"""The users-and-ACLs file (``security.json``): the durable metadata format
(:func:`clmq.commitlog.write_json`: checksummed, bound to its name, the previous
generation kept and fallen back to), holding :meth:`SecurityState.to_json`."""

from __future__ import annotations

from pathlib import Path

from clmq.commitlog import MetadataSource, load_json, write_json
from clmq.common import MetadataError

from ._state import SecurityState

SECURITY_FILE = "security.json"


def _validate(value: object) -> str | None:
    try:
        SecurityState.from_json(value)
    except ValueError as e:
        return str(e)
    return None


def load_security(path: Path) -> SecurityState:
    """The state in ``path`` (its previous generation if the file is damaged); an empty
    state if neither exists; :class:`MetadataError` if no generation checks (users and
    rules are never silently dropped: an empty state would lock everyone out, or worse
    forget a DENY)."""
    loaded = load_json(path, _validate)
    if loaded.source is MetadataSource.MISSING:
        return SecurityState()
    if not loaded.ok:
        raise MetadataError(f"{path}: no generation of the users and ACLs file checks: {'; '.join(loaded.problems)}")
    return SecurityState.from_json(loaded.value)


def save_security(path: Path, state: SecurityState) -> None:
    """Replace ``path`` with ``state`` (the current file kept as the previous generation)."""
    write_json(path, state.to_json())

"""Crash-safe small files: write a temporary, fsync, rename over, fsync the directory."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from commitlog import fsync_dir


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` so that a crash leaves the old or the new content."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_json(path: Path, value: Any) -> None:
    write_atomic(path, json.dumps(value, separators=(",", ":")).encode())


def read_json(path: Path) -> Any | None:
    """The parsed content, or None if the file is missing or not valid JSON."""
    try:
        return json.loads(path.read_bytes())
    except (FileNotFoundError, ValueError):
        return None

"""The optional compiled part of the record format (common/_cdecode.c, built by
setup.py where a C compiler and Python's headers are): ``None`` when it was not built,
or when ``CLMQ_PURE_PYTHON`` is set to anything but ``0`` in the environment. Every user
has a pure-Python path that gives the same results (tests/test_decode_compiled.py)."""

from __future__ import annotations

import importlib
import os
from types import ModuleType


def _load() -> ModuleType | None:
    if os.environ.get("CLMQ_PURE_PYTHON", "") not in ("", "0"):
        return None
    try:
        return importlib.import_module(f"{__package__}._cdecode")
    except ImportError:
        return None


COMPILED = _load()

"""Names a package exports but imports only when first used (PEP 562's module
``__getattr__``): what needs numpy, so that processes which never touch it (the
command line, a client that only produces) start without paying for it."""

from __future__ import annotations

from importlib import import_module
from typing import Any, Callable


def lazy_exports(package: str, table: dict[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """The ``__getattr__`` of ``package``: a name of ``table`` (name -> submodule) is
    imported from its submodule at first use and kept in ``namespace`` (the package's
    globals), so later look-ups are plain attribute reads."""

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(f"{package}.{module}"), name)
        namespace[name] = value
        return value

    return __getattr__

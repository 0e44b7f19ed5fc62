"""The import graph of a source tree, and the dependency rules clmq keeps on it.

Every import counts: module level, inside functions, and under ``TYPE_CHECKING`` (a
cycle that only type checkers see is still a cycle a reader has to untangle).
Relative imports are resolved against the importing module's package. The rules are
plain functions over a graph, so ``tests/test_layering.py`` can show them failing on
small synthetic trees as well as passing on the real one.
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass, field
from pathlib import Path

# Rooms in the order of the layers, lowest first: a module may import its own layer
# and the layers below, never one above. A module belongs to its longest room prefix.
LAYERS: list[tuple[str, list[str]]] = [
    ("common", ["clmq.common"]),  # record and batch formats, errors, system topics, units
    (
        "storage",
        ["clmq.commitlog", "clmq.consumequeue", "clmq.broker.store", "clmq.broker"],
    ),  # ``broker`` itself exports nothing
    ("protocol", ["clmq.protocol"]),  # sans-IO
    ("transport", ["clmq.protocol.transport"]),
    ("services", ["clmq.broker.service", "clmq.broker.replication", "clmq.broker.coordination", "clmq.nameserver"]),
    ("clients", ["clmq.client", "clmq.spark_connector"]),
    ("cli", ["clmq.broker.cli", "clmq.bench", "clmq.devtools"]),
]

# Third-party libraries allowed only in these rooms (and their sub-rooms).
ONLY_IN: dict[str, set[str]] = {
    "pyspark": {"clmq.spark_connector"},
    "pyarrow": {"clmq.spark_connector"},
    "kazoo": {"clmq.broker.coordination"},
    "matplotlib": {"clmq.bench"},
    "prometheus_client": {"clmq.broker.service", "clmq.nameserver"},
}
# Libraries a layer must not import (storage is plain synchronous Python; the protocol is sans-IO).
FORBIDDEN_IN_LAYER: dict[str, set[str]] = {
    "common": {"trio", "msgpack", "kazoo", "pyspark", "pyarrow", "socket", "asyncio", "rich", "prometheus_client"},
    "storage": {"trio", "msgpack", "kazoo", "pyspark", "pyarrow", "socket", "asyncio", "rich", "prometheus_client"},
    "protocol": {"trio", "kazoo", "pyspark", "pyarrow", "socket", "asyncio", "selectors", "rich", "prometheus_client"},
}


@dataclass
class Graph:
    """Modules of the tree (dotted names) and, per module, what it imports."""

    packages: set[str] = field(default_factory=set)  # modules that are packages (``__init__``)
    internal: dict[str, set[str]] = field(default_factory=dict)  # module -> modules of the tree
    external: dict[str, set[str]] = field(default_factory=dict)  # module -> top-level third-party names

    def package_of(self, module: str) -> str:
        return module if module in self.packages else module.rpartition(".")[0]


def build(sources: dict[str, str], top_level: set[str], packages: set[str] | None = None) -> Graph:
    """The graph of ``sources`` (module name -> its source; a package's source is its
    ``__init__``, named by the package) for the top-level packages ``top_level``.
    ``packages`` names the modules that are packages (default: those with modules below)."""
    graph = Graph()
    if packages is None:
        packages = {n for n in sources if any(other.startswith(n + ".") for other in sources)} | set(top_level) & set(
            sources
        )
    graph.packages = packages
    for name, text in sources.items():
        inside: set[str] = set()
        outside: set[str] = set()
        for target in _imports(ast.parse(text), name, name in graph.packages):
            if target.split(".")[0] in top_level:
                inside.add(_existing(target, sources))
            else:
                outside.add(target.split(".")[0])
        graph.internal[name] = inside - {name}
        graph.external[name] = outside
    return graph


def tree_packages(root: Path, top_level: list[str]) -> set[str]:
    """The dotted names of every package (a directory with ``__init__.py``) of ``top_level``."""
    return {
        ".".join(p.parent.relative_to(root).parts)
        for t in top_level
        for p in _python_files(root / t)
        if p.name == "__init__.py"
    }


def _python_files(folder: Path) -> list[Path]:
    """Every ``.py`` file under ``folder``, through symlinked folders (``clmq/client ->
    ../client``: the package is made of them)."""
    return sorted(Path(d, f) for d, _, files in os.walk(folder, followlinks=True) for f in files if f.endswith(".py"))


def tree_sources(root: Path, top_level: list[str]) -> dict[str, str]:
    """Module name -> source for every ``.py`` file of the packages ``top_level`` under ``root``."""
    found: dict[str, str] = {}
    for package in top_level:
        for path in _python_files(root / package):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path.read_text()
    return found


def _imports(tree: ast.AST, module: str, is_package: bool) -> list[str]:
    """Dotted names imported anywhere in ``tree``; ``from x import y`` yields ``x.y``
    (resolved to ``x`` later if ``y`` is not a module)."""
    package = module if is_package else module.rpartition(".")[0]
    out: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            out += [f"{base}.{a.name}" if a.name != "*" else base for a in node.names]
    return out


def _existing(target: str, sources: dict[str, str]) -> str:
    """The longest prefix of ``target`` that is a module of the tree."""
    parts = target.split(".")
    while parts and ".".join(parts) not in sources:
        parts.pop()
    return ".".join(parts) if parts else target


# ------------------------------------------------------------------------- rules
def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def package_edges(graph: Graph, depth: int | None = None) -> dict[str, set[str]]:
    """Imports between packages (rooms: a module belongs to the package that holds it);
    ``depth=2``: between the packages below ``clmq``.

    An import of a module of an enclosing package is not an edge: a family of files
    (``client/producer/``) may use the shared modules of its room (``clmq.client._routes``)
    while the room's ``__init__`` re-exports the family. Cycles between sibling
    families, or between rooms, still are; and no module cycle is allowed at all."""
    edges: dict[str, set[str]] = {}
    for module, targets in graph.internal.items():
        src = _cut(graph.package_of(module), depth)
        for target in targets:
            dst = _cut(graph.package_of(target), depth)
            if src != dst and not src.startswith(dst + "."):
                edges.setdefault(src, set()).add(dst)
    return edges


def room_of(module: str) -> str | None:
    """The room (of ``LAYERS``) that holds ``module``: its longest room prefix."""
    found = [room for _, rooms in LAYERS for room in rooms if module == room or module.startswith(room + ".")]
    return max(found, key=len) if found else None


def room_edges(graph: Graph) -> dict[str, set[str]]:
    """Imports between the rooms of ``LAYERS`` (``clmq.broker.cli`` and ``clmq.broker.store``
    are two rooms though one folder holds both)."""
    edges: dict[str, set[str]] = {}
    for module, targets in graph.internal.items():
        for target in targets:
            src, dst = room_of(module), room_of(target)
            if src and dst and src != dst:
                edges.setdefault(src, set()).add(dst)
    return edges


def _cut(package: str, depth: int | None) -> str:
    return package if depth is None else ".".join(package.split(".")[:depth])


def private_imports(graph: Graph) -> list[str]:
    """Imports of a private module (a name part starting with ``_``) from outside the
    package that holds it."""
    bad = []
    for module, targets in graph.internal.items():
        for target in targets:
            parts = target.split(".")
            for i, part in enumerate(parts):
                if part.startswith("_") and not part.startswith("__"):
                    owner = ".".join(parts[:i])
                    if module != owner and not module.startswith(owner + "."):
                        bad.append(f"{module} imports {target}, private to {owner}")
                    break
    return sorted(bad)


# Modules that are a layer by themselves, not a room: the package's public face (it
# re-exports names of every layer, lazily) and ``python -m clmq``.
EXACT_LAYER: dict[str, str] = {"clmq": "cli", "clmq.__main__": "cli"}


def layer_of(module: str) -> str | None:
    if module in EXACT_LAYER:
        return EXACT_LAYER[module]
    best, layer = "", None
    for name, rooms in LAYERS:
        for room in rooms:
            if (module == room or module.startswith(room + ".")) and len(room) > len(best):
                best, layer = room, name
    return layer


def upward_imports(graph: Graph) -> list[str]:
    """Imports of a higher layer than the importer's, and modules in no layer."""
    rank = {name: i for i, (name, _) in enumerate(LAYERS)}
    bad = []
    for module, targets in graph.internal.items():
        mine = layer_of(module)
        if mine is None:
            bad.append(f"{module} is in no layer: add its room to LAYERS")
            continue
        for target in targets:
            theirs = layer_of(target)
            if theirs is not None and rank[theirs] > rank[mine]:
                bad.append(f"{module} ({mine}) imports {target} ({theirs}), a higher layer")
    return sorted(bad)


def library_violations(graph: Graph) -> list[str]:
    bad = []
    for module, libs in graph.external.items():
        layer = layer_of(module)
        for lib in sorted(libs & FORBIDDEN_IN_LAYER.get(layer or "", set())):
            bad.append(f"{module} ({layer}) imports {lib}")
        for lib in sorted(libs & set(ONLY_IN)):
            if not any(module == room or module.startswith(room + ".") for room in ONLY_IN[lib]):
                bad.append(f"{module} imports {lib}, allowed only in {', '.join(sorted(ONLY_IN[lib]))}")
    return bad

"""The dependency rules of the code base, checked on the source (see docs/architecture.md).

Each rule is shown failing on a small synthetic tree first, so that a rule that could
never fail would be noticed, then checked on the real tree.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests import import_graph as ig

ROOT = Path(__file__).resolve().parents[1]
TOP_LEVEL = ["clmq"]


@pytest.fixture(scope="module")
def tree() -> ig.Graph:
    return ig.build(ig.tree_sources(ROOT, TOP_LEVEL), set(TOP_LEVEL), ig.tree_packages(ROOT, TOP_LEVEL))


def synthetic(**modules: str) -> ig.Graph:
    """A tree from ``name="source"`` pairs; ``__`` in a name stands for a dot."""
    sources = {name.replace("__", "."): text for name, text in modules.items()}
    return ig.build(sources, {name.split(".")[0] for name in sources})


# ----------------------------------------------------------------- the rules fail
def test_a_module_cycle_is_found_even_through_a_function_level_import() -> None:
    g = synthetic(pkg="", pkg__a="from pkg import b\n", pkg__b="def f():\n    from pkg.a import x\n")
    assert ig.cycles(g.internal) == [["pkg.a", "pkg.b"]]


def test_a_cycle_only_type_checkers_see_is_still_a_cycle() -> None:
    g = synthetic(
        pkg="",
        pkg__a="from .b import B\n",
        pkg__b="from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n",
    )
    assert ig.cycles(g.internal) == [["pkg.a", "pkg.b"]]


def test_a_cycle_between_packages_is_found_though_the_modules_do_not_form_one() -> None:
    g = synthetic(one="", one__a="import two.c\n", one__b="", two="", two__c="", two__d="from one import b\n")
    assert ig.cycles(g.internal) == []
    assert ig.cycles(ig.package_edges(g)) == [["one", "two"]]


def test_a_family_may_use_its_rooms_modules_but_sibling_families_form_no_cycle() -> None:
    g = synthetic(
        room="from .fam import m\n",
        room___shared="",
        room__fam="",
        room__fam__m="from .._shared import y\n",
        room__a="",
        room__a__m="from ..b.n import z\n",
        room__a__j="",
        room__b="",
        room__b__n="",
        room__b__k="from ..a.j import w\n",
    )
    assert ig.cycles(g.internal) == []
    assert ig.cycles(ig.package_edges(g)) == [["room.a", "room.b"]]


def test_relative_imports_resolve_to_the_module_they_name() -> None:
    g = synthetic(
        pkg="from ._x import y\n",
        pkg___x="",
        pkg__sub="",
        pkg__sub__m="from .. import _x\nfrom ..sub import n\n",
        pkg__sub__n="",
    )
    assert g.internal["pkg"] == {"pkg._x"}
    assert g.internal["pkg.sub.m"] == {"pkg._x", "pkg.sub.n"}


def test_a_private_module_imported_from_another_package_is_found() -> None:
    g = synthetic(
        one="",
        one___impl="",
        one__pub="from ._impl import x\n",
        two="",
        two__m="from one._impl import x\n",
        three="",
        three__m="from one import _impl\n",
    )
    assert ig.private_imports(g) == [
        "three.m imports one._impl, private to one",
        "two.m imports one._impl, private to one",
    ]


def test_an_upward_import_and_a_module_in_no_layer_are_found() -> None:
    g = synthetic(clmq__commitlog="import clmq.client\n", clmq__client="", clmq__elsewhere="")
    assert ig.upward_imports(g) == [
        "clmq.commitlog (storage) imports clmq.client (clients), a higher layer",
        "clmq.elsewhere is in no layer: add its room to LAYERS",
    ]


def test_a_forbidden_library_is_found() -> None:
    g = synthetic(
        clmq__commitlog="def f():\n    import trio\n",
        clmq__protocol="import socket\n",
        clmq__client="import kazoo.client\n",
    )
    assert sorted(ig.library_violations(g)) == [
        "clmq.client imports kazoo, allowed only in clmq.broker.coordination",
        "clmq.commitlog (storage) imports trio",
        "clmq.protocol (protocol) imports socket",
    ]


# ------------------------------------------------------------ on the real tree
def test_no_module_imports_itself_back(tree: ig.Graph) -> None:
    assert ig.cycles(tree.internal) == []


def test_no_cycle_between_rooms_or_top_level_packages(tree: ig.Graph) -> None:
    assert ig.cycles(ig.package_edges(tree)) == []
    assert ig.cycles(ig.room_edges(tree)) == []


def test_no_package_imports_another_packages_private_modules(tree: ig.Graph) -> None:
    assert ig.private_imports(tree) == []


def test_layers_point_one_way(tree: ig.Graph) -> None:
    assert ig.upward_imports(tree) == []


def test_libraries_stay_in_their_rooms(tree: ig.Graph) -> None:
    assert ig.library_violations(tree) == []


def test_commitlog_does_not_know_about_consume_queues(tree: ig.Graph) -> None:
    for module, targets in tree.internal.items():
        if module.startswith("clmq.commitlog"):
            assert not any(t.startswith("clmq.consumequeue") for t in targets), module


def test_clients_take_the_record_format_from_common_not_from_the_storage_engine(tree: ig.Graph) -> None:
    """The shared vocabulary lives in ``clmq.common``: a client needs no storage room."""
    for module, targets in tree.internal.items():
        if module.startswith("clmq.client"):
            storage = [t for t in targets if ig.layer_of(t) == "storage"]
            assert storage == [], module


def test_common_imports_nothing_of_clmq(tree: ig.Graph) -> None:
    for module, targets in tree.internal.items():
        if module.startswith("clmq.common"):
            assert all(t.startswith("clmq.common") for t in targets), module


MAX_CLASS_LINES = 300  # docs/architecture.md: split a class that grows past it by composition


def test_no_class_is_over_300_lines() -> None:
    """A class past the limit is split into parts sharing one state object (``StoreState``,
    ``ReplicaState``, ``ConsumerState``: docs/architecture.md), not allowed to grow."""
    sources = ig.tree_sources(ROOT, TOP_LEVEL)
    too_long = sorted(
        f"{module}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for module, text in sources.items()
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.ClassDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES
    )
    assert too_long == []


def test_every_room_is_where_the_architecture_says(tree: ig.Graph) -> None:
    """The rooms docs/architecture.md names exist, and each has its layer."""
    for room, layer in [
        ("clmq.broker.store", "storage"),
        ("clmq.protocol.transport", "transport"),
        ("clmq.broker.service", "services"),
        ("clmq.broker.replication", "services"),
        ("clmq.broker.coordination", "services"),
        ("clmq.broker.cli", "cli"),
        ("clmq.bench", "cli"),
        ("clmq.devtools", "cli"),
        ("clmq.common", "common"),
        ("clmq.client.producer", "clients"),
        ("clmq.client.consumer", "clients"),
        ("clmq.broker.service.timer", "services"),
    ]:
        assert room in tree.packages, room
        assert ig.layer_of(room) == layer, room

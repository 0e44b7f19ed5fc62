"""The contracts the layout states as types hold at run time too: both storage modes
are a ``StorageEngine``, and every exception clmq exports is a ``ClmqError``."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

import clmq
from clmq.broker.store import StorageEngine, Store
from clmq.common import ClmqError, CorruptRecordError

from .conftest import small_config

PACKAGES = [
    "clmq",
    "clmq.commitlog",
    "clmq.consumequeue",
    "clmq.protocol",
    "clmq.protocol.transport",
    "clmq.broker.store",
    "clmq.broker.service",
    "clmq.broker.cli.settings",
    "clmq.nameserver",
    "clmq.client",
    "clmq.spark_connector",
]


def test_both_storage_modes_are_storage_engines(tmp_path, mode: str) -> None:
    with Store.open(small_config(tmp_path / "s", mode=mode)) as store:
        assert isinstance(store, StorageEngine)
        missing = [name for name in dir(StorageEngine) if not name.startswith("_") and not hasattr(store, name)]
        assert missing == []


@pytest.mark.parametrize("package", PACKAGES)
def test_every_exported_exception_is_a_clmq_error(package: str) -> None:
    module = importlib.import_module(package)
    names = getattr(module, "__all__", [n for n in dir(module) if not n.startswith("_")])
    # The Spark connector's data-source classes load pyspark, which then holds the
    # interpreter's exit for a minute: look only at the names that do not need it.
    lazy = getattr(module, "_EXPORTS", {})
    names = [n for n in names if lazy.get(n) not in ("._source", "._export")]
    exceptions = [
        getattr(module, n)
        for n in names
        if inspect.isclass(getattr(module, n)) and issubclass(getattr(module, n), BaseException)
    ]
    assert [e.__name__ for e in exceptions if not issubclass(e, ClmqError)] == []
    if package in ("clmq", "clmq.commitlog", "clmq.protocol", "clmq.protocol.transport", "clmq.client"):
        assert exceptions, f"{package} exports exceptions"


def test_a_corruption_error_carries_where_and_what() -> None:
    e = CorruptRecordError("/data/commitlog/00000000000000000000", 4096, "crc", "0x1234abcd", "0x0")
    assert (e.file, e.offset, e.check, e.expected, e.actual) == (
        "/data/commitlog/00000000000000000000",
        4096,
        "crc",
        "0x1234abcd",
        "0x0",
    )
    assert isinstance(e, ClmqError)
    assert (
        str(e)
        == "corrupt record in /data/commitlog/00000000000000000000 at offset 4096: crc expected 0x1234abcd, got 0x0"
    )


def test_the_public_face_lists_each_export_once_and_shows_each_to_type_checkers() -> None:
    """``clmq/__init__.py`` keeps three lists of its names (the lazy table, ``__all__``,
    the ``TYPE_CHECKING`` imports): they agree, and every name loads."""
    assert sorted(clmq.__all__) == sorted(["__version__", *clmq._EXPORTS])
    tree = ast.parse(Path(clmq.__file__).read_text())
    (block,) = [n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"]
    shown = {a.asname or a.name for n in block.body if isinstance(n, ast.ImportFrom) for a in n.names}
    assert shown == set(clmq._EXPORTS)
    assert all(getattr(clmq, name) is not None for name in clmq._EXPORTS)

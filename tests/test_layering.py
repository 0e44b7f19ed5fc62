"""The dependency rules of the code base, checked on the source."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVICE_LIBS = {"trio", "msgpack", "kazoo", "pyspark", "pyarrow"}


def imported_modules(package: str) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in (ROOT / package).rglob("*.py"):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
        found[str(path.relative_to(ROOT))] = names
    return found


@pytest.mark.parametrize("package", ["commitlog", "consumequeue"])
def test_storage_packages_import_no_service_libraries(package: str) -> None:
    for path, names in imported_modules(package).items():
        assert not names & SERVICE_LIBS, f"{path} imports {names & SERVICE_LIBS}"
        assert not names & {"broker", "client", "nameserver", "spark_connector"}, f"{path} points upward"


def test_commitlog_does_not_know_about_consume_queues() -> None:
    for path, names in imported_modules("commitlog").items():
        assert "consumequeue" not in names, path


def test_the_store_facade_is_free_of_trio() -> None:
    for path, names in imported_modules("broker").items():
        if Path(path).name in {"_store.py", "_recovery.py", "_checkpoint.py", "_topics.py", "_results.py", "_durable_file.py"}:
            assert not names & SERVICE_LIBS, f"{path} imports {names & SERVICE_LIBS}"


def test_only_the_spark_connector_imports_pyspark() -> None:
    for package in ("commitlog", "consumequeue", "broker", "client", "nameserver", "protocol"):
        for path, names in imported_modules(package).items():
            assert not names & {"pyspark", "pyarrow"}, f"{path} imports {names & {'pyspark', 'pyarrow'}}"


def test_the_wire_protocol_is_sans_io() -> None:
    for path, names in imported_modules("protocol").items():
        assert not names & {"trio", "socket", "asyncio", "selectors"}, f"{path} imports {names}"

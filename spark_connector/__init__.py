"""clmq's Spark connector: the PySpark data source ``clmq`` and ``clmq export``.

``register(spark)`` makes ``spark.read.format("clmq")`` (and ``readStream``) available.
Options, read paths and guarantees: docs/spark.md. Only this package imports pyspark,
and only when a name that needs it is used (so ``clmq --help`` stays fast).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

_EXPORTS = {
    "COLUMNS": "._arrow",
    "SCHEMA_DDL": "._arrow",
    "LayoutError": "._layout",
    "LogLayout": "._layout",
    "local_layout": "._layout",
    "OptionError": "._options",
    "ReadOptions": "._options",
    "parse_options": "._options",
    "read_corrupt_log": "._scan",
    "ClmqDataSource": "._source",
    "register": "._source",
    "explain": "._source",
    "DataLossError": "._select",
    "ManifestError": "._manifest",
    "Snapshot": "._manifest",
    "read_manifest": "._manifest",
    "resolve_snapshot": "._manifest",
    "parse_profile": "._profile",
    "register_replay": "._replay",
    "write_replay_files": "._replay",
    "export": "._export",
    "spark_session": "._export",
    "ExportSummary": "._export",
    "FORMATS": "._export",
}

__all__ = [
    "COLUMNS",
    "FORMATS",
    "SCHEMA_DDL",
    "ClmqDataSource",
    "DataLossError",
    "ExportSummary",
    "LayoutError",
    "LogLayout",
    "ManifestError",
    "OptionError",
    "ReadOptions",
    "Snapshot",
    "explain",
    "export",
    "local_layout",
    "parse_options",
    "parse_profile",
    "read_corrupt_log",
    "read_manifest",
    "register",
    "register_replay",
    "resolve_snapshot",
    "spark_available",
    "spark_session",
    "write_replay_files",
]


def spark_available() -> bool:
    """Whether pyspark is installed (the ``spark`` extra), without importing it."""
    return importlib.util.find_spec("pyspark") is not None


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'spark_connector' has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)

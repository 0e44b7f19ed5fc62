"""clmq's Spark connector: the PySpark data source ``clmq`` and ``clmq export``.

``register(spark)`` makes ``spark.read.format("clmq")`` (and ``readStream``) available.
Options, read paths and guarantees: docs/spark.md. Only this package imports pyspark.
"""

from ._arrow import COLUMNS, SCHEMA_DDL
from ._layout import LayoutError, LogLayout, local_layout
from ._options import OptionError, ReadOptions, parse_options
from ._scan import read_corrupt_log
from ._source import ClmqDataSource, register

__all__ = [
    "COLUMNS", "ClmqDataSource", "LayoutError", "LogLayout", "OptionError", "ReadOptions", "SCHEMA_DDL",
    "local_layout", "parse_options", "read_corrupt_log", "register",
]  # fmt: skip

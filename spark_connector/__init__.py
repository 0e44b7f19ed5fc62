"""clmq spark_connector (see the issues that build it)."""

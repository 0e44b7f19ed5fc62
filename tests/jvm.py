"""The options of the JVMs the tests start (Spark's driver, in the test process and in
the ``clmq`` commands the tests run; the Kafka Java harness).

They compile with C1 only (``-XX:TieredStopAtLevel=1``): each lives seconds to minutes
on small data, where C2's compiler threads cost more CPU than their code saves, and the
suite is bound by the machine's 2 cores. ``tests/test_spark.py`` alone on an idle
machine: 141-165 s of CPU in three runs with the default JIT, 92-99 s in two with these
(docs/benchmarks.md, "Sixth session: the tests' JVMs").
What the JVMs do is the same; only the benchmarks' own peers (``bench/peers_*``) keep
the default JIT, since their speed is what they measure.
"""

from __future__ import annotations

TEST_JVM_OPTIONS = ("-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC")
# How PySpark starts its driver JVM (read by pyspark.java_gateway; `bench/spark.py`
# prepends its own --conf to it).
PYSPARK_SUBMIT_ARGS = f'--driver-java-options "{" ".join(TEST_JVM_OPTIONS)}" pyspark-shell'

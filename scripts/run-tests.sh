#!/usr/bin/env bash
# Installs everything the tests need and runs the checks CI runs: ruff (lint and format),
# mypy, then the whole test suite, slow tests included.
# Extra arguments go to pytest (e.g. -m "not slow" for a quick local run, -n 0 for one process).
source "$(dirname "$0")/_env.sh" "test,spark,bench,dev"
# The disk-full tests mount a small tmpfs: they need root and util-linux's mount.
apt_install util-linux
# The Spark tests run a real local SparkSession: it needs a Java runtime (17 or later).
command -v java >/dev/null 2>&1 || apt_install default-jre-headless
# The failover tests run real ZooKeeper servers (tests/zk.py): Debian's jar, started with
# that Java runtime (not the `zookeeper` package, which pulls a desktop JRE and a service).
[ -f /usr/share/java/zookeeper.jar ] || apt_install libzookeeper-java
# The dashboard's tests load its pages in a real headless browser: Debian's Chromium.
command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || apt_install chromium
# The Kafka listener is judged by real Kafka clients: kcat (librdkafka), from Debian; the
# Python ones (confluent-kafka, kafka-python, aiokafka) come with the test extra.
command -v kcat >/dev/null 2>&1 || apt_install kcat
# ... and by the official Java client and Spark's Kafka source, from Maven Central.
source "$(dirname "$0")/_java_deps.sh"
echo "== ruff check"; .venv/bin/ruff check .
echo "== ruff format --check"; .venv/bin/ruff format --check .
echo "== mypy"; .venv/bin/mypy
# The tests run on CLMQ_TEST_WORKERS pytest-xdist workers (default 4: on 2 cores most
# tests wait on sockets, timers, ZooKeeper and child processes, so more workers than cores
# pay). Tests of one xdist_group run on one worker. `-n 0` among the extra arguments runs
# everything in this process, one test at a time. --durations=30: the slowest 30 tests
# (setup, call and teardown each) close the report, so CI shows where the time goes.
echo "== pytest"; exec .venv/bin/python -m pytest -n "${CLMQ_TEST_WORKERS:-4}" --dist loadgroup --durations=30 "$@"

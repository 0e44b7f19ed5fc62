#!/usr/bin/env bash
# Installs everything the tests need and runs the whole suite, slow tests included.
# Extra arguments go to pytest (e.g. -m "not slow" for a quick local run).
source "$(dirname "$0")/_env.sh" "test,spark"
# The disk-full tests mount a small tmpfs: they need root and util-linux's mount.
apt_install util-linux
# The Spark tests run a real local SparkSession: it needs a Java runtime (17 or later).
command -v java >/dev/null 2>&1 || apt_install default-jre-headless
exec .venv/bin/python -m pytest "$@"

#!/usr/bin/env bash
# Installs everything the tests need and runs the whole suite, slow tests included.
# Extra arguments go to pytest (e.g. -m "not slow" for a quick local run).
source "$(dirname "$0")/_env.sh" "test"
# The disk-full tests mount a small tmpfs: they need root and util-linux's mount.
apt_install util-linux
exec .venv/bin/python -m pytest "$@"

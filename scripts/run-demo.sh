#!/usr/bin/env bash
# Installs clmq into .venv and starts the embedded default: a name server and a broker in
# one process on ./clmq-data, then creates a topic, produces and consumes a few messages
# so you see them flow. It keeps serving until Ctrl-C (add --exit-after-demo to stop).
source "$(dirname "$0")/_env.sh" ""
echo "clmq is installed as $(pwd)/.venv/bin/clmq ('source .venv/bin/activate' puts it on PATH)"
exec .venv/bin/clmq dev --demo "$@"

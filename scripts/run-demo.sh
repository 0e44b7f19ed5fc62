#!/usr/bin/env bash
# Installs clmq into .venv and runs the embedded default: for now the storage engine's
# demo (append to ./clmq-data, restart, read every queue back).
source "$(dirname "$0")/_env.sh" ""
exec .venv/bin/clmq demo "$@"

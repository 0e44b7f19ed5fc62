"""Structured logs (issue 18): ``--log-format json`` writes one JSON object per line
(with an event's extra fields), ``--log-level`` sets levels per component, a bad level
is a usage error. Through the real CLI."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
from pathlib import Path

import pytest

from clmq.broker.cli._logging import JsonFormatter
from tests.cli_helpers import clmq, popen


def test_a_service_started_with_json_logs_writes_json_lines(tmp_path: Path) -> None:
    proc = popen(
        "--log-format",
        "json",
        "--log-level",
        "warning,clmq.nameserver=info",
        "nameserver",
        "--listen-port",
        "0",
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    assert b"name server on" in proc.stdout.readline()  # it runs and catches Ctrl-C: stop it
    os.kill(proc.pid, signal.SIGINT)
    first, *rest = proc.communicate(timeout=30)[1].decode().splitlines()
    first = json.loads(first)
    assert proc.returncode == 0
    assert first["logger"] == "clmq.nameserver" and first["level"] == "info" and "listening" in first["msg"]
    assert first["ts"].endswith("Z")
    for line in rest:  # every line is JSON (nothing at info from other components)
        assert json.loads(line)["level"] in ("info", "warning", "error"), line


def test_an_events_extra_fields_are_json_fields() -> None:
    record = logging.LogRecord("clmq.broker", logging.WARNING, __file__, 1, "store %s failed", ("a",), None)
    record.topic = "orders"
    line = json.loads(JsonFormatter().format(record))
    assert line == {
        "ts": line["ts"],
        "level": "warning",
        "logger": "clmq.broker",
        "msg": "store a failed",
        "topic": "orders",
    }


@pytest.mark.parametrize("levels", ["loud", "clmq.broker=loud", "info,=x"])
def test_a_level_that_is_none_is_a_usage_error(tmp_path: Path, levels: str) -> None:
    out = clmq("--log-level", levels, "topic", "list", cwd=tmp_path)
    assert out.returncode == 2 and "is not a level" in out.stderr, out.stderr

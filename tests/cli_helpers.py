"""Running the real ``clmq`` in tests: a command as a subprocess, and a ``clmq dev``
(name server and broker) to run commands against."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import trio

from clmq.client import ConnectionFailed, open_admin
from tests import ports, process_groups
from tests.jvm import PYSPARK_SUBMIT_ARGS
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[1]
ENV = {"COLUMNS": "200", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "PYSPARK_SUBMIT_ARGS": PYSPARK_SUBMIT_ARGS}


def clmq(*args: str, cwd: Path, stdin: bytes | None = None, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``clmq args`` to the end (``stdin``: its input, as bytes); its exit code,
    stdout and stderr (decoded as UTF-8)."""
    done = subprocess.run(
        [sys.executable, "-m", "clmq", *args],
        cwd=cwd,
        capture_output=True,
        timeout=timeout_s,
        env=ENV,
        input=stdin if stdin is not None else b"",
    )
    return subprocess.CompletedProcess(
        done.args, done.returncode, done.stdout.decode("utf-8", "replace"), done.stderr.decode("utf-8", "replace")
    )


def popen(*args: str, cwd: Path, **kw: object) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "clmq", *args], cwd=cwd, env=ENV, **kw)  # type: ignore[call-overload]


def free_port() -> int:
    """A port for a server of this test (:func:`tests.ports.free_port`)."""
    return ports.free_port()


def _brokers(ns: str) -> int:
    async def ask() -> int:
        async with open_admin([ns]) as admin:
            try:
                return len(await admin.brokers())
            except ConnectionFailed:
                return 0

    return trio.run(ask)


@contextmanager
def running_dev(tmp_path: Path, config: str | None = None) -> Iterator[str]:
    """A ``clmq dev`` process (name server and broker; ``config``: the text of its
    TOML settings file); yields the name server's address. Stopped with SIGINT (a
    graceful stop) at the end."""
    ns_port, broker_port = free_port(), free_port()
    ns = f"127.0.0.1:{ns_port}"
    settings: tuple[str, ...] = ()
    if config is not None:
        (tmp_path / "broker.toml").write_text(config)
        settings = ("--config", str(tmp_path / "broker.toml"))
    proc = popen(
        "dev",
        *settings,
        "--data-dir",
        str(tmp_path / "dev-data"),
        "--listen-port",
        str(broker_port),
        "--namesrv-port",
        str(ns_port),
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        **process_groups.spawn_options(),  # dies with this test process, whatever ends it
    )
    process_groups.track(proc)
    try:
        wait_until(lambda: proc.poll() is not None or _brokers(ns) > 0, 60, "clmq dev to register its broker")
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        yield ns
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        process_groups.kill_group(proc)  # anything left of it, the process itself after a timeout

"""A real standalone ZooKeeper server run as a subprocess, for development and tests.

``LocalZooKeeper`` writes its own ``zoo.cfg`` and data directory under ``directory``,
starts ``java ... ZooKeeperServerMain`` and waits until the server answers ``ruok``
with ``imok``. It imports no kazoo (it only speaks the four-letter words over a plain
socket), so any package may use it: ``from clmq.devtools.zkserver import LocalZooKeeper``.

The port is chosen once (``client_port=0`` picks a free one) and kept across
``restart()``, so connect strings handed out before a restart stay valid. ``pause()``
and ``resume()`` freeze the JVM (SIGSTOP/SIGCONT): sessions then expire as they would
behind a partition.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import IO

ZOOKEEPER_JAR = Path("/usr/share/java/zookeeper.jar")
SLF4J_JAR = Path("/usr/share/java/slf4j-simple.jar")
INSTALL_HINT = "apt-get install libzookeeper-java default-jre-headless"
MAIN_CLASS = "org.apache.zookeeper.server.ZooKeeperServerMain"

DEFAULT_TICK_TIME_MS = 500
DEFAULT_START_TIMEOUT_S = 30.0
DEFAULT_STOP_TIMEOUT_S = 10.0
RUOK_TIMEOUT_S = 0.5
LOG_TAIL_BYTES = 4000
HEAP_MAX = "-Xmx128m"


class ZooKeeperError(RuntimeError):
    """The server could not be started (java or the jar missing, no answer in time)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def four_letter_word(port: int, word: str, timeout_s: float = RUOK_TIMEOUT_S, host: str = "127.0.0.1") -> str:
    """Send a ZooKeeper four-letter command (``ruok``, ``srvr``, ``mntr``) and return the
    reply; an empty string when nothing answers (refused, closed, timed out)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as s:
            s.sendall(word.encode("ascii"))
            chunks = []
            while chunk := s.recv(4096):
                chunks.append(chunk)
            return b"".join(chunks).decode("utf-8", "replace")
    except OSError:
        return ""


class LocalZooKeeper:
    """One standalone ZooKeeper server (a ``java`` subprocess) with its config, data and
    log in ``directory``. Use as a context manager, or call ``start()``/``stop()``."""

    def __init__(
        self,
        directory: Path | str,
        *,
        client_port: int = 0,
        tick_time_ms: int = DEFAULT_TICK_TIME_MS,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
        jar: Path | str = ZOOKEEPER_JAR,
        slf4j_jar: Path | str = SLF4J_JAR,
        java: str = "java",
    ) -> None:
        self.directory = Path(directory)
        self.tick_time_ms = tick_time_ms
        self.start_timeout_s = start_timeout_s
        self.jar = Path(jar)
        self.slf4j_jar = Path(slf4j_jar)
        self.java = java
        self._port = client_port
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def port(self) -> int:
        """The client port (chosen at the first ``start()`` when 0 was given)."""
        return self._port

    @property
    def pid(self) -> int | None:
        """The java process's id while it runs."""
        return self._proc.pid if self._proc is not None else None

    @property
    def data_dir(self) -> Path:
        return self.directory / "data"

    @property
    def config_path(self) -> Path:
        return self.directory / "zoo.cfg"

    @property
    def log_path(self) -> Path:
        return self.directory / "zookeeper.log"

    def connect_string(self, chroot: str = "") -> str:
        """``127.0.0.1:PORT`` plus ``/chroot`` when given (a leading slash is optional)."""
        suffix = "/" + chroot.lstrip("/") if chroot else ""
        return f"127.0.0.1:{self._port}{suffix}"

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def ruok(self) -> bool:
        """True when the server answers ``ruok`` with ``imok``."""
        return self._port != 0 and four_letter_word(self._port, "ruok") == "imok"

    def serving(self) -> bool:
        """True when the server answers ``ruok`` and serves requests: ``imok`` comes ~0.1 s
        before ``srvr`` stops saying "not currently serving requests"."""
        return self.ruok() and "Mode:" in four_letter_word(self._port, "srvr")

    def start(self) -> LocalZooKeeper:
        """Start the server and wait until it answers ``ruok`` and serves; ``ZooKeeperError`` (with
        the install hint or the log's tail) when it cannot."""
        if self.is_running():
            return self
        self._check_installed()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self._port == 0:
            self._port = free_port()
        self._write_config()
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - kept open while the server runs
        # A session of its own: a Ctrl-C at a terminal reaches only the command that owns
        # the server (e.g. clmq dev), which stops it last, after the brokers using it.
        self._proc = subprocess.Popen(
            self._command(),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=self.directory,
            start_new_session=True,
        )
        self._await_ready()
        return self

    def stop(self, timeout_s: float = DEFAULT_STOP_TIMEOUT_S) -> None:
        """SIGTERM, wait up to ``timeout_s``, then SIGKILL. A paused server is resumed
        first so that it can act on the SIGTERM."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.terminate()
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._forget()

    def kill(self) -> None:
        """SIGKILL: the server dies at once, as in a crash (its data stays)."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        self._forget()

    def restart(self) -> LocalZooKeeper:
        """Stop and start again on the same port with the same data."""
        self.stop()
        return self.start()

    def pause(self) -> None:
        """SIGSTOP the server: connections stay open but nothing answers."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT a paused server."""
        self._signal(signal.SIGCONT)

    def log_tail(self, limit_bytes: int = LOG_TAIL_BYTES) -> str:
        """The last ``limit_bytes`` of the server's log (for error messages)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - limit_bytes))
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def __enter__(self) -> LocalZooKeeper:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"LocalZooKeeper({str(self.directory)!r}, port={self._port}, pid={self.pid})"

    def _check_installed(self) -> None:
        if shutil.which(self.java) is None:
            raise ZooKeeperError(f"no Java runtime ({self.java!r} not found on PATH): {INSTALL_HINT}")
        for jar in (self.jar, self.slf4j_jar):
            if not jar.is_file():
                raise ZooKeeperError(f"ZooKeeper's jar {jar} is missing: {INSTALL_HINT}")

    def _command(self) -> list[str]:
        classpath = f"{self.jar}:{self.slf4j_jar}"
        return [self.java, HEAP_MAX, "-XX:+UseSerialGC", "-cp", classpath, MAIN_CLASS, str(self.config_path)]

    def _write_config(self) -> None:
        lines = [
            f"tickTime={self.tick_time_ms}",
            f"dataDir={self.data_dir}",
            f"clientPort={self._port}",
            "clientPortAddress=127.0.0.1",
            # The floor on session timeouts: clmq's default session is 2000 ms.
            "minSessionTimeout=1000",
            "admin.enableServer=false",
            "4lw.commands.whitelist=ruok,srvr,mntr",
        ]
        self.config_path.write_text("\n".join(lines) + "\n")

    def _await_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        interval = 0.02
        while not self.serving():
            proc = self._proc
            if proc is not None and proc.poll() is not None:
                code = proc.returncode
                self._forget()
                raise ZooKeeperError(
                    f"ZooKeeper exited with status {code} at start; log {self.log_path}:\n{self.log_tail()}"
                )
            if time.monotonic() >= deadline:
                self.kill()
                raise ZooKeeperError(
                    f"ZooKeeper on port {self._port} did not answer ruok within {self.start_timeout_s} s; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(interval)
            interval = min(interval * 2, 0.2)

    def _signal(self, sig: signal.Signals) -> None:
        if self._proc is None or self._proc.poll() is not None:
            raise ZooKeeperError("ZooKeeper is not running")
        self._proc.send_signal(sig)

    def _forget(self) -> None:
        self._proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

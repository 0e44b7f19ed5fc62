"""A TCP forwarding proxy in a process of its own, for tests that cut or freeze the
network between two real processes (a broker and ZooKeeper, a follower and its leader).

Run it as ``python -m tests.tcp_proxy --listen-port P --target host:port`` (``P`` 0 picks
a free port); it prints ``proxy ready on PORT`` once it listens. From a test use
:class:`Proxy`: ``stop()`` SIGKILLs the process so that every connection through it
drops at once (the peers see a reset or an end of stream); ``pause()`` SIGSTOPs it so
that connections stay open but hang (a partition); ``resume()`` lets them flow again;
``start()`` after ``stop()`` listens on the same port again (the network heals).
"""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import TracebackType

READY_PREFIX = "proxy ready on "
CHUNK_BYTES = 64 * 1024
LISTEN_BACKLOG = 128
READY_TIMEOUT_S = 10.0
REPO_ROOT = Path(__file__).resolve().parent.parent


def _pump(src: socket.socket, dst: socket.socket) -> None:
    """Copy ``src`` to ``dst`` until either side closes; then close both directions so
    that the other pump ends too."""
    try:
        while data := src.recv(CHUNK_BYTES):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _serve_one(client: socket.socket, target: tuple[str, int]) -> None:
    try:
        upstream = socket.create_connection(target)
    except OSError:
        client.close()  # the target is down: the client sees its connection closed
        return
    for s in (client, upstream):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    back = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
    back.start()
    _pump(client, upstream)
    back.join()
    client.close()
    upstream.close()


def serve(listen_port: int, target: tuple[str, int]) -> None:
    """Listen on 127.0.0.1:``listen_port`` and forward every connection to ``target``
    (a thread pair per connection), forever."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", listen_port))
    listener.listen(LISTEN_BACKLOG)
    print(f"{READY_PREFIX}{listener.getsockname()[1]}", flush=True)
    while True:
        client, _ = listener.accept()
        threading.Thread(target=_serve_one, args=(client, target), daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Forward TCP connections (a test tool).")
    parser.add_argument("--listen-port", type=int, default=0, help="port on 127.0.0.1 (0: a free one)")
    parser.add_argument("--target", required=True, help="host:port to forward to")
    args = parser.parse_args(argv)
    host, _, port = args.target.rpartition(":")
    serve(args.listen_port, (host or "127.0.0.1", int(port)))


STOP_TIMEOUT_S = 10.0


def _thread_states(pid: int) -> list[str]:
    """The state letter of every thread of ``pid`` (``T``: stopped), from /proc."""
    states = []
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue  # a thread that ended meanwhile
        states.append(text.rpartition(")")[2].split()[0])
    return states


def _wait_stopped(pid: int) -> None:
    """Wait until every thread of ``pid`` is stopped by SIGSTOP."""
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while not all(s in ("T", "t") for s in _thread_states(pid)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"tcp proxy {pid} did not stop within {STOP_TIMEOUT_S} s: {_thread_states(pid)}")
        time.sleep(0.001)  # polling /proc: there is no event to wait on for another process's stop


class Proxy:
    """A :mod:`tests.tcp_proxy` process forwarding 127.0.0.1:``port`` to ``target``."""

    def __init__(self, target: str, listen_port: int = 0) -> None:
        self.target = target
        self.port = listen_port
        self._proc: subprocess.Popen[str] | None = None

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> Proxy:
        """Start the process and wait for its ready line; the port chosen the first time
        is kept by later starts."""
        if self._proc is not None:
            return self
        cmd = [sys.executable, "-m", "tests.tcp_proxy", "--listen-port", str(self.port), "--target", self.target]
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        assert proc.stdout is not None
        timer = threading.Timer(READY_TIMEOUT_S, proc.kill)  # a line that never comes must not hang the test
        timer.start()
        try:
            line = proc.stdout.readline()
        finally:
            timer.cancel()
        if not line.startswith(READY_PREFIX):
            proc.kill()
            proc.wait()
            raise RuntimeError(f"tcp proxy to {self.target} did not start (said {line!r})")
        self.port = int(line[len(READY_PREFIX) :])
        self._proc = proc
        return self

    def stop(self) -> None:
        """SIGKILL the process: every connection through it drops at once."""
        if self._proc is None:
            return
        self._proc.kill()
        self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        self._proc = None

    def pause(self) -> None:
        """SIGSTOP the process and wait until every thread of it is stopped: connections
        stay open and hang. (kill() returns once the signal is queued; a pump thread
        running on the other core could still forward a few bytes before it stops.)"""
        assert self._proc is not None, "the proxy is not running"
        self._proc.send_signal(signal.SIGSTOP)
        _wait_stopped(self._proc.pid)

    def resume(self) -> None:
        """SIGCONT a paused process."""
        assert self._proc is not None, "the proxy is not running"
        self._proc.send_signal(signal.SIGCONT)

    def __enter__(self) -> Proxy:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


if __name__ == "__main__":
    main()

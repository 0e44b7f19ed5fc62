"""``clmq bench pop``'s member processes seen from the benchmark: started with a spec
(``pop_member.py``), read line by line, told ``go`` and ``stop``, killed."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
from typing import Any

import trio

READY_MAX_S = 60.0  # a member process prints "ready" within this
EXIT_MAX_S = 30.0  # a stopped member process exits within this (else it is killed)


class MemberProcess:
    """One ``python -m clmq.bench.pop_member SPEC`` with its stdin and stdout piped
    (stderr to a temporary file, shown if it fails)."""

    def __init__(self, proc: trio.Process, err: Any, name: str) -> None:
        self.proc, self.err, self.name = proc, err, name
        self._buf = b""

    @classmethod
    async def start(cls, spec: dict[str, Any]) -> MemberProcess:
        err = tempfile.TemporaryFile()  # noqa: SIM115 - closed by close()
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", "clmq.bench.pop_member", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
        )
        return cls(proc, err, spec["name"])

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    async def line(self) -> str | None:
        """The next line of its stdout (None: it closed it)."""
        assert self.proc.stdout is not None
        while b"\n" not in self._buf:
            data = await self.proc.stdout.receive_some(65536)
            if not data:
                return None
            self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    async def expect(self, word: str, max_s: float = READY_MAX_S) -> None:
        """Wait for the line ``word`` (lines before it are ignored)."""
        with trio.fail_after(max_s):
            while (line := await self.line()) != word:
                if line is None:
                    raise RuntimeError(f"member process {self.name} exited: {self.stderr_tail()}")

    async def send(self, word: str) -> None:
        assert self.proc.stdin is not None
        await self.proc.stdin.send_all(word.encode() + b"\n")

    async def finish(self) -> None:
        """Wait for it to exit (killed after EXIT_MAX_S); RuntimeError with its stderr
        if it did not exit cleanly (a member that failed mid-run spoils the figures)."""
        with trio.move_on_after(EXIT_MAX_S):
            await self.proc.wait()
        if self.proc.returncode is None:
            self.kill()
            await self.proc.wait()
        if self.proc.returncode != 0:
            raise RuntimeError(f"member process {self.name} exited {self.proc.returncode}: {self.stderr_tail()}")

    def kill(self) -> None:
        """``kill -9``."""
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGKILL)

    def stderr_tail(self) -> str:
        self.err.seek(0)
        return str(self.err.read().decode(errors="replace")[-3000:])

    def close(self) -> None:
        self.kill()
        self.err.close()


def split(members: int, processes: int) -> list[int]:
    """``members`` spread over at most ``processes`` processes, as evenly as can be."""
    n = max(1, min(members, processes))
    return [members // n + (1 if i < members % n else 0) for i in range(n)]

"""``clmq bench latency``'s load processes seen from the benchmark: one
``python -m clmq.bench.latency_load SPEC`` each (``pop_procs.MemberProcess``'s pipes)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from typing import Any

import trio

from .pop_procs import MemberProcess


class LoadProcess(MemberProcess):
    """A producer or the consumer of a case, read line by line."""

    @classmethod
    async def start(cls, spec: dict[str, Any]) -> LoadProcess:
        err = tempfile.TemporaryFile()  # noqa: SIM115 - closed by close()
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", "clmq.bench.latency_load", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
        )
        return cls(proc, err, spec["name"])

    async def result(self, max_s: float) -> dict[str, Any]:
        """Its JSON line of results (RuntimeError with its stderr if it exits without one)."""
        with trio.fail_after(max_s):
            while (line := await self.line()) is not None:
                if line.startswith("{"):
                    doc: dict[str, Any] = json.loads(line)
                    return doc
        raise RuntimeError(f"load process {self.name} exited without results: {self.stderr_tail()}")

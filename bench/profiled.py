"""``python -m clmq.bench.profiled OUT ARGS...``: ``python -m clmq ARGS...``
with every thread under cProfile (``python -m cProfile`` sees only the main thread, and
a broker's storage work runs in its threads). On exit each thread's profile is written
to ``OUT.<n>.<thread name>.prof`` (``OUT.0.MainThread.prof`` first); read them with
``pstats``. Used by ``clmq bench replication --profile-dir``."""

from __future__ import annotations

import cProfile
import runpy
import sys
import threading
from typing import Any

_profiles: list[tuple[str, cProfile.Profile]] = []


def _start_in_thread(*_: Any) -> None:
    """The first profile event of a new thread: give it its own profiler (whose
    ``enable`` replaces this hook for that thread)."""
    prof = cProfile.Profile()
    _profiles.append((threading.current_thread().name, prof))
    prof.enable()


def main() -> None:
    out, sys.argv = sys.argv[1], ["clmq", *sys.argv[2:]]
    threading.setprofile(_start_in_thread)
    prof = cProfile.Profile()
    _profiles.insert(0, ("MainThread", prof))
    prof.enable()
    try:
        runpy.run_module("clmq", run_name="__main__", alter_sys=True)
    except SystemExit:
        pass
    finally:
        prof.disable()
        threading.setprofile(None)  # None removes the hook
        for n, (name, p) in enumerate(list(_profiles)):
            safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in name)
            p.dump_stats(f"{out}.{n}.{safe}.prof")


if __name__ == "__main__":
    main()

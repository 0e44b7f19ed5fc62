"""Server processes of tests that never outlive the test run, whatever ends it.

A fixture's ``finally`` runs when a test fails, not when its pytest process is killed
(pytest-timeout's ``os._exit``, an xdist worker crashing, SIGKILL): a ``clmq dev`` it
started then runs on under pid 1. :func:`spawn_options` makes a process that dies with
the test process (Linux's parent-death signal, set in the child before ``exec``) in a
process group of its own, which :func:`kill_group` stops entirely; an ``atexit`` hook
kills every group still registered when the interpreter exits normally (an interrupted
run)."""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import subprocess
from typing import Any

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_GROUPS: set[int] = set()  # process groups started and not yet killed


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the process that started it exits."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def spawn_options() -> dict[str, Any]:
    """Keyword arguments for :class:`subprocess.Popen`: a session (and process group) of
    its own, and death with this process."""
    return {"start_new_session": True, "preexec_fn": _die_with_parent}


def track(proc: subprocess.Popen[Any]) -> None:
    """Remember ``proc``'s process group, to be killed at exit if nothing else did."""
    _GROUPS.add(proc.pid)


def kill_group(proc: subprocess.Popen[Any], wait_s: float = 30) -> None:
    """SIGKILL to ``proc``'s whole process group, then reap ``proc``. Only while ``proc``
    is not reaped: until then its pid (the group's id) cannot be given to another process."""
    _GROUPS.discard(proc.pid)
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(wait_s)


@atexit.register
def _kill_all() -> None:
    for group in list(_GROUPS):
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass

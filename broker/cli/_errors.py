"""How ``clmq`` fails: one line on stderr and a documented exit code.

A command raises :class:`CliError` (or lets a library error propagate); ``main`` turns
either into ``error: <what to do>`` and the exit code below. ``-v`` adds the stack.
"""

from __future__ import annotations

import errno
import sys
import traceback

import trio

from clmq.common import ClmqError

from .settings import SettingsError

EXIT_OK = 0
EXIT_FAILED = (
    1  # the operation failed, or found nothing it was asked for (unknown topic, group, message); a refused login
)
EXIT_USAGE = 2  # a bad argument or setting (argparse's own errors exit 2 too)
EXIT_UNREACHABLE = 3  # no name server or broker answered
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT, as shells report it)


class CliError(ClmqError):
    """A failure a person can act on: ``message`` says what happened and what to do."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def innermost(error: BaseException) -> BaseException:
    """The one error inside nested exception groups of one (trio wraps what a nursery
    raises); a group of several stays a group."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error


def exit_code_of(error: BaseException) -> int:
    """The documented exit code for ``error``."""
    # Here, not at the top: every verb reports through this module, and `clmq broker` needs no client.
    from clmq.client import AuthenticationFailed, ConnectionFailed, NoRouteError

    if isinstance(error, CliError):
        return error.exit_code
    if isinstance(error, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if isinstance(error, SettingsError):
        return EXIT_USAGE
    if isinstance(error, AuthenticationFailed):  # it answered: the login is wrong
        return EXIT_FAILED
    if isinstance(error, ConnectionFailed | trio.TooSlowError):
        return EXIT_UNREACHABLE
    if isinstance(error, NoRouteError):
        return EXIT_UNREACHABLE if getattr(error, "unreachable", False) else EXIT_FAILED
    return EXIT_FAILED


def describe(error: BaseException) -> str:
    """One line saying what went wrong."""
    from clmq.client import ClientError, RpcError, SendError

    if isinstance(error, KeyboardInterrupt):
        return "interrupted"
    if isinstance(error, trio.TooSlowError):
        return "timed out waiting for an answer (is the name server or broker running?)"
    if isinstance(error, OSError) and error.errno == errno.EADDRINUSE:
        return f"cannot listen: {error.strerror or 'address already in use'} ({error})"
    if isinstance(error, BaseExceptionGroup):
        return "; ".join(describe(innermost(e)) for e in error.exceptions)
    known = (ClmqError, ClientError, RpcError, SendError, OSError)
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())  # one line, nothing dropped
    if isinstance(error, known):
        return text or type(error).__name__
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def report(error: BaseException, verbose: bool) -> int:
    """Print ``error`` as one line on stderr (the stack too if ``verbose``); its exit code."""
    error = innermost(error)
    if verbose and not isinstance(error, KeyboardInterrupt):
        traceback.print_exception(error, file=sys.stderr)
    print(f"error: {describe(error)}", file=sys.stderr, flush=True)
    return exit_code_of(error)

"""What the ``clmq`` verbs that talk to a running cluster share: the name-server
argument, running a client command, printing rows."""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable

import trio
from rich.console import Console
from rich.table import Table

from ._errors import EXIT_USAGE, CliError
from ._output import add_output_arg

console = Console()
DEFAULT_NAMESRV = "127.0.0.1:9876"


def namesrv_arg(p: argparse.ArgumentParser) -> None:
    """``--namesrv host:port[,host:port...]`` (checked when parsed)."""
    p.add_argument(
        "--namesrv",
        default=os.environ.get("CLMQ_NAMESRV", DEFAULT_NAMESRV),
        type=addr_list,
        help=f"name server address(es), comma separated (default $CLMQ_NAMESRV or {DEFAULT_NAMESRV})",
    )


def add_client_args(parsers: dict[str, argparse.ArgumentParser]) -> None:
    """``-o/--output`` and ``--namesrv`` on each of a verb's sub-commands."""
    for p in parsers.values():
        add_output_arg(p)
        namesrv_arg(p)


def addr_list(text: str) -> str:
    """``host:port[,host:port...]``, each port 1..65535; CliError (usage) otherwise."""
    parts = [a.strip() for a in text.split(",") if a.strip()]
    if not parts:
        raise CliError(f"address list {text!r} is empty: give host:port", EXIT_USAGE)
    for part in parts:
        check_addr(part)
    return ",".join(parts)


def check_addr(addr: str) -> str:
    """``addr`` if it is ``host:port`` with a port in 1..65535; CliError (usage) naming it otherwise."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise CliError(f"address {addr!r}: give host:port, e.g. 127.0.0.1:9876", EXIT_USAGE)
    check_port(int(port), addr)
    return addr


def check_port(port: int, what: str) -> int:
    """``port`` if it is a TCP port a service can listen on or connect to (1..65535)."""
    if not 1 <= port <= 65535:
        raise CliError(f"{what}: port {port} is outside 1..65535", EXIT_USAGE)
    return port


def listen_port_arg(text: str) -> int:
    """``argparse`` ``type=`` for a port to listen on: 0 (any free port) to 65535."""
    if not text.strip().isdigit():
        raise CliError(f"port {text!r}: give a number in 0..65535", EXIT_USAGE)
    port = int(text)
    if port > 65535:
        raise CliError(f"port {port} is outside 0..65535 (0: any free port)", EXIT_USAGE)
    return port


def addrs(args: argparse.Namespace) -> list[str]:
    return [a.strip() for a in args.namesrv.split(",") if a.strip()]


def run_client(fn: Callable[[], Any]) -> int:
    """Run a client command under trio; its errors reach ``main``, which prints them as
    one line with their exit code."""
    return int(trio.run(fn) or 0)


def print_rows(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    table = Table(title=title)
    for c in columns:
        table.add_column(c)
    for r in rows:
        table.add_row(*[f"{v:,}" if isinstance(v, int) else str(v) for v in r])
    console.print(table)

"""What the ``clmq`` verbs that talk to a running cluster share: the name-server
argument, running a client command, printing rows."""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable

import trio
from rich.console import Console
from rich.table import Table

from client import ConnectionFailed, NoRouteError, RpcError, SendError

from .settings import SettingsError

console = Console()
DEFAULT_NAMESRV = "127.0.0.1:9876"


def namesrv_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--namesrv", default=os.environ.get("CLMQ_NAMESRV", DEFAULT_NAMESRV),
                   help=f"name server address(es), comma separated (default $CLMQ_NAMESRV or {DEFAULT_NAMESRV})")  # fmt: skip


def addrs(args: argparse.Namespace) -> list[str]:
    return [a.strip() for a in args.namesrv.split(",") if a.strip()]


def run_client(fn: Callable[[], Any]) -> int:
    """Run a client command; errors a person can act on become one line and exit 1."""
    try:
        return int(trio.run(fn) or 0)
    except (ConnectionFailed, NoRouteError, RpcError, SendError, SettingsError, trio.TooSlowError) as e:
        console.print(f"[red]error:[/red] {e or 'timed out'}")
        return 1


def print_rows(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    table = Table(title=title)
    for c in columns:
        table.add_column(c)
    for r in rows:
        table.add_row(*[f"{v:,}" if isinstance(v, int) else str(v) for v in r])
    console.print(table)

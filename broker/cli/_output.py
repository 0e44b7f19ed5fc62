"""What ``clmq`` prints: tables for people, JSON for scripts (``-o json``), and messages.

With ``--output json`` stdout carries only JSON (one document, or one object per line
for streams of messages); notes for people go to stderr.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from clmq.common import Record

from ._timefmt import format_time_ms

console = Console()
err_console = Console(stderr=True)


def add_output_arg(parser: argparse.ArgumentParser) -> None:
    """``-o/--output {table,json}``."""
    parser.add_argument(
        "-o",
        "--output",
        choices=["table", "json"],
        default="table",
        help="table (default, for people) or json (for scripts: stdout is only JSON)",
    )


def is_json(args: argparse.Namespace) -> bool:
    return getattr(args, "output", "table") == "json"


def note(args: argparse.Namespace, text: str) -> None:
    """A line for people: stdout with tables, stderr with JSON (stdout stays parseable)."""
    (err_console if is_json(args) else console).print(text)


def emit(args: argparse.Namespace, title: str, columns: list[str], rows: list[list[Any]], *, data: Any = None) -> None:
    """A table of ``rows`` (people), or JSON: ``data`` if given, else one object per row
    keyed by ``columns``."""
    if is_json(args):
        doc = data if data is not None else [dict(zip(columns, r)) for r in rows]
        sys.stdout.write(json.dumps(doc, default=str) + "\n")
        sys.stdout.flush()
        return
    table = Table(title=title)
    for c in columns:
        table.add_column(c)
    for r in rows:
        table.add_row(*[escape(f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v)) for v in r])
    console.print(table)


def record_fields(rec: Record, msg_id: str | None = None) -> dict[str, Any]:
    """Everything about a stored message, as JSON-ready fields: the body as text, or
    ``body_base64`` when it is not UTF-8."""
    out: dict[str, Any] = {"topic": rec.topic, "queue_id": rec.queue_id, "queue_offset": rec.queue_offset}
    if msg_id is not None:
        out["msg_id"] = msg_id
    out.update(
        commitlog_offset=rec.commitlog_offset,
        born_time=format_time_ms(rec.born_timestamp_ms),
        store_time=format_time_ms(rec.store_timestamp_ms),
        born_host=f"{rec.born_host[0]}:{rec.born_host[1]}",
        store_host=f"{rec.store_host[0]}:{rec.store_host[1]}",
        tags=rec.tags,
        keys=rec.keys,
        properties=dict(rec.properties),
        reconsume_times=rec.reconsume_times,
        size=rec.size,
    )
    try:
        out["body"] = rec.body.decode("utf-8")
    except UnicodeDecodeError:
        out["body_base64"] = base64.b64encode(rec.body).decode("ascii")
    return out


def record_line(rec: Record, *, details: bool = False, msg_id: str | None = None) -> str:
    """One line for people: ``topic q3 @17 2026-11-23T10:00:00.123Z [tags] body``; with
    ``details`` also keys, properties, id and attempts."""
    body = rec.body.decode("utf-8", errors="backslashreplace")
    head = f"{rec.topic} q{rec.queue_id} @{rec.queue_offset} {format_time_ms(rec.store_timestamp_ms)} [{rec.tags}]"
    if details:
        extra = [
            f"keys={rec.keys!r}" if rec.keys else "",
            f"id={msg_id}" if msg_id else "",
            " ".join(f"{k}={v!r}" for k, v in sorted(rec.properties.items())),
            f"reconsume_times={rec.reconsume_times}" if rec.reconsume_times else "",
        ]
        head += "".join(f" {e}" for e in extra if e)
    return f"{head} {body}"


def print_record(args: argparse.Namespace, rec: Record, *, msg_id: str | None = None) -> None:
    """A message on stdout: a line for people (details with ``--details``), or one JSON
    object per line with ``--output json``."""
    if is_json(args):
        line = json.dumps(record_fields(rec, msg_id))
    else:
        line = record_line(rec, details=getattr(args, "details", False), msg_id=msg_id)
    sys.stdout.write(line + "\n")
    sys.stdout.flush()

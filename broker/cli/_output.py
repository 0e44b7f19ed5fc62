"""What ``clmq`` prints, the one mechanism every verb uses.

- ``-o json``: stdout carries only JSON (one document, or one object per line for
  streams of messages); whatever else a command prints goes to stderr
  (:func:`json_only_stdout`, entered by ``main`` around every command).
- stdout a terminal: rich tables and styled notes, for people.
- stdout anything else (a pipe, a file): plain lines, a table's fields separated by
  tabs, never wrapped nor cut, so that ``clmq store check DIR | grep FILE`` finds the
  whole path, id or address.

Text that comes from users (message bodies, keys, tags, names) is printed with its
control characters escaped (:func:`safe`): a message cannot move the cursor, ring the
bell or retitle the terminal. JSON carries it exactly.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import sys
import unicodedata
from typing import Any, Iterator, Sequence, TextIO

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from clmq.common import Record

from ._timefmt import format_time_ms

# soft_wrap: rich never breaks a line of text itself (a terminal wraps it, a pipe keeps it whole).
console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)

# Characters escaped in text for people: C0/C1 controls and DEL (Cc), line and paragraph
# separators, and the bidirectional overrides that reorder what a terminal shows.
_ESCAPED_CATEGORIES = frozenset({"Cc", "Zl", "Zp"})
_BIDI_CONTROLS = frozenset([0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)])
_SHORT_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}

_json_stdouts: list[TextIO] = []  # the real stdout while json_only_stdout() is in effect


def add_output_arg(parser: argparse.ArgumentParser) -> None:
    """``-o/--output {table,json}``."""
    parser.add_argument(
        "-o",
        "--output",
        choices=["table", "json"],
        default="table",
        help="table (default: tables on a terminal, plain tab-separated lines otherwise) or json "
        "(for scripts: stdout is only JSON)",
    )


def is_json(args: argparse.Namespace) -> bool:
    return getattr(args, "output", "table") == "json"


def to_terminal() -> bool:
    """Whether stdout is a terminal (tables), or a pipe or file (plain lines)."""
    return console.is_terminal


@contextlib.contextmanager
def json_only_stdout(args: argparse.Namespace) -> Iterator[None]:
    """With ``-o json``, everything printed for people goes to stderr while the block
    runs, and only :func:`write_json` reaches stdout."""
    if not is_json(args):
        yield
        return
    _json_stdouts.append(sys.stdout)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        _json_stdouts.pop()


def write_json(doc: Any) -> None:
    """One JSON document on one line of the real stdout."""
    out = _json_stdouts[-1] if _json_stdouts else sys.stdout
    out.write(json.dumps(doc, default=str) + "\n")
    out.flush()


def write_lines(lines: Sequence[str]) -> None:
    """Plain lines on stdout, as they are."""
    if lines:
        sys.stdout.write("".join(f"{line}\n" for line in lines))
    sys.stdout.flush()


def safe(text: str) -> str:
    """``text`` with its control characters escaped (``\\x1b``, ``\\n``, ``\\u202e``), so
    that printing it cannot drive the terminal nor break a line in two."""
    if text.isprintable():  # the common case: nothing to escape
        return text
    return "".join(_escape_char(ch) for ch in text)


def _escape_char(ch: str) -> str:
    code = ord(ch)
    if unicodedata.category(ch) not in _ESCAPED_CATEGORIES and code not in _BIDI_CONTROLS:
        return ch
    if ch in _SHORT_ESCAPES:
        return _SHORT_ESCAPES[ch]
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def preview(text: str, limit: int) -> str:
    """``text`` escaped, and cut to ``limit`` characters on a terminal only (a pipe gets
    all of it)."""
    text = safe(text)
    if not to_terminal() or len(text) <= limit:
        return text
    return text[: limit - 1] + "…"


def note(args: argparse.Namespace, text: str) -> None:
    """A line for people: stdout with tables, stderr with JSON (stdout stays parseable)."""
    (err_console if is_json(args) else console).print(text)


def tally(text: str) -> None:
    """A closing count for people (``12 messages``) on stderr: stdout carries the
    messages themselves, one per line, for whatever reads them."""
    err_console.print(text, highlight=False)


def emit(args: argparse.Namespace, title: str, columns: list[str], rows: list[list[Any]], *, data: Any = None) -> None:
    """``rows`` as a table (:func:`print_table`), or JSON: ``data`` if given, else one
    object per row keyed by ``columns``."""
    if is_json(args):
        write_json(data if data is not None else [dict(zip(columns, r)) for r in rows])
        return
    print_table(title, columns, rows)


def print_table(
    title: str,
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    show_header: bool = True,
    right: Sequence[str] = (),
) -> None:
    """A rich table on a terminal; else the title, the header and each row as one line
    of tab-separated fields. A cell is a value (printed as it is, escaped) or a rich
    :class:`Text` (styled on a terminal, its plain text otherwise)."""
    if not to_terminal():
        head = [safe(title)] if title else []
        head += ["\t".join(columns)] if show_header else []
        write_lines(head + ["\t".join(_plain_cell(v) for v in r) for r in rows])
        return
    table = Table(title=escape(safe(title)) or None, show_header=show_header)
    for c in columns:
        table.add_column(c, justify="right" if c in right else "left", overflow="fold")  # fold: never cut
    for r in rows:
        table.add_row(*[_rich_cell(v) for v in r])
    console.print(table, soft_wrap=False)


def _plain_cell(value: Any) -> str:
    return safe(value.plain if isinstance(value, Text) else str(value))


def _rich_cell(value: Any) -> Text | str:
    if isinstance(value, Text):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return escape(safe(str(value)))


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
    ``details`` also keys, id, properties and attempts. Control characters (newlines
    too) are escaped: one message is one line, and cannot drive the terminal."""
    body = safe(rec.body.decode("utf-8", errors="backslashreplace"))
    when = format_time_ms(rec.store_timestamp_ms)
    head = f"{safe(rec.topic)} q{rec.queue_id} @{rec.queue_offset} {when} [{safe(rec.tags)}]"
    if details:
        extra = [
            f"keys={rec.keys!r}" if rec.keys else "",  # repr escapes what is not printable
            f"id={msg_id}" if msg_id else "",
            " ".join(f"{safe(k)}={v!r}" for k, v in sorted(rec.properties.items())),
            f"reconsume_times={rec.reconsume_times}" if rec.reconsume_times else "",
        ]
        head += "".join(f" {e}" for e in extra if e)
    return f"{head} {body}"


def print_record(args: argparse.Namespace, rec: Record, *, msg_id: str | None = None) -> None:
    """A message on stdout: a line for people (details with ``--details``), or one JSON
    object per line with ``--output json``."""
    if is_json(args):
        write_json(record_fields(rec, msg_id))
        return
    sys.stdout.write(record_line(rec, details=getattr(args, "details", False), msg_id=msg_id) + "\n")
    sys.stdout.flush()

"""Logging of every ``clmq`` command: one line per event, as text or as JSON, with a
level for the whole program and per component (``clmq.broker=debug``)."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import sys
from typing import Any

# The attributes every LogRecord has: anything else on a record is an event's own field
# (``log.info("...", extra={"topic": t})``) and goes into the JSON line.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}
LEVELS = ("debug", "info", "warning", "error", "critical")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (ISO-8601 UTC), level, logger, msg, the event's
    extra fields, and exc (the traceback) if there is one."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": dt.datetime.fromtimestamp(record.created, dt.UTC)
            .isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                line[key] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def add_logging_args(parser: argparse.ArgumentParser) -> None:
    """The logging flags every ``clmq`` command takes."""
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level (and print stacks of errors)")
    parser.add_argument(
        "--log-format",
        choices=["text", "json"],
        default="text",
        help="text (default) or json: one JSON object per line (ts, level, logger, msg, fields)",
    )
    parser.add_argument(
        "--log-level",
        default="",
        type=log_levels,
        metavar="LEVEL[,COMPONENT=LEVEL...]",
        help="warning by default (info with -v); per component: e.g. info,clmq.replication=debug "
        "(components: clmq.broker, clmq.store, clmq.replication, clmq.coordination, "
        "clmq.consumer, clmq.producer, clmq.server, clmq.http ...)",
    )


def log_levels(text: str) -> dict[str, int]:
    """``info,clmq.broker=debug`` -> {"": INFO, "clmq.broker": DEBUG}; ValueError naming
    a level that is none (argparse turns it into a usage error)."""
    out: dict[str, int] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, sep, level = part.rpartition("=") if "=" in part else ("", "", part)
        if level.lower() not in LEVELS:
            raise argparse.ArgumentTypeError(f"{level!r} is not a level: use one of {', '.join(LEVELS)}")
        out[name.strip() if sep else ""] = getattr(logging, level.upper())
    return out


def configure_logging(args: argparse.Namespace) -> None:
    """Set up the root logger as ``args`` (parsed with :func:`add_logging_args`) say."""
    levels: dict[str, int] = dict(getattr(args, "log_level", {}) or {})
    root_level = levels.pop("", logging.INFO if args.verbose else logging.WARNING)
    handler = logging.StreamHandler(sys.stderr)
    if getattr(args, "log_format", "text") == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(root_level)
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)

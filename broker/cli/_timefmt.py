"""Times on the command line: ISO-8601, epoch milliseconds, or a duration ago.

Every verb that takes a time takes all three forms (``--from``, ``--to-time``,
``--since``): ``2026-11-23T10:00:00Z``, ``2026-11-23 10:00`` (no zone: local time),
``2026-11-23``, ``1763891000000``, ``-1h`` / ``1h`` (an hour ago), ``-30m``, ``-2d``,
``-90s``, ``-500ms``.
"""

from __future__ import annotations

import datetime as dt
import re
import time

from ._errors import EXIT_USAGE, CliError

FORMS = "ISO-8601 (2026-11-23T10:00:00Z, 2026-11-23 10:00, 2026-11-23), epoch milliseconds (1763891000000) or a duration ago (-1h, -30m, -2d, -90s, -500ms)"
FORMS_WHEN = "ISO-8601 (2026-11-23T10:00:00Z, 2026-11-23 10:00) or epoch milliseconds (1763891000000)"
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, "w": 7 * 86_400_000}
_RELATIVE = re.compile(r"^-?(\d+(?:\.\d+)?)(ms|s|m|h|d|w)$")
# An epoch in milliseconds has at least 10 digits from 2001 on: shorter numbers are
# more likely a mistake (seconds, or an offset) than a time in 1970.
_EPOCH_MS_MIN_DIGITS = 10
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


def parse_time_ms(text: str, *, now_ms: int | None = None) -> int:
    """``text`` as milliseconds since the epoch; CliError (usage) naming the accepted
    forms if it is none of them."""
    s = text.strip()
    now = int(time.time() * 1000) if now_ms is None else now_ms
    rel = _RELATIVE.match(s)
    if rel:
        return now - int(float(rel.group(1)) * _UNIT_MS[rel.group(2)])
    if s.isdigit():
        if len(s) < _EPOCH_MS_MIN_DIGITS:
            raise CliError(f"time {text!r}: too small for epoch milliseconds; use {FORMS}", EXIT_USAGE)
        return int(s)
    try:
        parsed = dt.datetime.fromisoformat(s.replace("Z", "+00:00") if s.endswith("Z") else s)
    except ValueError:
        raise CliError(f"time {text!r} not understood; use {FORMS}", EXIT_USAGE) from None
    if parsed.tzinfo is None:
        parsed = parsed.astimezone()  # no zone given: this machine's local time
    return (parsed - _EPOCH) // dt.timedelta(milliseconds=1)  # exact: no float on the way


def parse_duration_ms(text: str) -> int | None:
    """A duration (``30s``, ``5m``, ``1h``, ``1500ms``, ``2d``, ``1w``) in ms; None if
    ``text`` is not one."""
    found = _RELATIVE.match(text.strip())
    if found is None or text.strip().startswith("-"):
        return None
    return int(float(found.group(1)) * _UNIT_MS[found.group(2)])


def parse_when_ms(text: str) -> int:
    """A point in time for a schedule: ISO-8601 or epoch ms. A duration is refused here
    (elsewhere it means "ago", which would schedule in the past)."""
    if _RELATIVE.match(text.strip()):
        raise CliError(
            f"time {text!r} is a duration: give a time ({FORMS_WHEN}), or the delay with --delay", EXIT_USAGE
        )
    return parse_time_ms(text)


def time_arg(text: str) -> int:
    """``argparse`` ``type=`` for a time (see :func:`parse_time_ms`)."""
    return parse_time_ms(text)


def format_time_ms(ms: int) -> str:
    """``ms`` since the epoch as ISO-8601 UTC with milliseconds (``2026-11-23T10:00:00.123Z``)."""
    stamp = dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC)
    return stamp.strftime("%Y-%m-%dT%H:%M:%S.") + f"{ms % 1000:03d}Z"

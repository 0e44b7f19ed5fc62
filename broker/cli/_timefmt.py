"""Times and durations on the command line, one parser for every verb.

Every option that takes a time takes three forms (``--from``, ``--to-time``,
``--since``): ``2026-11-23T10:00:00Z``, ``2026-11-23 10:00`` (no zone: local time),
``2026-11-23``, ``1763891000000``, ``-1h`` / ``1h`` (an hour ago), ``-30m``, ``-2d``,
``-90s``, ``-500ms``.

Every option that takes a duration (``--idle-timeout``, ``--delay``, ``--*-ms``,
``--*-seconds``) takes ``500ms``, ``30s``, ``2m``, ``1h``, ``2d``, ``1w``, or a bare
number in the option's own unit (``--linger-ms 5``, ``--idle-timeout 10``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import re
import time

from ._errors import EXIT_USAGE, CliError

FORMS = (
    "ISO-8601 (2026-11-23T10:00:00Z, 2026-11-23 10:00, 2026-11-23), epoch milliseconds (1763891000000) "
    "or a duration ago (-1h, -30m, -2d, -90s, -500ms)"
)
FORMS_WHEN = "ISO-8601 (2026-11-23T10:00:00Z, 2026-11-23 10:00) or epoch milliseconds (1763891000000)"
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, "w": 7 * 86_400_000}
_RELATIVE = re.compile(r"^-?(\d+(?:\.\d+)?)(ms|s|m|h|d|w)$")
_NUMBER = re.compile(r"^\d+(?:\.\d+)?$")  # a bare duration: never negative
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


DURATION_FORMS = "500ms, 30s, 2m, 1h, 2d, 1w"
_UNIT_OF_OPTION = (("-ms", "ms"), ("seconds", "s"))  # an option named --linger-ms takes ms, --seconds s


class Duration:
    """``argparse`` ``type=`` for a duration: ``500ms``, ``30s``, ``2m``, ... in ``unit``
    (``ms``: an int of milliseconds; ``s``: a float of seconds). A bare number is taken
    in ``unit`` if ``bare`` (options whose name says the unit), else refused: ``--delay
    30`` might mean seconds or milliseconds. A negative or unreadable one is a usage
    error."""

    def __init__(self, unit: str, *, bare: bool = True) -> None:
        self.unit, self.bare = unit, bare
        self.__name__ = f"duration ({unit})"  # argparse names the type in its messages

    def __call__(self, text: str) -> int | float:
        ms = duration_ms(text, _UNIT_MS[self.unit] if self.bare else None)
        return round(ms) if self.unit == "ms" else ms / 1000


DURATION_MS = Duration("ms")
DURATION_S = Duration("s")


def duration_ms(text: str, bare_unit_ms: int | None = None) -> float:
    """``text`` as milliseconds: a duration with a unit, or (``bare_unit_ms`` given) a
    bare number of that many ms each; CliError (usage) otherwise."""
    s = text.strip()
    found = _RELATIVE.match(s)
    if found is not None and not s.startswith("-"):
        value = float(found.group(1)) * _UNIT_MS[found.group(2)]
    elif bare_unit_ms is not None and _NUMBER.match(s):
        value = float(s) * bare_unit_ms
    else:
        hint = f"a number ({'ms' if bare_unit_ms == 1 else 's'}) or " if bare_unit_ms is not None else ""
        raise CliError(f"duration {text!r} not understood: give {hint}one of {DURATION_FORMS}", EXIT_USAGE)
    return value


def accept_durations(parser: argparse.ArgumentParser) -> None:
    """Give every option of ``parser`` and its sub-commands that is named for a
    duration (``--*-ms``, ``--*seconds``) the duration parser, in the unit its name
    says: one rule for the whole command line, the benchmarks' options included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                accept_durations(sub)
            continue
        if isinstance(action.type, Duration):
            continue
        unit = next((u for suffix, u in _UNIT_OF_OPTION for o in action.option_strings if o.endswith(suffix)), None)
        if unit is not None:
            action.type = Duration(unit)


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

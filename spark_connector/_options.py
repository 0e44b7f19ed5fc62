"""The reader's options: parsed once, with an error a person can act on for each bad one.

Spark hands options over as case-insensitive strings. Names and meanings follow Spark's
Kafka source where there is an equivalent (``startingOffsets``, ``endingOffsets``,
``maxOffsetsPerTrigger``'s cousins ``maxRowsPerTrigger`` / ``maxBytesPerTrigger``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from clmq.common import ConnectorError

MiB = 1 << 20

# Per-queue positions in offset JSON, as in Spark's Kafka source.
EARLIEST, LATEST = -2, -1


class OptionError(ConnectorError, ValueError):
    """A reader option is missing, unknown or malformed."""


Positions = dict[str, dict[int, int]]  # topic -> queue id -> offset (or EARLIEST / LATEST)


@dataclass(frozen=True)
class ReadOptions:
    path: str | None = None
    brokers: tuple[str, ...] = ()
    nameservers: tuple[str, ...] = ()
    topics: tuple[str, ...] | None = None
    topic_pattern: str | None = None
    queues: dict[str, tuple[int, ...]] | tuple[int, ...] | None = None
    starting: Positions | None = None  # None: earliest everywhere
    ending: Positions | None = None  # None: latest (the snapshot's end) everywhere
    starting_timestamp_ms: int | None = None
    ending_timestamp_ms: int | None = None
    starting_by_timestamp: Positions | None = None  # topic -> queue id -> ms since the epoch
    ending_by_timestamp: Positions | None = None
    fail_on_data_loss: bool = True
    check_crc: bool = True  # Kafka's check.crcs: off trades detecting damage for speed
    max_split_bytes: int = 128 * MiB
    min_split_bytes: int = MiB
    min_partitions: int | None = None  # None: twice the planning machine's cores
    max_partitions: int = 10_000
    max_batch_rows: int = 65_536
    max_batch_bytes: int = 8 * MiB
    on_corrupt: str = "fail"  # or "skip"
    corrupt_records_log: str | None = None
    read_path: str = "auto"  # "scan", "index" or "auto"
    index_path_fraction: float = 0.25
    max_rows_per_trigger: int | None = None
    max_bytes_per_trigger: int | None = None
    timeout_ms: int = 30_000
    # TLS and a login of network mode: (documented option name, value) of those given
    # (kept as text: the files are read where each connection is made); none given:
    # $CLMQ_TLS_CA_FILE, $CLMQ_TLS_CERT_FILE, $CLMQ_TLS_KEY_FILE, $CLMQ_USER, $CLMQ_PASSWORD.
    security: tuple[tuple[str, str], ...] = field(default=(), repr=False)

    @property
    def network(self) -> bool:
        return bool(self.brokers or self.nameservers)


# TLS and a login (docs/security.md#tls), the sink's option names: lower case -> documented.
SECURITY_OPTIONS = {
    "tlscafile": "tlsCaFile",
    "tlscertfile": "tlsCertFile",
    "tlskeyfile": "tlsKeyFile",
    "user": "user",
    "password": "password",
}


KNOWN = {
    "path",
    "broker",
    "brokers",
    "nameserver",
    "nameservers",
    "topics",
    "topic",
    "topicpattern",
    "queues",
    "startingoffsets",
    "endingoffsets",
    "startingtimestamp",
    "endingtimestamp",
    "startingoffsetsbytimestamp",
    "endingoffsetsbytimestamp",
    "failondataloss",
    "checkcrc",
    "maxsplitbytes",
    "minsplitbytes",
    "minpartitions",
    "maxpartitions",
    "maxbatchrows",
    "maxbatchbytes",
    "oncorrupt",
    "corruptrecordslog",
    "readpath",
    "indexpathfraction",
    "maxrowspertrigger",
    "maxoffsetspertrigger",
    "maxbytespertrigger",
    "timeoutms",
    *SECURITY_OPTIONS,
}


def _int(opts: Mapping[str, str], name: str, default: int | None, minimum: int = 1) -> int | None:
    raw = opts.get(name.lower())
    if raw is None:
        return default
    try:
        value = int(str(raw).replace("_", ""))
    except ValueError:
        raise OptionError(f"option {name}={raw!r}: expected a whole number") from None
    if value < minimum:
        raise OptionError(f"option {name}={value}: must be at least {minimum}")
    return value


def _list(raw: str | None) -> tuple[str, ...]:
    return tuple(x.strip() for x in (raw or "").split(",") if x.strip())


def _positions(name: str, raw: str | None, default_word: str) -> Positions | None:
    """``earliest`` / ``latest`` or JSON ``{"topic": {"0": 23, "1": -2}}``."""
    if raw is None or raw.strip().lower() == default_word:
        return None
    text = raw.strip()
    if text.lower() in ("earliest", "latest"):
        word = EARLIEST if text.lower() == "earliest" else LATEST
        return {"*": {-1: word}}  # every queue
    out = _per_queue(
        name, text, '\'earliest\', \'latest\' or JSON such as {"orders": {"0": 42, "1": -2}} (-2: earliest, -1: latest)'
    )
    for topic, per in out.items():
        for q, o in per.items():
            if q < 0 or o < EARLIEST:
                raise OptionError(
                    f"option {name}: {topic}/{q} -> {o}: queue ids are 0 or more and offsets are "
                    "0 or more, or -2 (earliest) / -1 (latest)"
                )
    return out


def _per_queue(name: str, raw: str, expected: str) -> Positions:
    """JSON ``{"topic": {"<queue id>": <whole number>}}``, or an error saying what was expected."""
    try:
        doc = json.loads(raw)
        return {str(t): {_whole(q): _whole(v) for q, v in per.items()} for t, per in doc.items()}
    except (ValueError, AttributeError, TypeError):
        raise OptionError(f"option {name}={raw!r}: expected {expected}") from None


def _whole(value: object) -> int:
    """An int from JSON: whole numbers or their decimal strings, never floats or booleans."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(value)
    return int(value)


def _timestamps(name: str, raw: str | None) -> Positions | None:
    """JSON ``{"topic": {"0": 1700000000000}}``: per queue, ms since the epoch."""
    if raw is None:
        return None
    out = _per_queue(name, raw, 'JSON such as {"orders": {"0": 1700000000000}} (ms since the epoch per queue)')
    bad = [f"{t}/{q}" for t, per in out.items() for q, ms in per.items() if q < 0 or ms < 0]
    if bad:
        raise OptionError(f"option {name}: queue ids and timestamps must be 0 or more ({', '.join(bad)})")
    return out


def _bool(opts: Mapping[str, str], name: str, default: bool) -> bool:
    raw = opts.get(name.lower())
    if raw is None:
        return default
    if raw.strip().lower() not in ("true", "false"):
        raise OptionError(f"option {name}={raw!r}: expected true or false")
    return raw.strip().lower() == "true"


def _queues(raw: str | None) -> dict[str, tuple[int, ...]] | tuple[int, ...] | None:
    if raw is None or not raw.strip():
        return None
    text = raw.strip()
    try:
        if text.startswith("{"):
            doc = json.loads(text)
            if not all(isinstance(qs, list) for qs in doc.values()):
                raise TypeError(doc)
            out: dict[str, tuple[int, ...]] | tuple[int, ...]
            out = {str(t): tuple(_whole(q) for q in qs) for t, qs in doc.items()}
        else:
            out = tuple(int(q) for q in _list(text))
    except (ValueError, TypeError, AttributeError):
        raise OptionError(f"option queues={raw!r}: expected '0,1,2' or JSON such as {{\"orders\": [0, 1]}}") from None
    ids = list(out.values()) if isinstance(out, dict) else [out]
    if any(q < 0 for qs in ids for q in qs):
        raise OptionError(f"option queues={raw!r}: queue ids are 0 or more")
    return out


def _choice(opts: Mapping[str, str], name: str, choices: tuple[str, ...]) -> str:
    value = str(opts.get(name.lower(), choices[0])).strip().lower()
    if value not in choices:
        raise OptionError(f"option {name}={value!r}: expected one of {', '.join(choices)}")
    return value


def _fraction(opts: Mapping[str, str], name: str, default: float) -> float:
    raw = opts.get(name.lower())
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise OptionError(f"option {name}={raw!r}: expected a number between 0 and 1") from None
    if not 0 <= value <= 1:
        raise OptionError(f"option {name}={value}: expected a number between 0 and 1")
    return value


def _check_combinations(o: ReadOptions) -> None:
    """Options that exclude each other (Kafka's source refuses the same pairs)."""
    starts = [
        n
        for n, v in (
            ("startingOffsets", o.starting),
            ("startingTimestamp", o.starting_timestamp_ms),
            ("startingOffsetsByTimestamp", o.starting_by_timestamp),
        )
        if v is not None
    ]
    ends = [
        n
        for n, v in (
            ("endingOffsets", o.ending),
            ("endingTimestamp", o.ending_timestamp_ms),
            ("endingOffsetsByTimestamp", o.ending_by_timestamp),
        )
        if v is not None
    ]
    for group in (starts, ends):
        if len(group) > 1:
            raise OptionError(f"options {' and '.join(group)} exclude each other: give one")
    if o.min_partitions is not None and o.min_partitions > o.max_partitions:
        raise OptionError(f"option minPartitions={o.min_partitions} is above maxPartitions={o.max_partitions}")


def parse_options(options: Mapping[str, Any]) -> ReadOptions:
    """Parse Spark's options (any key case) into :class:`ReadOptions`."""
    opts = {str(k).lower(): str(v) for k, v in options.items()}
    unknown = sorted(k for k in opts if k not in KNOWN)
    if unknown:
        raise OptionError(f"unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(KNOWN))}")
    brokers = _list(opts.get("brokers") or opts.get("broker"))
    nameservers = _list(opts.get("nameservers") or opts.get("nameserver"))
    path = opts.get("path")
    if bool(path) + bool(brokers or nameservers) != 1:
        raise OptionError(
            "give exactly one of: a data directory (load(path) or option path), "
            "option broker=host:port, or option nameserver=host:port"
        )
    pattern = opts.get("topicpattern")
    if pattern is not None:
        try:
            re.compile(pattern)
        except re.error as e:
            raise OptionError(f"option topicPattern={pattern!r}: not a regular expression ({e})") from None
    topics = _list(opts.get("topics") or opts.get("topic")) or None
    if opts.get("maxrowspertrigger") and opts.get("maxoffsetspertrigger"):
        raise OptionError("give maxRowsPerTrigger or its Kafka name maxOffsetsPerTrigger, not both")
    rows_name = "maxOffsetsPerTrigger" if opts.get("maxoffsetspertrigger") else "maxRowsPerTrigger"
    security = tuple((name, opts[key]) for key, name in SECURITY_OPTIONS.items() if opts.get(key))
    if security and path:
        raise OptionError(
            f"options {', '.join(n for n, _ in security)} are for network mode (broker or nameserver), not a path"
        )
    if opts.get("password") and not opts.get("user"):
        raise OptionError("option password without option user: give user too")
    parsed = ReadOptions(
        path=path,
        brokers=brokers,
        nameservers=nameservers,
        topics=topics,
        topic_pattern=pattern,
        queues=_queues(opts.get("queues")),
        starting=_positions("startingOffsets", opts.get("startingoffsets"), "earliest"),
        ending=_positions("endingOffsets", opts.get("endingoffsets"), "latest"),
        starting_timestamp_ms=_int(opts, "startingTimestamp", None, 0),
        ending_timestamp_ms=_int(opts, "endingTimestamp", None, 0),
        starting_by_timestamp=_timestamps("startingOffsetsByTimestamp", opts.get("startingoffsetsbytimestamp")),
        ending_by_timestamp=_timestamps("endingOffsetsByTimestamp", opts.get("endingoffsetsbytimestamp")),
        fail_on_data_loss=_bool(opts, "failOnDataLoss", True),
        check_crc=_bool(opts, "checkCrc", True),
        max_split_bytes=_int(opts, "maxSplitBytes", 128 * MiB) or 0,
        min_split_bytes=_int(opts, "minSplitBytes", MiB) or 0,
        min_partitions=_int(opts, "minPartitions", None),
        max_partitions=_int(opts, "maxPartitions", 10_000) or 0,
        max_batch_rows=_int(opts, "maxBatchRows", 65_536) or 0,
        max_batch_bytes=_int(opts, "maxBatchBytes", 8 * MiB, 4096) or 0,
        on_corrupt=_choice(opts, "onCorrupt", ("fail", "skip")),
        corrupt_records_log=opts.get("corruptrecordslog"),
        read_path=_choice(opts, "readPath", ("auto", "scan", "index")),
        index_path_fraction=_fraction(opts, "indexPathFraction", 0.25),
        max_rows_per_trigger=_int(opts, rows_name, None),
        max_bytes_per_trigger=_int(opts, "maxBytesPerTrigger", None),
        timeout_ms=_int(opts, "timeoutMs", 30_000) or 0,
        security=security,
    )
    _check_combinations(parsed)
    if "minsplitbytes" in opts and "maxsplitbytes" in opts and parsed.min_split_bytes > parsed.max_split_bytes:
        raise OptionError(
            f"option minSplitBytes={parsed.min_split_bytes} is above maxSplitBytes={parsed.max_split_bytes}"
        )
    return parsed

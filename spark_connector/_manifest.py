"""Consistent snapshots and incremental exports: the manifest of ``clmq export``.

At the start of an export, every selected queue's ``[start, end)`` (queue offsets, end
exclusive) is resolved once, and the export reads with explicit ``startingOffsets`` /
``endingOffsets`` JSON and an explicit topic and queue list: exactly those records,
however much is appended (or however many topics are created) meanwhile. The manifest,
``<output>/_clmq_manifest.json``, records them; ``--since-manifest`` starts the next
export at its ends, so that a series of exports adds up to one full export.

A manifest carries the positions of one store (a data directory or one broker): with
several brokers, every broker has its own ``orders/0``, and the reader's offset options
cannot tell them apart. Such exports still run (unpinned, as before) but write no manifest.

No pyspark at import: the command line reads manifests before it starts Spark.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Mapping

from clmq.commitlog import write_atomic

from ._options import OptionError, ReadOptions, parse_options
from ._plan import QueueSource, Selection, select, selected_ranges

MANIFEST_NAME = "_clmq_manifest.json"  # a leading "_": Spark leaves it out when it reads the output back
MANIFEST_KIND = "clmq-export-manifest"
MANIFEST_VERSION = 1
MANIFEST_MAX_BYTES = 64 << 20  # a manifest is a few bytes per queue; anything larger is not one
_REPLACED = (
    "startingoffsets",
    "endingoffsets",
    "startingtimestamp",
    "endingtimestamp",
    "startingoffsetsbytimestamp",
    "endingoffsetsbytimestamp",
    "topics",
    "topic",
    "topicpattern",
    "queues",
)

Ranges = dict[str, dict[int, tuple[int, int]]]  # topic -> queue id -> (start, end)


class ManifestError(OptionError):
    """A manifest cannot be used: unreadable, malformed, of another store, or behind retention."""


@dataclass
class Snapshot:
    """What one export reads, resolved at its start (see :func:`resolve_snapshot`)."""

    source: dict[str, str]  # {"data_dir": path} or {"broker": host:port}; empty with several brokers
    topics: tuple[str, ...]
    queues: Ranges  # every selected queue of the one store (empty with several brokers)
    planned_rows: int  # sum of end - start: the rows to expect (holes in a queue make it fewer)
    since: str | None = None  # the manifest this export continues
    carried: Ranges = field(default_factory=dict)  # that manifest's queues not selected now: ends kept

    @property
    def pinned(self) -> bool:
        """Whether the export reads exactly ``queues`` (one store) and writes a manifest."""
        return bool(self.source)

    def reader_options(self, options: Mapping[str, str]) -> dict[str, str]:
        """``options`` with the selection replaced by explicit topics, queues and offsets."""
        if not self.pinned:
            return dict(options)
        out = {k: v for k, v in options.items() if k.lower() not in _REPLACED}
        live = {t: per for t, per in self.queues.items() if per}
        out["topics"] = ",".join(live)
        out["queues"] = json.dumps({t: sorted(per) for t, per in live.items()})
        out["startingOffsets"] = json.dumps({t: {str(q): r[0] for q, r in per.items()} for t, per in live.items()})
        out["endingOffsets"] = json.dumps({t: {str(q): r[1] for q, r in per.items()} for t, per in live.items()})
        return out

    def manifest(self, rows: int) -> dict[str, Any]:
        """The manifest of this export once it wrote ``rows`` rows."""
        queues: Ranges = {t: dict(per) for t, per in self.carried.items()}
        for t, per in self.queues.items():
            queues.setdefault(t, {}).update(per)
        now = datetime.now(UTC)
        return {
            "kind": MANIFEST_KIND,
            "version": MANIFEST_VERSION,
            "source": dict(self.source),
            "topics": list(self.topics),
            "queues": {
                t: {str(q): {"start": s, "end": e} for q, (s, e) in sorted(per.items())}
                for t, per in sorted(queues.items())
            },
            "rows": rows,
            "created": now.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "since": self.since,
        }


# ------------------------------------------------------------------ reading and writing
def is_remote(path: str) -> bool:
    """A Hadoop path (``s3a://``, ``hdfs://``, ``file://``...): written through Spark's JVM."""
    return "://" in path


def read_manifest(path: str, spark: Any = None) -> dict[str, Any]:
    """The manifest at ``path`` (its file, or an output directory holding one), checked."""
    if is_remote(path):
        if spark is None:
            raise ManifestError(f"since-manifest {path}: a remote manifest is read through Spark; start it first")
        where, raw = _hadoop_read(spark, path)
    else:
        file = Path(path) / MANIFEST_NAME if Path(path).is_dir() else Path(path)
        where = str(file)
        try:
            if file.stat().st_size > MANIFEST_MAX_BYTES:
                raise ManifestError(
                    f"since-manifest {where}: {file.stat().st_size:,} bytes is too large for a "
                    f"manifest (at most {MANIFEST_MAX_BYTES:,})"
                )
            raw = file.read_bytes()
        except OSError as e:
            raise ManifestError(
                f"since-manifest {path}: cannot read it ({e.strerror or e}); give the "
                f"{MANIFEST_NAME} of an earlier export, or its output directory"
            ) from None
    return check_manifest(raw, where)


def check_manifest(raw: bytes, where: str) -> dict[str, Any]:
    """``raw`` parsed and checked: a manifest of this version with sane queue ranges
    (returned as written: ``{"topic": {"0": {"start": 0, "end": 42}}}``)."""
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ManifestError(f"since-manifest {where}: not valid JSON ({e}); is it a {MANIFEST_NAME}?") from None
    if not isinstance(doc, dict) or doc.get("kind") != MANIFEST_KIND:
        raise ManifestError(f'since-manifest {where}: not a clmq export manifest (no "kind": "{MANIFEST_KIND}")')
    if doc.get("version") != MANIFEST_VERSION:
        raise ManifestError(
            f"since-manifest {where}: manifest version {doc.get('version')!r}; this clmq reads "
            f"version {MANIFEST_VERSION} (a newer clmq wrote it?)"
        )
    source = doc.get("source")
    if not (isinstance(source, dict) and len(source) == 1 and set(source) <= {"data_dir", "broker"}):
        raise ManifestError(f'since-manifest {where}: "source" must be {{"data_dir": ...}} or {{"broker": ...}}')
    _queue_ranges(doc.get("queues"), where)
    return doc


def _queue_ranges(value: Any, where: str) -> Ranges:
    try:
        out = {str(t): {int(q): (int(r["start"]), int(r["end"])) for q, r in per.items()} for t, per in value.items()}
    except (AttributeError, KeyError, TypeError, ValueError):
        raise ManifestError(
            f'since-manifest {where}: "queues" must be {{"topic": {{"0": {{"start": 0, "end": 42}}}}}}'
        ) from None
    for t, per in out.items():
        for q, (start, end) in per.items():
            if not 0 <= start <= end:
                raise ManifestError(f"since-manifest {where}: queue {t}/{q} has start {start} > end {end}")
    return out


def write_manifest(doc: dict[str, Any], output: str, spark: Any = None) -> str:
    """Write ``doc`` as ``<output>/_clmq_manifest.json`` (replacing one there); its path."""
    if is_remote(output):
        return _hadoop_write(spark, output.rstrip("/") + "/" + MANIFEST_NAME, json.dumps(doc, indent=1).encode())
    target = Path(output) / MANIFEST_NAME
    # fsynced, then renamed over the old one: readers (and a crash) see the old manifest or the new one
    write_atomic(target, (json.dumps(doc, indent=1) + "\n").encode())
    return str(target)


def remove_manifest(output: str, spark: Any = None) -> None:
    """Remove a manifest that no longer describes ``output`` (data was appended without one)."""
    if is_remote(output):
        fs, p = _hadoop(spark, output.rstrip("/") + "/" + MANIFEST_NAME)
        fs.delete(p, False)
    else:
        (Path(output) / MANIFEST_NAME).unlink(missing_ok=True)


def _hadoop(spark: Any, path: str) -> tuple[Any, Any]:
    """The Hadoop FileSystem of ``path`` and the path, through the session's JVM."""
    hpath = spark._jvm.org.apache.hadoop.fs.Path(path)
    return hpath.getFileSystem(spark._jsc.hadoopConfiguration()), hpath


def _hadoop_read(spark: Any, path: str) -> tuple[str, bytes]:
    fs, p = _hadoop(spark, path)
    if fs.exists(p) and fs.getFileStatus(p).isDirectory():
        p = spark._jvm.org.apache.hadoop.fs.Path(p, MANIFEST_NAME)
    if not fs.exists(p):
        raise ManifestError(
            f"since-manifest {p.toString()}: no such file; give the {MANIFEST_NAME} of an earlier "
            "export, or its output directory"
        )
    if fs.getFileStatus(p).getLen() > MANIFEST_MAX_BYTES:
        raise ManifestError(
            f"since-manifest {p.toString()}: too large for a manifest (at most {MANIFEST_MAX_BYTES:,} bytes)"
        )
    stream = fs.open(p)
    try:
        return p.toString(), bytes(spark._jvm.org.apache.commons.io.IOUtils.toByteArray(stream))
    finally:
        stream.close()


def _hadoop_write(spark: Any, path: str, data: bytes) -> str:
    fs, p = _hadoop(spark, path)
    out = fs.create(p, True)  # one create: object stores make the file visible whole, on close
    try:
        out.write(bytearray(data))
    finally:
        out.close()
    return path


# --------------------------------------------------------------------------- resolving
def resolve_snapshot(options: Mapping[str, str], since_manifest: str | None = None, spark: Any = None) -> Snapshot:
    """Resolve every selected queue's ``[start, end)`` now (the export's snapshot).

    ``since_manifest`` (a manifest, or an output directory holding one) starts every
    queue it lists at its end, and every other queue at its earliest offset. ``spark`` is
    needed only to read a remote (``scheme://``) manifest.
    """
    opts = parse_options(options)
    previous = read_manifest(since_manifest, spark) if since_manifest else None
    if previous is not None and any(
        v is not None for v in (opts.starting, opts.starting_timestamp_ms, opts.starting_by_timestamp)
    ):
        raise ManifestError(
            "since-manifest sets where every queue starts: leave out startingOffsets and "
            "startingTimestamp (--from-offsets, --from-time)"
        )
    from ._tasks import open_sources  # (imports pyspark: only once a snapshot is resolved)

    sources = open_sources(opts)
    try:
        if len(sources) != 1:
            if previous is not None:
                raise ManifestError(_several_stores(opts, sources))
            sel = select(opts, sources)
            planned = sum(e - s for src in sources for per in _ranges(opts, src, sel).values() for s, e in per.values())
            return Snapshot({}, sel.topics, {}, planned)
        return _resolve_one(opts, sources[0], previous, since_manifest)
    finally:
        for s in sources:
            s.close()


def _several_stores(opts: ReadOptions, sources: list[QueueSource]) -> str:
    names = ", ".join(s.layout.source for s in sources) or "none"
    via = f"name server {','.join(opts.nameservers)} knows" if opts.nameservers else "--broker names"
    return (
        f"an incremental export (since-manifest) needs one store, but {via} {len(sources)} brokers ({names}): "
        "each has its own queues (its own orders/0), so one manifest cannot carry their positions; export each "
        "broker on its own with --broker host:port"
    )


def _source_of(src: QueueSource, opts: ReadOptions) -> dict[str, str]:
    if opts.network:
        return {"broker": src.layout.source}
    return {"data_dir": str(Path(src.layout.source).resolve())}


def _ranges(opts: ReadOptions, src: QueueSource, sel: Selection) -> Ranges:
    """Each selected queue's ``[start, end)`` in this source's snapshot, empty ones too."""
    out: Ranges = {}
    for t, q, lo, hi in selected_ranges(src, sel):
        out.setdefault(t, {})[q] = (lo, hi)
    return out


def _resolve_one(opts: ReadOptions, src: QueueSource, previous: dict[str, Any] | None, since: str | None) -> Snapshot:
    source = _source_of(src, opts)
    sel = select(opts, [src])
    queues = _ranges(opts, src, sel)
    carried: Ranges = {}
    if previous is not None:
        if previous["source"] != source:
            raise ManifestError(
                f"since-manifest {since}: it is of {_describe(previous['source'])}, this export "
                f"reads {_describe(source)}; a manifest holds one store's queue offsets (a full "
                "export needs no --since-manifest)"
            )
        before = _queue_ranges(previous["queues"], str(since))
        queues = _continue(queues, before, src, since)
        carried = {
            t: {q: (e, e) for q, (_s, e) in per.items() if q not in queues.get(t, {})} for t, per in before.items()
        }
        carried = {t: per for t, per in carried.items() if per}
    settle = getattr(src, "ensure_readable", None)  # a broker: its snapshot may lag its queues' ends
    if settle is not None:
        for t, per in queues.items():
            for q, (start, end) in per.items():
                if end > start:
                    settle(t, q, end, opts.timeout_ms)
    planned = sum(e - s for per in queues.values() for s, e in per.values())
    return Snapshot(source, sel.topics, queues, planned, since, carried)


def _describe(source: dict[str, str]) -> str:
    kind, where = next(iter(source.items()))
    return f"data directory {where}" if kind == "data_dir" else f"broker {where}"


def _continue(queues: Ranges, before: Ranges, src: QueueSource, since: str | None) -> Ranges:
    """Start each queue where the previous manifest ended it: a gap (retention removed
    records not exported yet) or an end past the queue's (another store) is an error."""
    out: Ranges = {}
    for t, per in queues.items():
        for q, (lo, hi) in per.items():
            if q not in before.get(t, {}):
                out.setdefault(t, {})[q] = (lo, hi)  # new topic or queue: from its earliest offset
                continue
            end = before[t][q][1]
            qmin, qmax = src.bounds(t, q)
            if end > qmax:
                raise ManifestError(
                    f"since-manifest {since}: queue {t}/{q} ended at offset {end}, but the queue now "
                    f"ends at {qmax}: the manifest is of another store (or this one was recreated)"
                )
            if end < qmin:
                raise ManifestError(
                    f"since-manifest {since}: queue {t}/{q} continues at offset {end}, but retention "
                    f"removed everything below {qmin}: offsets {end}..{qmin - 1} are lost; export "
                    "without --since-manifest (in full, or --from-offsets to accept the gap)"
                )
            out.setdefault(t, {})[q] = (end, max(hi, end))
    return out


# ----------------------------------------------------------------------- network mode

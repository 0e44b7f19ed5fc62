"""``clmq store check``: read every file of a store directory and say what is damaged
and which messages that costs. Read-only; the store must be closed (its ``lock``).

What is read, per storage mode:
- CommitLog mode: every segment (:func:`clmq.commitlog.check_log`), the log's end against
  the checkpoint's durable offset, every consume-queue file (shape, zeroed entries,
  the checkpointed lengths, and every entry against the record it points at).
- Partition mode: every partition's segments (the same check, partition layout) and
  each partition's end against its recovery point.
- Both: the metadata files (readable, checksum, previous generation used; the content
  of a file the caller gives a validator for, such as ``security.json``'s users and ACLs).

Costs are named as queue-offset ranges: from the consume-queue entries pointing into
a damaged range, and from the records themselves for the readable bytes past it (which
a cut at the end of the longest valid prefix drops). Nothing here writes a byte.

Consume queues (CommitLog mode): every queue file under ``consumequeue/<topic>/<queue
id>/`` is read whole (numpy), so the check of a store with many entries holds them all
in memory at once (about 40 bytes per entry) and verifies them one segment at a time.

A queue file is damaged when its name or length breaks the layout (``consumequeue``:
contiguous files, only the last one short, whole entries), when it holds zeroed
entries, when it ends before the checkpointed length, or when an entry points at a
record of another queue or offset (or at no record). Entries pointing into a damaged
log range name the messages that damage costs.
"""

from __future__ import annotations

import fcntl
import itertools
import mmap
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from clmq.commitlog import (
    LogLayout,
    LogProblem,
    LogReport,
    MetadataSource,
    QueueKey,
    QueueRange,
    check_log,
    load_json,
    merge_ranges,
    read_json,
)
from clmq.common import (
    HEADER_SIZE,
    OFF_COMMITLOG_OFFSET,
    OFF_MAGIC,
    OFF_QUEUE_ID,
    OFF_QUEUE_OFFSET,
    OFF_TOPIC_LEN,
    OFF_TOTAL_SIZE,
    RECORD_MAGIC,
    gather_strings,
)
from clmq.consumequeue import ENTRY_DTYPE, ENTRY_SIZE, HOLE_TAG, START_TAG, check_index_dir

from ._checkpoint import Checkpoint
from ._config import StoreConfig, StoreLockedError
from ._partition_log import INDEX_MAGIC, TIME_MAGIC, open_index, read_whole

Progress = Callable[[int], None]  # called with the number of log bytes just read
# The users and ACLs (``security.json``: protocol.auth's SECURITY_FILE, a layer above);
# its content is the caller's to judge (``validators``), its format is checked here.
SECURITY_FILE = "security.json"
METADATA_FILES = {  # per storage mode
    "commitlog": ("topics.json", "consumer_offsets.json", "checkpoint", SECURITY_FILE),
    "partition-per-file": ("topics.json", "consumer_offsets.json", "recovery-points", SECURITY_FILE),
}
Validator = Callable[[Any], "str | None"]  # why a metadata file's content is unusable, or None
Validators = Mapping[str, Validator]  # a metadata file's name -> the judge of its content


@dataclass(frozen=True, slots=True)
class Damage:
    """One damaged range of a log and the messages it holds (as far as can be told)."""

    problem: LogProblem
    affected: list[QueueRange]


@dataclass(frozen=True, slots=True)
class MetadataStatus:
    """One metadata file: ``ok``, ``missing`` (never written), ``previous`` (damaged,
    its previous generation is good), ``damaged`` (no good generation) or, for
    ``topics.json``, ``incomplete`` (queues on disk that it does not list)."""

    file: str
    state: str
    detail: str = ""

    @property
    def damaged(self) -> bool:
        return self.state in ("previous", "damaged", "incomplete")


@dataclass(slots=True)
class StoreReport:
    """Everything ``clmq store check`` found; ``damaged`` decides its exit code."""

    directory: str
    mode: str
    logs: list[LogReport] = field(default_factory=list)
    damage: list[Damage] = field(default_factory=list)
    queue_problems: list[QueueFinding] = field(default_factory=list)
    index_problems: list[LogProblem] = field(default_factory=list)
    metadata: list[MetadataStatus] = field(default_factory=list)
    would_drop: list[QueueRange] = field(default_factory=list)  # what a repair cuts
    dropped: list[QueueRange] = field(default_factory=list)  # what a repair did cut
    repaired: bool = False

    @property
    def damaged(self) -> bool:
        return bool(self.damage or self.queue_problems or self.index_problems or any(m.damaged for m in self.metadata))

    @property
    def log_damaged(self) -> bool:
        """Log bytes are damaged or missing (a repair cuts the log)."""
        return bool(self.damage)

    def to_json(self) -> dict[str, Any]:
        """The report as plain JSON values (``--json``)."""
        return {
            "directory": self.directory,
            "mode": self.mode,
            "damaged": self.damaged,
            "repaired": self.repaired,
            "logs": [_log_json(r) for r in self.logs],
            "damage": [
                {**_problem_json(d.problem), "affected": [_range_json(r) for r in d.affected]} for d in self.damage
            ],
            "queue_problems": [q.to_json() for q in self.queue_problems],
            "index_problems": [_problem_json(p) for p in self.index_problems],
            "metadata": [{"file": m.file, "state": m.state, "detail": m.detail} for m in self.metadata],
            "would_drop": [_range_json(r) for r in self.would_drop],
            "dropped": [_range_json(r) for r in self.dropped],
        }


def _problem_json(p: LogProblem) -> dict[str, Any]:
    return {"file": p.file, "start": p.start, "end": p.end, "reason": p.reason}


def _range_json(r: QueueRange) -> dict[str, Any]:
    return {"topic": r.topic, "queue": r.queue_id, "first": r.first, "last": r.last, "count": r.count}


def _log_json(r: LogReport) -> dict[str, Any]:
    return {
        "directory": r.directory,
        "segments": r.segments,
        "records": r.records,
        "bytes": r.bytes,
        "start": r.start,
        "end": r.end,
        "valid_end": r.valid_end,
        "damaged": r.damaged,
    }


# ------------------------------------------------------------------ locking
@contextmanager
def store_lock(directory: Path) -> Iterator[None]:
    """Hold the store's ``lock`` (as ``Store.open`` does) while checking or repairing;
    :class:`StoreLockedError` when a broker has it open."""
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory} is not a directory")
    path = directory / "lock"
    fd = os.open(path, os.O_RDONLY) if path.exists() else -1  # a check creates nothing
    try:
        if fd >= 0:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise StoreLockedError(
                    f"data directory {directory} is in use (its lock is held): stop the broker first"
                ) from None
        yield
    finally:
        if fd >= 0:
            os.close(fd)


def detect_mode(directory: Path) -> str:
    """The storage mode a directory was written in (CommitLog unless only partitions exist)."""
    if (directory / "partitions").is_dir() and not (directory / "commitlog").is_dir():
        return "partition-per-file"
    return "commitlog"


def log_bytes(directory: Path) -> int:
    """Bytes of every segment file of the store (the total of a progress bar)."""
    total = 0
    for root, _dirs, files in os.walk(directory):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files if f.endswith(".log"))
    return total


# ------------------------------------------------------------------ the check
def check_store(
    config: StoreConfig, progress: Progress | None = None, validators: Validators | None = None
) -> StoreReport:
    """Check every file of the (closed) store at ``config.data_dir``; read-only.
    ``validators``: what a metadata file must hold besides a good checksum (a file
    whose generation fails it counts as damaged, as the service that loads it would
    find it), by file name."""
    with store_lock(config.data_dir):
        return check_unlocked(config, progress, validators)


def check_unlocked(
    config: StoreConfig, progress: Progress | None = None, validators: Validators | None = None
) -> StoreReport:
    """:func:`check_store` for a caller that holds the lock (repair)."""
    directory = config.data_dir
    report = StoreReport(str(directory), config.storage_mode)
    judges = validators or {}
    metadata = [_metadata_status(directory / name, judges.get(name)) for name in METADATA_FILES[config.storage_mode]]
    report.metadata = _topics_cover(directory, config.storage_mode, metadata)
    if config.storage_mode == "partition-per-file":
        _check_partitions(config, report, progress)
    else:
        _check_commitlog(config, report, progress)
    return report


def _check_commitlog(config: StoreConfig, report: StoreReport, progress: Progress | None) -> None:
    directory = config.data_dir
    log = check_log(directory / "commitlog", config.commitlog, LogLayout.COMMITLOG, progress)
    report.logs.append(log)
    report.index_problems.extend(log.index_problems)
    report.index_problems.extend(  # the key index (docs/operations.md): repair deletes the file, open rebuilds
        LogProblem(p.file, p.position, p.position + 1, f"at byte {p.position}: {p.reason}")
        for p in check_index_dir(directory / "index")
    )
    problems = list(log.problems)
    checkpoint = Checkpoint.load(directory / "checkpoint")
    if checkpoint is not None and log.end < checkpoint.log_durable:
        last = max((str(p) for p in (directory / "commitlog").glob("*.log")), default=str(directory / "commitlog"))
        reason = f"log ends at {log.end}, below the checkpoint's durable offset {checkpoint.log_durable}"
        problems.append(LogProblem(last, log.end, checkpoint.log_durable, reason))
    valid_end = min(log.valid_end, log.end)  # what survives a cut (a padding fix cuts nothing)
    queues = check_queues(directory, config, log, checkpoint, problems, valid_end)
    report.queue_problems = queues.problems
    report.damage = [Damage(p, queues.affected.get(i, [])) for i, p in enumerate(problems)]
    if problems:
        report.would_drop = queues.would_drop(log.beyond, checkpoint)


def _check_partitions(config: StoreConfig, report: StoreReport, progress: Progress | None) -> None:
    root = config.data_dir / "partitions"
    points = _recovery_points(config.data_dir / "recovery-points")
    for name in sorted(os.listdir(root)) if root.is_dir() else []:
        topic, _, qid = name.rpartition("-")
        if not qid.isdigit() or not topic:
            continue
        key = (topic, int(qid))
        log = check_log(root / name, config.commitlog, LogLayout.PARTITION, progress)
        report.logs.append(log)
        report.index_problems += _partition_index_problems(root / name, log)
        problems = list(log.problems)
        point = points.get(key, 0)
        if log.end < point:  # whole records gone from the end: at the end of the last file
            last = max((p for p in (root / name).glob("*.log")), default=None)
            size = last.stat().st_size if last is not None else 0
            reason = f"partition ends at queue offset {log.end}, below its recovery point {point}"
            problems.append(LogProblem(str(last or root / name), size, size, reason))
        if not problems:
            continue
        top = max([point - 1, log.end - 1, *(r.last for r in log.beyond)])
        lost = [QueueRange(topic, key[1], log.valid_end, top, top - log.valid_end + 1)] if top >= log.valid_end else []
        report.damage += [Damage(p, lost) for p in problems]
        report.would_drop = merge_ranges(report.would_drop + lost)


def _partition_index_problems(directory: Path, log: LogReport) -> list[LogProblem]:
    """Index files (``.index``, ``.timeindex``) that do not check or were written for
    another segment or more bytes than it holds (missing ones, or an active segment's
    that lag, are rebuilt at open and are not damage)."""
    out = []
    segments = sorted((int(p.name[:20]), p) for p in directory.glob("*.log") if p.name[:20].isdigit())
    for i, (base, path) in enumerate(segments):
        size = path.stat().st_size
        count = segments[i + 1][0] - base if i + 1 < len(segments) else log.end - base
        for suffix, magic, entry in ((".index", INDEX_MAGIC, 8), (".timeindex", TIME_MAGIC, 12)):
            opened = open_index(read_whole(path.with_suffix(suffix)), magic, entry)
            if isinstance(opened, str):
                why = None if opened == "missing" else opened
            else:
                _entries, at, covered, records = opened
                last = i + 1 == len(segments)
                whole = covered == size and records == count
                why = (f"written for the segment at {at}" if at != base else None) or (
                    None
                    if whole or (last and covered <= size and records <= count)
                    else f"covers {covered} bytes and {records} records, the segment holds {size} and {count}"
                )
            if why:
                out.append(LogProblem(str(path.with_suffix(suffix)), 0, size, why))
    return out


def _recovery_points(path: Path) -> dict[QueueKey, int]:
    raw = read_json(path)
    try:
        return {(str(t), int(q)): int(n) for t, q, n in raw["points"]} if isinstance(raw, dict) else {}
    except (TypeError, KeyError, ValueError):
        return {}


def _metadata_status(path: Path, validate: Validator | None = None) -> MetadataStatus:
    """Readable? checksum good (and content, if ``validate``)? Which generation would a store use?"""
    loaded = load_json(path, validate)
    state = {MetadataSource.CURRENT: "ok", MetadataSource.PREVIOUS: "previous", MetadataSource.MISSING: "missing"}.get(
        loaded.source, "damaged"
    )
    return MetadataStatus(str(path), state, "" if state in ("ok", "missing") else loaded.describe())


def _topics_cover(directory: Path, mode: str, metadata: list[MetadataStatus]) -> list[MetadataStatus]:
    """``topics.json`` marked ``incomplete`` when the queues on disk (consume-queue or
    partition directories, the checkpoint) name a topic or queue id it lacks."""
    loaded = load_json(directory / "topics.json")
    topics = loaded.value.get("topics") if loaded.ok else None
    if not isinstance(topics, dict):
        return metadata
    keys = set(on_disk_queues(directory, mode))
    lacking = sorted(f"{t}/{q}" for t, q in keys if not isinstance(topics.get(t), int) or q >= topics[t])
    if not lacking:
        return metadata
    detail = f"lacks {len(lacking)} queues found on disk: {', '.join(lacking[:5])}" + (
        " ..." if len(lacking) > 5 else ""
    )
    return [MetadataStatus(m.file, "incomplete", detail) if m.file.endswith("topics.json") else m for m in metadata]


def on_disk_queues(directory: Path, mode: str) -> list[QueueKey]:
    """The queues the store's files name: partition or consume-queue directories, and
    the checkpoint's queue list."""
    if mode == "partition-per-file":
        root = directory / "partitions"
        names = sorted(os.listdir(root)) if root.is_dir() else []
        return [(t, int(q)) for t, _, q in (n.rpartition("-") for n in names) if q.isdigit() and t]
    keys = [key for key, _path in _queue_dirs(directory / "consumequeue")]
    checkpoint = Checkpoint.load(directory / "checkpoint")
    return keys + list(checkpoint.queues if checkpoint else [])


# ------------------------------------------------------------ consume queues
@dataclass(frozen=True, slots=True)
class QueueFinding:
    """A damaged consume queue: ``file``, the queue, the queue offsets concerned."""

    file: str
    topic: str
    queue_id: int
    first: int
    last: int
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "topic": self.topic,
            "queue": self.queue_id,
            "first": self.first,
            "last": self.last,
            "reason": self.reason,
        }


@dataclass(slots=True)
class _Entries:
    """Every non-zero entry of every queue, as columns."""

    keys: list[QueueKey] = field(default_factory=list)
    code: list[np.ndarray] = field(default_factory=list)  # index into keys
    qoff: list[np.ndarray] = field(default_factory=list)
    off: list[np.ndarray] = field(default_factory=list)
    size: list[np.ndarray] = field(default_factory=list)

    def add(self, key: QueueKey, qoffs: np.ndarray, entries: np.ndarray) -> None:
        self.code.append(np.full(len(qoffs), len(self.keys), dtype=np.int64))
        self.keys.append(key)
        self.qoff.append(qoffs)
        self.off.append(entries["offset"].astype(np.int64))
        self.size.append(entries["size"].astype(np.int64))

    def columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        if not self.code:
            empty = np.empty(0, dtype=np.int64)
            return empty, empty, empty, empty
        return tuple(np.concatenate(c) for c in (self.code, self.qoff, self.off, self.size))  # type: ignore[return-value]


@dataclass(slots=True)
class QueueCheck:
    """What the queue files say: problems, messages in each damaged range, and what
    survives a cut (the last entry below it, per queue)."""

    problems: list[QueueFinding] = field(default_factory=list)
    affected: dict[int, list[QueueRange]] = field(default_factory=dict)  # by index of the log problem
    survivors: dict[QueueKey, int] = field(default_factory=dict)  # last queue offset below the cut
    lost: list[QueueRange] = field(default_factory=list)  # entries at or past the cut

    def would_drop(self, beyond: list[QueueRange], checkpoint: Checkpoint | None) -> list[QueueRange]:
        """Per queue, the offsets a cut at the valid end drops: from the last survivor
        (or the lowest lost offset) up to the highest offset anything knew of."""
        low: dict[QueueKey, int] = {}
        high: dict[QueueKey, int] = {}
        for r in self.lost + beyond:
            key = (r.topic, r.queue_id)
            low[key] = min(low.get(key, r.first), r.first)
            high[key] = max(high.get(key, r.last), r.last)
        for key, (_first, nxt) in (checkpoint.queues if checkpoint else {}).items():
            if nxt - 1 > self.survivors.get(key, -1):
                high[key] = max(high.get(key, nxt - 1), nxt - 1)
        out = []
        for key in sorted(high):
            first = self.survivors[key] + 1 if key in self.survivors else low.get(key, high[key])
            if high[key] >= first:
                out.append(QueueRange(key[0], key[1], first, high[key], high[key] - first + 1))
        return out


def check_queues(
    directory: Path,
    config: StoreConfig,
    log: LogReport,
    checkpoint: Checkpoint | None,
    problems: list[LogProblem],
    valid_end: int,
) -> QueueCheck:
    """Check every queue file of the store at ``directory`` against ``log``'s report."""
    out = QueueCheck()
    entries = _Entries()
    root = directory / "consumequeue"
    seen: set[QueueKey] = set()
    queues = _queue_dirs(root)
    per_file = _entries_per_file(queues, config.cq_entries_per_file)
    for key, qdir in queues:
        seen.add(key)
        _read_queue(key, qdir, per_file, checkpoint, out, entries)
    for key, (first, nxt) in (checkpoint.queues if checkpoint else {}).items():
        if key not in seen and nxt > first:
            out.problems.append(
                QueueFinding(
                    str(root / key[0] / str(key[1])),
                    key[0],
                    key[1],
                    first,
                    nxt - 1,
                    "queue files missing (the checkpoint lists entries)",
                )
            )
    code, qoff, off, size = entries.columns()
    live = off >= log.start  # below: deleted by retention, not damage
    for i, p in enumerate(problems):
        inside = live & (off >= p.start) & (off < p.end)
        out.affected[i] = _ranges(entries.keys, code[inside], qoff[inside])
    cut = live & (off >= valid_end)
    out.lost = _ranges(entries.keys, code[cut], qoff[cut])
    kept = live & ~cut
    for k, q in _last_per_queue(code[kept], qoff[kept]).items():
        out.survivors[entries.keys[k]] = q
    kept &= ~_in_any(off, problems)
    _verify_entries(directory / "commitlog", entries.keys, code[kept], qoff[kept], off[kept], size[kept], out)
    return out


def _queue_dirs(root: Path) -> list[tuple[QueueKey, Path]]:
    out = []
    for topic in sorted(os.listdir(root)) if root.is_dir() else []:
        tdir = root / topic
        if tdir.is_dir():
            out += [
                ((topic, int(q)), tdir / q) for q in sorted(os.listdir(tdir), key=lambda q: (len(q), q)) if q.isdigit()
            ]
    return out


def _entries_per_file(queues: list[tuple[QueueKey, Path]], configured: int) -> int:
    """The file size the store was written with, read off the names of the files (the
    smallest step between two of a queue's files); ``configured`` if no queue has two."""
    steps = []
    for _key, qdir in queues:
        starts = sorted(int(n) for n in os.listdir(qdir) if len(n) == 20 and n.isdigit())
        steps += [b - a for a, b in itertools.pairwise(starts) if b > a]
    return min(steps, default=configured)


def _read_queue(
    key: QueueKey, qdir: Path, per_file: int, checkpoint: Checkpoint | None, out: QueueCheck, entries: _Entries
) -> None:
    """One queue's files: layout, zeroed entries, checkpointed length; entries kept."""
    starts = sorted(int(n) for n in os.listdir(qdir) if len(n) == 20 and n.isdigit())
    expected = checkpoint.queues.get(key) if checkpoint else None
    end = starts[0] if starts else 0
    kept_q, kept_e = [], []
    for i, start in enumerate(starts):
        path = qdir / f"{start:020d}"
        size = os.path.getsize(path)
        reason = _layout_problem(start, size, end, per_file, last=i == len(starts) - 1)
        if reason:  # the offsets concerned: those in no file, or the file's own (a torn entry too)
            first, last = (end, start - 1) if start > end else (start, start + -(-size // ENTRY_SIZE) - 1)
            out.problems.append(QueueFinding(str(path), key[0], key[1], first, last, reason))
        data = np.fromfile(path, dtype=ENTRY_DTYPE, count=size // ENTRY_SIZE)
        qoffs = start + np.arange(len(data), dtype=np.int64)
        first = _queue_first(data, start, per_file, expected[0] if expected else None) if i == 0 else start
        hole = (data["offset"] == 0) & (data["size"] == 0) & (data["tag"] == HOLE_TAG)  # dispatch saw a gap
        zero = (data["offset"] == 0) & (data["size"] == 0) & (data["tag"] == 0)
        real = (qoffs >= first) & ~hole  # below the first: never written, or the start marker
        for a, b in _runs(qoffs[real & zero]):
            out.problems.append(QueueFinding(str(path), key[0], key[1], a, b, f"{b - a + 1} zeroed entries"))
        kept_q.append(qoffs[real & ~zero])
        kept_e.append(data[real & ~zero])
        end = start + len(data)
    if starts:
        entries.add(key, np.concatenate(kept_q), np.concatenate(kept_e))
    if expected is not None and end < expected[1]:
        out.problems.append(
            QueueFinding(
                str(qdir),
                key[0],
                key[1],
                end,
                expected[1] - 1,
                f"queue files end at offset {end}, the checkpoint says {expected[1]}",
            )
        )


def _queue_first(data: np.ndarray, start: int, per_file: int, expected_first: int | None) -> int:
    """The first offset a queue's first file holds (``consumequeue``'s rule): a start
    marker in slot 0 says it; a zero slot 0 defers to the checkpoint, else to the first
    entry that is not zero (files written before start markers existed)."""
    if not len(data):
        return start
    head = data[0]
    if head["size"] == 0 and head["tag"] == START_TAG and start < int(head["offset"]) < start + per_file:
        return int(head["offset"])
    if head["offset"] or head["size"] or head["tag"]:
        return start
    if expected_first is not None:
        return max(start, min(expected_first, start + per_file - 1))
    nonzero = np.flatnonzero((data["offset"] != 0) | (data["size"] != 0) | (data["tag"] != 0))
    return start + (int(nonzero[0]) if len(nonzero) else len(data))


def _layout_problem(start: int, size: int, expected_start: int, per_file: int, last: bool) -> str | None:
    if start % per_file:
        return f"file name {start} is not a multiple of {per_file} entries per file"
    if start > expected_start:
        return f"files missing: offsets {expected_start}..{start - 1} are in no file"
    if size % ENTRY_SIZE:
        return f"holds {size} bytes, not a whole number of {ENTRY_SIZE}-byte entries"
    if not last and size != per_file * ENTRY_SIZE:
        return f"holds {size // ENTRY_SIZE} entries, but it is not the last file and must hold {per_file}"
    return None


def _runs(values: np.ndarray) -> list[tuple[int, int]]:
    """Consecutive runs ``(first, last)`` of sorted integers."""
    if not len(values):
        return []
    breaks = np.flatnonzero(np.diff(values) != 1)
    firsts = np.concatenate([values[:1], values[breaks + 1]])
    lasts = np.concatenate([values[breaks], values[-1:]])
    return list(zip(firsts.tolist(), lasts.tolist()))


def _ranges(keys: list[QueueKey], code: np.ndarray, qoff: np.ndarray) -> list[QueueRange]:
    out = []
    for k in np.unique(code).tolist():
        sel = qoff[code == k]
        out.append(QueueRange(keys[k][0], keys[k][1], int(sel.min()), int(sel.max()), len(sel)))
    return out


def _last_per_queue(code: np.ndarray, qoff: np.ndarray) -> dict[int, int]:
    out: dict[int, int] = {}
    for k in np.unique(code).tolist():
        out[k] = int(qoff[code == k].max())
    return out


def _in_any(off: np.ndarray, problems: list[LogProblem]) -> np.ndarray:
    hit = np.zeros(len(off), dtype=bool)
    for p in problems:
        hit |= (off >= p.start) & (off < p.end)
    return hit


# ------------------------------------------------------- entries vs records
def _verify_entries(
    log_dir: Path,
    keys: list[QueueKey],
    code: np.ndarray,
    qoff: np.ndarray,
    off: np.ndarray,
    size: np.ndarray,
    out: QueueCheck,
) -> None:
    """Each entry must point at a whole record of its own topic, queue id and offset."""
    segments = sorted(
        (int(n[:20]), log_dir / n) for n in os.listdir(log_dir) if n.endswith(".log") and n[:20].isdigit()
    )
    if not segments or not len(off):
        return
    bases = np.array([b for b, _ in segments], dtype=np.int64)
    which = np.searchsorted(bases, off, side="right") - 1
    bad = np.zeros(len(off), dtype=bool)
    for i, (base, path) in enumerate(segments):
        sel = np.flatnonzero(which == i)
        if len(sel):
            bad[sel] = ~_entries_match(path, off[sel] - base, off[sel], size[sel], code[sel], qoff[sel], keys)
    bad |= which < 0
    for k in np.unique(code[bad]).tolist():
        q = qoff[bad & (code == k)]
        topic, qid = keys[k]
        out.problems.append(
            QueueFinding(
                f"consumequeue/{topic}/{qid}",
                topic,
                qid,
                int(q.min()),
                int(q.max()),
                f"{len(q)} entries point at no record of this queue and offset",
            )
        )


def _entries_match(
    path: Path,
    pos: np.ndarray,
    off: np.ndarray,
    size: np.ndarray,
    code: np.ndarray,
    qoff: np.ndarray,
    keys: list[QueueKey],
) -> np.ndarray:
    """Which entries find their record at ``pos`` of segment ``path``."""
    length = os.path.getsize(path)
    ok = (pos + np.maximum(size, HEADER_SIZE)) <= length
    if not ok.any():
        return np.asarray(ok, dtype=bool)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as data:
        buf = np.frombuffer(data, dtype=np.uint8)
        at = np.where(ok, pos, 0)
        ok &= _field(buf, at, OFF_TOTAL_SIZE, "<u4") == size
        ok &= _field(buf, at, OFF_MAGIC, "<u4") == RECORD_MAGIC
        ok &= _field(buf, at, OFF_COMMITLOG_OFFSET, "<u8") == off
        ok &= _field(buf, at, OFF_QUEUE_OFFSET, "<u8") == qoff
        qids = np.array([q for _t, q in keys], dtype=np.int64)
        ok &= _field(buf, at, OFF_QUEUE_ID, "<u4") == qids[code]
        lengths = np.where(ok, _field(buf, at, OFF_TOPIC_LEN, "<u2"), 0)
        names, inverse = gather_strings(buf, at + HEADER_SIZE, lengths)
        del buf
    ids = {topic: i for i, topic in enumerate(sorted({t for t, _q in keys}))}
    found = np.array([ids.get(n.decode(errors="replace"), -1) for n in names], dtype=np.int64)[inverse]
    wanted = np.array([ids[t] for t, _q in keys], dtype=np.int64)[code]
    return np.asarray(ok & (found == wanted), dtype=bool)


def _field(buf: np.ndarray, pos: np.ndarray, offset: int, dtype: str) -> np.ndarray:
    width = np.dtype(dtype).itemsize
    cells = buf[pos[:, None] + np.arange(offset, offset + width)]
    return np.ascontiguousarray(cells).view(dtype).reshape(len(pos)).astype(np.int64)

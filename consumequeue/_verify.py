"""Checking that the records a queue's entries point at are that queue's records.

An entry is only a pointer: after damage (a zeroed or garbled queue file, a log that
lost its tail and was written again) it can point at bytes that are now another
queue's record, or no record at all. Every read through an entry therefore checks the
record's identity against what the entry promised: size, magic, commit-log offset,
topic, queue id and queue offset. The decoded path (:func:`check_record_identity`)
also has the CRC checked by the decoder; the zero-copy path checks headers only
(:func:`check_headers`, vectorised: the consumer checks the CRC).

:class:`EntryReader` reads through entries both ways. An entry naming bytes that are
not in the log is damage (:class:`CorruptRecordError`, "record extent"), unless the
bytes are below the log's first offset: retention took them, and they are left out.

:func:`spans_many` reads the records of many queues at once (a pull of thousands of
queues of a few records each): sorted by log position, read in windows of neighbours,
the same identity fields checked with array operations over all of them. It reports
no damage itself: a queue whose records do not check (or are not in one segment, or
no longer in the log) is left to the per-queue read, which says what is wrong.
"""

from __future__ import annotations

import itertools
import os
import struct
import threading
from pathlib import Path
from typing import Callable

import numpy as np

from clmq.commitlog import CommitLog, fileops
from clmq.common import (
    HEADER_SIZE,
    OFF_COMMITLOG_OFFSET,
    OFF_MAGIC,
    OFF_QUEUE_ID,
    OFF_QUEUE_OFFSET,
    OFF_TOPIC_LEN,
    OFF_TOTAL_SIZE,
    RECORD_MAGIC,
    CorruptRecordError,
    MiB,
    Record,
    decode_record,
)

PREAD_MAX_BYTES = 64 * 1024  # zero-copy reads: runs up to this are read to check headers, longer ones mapped
FileSpan = tuple[str, int, int]  # segment path, position in it, length

_LOW = OFF_QUEUE_ID + 4  # header bytes [0, _LOW): size, magic, crc, offsets, queue id
_COLS_CACHE: dict[int, tuple[np.ndarray, np.dtype[np.void]]] = {}


def _layout(topic_len: int) -> tuple[np.ndarray, np.dtype[np.void]]:
    """Columns gathered per record (header bytes and the topic) and their dtype."""
    got = _COLS_CACHE.get(topic_len)
    if got is None:
        pad = [] if topic_len else [0]  # no topic: one padding column keeps the dtype valid
        cols = np.concatenate([np.arange(_LOW), np.arange(OFF_TOPIC_LEN, HEADER_SIZE + topic_len), pad]).astype(
            np.int64
        )
        high = _LOW - OFF_TOPIC_LEN  # where header byte OFF_TOPIC_LEN lands in a gathered row
        dtype = np.dtype(
            {
                "names": ["size", "magic", "offset", "queue_offset", "queue_id", "topic_len", "topic"],
                "formats": ["<u4", "<u4", "<u8", "<u8", "<u4", "<u2", f"V{max(topic_len, 1)}"],
                "offsets": [
                    OFF_TOTAL_SIZE,
                    OFF_MAGIC,
                    OFF_COMMITLOG_OFFSET,
                    OFF_QUEUE_OFFSET,
                    OFF_QUEUE_ID,
                    OFF_TOPIC_LEN + high,
                    HEADER_SIZE + high,
                ],
                "itemsize": len(cols),
            }
        )
        got = _COLS_CACHE[topic_len] = (cols, dtype)
    return got


_HEAD = struct.Struct("<II4xQQI60xH")  # size, magic, (crc), commit-log offset, queue offset, queue id, topic length
assert _HEAD.size == OFF_TOPIC_LEN + 2 and OFF_QUEUE_ID == 28
SMALL_RUN = 64  # runs of at most this many records are checked with struct (numpy's per-call cost is more)


def check_headers(
    data: bytes | memoryview,
    start: int,
    offsets: list[int],
    sizes: list[int],
    queue_offsets: list[int],
    topic: bytes,
    queue_id: int,
    where: Callable[[int], str],
) -> None:
    """Check the headers of the records at log ``offsets`` (``data`` holds the log from
    ``start``) against their entries (``sizes``, ``queue_offsets``) and the queue.

    Raises :class:`CorruptRecordError` (file from ``where(offset)``, the record's log
    offset, the first field that differs, expected and actual) at the first mismatch.
    """
    n = len(offsets)
    positions = [o - start for o in offsets]
    cols, dtype = _layout(len(topic))
    if n <= SMALL_RUN or positions[-1] + len(cols) > len(data) or min(sizes) < HEADER_SIZE + len(topic):
        _check_small(data, positions, sizes, offsets, queue_offsets, topic, queue_id, where)
        return
    buf = np.frombuffer(data, np.uint8)
    rows = buf[np.array(positions, dtype=np.int64)[:, None] + cols].view(dtype).reshape(n)
    ok = rows["size"] == np.array(sizes, dtype=np.uint32)
    ok &= rows["magic"] == RECORD_MAGIC
    ok &= rows["offset"] == np.array(offsets, dtype=np.uint64)
    ok &= rows["queue_offset"] == np.array(queue_offsets, dtype=np.uint64)
    ok &= rows["queue_id"] == queue_id
    ok &= rows["topic_len"] == len(topic)
    if topic:
        ok &= rows["topic"] == np.frombuffer(topic, dtype=dtype["topic"])[0]
    if not ok.all():
        i = int(np.argmin(ok))
        _diagnose(data, positions[i], sizes[i], offsets[i], queue_offsets[i], topic, queue_id, where)


def _check_small(
    data: bytes | memoryview,
    positions: list[int],
    sizes: list[int],
    offsets: list[int],
    queue_offsets: list[int],
    topic: bytes,
    queue_id: int,
    where: Callable[[int], str],
) -> None:
    """:func:`check_headers` record by record (few records, or some too short): one
    unpack per record, topic included, compared as one tuple."""
    tl, avail = len(topic), len(data)
    head = _head_with_topic(tl)
    for p, size, offset, qoff in zip(positions, sizes, offsets, queue_offsets):
        if size < HEADER_SIZE + tl or p + HEADER_SIZE + tl > avail:
            raise CorruptRecordError(
                where(offset), offset, "total size", f">= {HEADER_SIZE + tl} (header and topic)", str(size)
            )
        if head.unpack_from(data, p) != (size, RECORD_MAGIC, offset, qoff, queue_id, tl, topic):
            _diagnose(data, p, size, offset, qoff, topic, queue_id, where)


_HEADS: dict[int, struct.Struct] = {}


def _head_with_topic(topic_len: int) -> struct.Struct:
    head = _HEADS.get(topic_len)
    if head is None:
        head = _HEADS[topic_len] = struct.Struct(f"{_HEAD.format}{HEADER_SIZE - _HEAD.size}x{topic_len}s")
    return head


def _diagnose(
    data: bytes | memoryview,
    p: int,
    size: int,
    offset: int,
    qoff: int,
    topic: bytes,
    queue_id: int,
    where: Callable[[int], str],
) -> None:
    """Raise for the first field of the record at ``p`` that is not what its entry says."""
    got_size, magic, got_offset, got_qoff, got_qid, tl = _HEAD.unpack_from(data, p)
    got_topic = repr(bytes(data[p + HEADER_SIZE : p + HEADER_SIZE + tl]).decode("utf-8", "replace"))
    if tl != len(topic):  # its length differs (the bytes read may stop at the expected length)
        got_topic = f"{got_topic} ({tl} bytes)"
    for check, expected, actual in (
        ("magic", hex(RECORD_MAGIC), hex(magic)),
        ("total size", str(size), str(got_size)),
        ("commitlog offset", str(offset), str(got_offset)),
        ("topic", repr(topic.decode()), got_topic),
        ("queue id", str(queue_id), str(got_qid)),
        ("queue offset", str(qoff), str(got_qoff)),
    ):
        if expected != actual:
            raise CorruptRecordError(where(offset), offset, check, expected, actual)
    raise AssertionError("_diagnose called for a record that checks")  # pragma: no cover


def check_record_identity(
    rec: Record, where: str, offset: int, size: int, topic: str, queue_id: int, queue_offset: int
) -> None:
    """A decoded (CRC-checked) record against its entry and its queue."""
    if (
        rec.size == size
        and rec.commitlog_offset == offset
        and rec.queue_offset == queue_offset
        and rec.queue_id == queue_id
        and rec.topic == topic
    ):
        return
    for check, expected, actual in (
        ("total size", size, rec.size),
        ("commitlog offset", offset, rec.commitlog_offset),
        ("topic", topic, rec.topic),
        ("queue id", queue_id, rec.queue_id),
        ("queue offset", queue_offset, rec.queue_offset),
    ):
        if expected != actual:
            raise CorruptRecordError(
                where,
                offset,
                check,
                repr(expected) if check == "topic" else str(expected),
                repr(actual) if check == "topic" else str(actual),
            )


class EntryReader:
    """Reads the records that queue entries point at, checking each one's identity.

    The zero-copy path reads headers through its own read-only descriptor per segment
    (the spans it checks came from :meth:`CommitLog.file_span`, so the bounds are
    checked already): a pull of one record from each of many queues costs one
    ``pread`` per record and no more, and takes no lock. Descriptors of segments that
    retention or a truncation removed are dropped by :meth:`forget_missing` (the store
    calls it then) and closed one call later, as the log closes deleted segments. A
    read that took a descriptor before it was dropped checks after reading that it is
    still its segment's: if not, the bytes may come from another file that got the
    number (two calls can come a moment apart), and the read answers "not in the log"
    (the segment is gone: its records are below the log's start).
    """

    def __init__(self, log: CommitLog) -> None:
        self._log = log
        self._fds: dict[Path, int] = {}
        self._retired: list[int] = []  # dropped by the last forget_missing, closed by the next
        self._lock = threading.Lock()

    def spans(self, picked: np.ndarray, qoffs: np.ndarray, topic: bytes, queue_id: int) -> tuple[list[FileSpan], int]:
        """File spans of the picked records, per log-contiguous run, headers checked."""
        spans: list[FileSpan] = []
        count = 0
        offsets, sizes, qo = picked["offset"].tolist(), picked["size"].tolist(), qoffs.tolist()
        head, want = _head_with_topic(len(topic)), HEADER_SIZE + len(topic)
        for i, j in contiguous_runs(picked["offset"], picked["size"]):
            start, end = offsets[i], offsets[j - 1] + sizes[j - 1]
            where = self._log.file_span(start, end - start)
            if where is not None and j - i == 1 and sizes[i] >= want:  # the usual run of a pull of many queues
                data = self._pread(where[0], want, where[1], start)  # the header and topic only
                if data is None or len(data) < want:
                    self._gone(start, sizes[i])
                    continue
                if head.unpack_from(data) != (sizes[i], RECORD_MAGIC, start, qo[i], queue_id, len(topic), topic):
                    _diagnose(data, 0, sizes[i], start, qo[i], topic, queue_id, self._log.segment_path)
                spans.append((str(where[0]), where[1], sizes[i]))
                count += 1
                continue
            if where is not None and j - i > 2 and min(sizes[i], sizes[j - 1]) >= want:
                if self._check_ends(where, offsets, sizes, qo, i, j, topic, queue_id):
                    spans.append((str(where[0]), where[1], end - start))
                    count += j - i
                continue
            if where is not None:
                if self._check_at(where, start, end, offsets[i:j], sizes[i:j], qo[i:j], topic, queue_id):
                    spans.append((str(where[0]), where[1], end - start))
                    count += j - i
                continue
            for k in range(i, j):  # crosses a segment end, or fell out of retention: record by record
                one = self._log.file_span(offsets[k], sizes[k])
                if one is None:
                    self._gone(offsets[k], sizes[k])
                elif self._check_at(
                    one,
                    offsets[k],
                    offsets[k] + sizes[k],
                    offsets[k : k + 1],
                    sizes[k : k + 1],
                    qo[k : k + 1],
                    topic,
                    queue_id,
                ):
                    spans.append((str(one[0]), one[1], sizes[k]))
                    count += 1
        return spans, count

    def spans_many(self, picks: list[Pick]) -> list[tuple[PickSpans, int] | None]:
        """:func:`spans_many`: the records of many queues' picks, read together."""
        return spans_many(self, picks)

    def _check_ends(
        self,
        where: tuple[Path, int],
        offsets: list[int],
        sizes: list[int],
        qo: list[int],
        i: int,
        j: int,
        topic: bytes,
        queue_id: int,
    ) -> bool:
        """Check the first and the last record of a log-contiguous run of entries
        ``[i, j)``; False if retention took them meanwhile.

        Why the two ends are enough for the entries between: the dispatcher wrote them
        from consecutive records of this queue, and the run is contiguous only while
        each entry's offset is the previous one's offset plus size. Damage to any
        offset or size breaks the run (its pieces are then checked on their own), and
        the last record's header must hold the queue offset and log offset that the
        sizes in between add up to. Damage *inside* a record (the log's bytes) is the
        consumer's CRC check to find, as for every record sent without a copy.
        """
        path, pos = where
        want = HEADER_SIZE + len(topic)
        head = _head_with_topic(len(topic))
        for k in (i, j - 1):
            data = self._pread(path, want, pos + offsets[k] - offsets[i], offsets[k])
            if data is None or len(data) < want:
                return self._gone(offsets[i], offsets[j - 1] + sizes[j - 1] - offsets[i])
            if head.unpack_from(data) != (sizes[k], RECORD_MAGIC, offsets[k], qo[k], queue_id, len(topic), topic):
                _diagnose(data, 0, sizes[k], offsets[k], qo[k], topic, queue_id, self._log.segment_path)
        return True

    def _check_at(
        self,
        where: tuple[Path, int],
        start: int,
        end: int,
        offsets: list[int],
        sizes: list[int],
        qoffs: list[int],
        topic: bytes,
        queue_id: int,
    ) -> bool:
        """Check the headers of a run of records at ``where`` (segment, position);
        False if retention took them meanwhile."""
        path, pos = where
        data: bytes | memoryview | None
        if end - start <= PREAD_MAX_BYTES:
            data = self._pread(path, end - start, pos, start)
        else:  # a long run: map it, only the header pages are touched
            data = self._log.map_chunk(start, end - start)[1]
        if data is None or len(data) < end - start:
            return self._gone(start, end - start)
        check_headers(data, start, offsets, sizes, qoffs, topic, queue_id, self._log.segment_path)
        return True

    def _pread(self, path: Path, n: int, pos: int, offset: int) -> bytes | None:
        """``n`` bytes of a segment (None: deleted meanwhile); a failed read inside the
        log is :class:`CorruptRecordError` ("read")."""
        try:
            fd = self._fds.get(path)
            if fd is None:
                fd = self._open(path)
            data = fileops.OPS.pread(fd, n, pos)
            # Dropped meanwhile (its segment deleted), maybe closed and the number reused
            # by another file: what was read cannot be trusted, and the records are gone.
            return data if self._fds.get(path) == fd else None
        except FileNotFoundError:
            # Unlinked. Retention unlinks a segment a moment before it moves the log's
            # start (readers in between found "damage"); the log's own descriptor still
            # reads it, and answers None once the records are below the start.
            return self._log.read_bytes(offset, n)
        except OSError as e:
            if offset < self._log.min_offset:
                return None
            raise CorruptRecordError(str(path), offset, "read", f"{n} bytes", f"{type(e).__name__}: {e}") from e

    def _open(self, path: Path) -> int:
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                fd = self._fds[path] = os.open(path, os.O_RDONLY)
            return fd

    def forget_missing(self) -> None:
        """Drop the descriptors of segments no longer in the log (retention, truncation);
        those dropped by the previous call are closed now."""
        with self._lock:
            # Listed under the lock: a segment a reader opened (under the lock) before is
            # listed, so a live segment is never dropped. Listed before the lock, one the
            # log rolled to in between was dropped and then closed under its readers.
            keep = {path for _base, _size, path in self._log.segments()}
            closing, self._retired = self._retired, [fd for p, fd in self._fds.items() if p not in keep]
            self._fds = {p: fd for p, fd in self._fds.items() if p in keep}
        for fd in closing:
            os.close(fd)

    def close(self) -> None:
        with self._lock:
            fds, self._fds = [*self._fds.values(), *self._retired], {}
            self._retired = []
        for fd in fds:
            os.close(fd)

    def _gone(self, offset: int, size: int) -> bool:
        """A record its entry names is not in the log: retention (False), or damage."""
        if offset < self._log.min_offset:
            return False
        raise CorruptRecordError(
            self._log.segment_path(offset),
            offset,
            "record extent",
            f"inside the log (ends at {self._log.write_offset}, one segment)",
            f"{size} bytes from {offset}",
        )

    def records(self, picked: np.ndarray, qoffs: np.ndarray, topic: str, queue_id: int) -> list[Record]:
        """Read, decode (CRC) and check the picked records, one read per log-contiguous run."""
        out: list[Record] = []
        offsets, sizes, qo = picked["offset"].tolist(), picked["size"].tolist(), qoffs.tolist()
        for i, j in contiguous_runs(picked["offset"], picked["size"]):
            start = offsets[i]
            data = self._log.read_bytes(start, offsets[j - 1] + sizes[j - 1] - start)
            where = self._log.segment_path(start)
            for k in range(i, j):
                if data is not None:
                    piece, pos = data, offsets[k] - start
                else:  # crosses a segment end, or fell out of retention: record by record
                    one = self._log.read_bytes(offsets[k], sizes[k])
                    if one is None and not self._gone(offsets[k], sizes[k]):
                        continue
                    piece, pos, where = one or b"", 0, self._log.segment_path(offsets[k])
                rec = decode_record(piece, pos, where, offsets[k])
                check_record_identity(rec, where, offsets[k], sizes[k], topic, queue_id, qo[k])
                out.append(rec)
        return out


def contiguous_runs(offsets: np.ndarray, sizes: np.ndarray, max_run_bytes: int = 4 * MiB) -> list[tuple[int, int]]:
    """Index ranges ``[i, j)`` of records that follow each other in the log; a run ends
    before a record starting ``max_run_bytes`` or more after the run's start. Found
    with array operations: a loop per record here cost half of a 256-record read."""
    n = len(offsets)
    if n == 0:
        return []
    starts = offsets.astype(np.int64)
    cuts = (np.flatnonzero(starts[1:] != starts[:-1] + sizes[:-1]) + 1).tolist()
    runs: list[tuple[int, int]] = []
    i = 0
    for j in cuts + [n]:
        while int(starts[j - 1] - starts[i]) >= max_run_bytes:  # too long: split it
            k = i + int(np.searchsorted(starts[i:j], starts[i] + max_run_bytes, side="left"))
            runs.append((i, k))
            i = k
        runs.append((i, j))
        i = j
    return runs


# ------------------------------------------------------------------ many queues at once
WINDOW_SPAN_MAX_BYTES = 64 * 1024  # a queue's log-contiguous run this long stays a file span (sendfile)
WINDOW_GAP_MAX_BYTES = 16 * 1024  # records at most this far apart in the log are read with one pread (the gap too)
WINDOW_READ_MAX_BYTES = 1 * MiB  # one such pread at most (a longer neighbourhood is cut; its last record may pass it)
Pick = tuple[np.ndarray, np.ndarray, bytes, int]  # entries picked, their queue offsets, topic, queue id
PickSpans = list["FileSpan | bytes"]  # file spans (long runs) or the records' bytes, in queue order
_HEAD_COLS = np.r_[0:_LOW, OFF_TOPIC_LEN : OFF_TOPIC_LEN + 2].astype(np.int64)  # the checked header bytes only
_HEAD_DTYPE = np.dtype(
    {
        "names": ["size", "magic", "offset", "queue_offset", "queue_id", "topic_len"],
        "formats": ["<u4", "<u4", "<u8", "<u8", "<u4", "<u2"],
        "offsets": [OFF_TOTAL_SIZE, OFF_MAGIC, OFF_COMMITLOG_OFFSET, OFF_QUEUE_OFFSET, OFF_QUEUE_ID, _LOW],
        "itemsize": _LOW + 2,
    }
)


class _Flat:
    """The records of many picks as flat arrays, in answer order (pick by pick)."""

    def __init__(self, picks: list[Pick]) -> None:
        counts = [len(p[0]) for p in picks]
        self.owner = np.repeat(np.arange(len(picks), dtype=np.int64), counts)
        # One copy of the entries, fields taken once (np.concatenate of record arrays
        # promotes their fields: 9 us per array, most of the work for one record each).
        entries = np.frombuffer(b"".join([p[0].tobytes() for p in picks]), picks[0][0].dtype)
        self.offset = entries["offset"].astype(np.int64)
        self.size = entries["size"].astype(np.int64)
        self.qoff = np.concatenate([p[1] for p in picks]).astype(np.int64)
        self.queue_id = np.repeat(np.array([p[3] for p in picks], dtype=np.int64), counts)
        topics = [p[2] for p in picks]
        self.topic_len = np.repeat(np.array([len(t) for t in topics], dtype=np.int64), counts)
        self.topics = topics

    def long_picks(self) -> np.ndarray:
        """Picks with a log-contiguous run of at least ``WINDOW_SPAN_MAX_BYTES``."""
        o, s, w = self.offset, self.size, self.owner
        cut = np.flatnonzero((w[1:] != w[:-1]) | (o[1:] != o[:-1] + s[:-1])) + 1
        first = np.concatenate([[0], cut])
        run_bytes = np.add.reduceat(s, first) if len(s) else s
        return np.unique(w[first[run_bytes >= WINDOW_SPAN_MAX_BYTES]])


def spans_many(reader: EntryReader, picks: list[Pick]) -> list[tuple[PickSpans, int] | None]:
    """Per pick, its records (the bytes of small records, file spans of long runs) and
    their count, every record's identity checked as by :meth:`EntryReader.spans`; None
    for a pick that met anything else (a mismatch, a record not in the log, a segment
    end): the caller reads it alone, which says what is wrong.

    Why: with thousands of queues each pick is a few records scattered in the log, and
    a pread per record (with a Python check each) was most of a pull's cost. Here all
    records are sorted by log position and read in windows of neighbours (one pread
    each), and the headers checked with array operations over all of them at once."""
    out: list[tuple[PickSpans, int] | None] = [([], 0)] * len(picks)
    if not any(len(p[0]) for p in picks):
        return out
    flat = _Flat(picks)
    long = set(flat.long_picks().tolist())
    for k in long:  # a queue written alone: long runs, sent with sendfile as before
        try:
            out[k] = reader.spans(*picks[k])  # type: ignore[assignment]
        except CorruptRecordError:
            out[k] = None
    small = ~np.isin(flat.owner, np.fromiter(long, np.int64, len(long))) if long else np.ones(len(flat.owner), bool)
    bad = np.zeros(len(picks), dtype=bool)
    buf, at = _read_windows(reader, flat, np.flatnonzero(small), bad)
    _check_many(buf, at, flat, small, bad)
    _cut_pieces(buf, at, flat, small & ~bad[flat.owner], out)
    for k in np.flatnonzero(bad).tolist():
        out[k] = None
    return out


def _read_windows(reader: EntryReader, flat: _Flat, idx: np.ndarray, bad: np.ndarray) -> tuple[bytes, np.ndarray]:
    """Read the records ``idx`` (flat indexes) in windows of neighbours; the bytes read
    and each record's position in them (-1: not read, its pick marked in ``bad``)."""
    at = np.full(len(flat.offset), -1, dtype=np.int64)
    order = idx[np.argsort(flat.offset[idx], kind="stable")]
    pos, end = flat.offset[order], flat.offset[order] + flat.size[order]
    cuts = np.flatnonzero(pos[1:] - end[:-1] > WINDOW_GAP_MAX_BYTES) + 1
    bounds = [0, *cuts.tolist(), len(order)]
    chunks: list[bytes] = []
    base = 0
    for a, b in itertools.pairwise(bounds):
        while a < b:
            k = a + max(1, int(np.searchsorted(pos[a:b], pos[a] + WINDOW_READ_MAX_BYTES, side="left")))
            first, last = int(pos[a]), int(end[a:k].max())
            data = _read_window(reader, first, last - first)
            if data is None:
                bad[flat.owner[order[a:k]]] = True
            else:
                at[order[a:k]] = pos[a:k] - first + base
                chunks.append(data)
                base += len(data)
            a = k
    return (chunks[0] if len(chunks) == 1 else b"".join(chunks)), at


def _read_window(reader: EntryReader, offset: int, n: int) -> bytes | None:
    """``n`` log bytes from ``offset`` in one segment; None if not (a segment end,
    retention): the picks are then read alone."""
    where = reader._log.file_span(offset, n)
    if where is None:
        return None
    try:
        data = reader._pread(where[0], n, where[1], offset)
    except CorruptRecordError:
        return None
    return data if data is not None and len(data) == n else None


def _check_many(buf: bytes, at: np.ndarray, flat: _Flat, small: np.ndarray, bad: np.ndarray) -> None:
    """Mark in ``bad`` every pick with a record read whose header or topic is not what
    its entry and queue say (size, magic, log offset, queue offset, queue id, topic)."""
    idx = np.flatnonzero(small & (at >= 0))
    short = flat.size[idx] < HEADER_SIZE + flat.topic_len[idx]
    bad[flat.owner[idx[short]]] = True
    idx = idx[~short]
    if not len(idx):
        return
    data = np.frombuffer(buf, np.uint8)
    rows = data[at[idx][:, None] + _HEAD_COLS].view(_HEAD_DTYPE).reshape(len(idx))
    ok = rows["size"] == flat.size[idx]
    ok &= rows["magic"] == RECORD_MAGIC
    ok &= rows["offset"] == flat.offset[idx].astype(np.uint64)
    ok &= rows["queue_offset"] == flat.qoff[idx].astype(np.uint64)
    ok &= rows["queue_id"] == flat.queue_id[idx]
    ok &= rows["topic_len"] == flat.topic_len[idx]
    for topic in set(flat.topics):
        if not topic:
            continue
        mine = np.flatnonzero(np.array([t == topic for t in flat.topics])[flat.owner[idx]])
        got = data[at[idx[mine]][:, None] + HEADER_SIZE + np.arange(len(topic))]
        ok[mine] &= (got == np.frombuffer(topic, np.uint8)).all(axis=1)
    bad[flat.owner[idx[~ok]]] = True


def _cut_pieces(
    buf: bytes, at: np.ndarray, flat: _Flat, good: np.ndarray, out: list[tuple[PickSpans, int] | None]
) -> None:
    """Each good small pick's records as one bytes object, in queue order (neighbours in
    ``buf`` sliced together)."""
    idx = np.flatnonzero(good)
    if not len(idx):
        return
    pos, size, owner = at[idx], flat.size[idx], flat.owner[idx]
    cut = np.flatnonzero((owner[1:] != owner[:-1]) | (pos[1:] != pos[:-1] + size[:-1])) + 1
    first = np.concatenate([[0], cut])
    lengths = np.add.reduceat(size, first)
    view = memoryview(buf)
    pieces = [view[p : p + n] for p, n in zip(pos[first].tolist(), lengths.tolist())]
    piece_owner = owner[first]
    picks, begin = np.unique(piece_owner, return_index=True)
    counts = np.bincount(owner, minlength=len(out))
    for k, a, b in zip(picks.tolist(), begin.tolist(), [*begin[1:].tolist(), len(pieces)]):
        out[k] = ([pieces[a].tobytes() if b - a == 1 else b"".join(pieces[a:b])], int(counts[k]))

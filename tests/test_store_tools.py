"""``clmq store check`` and ``clmq store repair`` on real store directories, damaged on
purpose: the exact damaged range and the messages it costs are reported, and after a
repair every message not listed as dropped reads back with its content."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clmq.broker.store import Store, StoreConfig, StoreLockedError, TopicTable, check_store, repair_store
from clmq.commitlog import CommitLogConfig
from clmq.common import BLANK_MAGIC, BLANK_SIZE, LogDamageError, Message

MODES = ("commitlog", "partition-per-file")
LOG = CommitLogConfig(segment_bytes=64 * 1024, max_message_bytes=4096, boundary_interval_bytes=4096)
QUEUES = [("t", 0), ("t", 1), ("u", 0)]
COUNT = 2400
Key = tuple[str, int, int]  # topic, queue id, queue offset


@dataclass
class Written:
    """A closed store and what was written to it: body and (log offset, size) per message."""

    config: StoreConfig
    bodies: dict[Key, bytes]
    places: dict[Key, tuple[int, int]]


def _config(directory: Path, mode: str) -> StoreConfig:
    return StoreConfig(directory, LOG, storage_mode=mode, cq_entries_per_file=100)


def _write(directory: Path, mode: str) -> Written:
    config = _config(directory, mode)
    bodies: dict[Key, bytes] = {}
    places: dict[Key, tuple[int, int]] = {}
    with Store.open(config) as store:
        store.create_topic("t", 2)
        store.create_topic("u", 1)
        for i in range(COUNT):
            topic, qid = QUEUES[i % 3]
            body = b"message %05d " % i + os.urandom(8).hex().encode() * (1 + i % 5)
            result = store.put(Message(topic, qid, body))
            assert result.ok
            key = (topic, qid, result.queue_offsets[0])
            bodies[key] = body
            places[key] = (-1, 0)  # filled in from the reads below
        store.catch_up()
        for topic, qid in QUEUES:
            for rec in _read_queue(store, topic, qid):
                places[(topic, qid, rec.queue_offset)] = (rec.commitlog_offset, rec.size)
    return Written(config, bodies, places)


def _read_queue(store: Store, topic: str, qid: int) -> list:  # type: ignore[type-arg]
    out, offset = [], store.min_offset(topic, qid)
    while offset < store.max_offset(topic, qid):
        got = store.get(topic, qid, offset, 256).messages
        if not got:
            break
        out += got
        offset = got[-1].queue_offset + 1
    return out


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Written]:
    root = tmp_path_factory.mktemp("pristine")
    return {mode: _write(root / mode, mode) for mode in MODES}


def _copy(pristine: dict[str, Written], mode: str, target: Path) -> Written:
    src = pristine[mode]
    shutil.copytree(src.config.data_dir, target)
    return Written(_config(target, mode), src.bodies, src.places)


def _segments(w: Written, partition: str = "t-1") -> list[Path]:
    if w.config.storage_mode == "commitlog":
        return sorted((w.config.data_dir / "commitlog").glob("*.log"))
    return sorted((w.config.data_dir / "partitions" / partition).glob("*.log"))


def _clmq(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "clmq", *args], capture_output=True, text=True, timeout=120)


# ------------------------------------------------------------------- clean
@pytest.mark.parametrize("mode", MODES)
def test_clean_store_checks_clean_through_the_command(pristine: dict[str, Written], mode: str, tmp_path: Path) -> None:
    w = _copy(pristine, mode, tmp_path / "s")
    done = _clmq("store", "check", str(w.config.data_dir))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no damage" in done.stdout
    before = _listing(w.config.data_dir)
    report = check_store(w.config)
    assert not report.damaged and report.logs and sum(r.records for r in report.logs) == COUNT
    assert _listing(w.config.data_dir) == before  # a check writes nothing


def _listing(directory: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("mode", MODES)
def test_a_store_after_retention_checks_clean(pristine: dict[str, Written], mode: str, tmp_path: Path) -> None:
    """Segments and queue heads deleted by retention, queues rebuilt starting inside
    their first file: nothing of that is damage."""
    w = _copy(pristine, mode, tmp_path / "s")
    kept = dataclasses.replace(LOG, retention_bytes=100_000)
    config = dataclasses.replace(w.config, commitlog=kept)
    with Store.open(config) as store:
        assert store.apply_retention() > 0
    if mode == "commitlog":  # rebuilt from what retention left: queues begin inside a file
        shutil.rmtree(w.config.data_dir / "consumequeue")
        for name in ("checkpoint", "checkpoint.prev"):
            (w.config.data_dir / name).unlink(missing_ok=True)
        Store.open(config).close()
    report = check_store(w.config)
    assert not report.damaged, report.to_json()
    assert repair_store(w.config).repaired is False


def test_a_store_in_use_is_refused(pristine: dict[str, Written], tmp_path: Path) -> None:
    w = _copy(pristine, "commitlog", tmp_path / "s")
    with Store.open(w.config):
        with pytest.raises(StoreLockedError):
            check_store(w.config)
        done = _clmq("store", "check", str(w.config.data_dir))
        assert done.returncode == 2 and "in use" in done.stdout


def test_usage_errors_exit_2(tmp_path: Path) -> None:
    assert _clmq("store", "check", str(tmp_path / "nowhere")).returncode == 2
    assert _clmq("store", "frobnicate", str(tmp_path)).returncode == 2


# ------------------------------------------------------------ damage kinds
def _in(w: Written, lo: int, hi: int) -> dict[tuple[str, int], list[int]]:
    """Messages whose records start in log offsets [lo, hi), per queue."""
    out: dict[tuple[str, int], list[int]] = {}
    for (t, q, o), (off, _size) in sorted(w.places.items()):
        if lo <= off < hi:
            out.setdefault((t, q), []).append(o)
    return out


def _affected(entry: dict) -> dict[tuple[str, int], tuple[int, int, int]]:  # type: ignore[type-arg]
    return {(a["topic"], a["queue"]): (a["first"], a["last"], a["count"]) for a in entry["affected"]}


def test_truncated_middle_segment(pristine: dict[str, Written], tmp_path: Path) -> None:
    w = _copy(pristine, "commitlog", tmp_path / "s")
    seg = _segments(w)[2]
    base = int(seg.name[:20])
    os.truncate(seg, 20_000)
    done = _clmq("store", "check", "--json", str(w.config.data_dir))
    assert done.returncode == 1
    report = json.loads(done.stdout)
    gap = [d for d in report["damage"] if "shorter than its successor" in d["reason"]]
    assert len(gap) == 1
    nxt = int(_segments(w)[3].name[:20])
    torn = [d for d in report["damage"] if d["start"] < gap[0]["start"]]
    start = torn[0]["start"] if torn else gap[0]["start"]
    assert gap[0]["end"] == nxt and gap[0]["file"] == str(seg)
    cut = base + 20_000
    assert start == max(
        (off + size for off, size in w.places.values() if base <= off and off + size <= cut), default=base
    )
    lost = _in(w, start, nxt)
    got: dict[tuple[str, int], list[int]] = {}
    for d in report["damage"]:
        for key, (a, b, n) in _affected(d).items():
            got.setdefault(key, []).extend(range(a, b + 1))
            assert n == b - a + 1
    assert {k: sorted(v) for k, v in got.items()} == lost


def test_flipped_byte_names_its_record_and_message(pristine: dict[str, Written], tmp_path: Path) -> None:
    w = _copy(pristine, "commitlog", tmp_path / "s")
    key = ("t", 1, 150)
    off, size = w.places[key]
    seg = next(s for s in reversed(_segments(w)) if int(s.name[:20]) <= off)
    _flip(seg, off - int(seg.name[:20]) + size // 2)
    report = check_store(w.config).to_json()
    assert [(d["start"], d["end"]) for d in report["damage"]] == [(off, off + size)]
    assert "crc32c" in report["damage"][0]["reason"]
    assert _affected(report["damage"][0]) == {("t", 1): (150, 150, 1)}
    # a cut there drops this message and everything after it in every queue
    drops = {(r["topic"], r["queue"]): (r["first"], r["last"]) for r in report["would_drop"]}
    for (t, q), (first, last) in drops.items():
        assert last == max(o for (tt, qq, o) in w.bodies if (tt, qq) == (t, q))
        assert first == min(o for (tt, qq, o), (p, _s) in w.places.items() if (tt, qq) == (t, q) and p >= off)


def _flip(path: Path, pos: int) -> None:
    data = bytearray(path.read_bytes())
    data[pos] ^= 0xFF
    path.write_bytes(bytes(data))


QUEUE_DAMAGES = {  # damage to u/0's second file (offsets 100..199) -> offsets reported
    "zeroed": (lambda data: data[:200] + bytes(100) + data[300:], (110, 114)),
    "swapped": (lambda data: data[:200] + data[220:240] + data[200:220] + data[240:], (110, 111)),
    "short": (lambda data: data[:1000], (100, 149)),
    "torn": (lambda data: data[:1010], (100, 150)),
}


@pytest.mark.parametrize("kind", sorted(QUEUE_DAMAGES))
def test_damaged_queue_file(pristine: dict[str, Written], kind: str, tmp_path: Path) -> None:
    w = _copy(pristine, "commitlog", tmp_path / "s")
    qfile = w.config.data_dir / "consumequeue" / "u" / "0" / f"{100:020d}"
    damage, (first, last) = QUEUE_DAMAGES[kind]
    qfile.write_bytes(damage(qfile.read_bytes()))
    report = check_store(w.config)
    assert report.damaged and not report.log_damaged
    found = {(q.topic, q.queue_id, q.first, q.last) for q in report.queue_problems}
    assert ("u", 0, first, last) in found, found
    assert all(q.topic == "u" and q.queue_id == 0 for q in report.queue_problems)
    assert repair_store(w.config).dropped == []  # the log holds every message: queues are rebuilt
    with Store.open(w.config) as store:
        _assert_readable_except(store, w, [])


@pytest.mark.parametrize("mode", MODES)
def test_shortened_newest_segment(pristine: dict[str, Written], mode: str, tmp_path: Path) -> None:
    w = _copy(pristine, mode, tmp_path / "s")
    seg = _segments(w)[-1]
    size = seg.stat().st_size
    os.truncate(seg, size - 30)
    report = check_store(w.config)
    assert report.log_damaged
    reasons = " ".join(d.problem.reason for d in report.damage)
    assert "torn record" in reasons
    assert "durable offset" in reasons or "recovery point" in reasons
    drops = [(r.topic, r.queue_id, r.first, r.last, r.count) for r in report.would_drop]
    topic, qid = ("t", 1) if mode != "commitlog" else max(w.places, key=lambda k: w.places[k][0])[:2]
    last = max(o for (t, q, o) in w.bodies if (t, q) == (topic, qid))
    assert drops == [(topic, qid, last, last, 1)]


def test_topics_file_damaged_with_a_good_previous_generation(pristine: dict[str, Written], tmp_path: Path) -> None:
    w = _copy(pristine, "commitlog", tmp_path / "s")
    TopicTable(w.config.data_dir / "topics.json").replace({"t": 2, "u": 1})  # both generations complete
    _flip(w.config.data_dir / "topics.json", 5)
    report = check_store(w.config)
    assert [m.state for m in report.metadata if m.file.endswith("topics.json")] == ["previous"]
    assert repair_store(w.config).dropped == []
    assert [m.state for m in check_store(w.config).metadata if m.file.endswith("topics.json")] == ["ok"]
    with Store.open(w.config) as store:
        assert store.topics.all() == {"t": 2, "u": 1}


def test_damaged_topics_file(pristine: dict[str, Written], tmp_path: Path) -> None:
    w = _copy(pristine, "commitlog", tmp_path / "s")
    (w.config.data_dir / "topics.json").write_bytes(b'{"crc32c":"00000000","version":1,"topics":{}}')
    (w.config.data_dir / "topics.json.prev").unlink(missing_ok=True)
    report = check_store(w.config)
    assert report.damaged and not report.log_damaged
    assert [m.state for m in report.metadata if m.file.endswith("topics.json")] == ["damaged"]
    repaired = repair_store(w.config)
    assert repaired.repaired and repaired.dropped == []
    with Store.open(w.config) as store:
        assert store.topics.all() == {"t": 2, "u": 1}
        _assert_readable_except(store, w, [])


@pytest.mark.parametrize("mode", MODES)
def test_topics_file_lacking_queues_on_disk(pristine: dict[str, Written], mode: str, tmp_path: Path) -> None:
    w = _copy(pristine, mode, tmp_path / "s")
    TopicTable(w.config.data_dir / "topics.json").replace({"t": 1})  # a valid file that lost t/1 and u
    report = check_store(w.config)
    assert [m.state for m in report.metadata if m.file.endswith("topics.json")] == ["incomplete"]
    assert report.damaged and not report.log_damaged
    assert repair_store(w.config).dropped == []
    with Store.open(w.config) as store:
        assert store.topics.all() == {"t": 2, "u": 1}
        _assert_readable_except(store, w, [])


def _padding(seg: Path) -> int:
    """Bytes after a sealed segment's blank marker."""
    data = seg.read_bytes()
    return len(data) - (data.rfind(BLANK_MAGIC.to_bytes(4, "little")) - 4 + BLANK_SIZE)


@pytest.mark.parametrize("change", [-1, +3000])
def test_padding_of_a_sealed_segment_is_restored_without_loss(
    pristine: dict[str, Written], change: int, tmp_path: Path
) -> None:
    """A middle segment shorter or longer than its successor's base says, but only in the
    padding after its blank marker: reported, and repaired without dropping anything."""
    w = _copy(pristine, "commitlog", tmp_path / "s")
    segs = _segments(w)
    seg = max(segs[:-1], key=_padding)  # the middle segment with the most padding after its marker
    size, padding = seg.stat().st_size, _padding(seg)
    change = change if change > 0 else -(padding // 2)
    assert padding >= 2
    os.truncate(seg, size + change)
    report = check_store(w.config)
    base = int(seg.name[:20])
    lo, hi = sorted((size, size + change))
    assert [(d.problem.start, d.problem.end) for d in report.damage] == [(base + lo, base + hi)]
    assert "no record lost" in report.damage[0].problem.reason and report.would_drop == []
    repaired = repair_store(w.config)
    assert repaired.repaired and repaired.dropped == [] and seg.stat().st_size == size
    with Store.open(w.config) as store:
        _assert_readable_except(store, w, [])


@pytest.mark.parametrize("mode", MODES)
def test_damaged_index_file(pristine: dict[str, Written], mode: str, tmp_path: Path) -> None:
    w = _copy(pristine, mode, tmp_path / "s")
    index = _segments(w)[0].with_suffix(".bidx" if mode == "commitlog" else ".index")
    _flip(index, index.stat().st_size // 2)
    report = check_store(w.config)
    assert [p.file for p in report.index_problems] == [str(index)]
    assert report.damaged and not report.log_damaged
    assert repair_store(w.config).dropped == []
    with Store.open(w.config) as store:
        _assert_readable_except(store, w, [])
    assert not check_store(w.config).damaged


# ------------------------------------------------------------------ repair
def _assert_readable_except(store: Store, w: Written, dropped: list[tuple[str, int, int, int]]) -> None:
    """Every message not in ``dropped`` reads back with its body; the dropped ones are
    exactly the missing ones."""
    gone = {(t, q, o) for t, q, a, b in dropped for o in range(a, b + 1)}
    read = {(t, q, r.queue_offset): r.body for t, q in QUEUES for r in _read_queue(store, t, q)}
    assert read == {k: v for k, v in w.bodies.items() if k not in gone}
    assert gone <= set(w.bodies)


DAMAGES = ("truncate-middle", "flip-byte", "shorten-newest", "cut-newest-at-a-record", "delete-middle")


def _damage(w: Written, kind: str) -> None:
    segs = _segments(w)
    if kind == "truncate-middle":
        os.truncate(segs[1], 9_000)
    elif kind == "flip-byte":
        _flip(segs[1], 5_000)
    elif kind == "shorten-newest":
        os.truncate(segs[-1], segs[-1].stat().st_size - 50)
    elif kind == "cut-newest-at-a-record":  # whole records only: the end is below what was promised
        if w.config.storage_mode == "commitlog":
            off = max(off for off, _size in w.places.values())
            os.truncate(segs[-1], off - int(segs[-1].name[:20]))
        else:  # t-1's last record, at its position in the partition's last segment
            os.truncate(segs[-1], w.places[max(k for k in w.places if k[:2] == ("t", 1))][0])
    else:
        segs[1].unlink()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", DAMAGES)
def test_repair_drops_exactly_what_it_lists(pristine: dict[str, Written], mode: str, kind: str, tmp_path: Path) -> None:
    w = _copy(pristine, mode, tmp_path / "s")
    _damage(w, kind)
    if kind != "flip-byte":  # log bytes that were promised are gone: the store will not open
        with pytest.raises(LogDamageError):
            Store.open(w.config)
    if kind == "flip-byte" and mode == "commitlog":
        done = _clmq("store", "repair", "--yes", "--json", str(w.config.data_dir))
        assert done.returncode == 0, done.stdout + done.stderr
        report = json.loads(done.stdout)
        assert report["repaired"]
        dropped = [(r["topic"], r["queue"], r["first"], r["last"]) for r in report["dropped"]]
        assert all(r["count"] == r["last"] - r["first"] + 1 for r in report["dropped"])
    else:
        report_obj = repair_store(w.config)
        assert report_obj.repaired
        dropped = [(r.topic, r.queue_id, r.first, r.last) for r in report_obj.dropped]
    assert dropped, "this damage costs messages"
    assert not check_store(w.config).log_damaged
    with Store.open(w.config) as store:
        _assert_readable_except(store, w, dropped)


def test_repair_asks_first(pristine: dict[str, Written], tmp_path: Path) -> None:
    w = _copy(pristine, "commitlog", tmp_path / "s")
    _damage(w, "flip-byte")
    done = subprocess.run(
        [sys.executable, "-m", "clmq", "store", "repair", str(w.config.data_dir)],
        input="n\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and "nothing changed" in done.stdout
    assert check_store(w.config).log_damaged


# -------------------------------------------------------------- hypothesis
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pick=st.integers(min_value=0, max_value=COUNT - 1), at=st.floats(min_value=0, max_value=0.999))
def test_any_flipped_byte_is_found_where_it_is(
    pristine: dict[str, Written], tmp_path_factory: pytest.TempPathFactory, pick: int, at: float
) -> None:
    w = _copy(pristine, "commitlog", tmp_path_factory.mktemp("h") / "s")
    key = sorted(w.places)[pick]
    off, size = w.places[key]
    pos = off + int(at * size)
    seg = next(s for s in reversed(_segments(w)) if int(s.name[:20]) <= off)
    _flip(seg, pos - int(seg.name[:20]))
    report = check_store(w.config)
    hits = [d for d in report.damage if d.problem.start <= pos < d.problem.end]
    assert hits and hits[0].problem.start == off
    assert (key[0], key[1]) in {(r.topic, r.queue_id) for r in hits[0].affected}

"""Metadata files (topics, consumer offsets, the checkpoint, partition mode's recovery
points): written atomically with a checksum, keeping the previous generation; read
back from the current file, else the previous one, else the caller is told. A damaged
metadata file never reads as "empty".

Each file kind meets each damage (truncate, extend with zeros, flip a byte, delete,
replace with another metadata file's content) at Hypothesis-chosen positions, first
on the file alone, then through the real ``Store.open`` of both storage modes.
"""

from __future__ import annotations

import errno
import json
import logging
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clmq.broker.service._offsets import ConsumerOffsets
from clmq.broker.store import STORAGE_MODES, GetStatus, Store, TopicTable, read_json, write_json
from clmq.broker.store._checkpoint import Checkpoint
from clmq.commitlog import MetadataSource, delete_json, load_json, previous_path
from clmq.common import Message, MetadataError

from .conftest import small_config
from .faults import SHORT, Fault, inject

DAMAGES = ["truncate", "zeros", "flip", "delete", "replace"]
FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def damage(path: Path, how: str, where: int, other: Path) -> None:
    """Damage ``path``: ``where`` chooses the position (modulo the size) and, for a
    flip, the bit pattern; ``other`` is the file whose content replaces it."""
    data = path.read_bytes()
    if how == "truncate":
        path.write_bytes(data[: where % len(data)])
    elif how == "zeros":
        path.write_bytes(data + bytes(1 + where % 64))
    elif how == "flip":
        buf = bytearray(data)
        buf[where % len(buf)] ^= 1 + (where // len(buf)) % 255
        path.write_bytes(bytes(buf))
    elif how == "delete":
        path.unlink()
    elif how == "replace":
        path.write_bytes(other.read_bytes())
    else:
        raise AssertionError(how)


# ------------------------------------------------------------------ file kinds
# Each kind: write two generations in ``d``, return (path, value of the older one,
# load -> the value as its owner reads it).
TOPICS_OLD, TOPICS_NEW = {"a": 3}, {"a": 3, "b": 2}
OFFSETS_OLD = {("g", "a", 0): 5, ("g", "a", 1): 7}


def _topics(d: Path) -> tuple[Path, Any, Callable[[Path], Any]]:
    table = TopicTable(d / "topics.json")
    table.create("a", 3)
    table.create("b", 2)
    return d / "topics.json", TOPICS_OLD, lambda p: TopicTable(p).all()


def _checkpoint(d: Path) -> tuple[Path, Any, Callable[[Path], Any]]:
    old = Checkpoint(100, 90, {("a", 0): (0, 4)})
    old.save(d / "checkpoint")
    Checkpoint(200, 190, {("a", 0): (0, 9), ("b", 1): (0, 2)}).save(d / "checkpoint")

    def load(p: Path) -> Any:
        cp = Checkpoint.load(p)
        return cp and (cp.log_durable, cp.dispatched, cp.queues, cp.from_previous)

    return d / "checkpoint", (100, 90, {("a", 0): (0, 4)}, True), load


def _offsets(d: Path) -> tuple[Path, Any, Callable[[Path], Any]]:
    offsets = ConsumerOffsets(d / "consumer_offsets.json")
    for (g, t, q), o in OFFSETS_OLD.items():
        offsets.commit(g, t, q, o)
    assert offsets.flush()
    offsets.commit("g", "b", 0, 11)
    assert offsets.flush()
    return d / "consumer_offsets.json", OFFSETS_OLD, lambda p: ConsumerOffsets(p).all()


def _points(d: Path) -> tuple[Path, Any, Callable[[Path], Any]]:
    old = {"version": 1, "points": [["a", 0, 4]]}
    write_json(d / "recovery-points", old)
    write_json(d / "recovery-points", {"version": 1, "points": [["a", 0, 9], ["b", 1, 2]]})
    return d / "recovery-points", old, read_json


KINDS = {"topics": _topics, "checkpoint": _checkpoint, "offsets": _offsets, "recovery-points": _points}


def _other(d: Path, kind: str) -> Path:
    """Another metadata file's content, written as its owner writes it."""
    other_kind = "checkpoint" if kind == "topics" else "topics"
    sub = d / "other"
    sub.mkdir(exist_ok=True)
    return KINDS[other_kind](sub)[0]


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("byte", [b"}", b" ", b"]"])
def test_a_damaged_separator_after_the_checksum_is_seen(tmp_path: Path, kind: str, byte: bytes) -> None:
    # Found by the property below: '{"crc32c":"..."}"version":1,...}' (the ',' after the
    # checksum, which it does not cover, flipped to '}') was read as the current file.
    path, older, load = KINDS[kind](tmp_path)
    data = path.read_bytes()
    at = data.index(b'",') + 1
    path.write_bytes(data[:at] + byte + data[at + 1 :])
    loaded = load_json(path)
    assert loaded.source is MetadataSource.PREVIOUS and loaded.problems, loaded
    assert load(path) == older


@pytest.mark.parametrize("kind", list(KINDS))
@FAST
@given(how=st.sampled_from(DAMAGES), where=st.integers(0, 1 << 20))
def test_damaged_current_file_falls_back_to_the_previous_generation(
    tmp_path_factory: pytest.TempPathFactory, kind: str, how: str, where: int
) -> None:
    d = tmp_path_factory.mktemp(kind)
    path, older, load = KINDS[kind](d)
    damage(path, how, where, _other(d, kind))
    loaded = load_json(path)
    assert loaded.source is MetadataSource.PREVIOUS, loaded
    assert loaded.problems and loaded.path == path
    assert load(path) == older


@pytest.mark.parametrize("kind", list(KINDS))
@FAST
@given(how=st.sampled_from(DAMAGES), how_prev=st.sampled_from(DAMAGES[:3] + ["replace"]), where=st.integers(0, 1 << 20))
def test_both_generations_damaged_is_never_read_as_empty(
    tmp_path_factory: pytest.TempPathFactory, kind: str, how: str, how_prev: str, where: int
) -> None:
    d = tmp_path_factory.mktemp(kind)
    path, _older, load = KINDS[kind](d)
    other = _other(d, kind)
    damage(path, how, where, other)
    damage(previous_path(path), how_prev, where // 7, other)
    loaded = load_json(path)
    assert loaded.source is MetadataSource.DAMAGED and loaded.value is None, loaded
    assert len(loaded.problems) == 2, loaded.problems
    assert read_json(path) is None
    if kind == "offsets":
        with pytest.raises(MetadataError) as refused:
            load(path)
        assert str(path) in str(refused.value) and str(previous_path(path)) in str(refused.value)
        assert "delete" in str(refused.value)
    elif kind == "checkpoint":
        assert load(path) is None  # an unclean open: full recovery
    elif kind == "topics":
        table = TopicTable(path)
        assert table.all() == {} and table.source is MetadataSource.DAMAGED  # nothing on disk to rebuild from


def test_both_generations_missing_is_a_new_store(tmp_path: Path) -> None:
    loaded = load_json(tmp_path / "topics.json")
    assert loaded.source is MetadataSource.MISSING and loaded.value is None and not loaded.problems
    assert TopicTable(tmp_path / "topics.json").all() == {}
    assert ConsumerOffsets(tmp_path / "consumer_offsets.json").groups() == []
    assert Checkpoint.load(tmp_path / "checkpoint") is None


@pytest.mark.parametrize("kind", list(KINDS))
def test_good_current_file_is_read_and_previous_generation_kept(tmp_path: Path, kind: str) -> None:
    path, older, load = KINDS[kind](tmp_path)
    loaded = load_json(path)
    assert loaded.source is MetadataSource.CURRENT and not loaded.problems
    assert load_json(previous_path(path)).source is MetadataSource.CURRENT  # the .prev alone is good too
    assert load(path) != older
    assert not path.with_name(path.name + ".tmp").exists()


def test_files_of_earlier_versions_still_load(tmp_path: Path) -> None:
    (tmp_path / "topics.json").write_text('{"version":1,"topics":{"a":3,"b":2}}')
    (tmp_path / "consumer_offsets.json").write_text('{"version":1,"offsets":[["g","a",0,5]]}')
    (tmp_path / "checkpoint").write_text('{"version":1,"log_durable":10,"dispatched":9,"queues":[["a",0,0,4]]}')
    assert TopicTable(tmp_path / "topics.json").all() == {"a": 3, "b": 2}
    assert ConsumerOffsets(tmp_path / "consumer_offsets.json").query("g", "a", 0) == 5
    cp = Checkpoint.load(tmp_path / "checkpoint")
    assert cp is not None and (cp.log_durable, cp.queues, cp.from_previous) == (10, {("a", 0): (0, 4)}, False)
    assert load_json(tmp_path / "topics.json").source is MetadataSource.CURRENT
    # the next write uses the checked format; the old file becomes the previous generation
    TopicTable(tmp_path / "topics.json").create("c", 1)
    assert json.loads((tmp_path / "topics.json.prev").read_text())["topics"] == {"a": 3, "b": 2}
    assert TopicTable(tmp_path / "topics.json").all() == {"a": 3, "b": 2, "c": 1}


def test_files_stay_json_objects_with_their_fields(tmp_path: Path) -> None:
    """Readers outside the store (the Spark connector, jq) still find every field."""
    Checkpoint(100, 90, {("a", 0): (0, 4)}).save(tmp_path / "checkpoint")
    doc = json.loads((tmp_path / "checkpoint").read_text())
    assert doc["log_durable"] == 100 and doc["dispatched"] == 90 and "crc32c" in doc


def test_damaged_legacy_file_is_noticed(tmp_path: Path) -> None:
    (tmp_path / "topics.json").write_text('{"version":1,"topics":{"a":3}')  # cut short: not JSON
    loaded = load_json(tmp_path / "topics.json")
    assert loaded.source is MetadataSource.DAMAGED and "JSON" in loaded.problems[0]


def test_a_warning_names_the_file_and_the_damage(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path, _older, _load = _topics(tmp_path)
    damage(path, "truncate", 10, path)
    with caplog.at_level(logging.WARNING):
        assert TopicTable(path).all() == TOPICS_OLD
    assert any(str(path) in r.getMessage() and "previous generation" in r.getMessage() for r in caplog.records)


def test_a_damaged_current_file_is_not_rotated_over_the_good_previous_one(tmp_path: Path) -> None:
    path, _older, _load = _topics(tmp_path)
    damage(path, "flip", 5, path)
    table = TopicTable(path)  # reads the previous generation ({"a": 3})
    table.create("c", 1)  # the damaged file is replaced, the good .prev kept
    assert load_json(previous_path(path)).value["topics"] == TOPICS_OLD
    assert TopicTable(path).all() == {"a": 3, "c": 1}


def test_topic_table_replace(tmp_path: Path) -> None:
    table = TopicTable(tmp_path / "topics.json")
    table.create("a", 3)
    table.replace({"x": 2, "y": 5})
    assert table.all() == {"x": 2, "y": 5} == TopicTable(tmp_path / "topics.json").all()
    with pytest.raises(ValueError):
        table.replace({"bad/name": 1})
    with pytest.raises(ValueError):
        table.replace({"x": 0})
    assert table.all() == {"x": 2, "y": 5}


# --------------------------------------------------------------- crash safety
def test_crash_between_the_renames_leaves_the_newest_good_copy(tmp_path: Path) -> None:
    path, _older, _load = _topics(tmp_path)
    path.rename(previous_path(path))  # the first rename happened, the second did not
    loaded = load_json(path)
    assert loaded.source is MetadataSource.PREVIOUS and loaded.value["topics"] == TOPICS_NEW
    assert TopicTable(path).all() == TOPICS_NEW


@pytest.mark.parametrize(
    "fault",
    [
        Fault("fsync", errno.EIO, path="topics.json.tmp"),
        Fault("write", errno.ENOSPC, path="topics.json.tmp"),
        Fault("write", errno.EIO, path="topics.json.tmp", after=0, times=None),
    ],
    ids=["fsync-EIO", "write-ENOSPC", "write-EIO-always"],
)
def test_a_failed_write_leaves_the_previous_content_readable(tmp_path: Path, fault: Fault) -> None:
    path, _older, _load = _topics(tmp_path)
    table = TopicTable(path)
    with inject(fault) as faults, pytest.raises(OSError):
        table.create("c", 1)
    assert faults.fired
    assert table.all() == TOPICS_NEW  # nothing half-done in memory either
    loaded = load_json(path)
    assert loaded.source is MetadataSource.CURRENT and loaded.value["topics"] == TOPICS_NEW
    assert not path.with_name(path.name + ".tmp").exists()
    table.create("c", 1)  # and the next write works
    assert TopicTable(path).all() == {**TOPICS_NEW, "c": 1}


def test_a_short_write_is_finished(tmp_path: Path) -> None:
    path, _older, _load = _topics(tmp_path)
    with inject(Fault("write", SHORT, path="topics.json.tmp")) as faults:
        TopicTable(path).create("c", 1)
    assert faults.fired and TopicTable(path).all() == {**TOPICS_NEW, "c": 1}


def test_a_failed_directory_fsync_is_reported(tmp_path: Path) -> None:
    path, _older, _load = _topics(tmp_path)
    with inject(Fault("fsync", errno.EIO, path=str(tmp_path), after=1)) as faults, pytest.raises(OSError):
        TopicTable(path).create("c", 1)  # fsync 1: the temporary file; fsync 2: the directory
    assert faults.fired
    assert TopicTable(path).all() in (TOPICS_NEW, {**TOPICS_NEW, "c": 1})  # old or new, never neither


def test_offsets_flush_failure_keeps_them_dirty(tmp_path: Path) -> None:
    offsets = ConsumerOffsets(tmp_path / "consumer_offsets.json")
    offsets.commit("g", "a", 0, 5)
    with inject(Fault("fsync", errno.EIO, path="consumer_offsets")), pytest.raises(OSError):
        offsets.flush()
    assert offsets.flush()  # tried again
    assert ConsumerOffsets(tmp_path / "consumer_offsets.json").query("g", "a", 0) == 5


# ------------------------------------------------------- through Store.open
STORE_TOPICS = {"alpha": 3, "beta": 2}


def _write_store(d: Path, mode: str) -> dict[tuple[str, int], list[bytes]]:
    """Two topics created one after the other (so the previous topics.json lacks the
    second), a message in every queue, a clean close."""
    sent: dict[tuple[str, int], list[bytes]] = {}
    store = Store.open(small_config(d, mode=mode)).start()
    for topic, count in STORE_TOPICS.items():
        store.create_topic(topic, count)
    for i in range(40):
        topic = "alpha" if i % 2 else "beta"
        qid = (i // 2) % STORE_TOPICS[topic]
        body = b"m%04d" % i
        assert store.put(Message(topic, qid, body), wait_durable=True).ok
        sent.setdefault((topic, qid), []).append(body)
    store.close()
    return sent


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[tuple[str, int], list[bytes]]]]:
    out = {}
    for mode in STORAGE_MODES:
        d = tmp_path_factory.mktemp(f"pristine-{mode}") / "store"
        out[mode] = (d, _write_store(d, mode))
    return out


def _reopen_and_check(d: Path, mode: str, sent: dict[tuple[str, int], list[bytes]]) -> None:
    with Store.open(small_config(d, mode=mode)) as store:
        assert store.topics.all() == STORE_TOPICS  # topics never vanish
        for (topic, qid), bodies in sent.items():
            got = store.get(topic, qid, 0, 100)
            assert got.status is GetStatus.FOUND, (topic, qid, got)
            assert [r.body for r in got.messages] == bodies
    assert TopicTable(d / "topics.json").all() == STORE_TOPICS  # and the table on disk is whole again


def _store_files(mode: str) -> list[str]:
    return ["topics.json", "checkpoint" if mode == "commitlog" else "recovery-points"]


@pytest.mark.parametrize("mode", STORAGE_MODES)
@pytest.mark.parametrize("both", [False, True], ids=["current", "both-generations"])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(how=st.sampled_from(DAMAGES), which=st.integers(0, 1), where=st.integers(0, 1 << 20))
def test_store_opens_whole_after_metadata_damage(
    pristine: dict[str, tuple[Path, dict[tuple[str, int], list[bytes]]]],
    tmp_path_factory: pytest.TempPathFactory,
    mode: str,
    both: bool,
    how: str,
    which: int,
    where: int,
) -> None:
    """Topics come from the previous generation plus what is on disk, or are rebuilt
    from the queue/partition directories and the checkpoint; a damaged checkpoint or
    recovery points file falls back or makes the open a full recovery. Every message
    stays readable."""
    src, sent = pristine[mode]
    d = tmp_path_factory.mktemp("store") / "store"
    shutil.copytree(src, d)
    names = _store_files(mode)
    victim, other = d / names[which], d / names[1 - which]
    assert previous_path(victim).exists()
    damage(victim, how, where, other)
    if both:
        damage(previous_path(victim), "flip" if how == "delete" else how, where // 3, other)
    expected = MetadataSource.DAMAGED if both else MetadataSource.PREVIOUS
    assert load_json(victim).source is expected
    _reopen_and_check(d, mode, sent)


@pytest.mark.parametrize("mode", STORAGE_MODES)
def test_topics_rebuilt_when_every_metadata_file_is_gone(
    pristine: dict[str, tuple[Path, dict[tuple[str, int], list[bytes]]]],
    tmp_path: Path,
    mode: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    src, sent = pristine[mode]
    d = tmp_path / "store"
    shutil.copytree(src, d)
    for name in _store_files(mode):
        delete_json(d / name)
    table = TopicTable(d / "topics.json")
    assert table.source is MetadataSource.MISSING and table.reconstructed == STORE_TOPICS
    delete_json(d / "topics.json")  # again: the table just rewrote it
    with caplog.at_level(logging.WARNING):
        _reopen_and_check(d, mode, sent)
    assert any("2 topic(s) with 5 queue(s) reconstructed" in r.getMessage() for r in caplog.records), caplog.text


def test_checkpoint_from_previous_generation_is_marked(
    pristine: dict[str, tuple[Path, dict[tuple[str, int], list[bytes]]]], tmp_path: Path
) -> None:
    src, sent = pristine["commitlog"]
    d = tmp_path / "store"
    shutil.copytree(src, d)
    damage(d / "checkpoint", "flip", 3, d)
    cp = Checkpoint.load(d / "checkpoint")
    assert cp is not None and cp.from_previous
    assert cp == Checkpoint(cp.log_durable, cp.dispatched, cp.queues)  # the mark is not part of the content
    _reopen_and_check(d, "commitlog", sent)


# ------------------------------------------------------------ the operator
def test_broker_refuses_to_start_on_damaged_offsets_and_says_why(tmp_path: Path) -> None:
    data = tmp_path / "data"
    path, _older, _load = _offsets(tmp_path)
    data.mkdir()
    for p in (path, previous_path(path)):
        damage(p, "flip", 20, p)
        shutil.move(p, data / p.name)
    out = subprocess.run(
        [sys.executable, "-m", "clmq", "broker", "--data-dir", str(data), "--listen-port", "0"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={"COLUMNS": "400", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    assert out.returncode == 1, out.stdout + out.stderr
    text = " ".join(out.stderr.split())
    assert "consumer_offsets.json" in text and "consumer_offsets.json.prev" in text and "delete" in text, text
    # The store it had opened was closed cleanly: no unclean-stop marker left behind.
    assert not (data / "abort").exists(), "the refused start left the store open (abort marker)"


def test_a_deleted_metadata_file_stays_deleted(tmp_path: Path) -> None:
    """Removing a file no longer needed removes its previous generation too: it must
    not come back at the next load (as a deleted current file with a good .prev does)."""
    path, _older, _load = _points(tmp_path)
    delete_json(path)
    assert load_json(path).source is MetadataSource.MISSING
    assert not list(tmp_path.glob("recovery-points*"))


def test_committed_offsets_past_a_cut_log_move_back_at_start(tmp_path: Path) -> None:
    """A repair (or a follower's truncation) cuts the log: a group committed past the new
    end would skip the new messages that take the dropped offsets. The broker moves it
    back to the end at start, and leaves offsets inside the queue alone."""
    from clmq.broker.service import Broker, BrokerConfig
    from clmq.broker.service._offsets import ConsumerOffsets

    data = tmp_path / "data"
    cfg = BrokerConfig(data_dir=str(data))
    with Store.open(cfg.store_config()) as s:
        s.create_topic("t", 1)
        res = s.put_batch([Message("t", 0, b"m%d" % i) for i in range(10)])
        s.catch_up()
        s.truncate(res.commitlog_offsets[6])  # queue offsets 6.. are gone
    offsets = ConsumerOffsets(data / "consumer_offsets.json")
    offsets.commit("ahead", "t", 0, 10)
    offsets.commit("inside", "t", 0, 3)
    offsets.commit("gone", "nosuch", 0, 7)
    offsets.flush()

    async def start() -> None:
        store = Store.open(cfg.store_config()).start()
        try:
            broker = Broker(cfg, store, trio.lowlevel.current_trio_token())
            assert broker.offsets.query("ahead", "t", 0) == 6
            assert broker.offsets.query("inside", "t", 0) == 3
            assert broker.offsets.query("gone", "nosuch", 0) == 7
        finally:
            store.close()

    trio.run(start)


@given(
    st.dictionaries(
        st.tuples(
            st.sampled_from(["g", "h", "grp/2"]), st.sampled_from(["a", "b", "%RETRY%g"]), st.integers(0, 70_000)
        ),
        st.integers(0, 2**63 - 1),
        max_size=200,
    )
)
@settings(max_examples=60, deadline=None)
def test_committed_offsets_survive_a_flush_and_a_restart(offsets: dict[tuple[str, str, int], int]) -> None:
    """Version 2 (a row per group and topic) reads back every committed offset, and the
    file written before it (version 1) is still read."""
    with tempfile.TemporaryDirectory() as d:
        _offsets_round_trip(Path(d), offsets)


def _offsets_round_trip(tmp_path: Path, offsets: dict[tuple[str, str, int], int]) -> None:
    path = tmp_path / "consumer_offsets.json"
    written = ConsumerOffsets(path)
    for (g, t, q), o in offsets.items():
        written.commit(g, t, q, o)
    written.flush()
    again = ConsumerOffsets(path)
    assert all(again.query(g, t, q) == o for (g, t, q), o in offsets.items())
    assert again.groups() == sorted({g for g, _t, _q in offsets})
    for g in again.groups():
        assert again.of_group(g) == {(t, q): o for (gg, t, q), o in offsets.items() if gg == g}
    if offsets:
        assert json.loads(path.read_text())["version"] == 2
    v1 = tmp_path / f"v1-{path.name}"
    v1.write_text(json.dumps({"version": 1, "offsets": [[g, t, q, o] for (g, t, q), o in offsets.items()]}))
    old = ConsumerOffsets(v1)
    assert all(old.query(g, t, q) == o for (g, t, q), o in offsets.items())


def test_an_offsets_row_of_unequal_lists_is_damage(tmp_path: Path) -> None:
    path = tmp_path / "consumer_offsets.json"
    path.write_text('{"version":2,"offsets":[["g","a",[0,1],[5]]]}')
    with pytest.raises(MetadataError, match="consumer offsets"):
        ConsumerOffsets(path)


# ------------------------------------------------------------ going back to a version-1 broker
def _clmq(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "clmq", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={"COLUMNS": "400", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )


def test_offsets_written_as_version_2_convert_back_to_version_1(tmp_path: Path) -> None:
    """After two flushes both generations are version 2, which a broker from before
    issue 34 cannot read: ``clmq store offsets --write-v1`` rewrites both as version 1,
    read back (by the version-1 reader a previous release has) as the same offsets."""
    from clmq.broker.service._offsets import _rows_v1

    data = tmp_path / "data"
    data.mkdir()
    path, _old, load = _offsets(data)
    want = load(path)
    assert [load_json(p).value["version"] for p in (path, previous_path(path))] == [2, 2]
    out = _clmq("store", "offsets", "--write-v1", str(data), cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    for p in (path, previous_path(path)):
        value = load_json(p).value
        assert value["version"] == 1 and _rows_v1(value) == want, p
    assert ConsumerOffsets(path).all() == want  # and this broker still reads it
    assert "version 1" in " ".join(out.stdout.split())


def test_offsets_are_not_converted_while_a_broker_holds_the_store(tmp_path: Path) -> None:
    import fcntl
    import os

    data = tmp_path / "data"
    data.mkdir()
    path, _old, _load = _offsets(data)
    fd = os.open(data / "lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        out = _clmq("store", "offsets", "--write-v1", str(data), cwd=tmp_path)
    finally:
        os.close(fd)
    assert out.returncode == 2 and "stop the broker" in " ".join(out.stdout.split()), out.stdout + out.stderr
    assert load_json(path).value["version"] == 2


def test_an_offsets_file_of_a_newer_version_is_named_so_not_damage(tmp_path: Path) -> None:
    path = tmp_path / "consumer_offsets.json"
    write_json(path, {"version": 3, "offsets": {"something": "new"}})
    write_json(path, {"version": 3, "offsets": {"something": "new"}})
    with pytest.raises(MetadataError, match=r"written by a newer broker \(version 3\)") as info:
        ConsumerOffsets(path)
    assert "damaged" not in str(info.value) and "delete" not in str(info.value)

"""The key index through the command line: ``clmq store check`` names a damaged index
file (file, byte, expected, found), ``clmq store repair`` deletes it and the next open
rebuilds it from the log; ``clmq bench index`` runs end to end at a tiny scale and
writes its figures and plot."""

from __future__ import annotations

import json
from pathlib import Path

from clmq.broker.store import Store, StoreConfig
from clmq.common import Message
from tests.cli_helpers import clmq


def _store(root: Path) -> StoreConfig:
    config = StoreConfig(root, index_hash_slots=7, index_max_entries_per_file=25)
    store = Store.open(config)
    try:
        store.create_topic("t", 2)
        store.put_batch([Message("t", i % 2, b"x", keys=f"k{i % 6} all") for i in range(60)])
    finally:
        store.close()
    return config


def test_store_check_names_a_damaged_index_file_and_repair_rebuilds_it(tmp_path: Path) -> None:
    config = _store(tmp_path / "data")
    files = sorted((tmp_path / "data" / "index").glob("*.idx"))
    assert len(files) > 2
    victim = files[1]
    raw = bytearray(victim.read_bytes())
    raw[56 + 4 * 3 : 56 + 4 * 4] = (10**6).to_bytes(4, "little")  # slot 3 names an entry far past the count
    victim.write_bytes(bytes(raw))
    out = clmq("store", "check", str(tmp_path / "data"), "-o", "json", cwd=tmp_path)
    assert out.returncode == 1, out.stderr
    problems = json.loads(out.stdout)["index_problems"]
    assert [p["file"] for p in problems] == [str(victim)]
    assert "slot 3: expected an entry up to" in problems[0]["reason"] and "found 1000000" in problems[0]["reason"]
    assert problems[0]["start"] == 56 + 4 * 3
    out = clmq("store", "repair", "--yes", str(tmp_path / "data"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert not victim.exists()
    store = Store.open(config)  # the open rebuilds the deleted file and every newer one
    try:
        found = store.find_by_key("t", "k3", max_results=100)
        assert found is not None and len(found.records) == 10
        assert all("k3" in r.keys.split() for r in found.records)
    finally:
        store.close()
    assert clmq("store", "check", str(tmp_path / "data"), cwd=tmp_path).returncode == 0


def test_bench_index_runs_and_writes_its_figures(tmp_path: Path) -> None:
    args = ["--messages", "3000", "--runs", "1", "--append-seconds", "0.2", "--lookups", "20"]
    args += ["--index-sizes", "5000", "--slots", "97", "--entries-per-file", "2000"]
    out = clmq("bench", "index", *args, "--json", "r.json", "--plot", "r.png", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["dispatch"]["on_msgs_per_s"] > 0 and result["dispatch"]["off_msgs_per_s"] > 0
    assert result["appends"]["ratio"] > 0
    assert [r["misses"] for r in result["lookups"]] == [0, 0, 0]
    assert [r["indexed_messages"] for r in result["lookups"]] == [3000, 5000, 5000]
    assert (tmp_path / "r.png").stat().st_size > 0

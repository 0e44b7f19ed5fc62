"""``clmq bench startup`` run for real at a tiny size: the JSON holds, for each command
and each checkout (this one and ``--against``'s), the median wall, CPU and import
seconds of its processes; a directory without clmq is refused with a clear error. A
smoke test of the command, not a measurement."""

from __future__ import annotations

import json
from pathlib import Path

from .cli_helpers import clmq

ROOT = Path(__file__).resolve().parents[1]


def test_every_command_is_measured_from_both_checkouts(tmp_path: Path) -> None:
    out = clmq(
        "bench", "startup", "--runs", "1", "--commands", "--help,broker --help", "--against", str(ROOT),
        "--out-dir", str(tmp_path), "--json", str(tmp_path / "s.json"), "--markdown", str(tmp_path / "s.md"),
        cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    rows = json.loads((tmp_path / "s.json").read_text())["rows"]
    assert [(r["command"], r["tree"]) for r in rows] == [
        ("clmq --help", "this"),
        ("clmq --help", "against"),
        ("clmq broker --help", "this"),
        ("clmq broker --help", "against"),
    ]
    for r in rows:
        assert r["runs"] == 1 and r["wall_s"] > 0 and r["cpu_s"] >= 0 and r["imports_s"] > 0, r
    broker = next(r for r in rows if r["command"] == "clmq broker --help")
    top = next(r for r in rows if r["command"] == "clmq --help")
    assert broker["imports_s"] > top["imports_s"]  # the broker's service is imported, --help imports almost nothing
    assert "| `clmq broker --help` | this |" in (tmp_path / "s.md").read_text()
    plots = list(tmp_path.glob("*.png"))
    assert len(plots) == 1 and plots[0].stat().st_size > 1000 and "plot written to" in out.stdout


def test_a_directory_without_clmq_is_refused(tmp_path: Path) -> None:
    out = clmq("bench", "startup", "--runs", "1", "--against", str(tmp_path), "--out-dir", str(tmp_path), cwd=tmp_path)
    assert out.returncode == 2 and "holds no clmq/ package" in out.stdout, out.stdout + out.stderr
    assert list(tmp_path.glob("*.json")) == []

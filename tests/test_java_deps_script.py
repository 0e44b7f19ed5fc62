"""scripts/_java_deps.sh run for real on a copy of the repository's layout: every pom is
tried even after one fails, every failure is named, and callers wait for each other on
build/java-deps/.fetch.lock."""

from __future__ import annotations

import fcntl
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("mvn") is None, reason="needs Maven (mvn)")


def _tree(tmp_path: Path, poms: dict[str, str]) -> Path:
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "_java_deps.sh", tmp_path / "scripts" / "_java_deps.sh")
    for name, text in poms.items():
        (tmp_path / "tests" / "java" / name).mkdir(parents=True)
        (tmp_path / "tests" / "java" / name / "pom.xml").write_text(text)
    return tmp_path / "scripts" / "_java_deps.sh"


def test_every_failing_pom_is_tried_and_named(tmp_path: Path) -> None:
    script = _tree(tmp_path, {"a-broken": "<project>not a pom", "b-broken": "<project>nor this"})
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "a-broken: Maven failed" in done.stdout and "b-broken: Maven failed" in done.stdout, done.stdout
    assert (tmp_path / "build" / "java-deps" / "b-broken.mvn.log").exists()  # tried after a-broken failed


def test_a_caller_waits_for_the_fetch_lock(tmp_path: Path) -> None:
    script = _tree(tmp_path, {})
    (tmp_path / "build" / "java-deps").mkdir(parents=True)
    with open(tmp_path / "build" / "java-deps" / ".fetch.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another caller is fetching
        waiting = subprocess.Popen(["bash", str(script)], stdout=subprocess.PIPE, text=True)
        with pytest.raises(subprocess.TimeoutExpired):
            waiting.wait(2)  # still waiting on the lock (nothing to fetch: it would end at once)
    out, _ = waiting.communicate(timeout=60)
    assert waiting.returncode == 0 and "ready" in out, out

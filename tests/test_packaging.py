"""What installing clmq gives a user: the built wheel holds one top-level import name,
``clmq`` (with ``py.typed`` and the dashboard's files), installs with its dependencies
into a fresh virtual environment, and every public name imports from it even with a
``client.py``, ``protocol.py`` and ``commitlog/`` of the user's own in the working
directory (clmq's imports never reach them); ``clmq --version`` runs. The editable
install of the repository offers ``clmq`` only."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import clmq

ROOT = Path(__file__).resolve().parents[1]
LEGACY_NAMES = [
    "bench",
    "broker",
    "client",
    "commitlog",
    "common",
    "consumequeue",
    "devtools",
    "nameserver",
    "protocol",
    "spark_connector",
]
# The user's own modules, named as clmq's rooms are: importing one is a failure.
SHADOWS = {
    "client.py": "raise ImportError('the working directory\\'s client.py was imported')\n",
    "protocol.py": "raise ImportError('the working directory\\'s protocol.py was imported')\n",
    "commitlog/__init__.py": "raise ImportError('the working directory\\'s commitlog/ was imported')\n",
}
IMPORT_ALL = """
import json, sys, sysconfig
import clmq
from clmq import *
names = list(clmq.__all__)
values = {name: getattr(clmq, name) for name in names}
star = [name for name in names if name not in globals()]
import clmq.client
print(json.dumps({
    "names": names,
    "not_star_imported": star,
    "version": clmq.__version__,
    "client_file": clmq.client.__file__,
    "purelib": sysconfig.get_paths()["purelib"],
    "shadowed_loaded": sorted(set(sys.modules) & {"client", "protocol", "commitlog"}),
}))
"""
FIND_LEGACY = """
import importlib, json
found = {}
for name in %r:
    try:
        importlib.import_module(name)
        found[name] = "imported"
    except ModuleNotFoundError:
        found[name] = "ModuleNotFoundError"
import clmq
print(json.dumps({"found": found, "clmq": clmq.__file__}))
"""


def _env() -> dict[str, str]:
    """This environment without PYTHONPATH (the repository must not be on the path)."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


def _run(*args: str | Path, cwd: Path, timeout_s: float = 600, stderr: bool = False) -> str:
    """stdout of a command that must succeed (with ``stderr``: stdout and stderr)."""
    done = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout_s
    )
    assert done.returncode == 0, f"{args} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr if stderr else done.stdout


def _source_copy(dest: Path) -> Path:
    """What the wheel is built from, copied out of the checkout (a build writes ``build/``
    and ``*.egg-info`` into its source tree): pyproject, README, ``clmq/`` with its
    relative symlinks, and the folders they point to."""
    dest.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "clmq", dest / "clmq", symlinks=True, ignore=ignore)
    for link in (ROOT / "clmq").iterdir():
        if link.is_symlink():
            target = (link.parent / os.readlink(link)).resolve()
            shutil.copytree(target, dest / target.relative_to(ROOT), ignore=ignore)
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    source = _source_copy(tmp / "source")
    # Not -q: what the build backend says is kept (test_the_build_is_quiet reads it).
    out = _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", tmp / "dist", source, cwd=tmp, stderr=True)
    (tmp / "dist" / "build-output.txt").write_text(out)
    (built,) = (tmp / "dist").glob("clmq-*.whl")
    return built


def test_the_build_is_quiet(wheel: Path) -> None:
    """No build-backend warning (the license field in its deprecated table form gave one)."""
    out = (wheel.parent / "build-output.txt").read_text()
    assert "Successfully built clmq" in out, out
    assert "Warning" not in out and "deprecat" not in out.lower(), out


def test_the_wheel_holds_only_clmq(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert tops == {"clmq", f"clmq-{clmq.__version__}.dist-info"}, tops
    for part in ("clmq/__init__.py", "clmq/py.typed", "clmq/client/__init__.py", "clmq/commitlog/__init__.py"):
        assert part in names, part
    static = ROOT / "broker" / "cli" / "dashboard_static"
    for path in static.rglob("*"):
        if path.is_file():
            shipped = f"clmq/broker/cli/dashboard_static/{path.relative_to(static).as_posix()}"
            assert shipped in names, shipped
    entry_points = zipfile.ZipFile(wheel).read(f"clmq-{clmq.__version__}.dist-info/entry_points.txt").decode()
    assert "clmq = clmq.broker.cli.main:main" in entry_points


def test_the_wheel_installed_in_a_fresh_venv_imports_every_public_name(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", venv, cwd=tmp_path)
    python = venv / "bin" / "python"
    _run(python, "-m", "pip", "install", "-q", wheel, cwd=tmp_path)  # with its dependencies
    work = tmp_path / "work"
    for name, text in SHADOWS.items():
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_text(text)

    report = json.loads(_run(python, "-c", IMPORT_ALL, cwd=work))

    assert sorted(report["names"]) == sorted(clmq.__all__) and len(report["names"]) > 40
    assert report["not_star_imported"] == []
    assert report["version"] == clmq.__version__
    assert report["shadowed_loaded"] == []  # the working directory's client.py & co. never imported
    site = Path(report["purelib"]).resolve()
    assert Path(report["client_file"]).resolve().is_relative_to(site), report
    assert _run(venv / "bin" / "clmq", "--version", cwd=work).strip() == f"clmq {clmq.__version__}"


def test_the_editable_install_offers_clmq_only(tmp_path: Path) -> None:
    """From a directory outside the repository, the project's interpreter finds ``clmq``
    and none of the folders it is made of (they are reached only through ``clmq/``)."""
    report = json.loads(_run(sys.executable, "-c", FIND_LEGACY % (LEGACY_NAMES,), cwd=tmp_path))
    assert report["found"] == {name: "ModuleNotFoundError" for name in LEGACY_NAMES}
    assert Path(report["clmq"]).parent.name == "clmq"

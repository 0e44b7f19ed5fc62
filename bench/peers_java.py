"""The Java side of ``clmq bench peers``: the jars of Apache Kafka and Apache RocketMQ
(``tests/java/peers-kafka/pom.xml``, ``tests/java/peers-rocketmq/pom.xml``) resolved by
Maven through ``scripts/_java_deps.sh`` into ``build/java-deps/``, and each pom's load
driver compiled once with ``javac`` (cached by the hash of its source and classpath).

Nothing of clmq depends on them: when ``java``, ``javac`` or ``mvn`` is missing, or Maven
cannot reach its repository, :class:`PeersUnavailable` says what is needed."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "_java_deps.sh"
POMS = ROOT / "tests" / "java"
OUT = ROOT / "build" / "java-deps"
FETCH_TIMEOUT_S = 900.0
JAVAC_TIMEOUT_S = 300.0
# The pom directory and the driver class of each peer.
PROJECTS = {"kafka": ("peers-kafka", "PeersKafka"), "rocketmq": ("peers-rocketmq", "PeersRocketMQ")}


class PeersUnavailable(Exception):
    """What ``clmq bench peers`` needs and did not find (a message for a person)."""


def require_tools() -> None:
    """``java``, ``javac`` and ``mvn`` on PATH, or :class:`PeersUnavailable` naming them."""
    missing = [t for t in ("java", "javac", "mvn") if shutil.which(t) is None]
    if missing:
        raise PeersUnavailable(
            f"clmq bench peers needs a JDK (java, javac) and Maven (mvn) on PATH to fetch and run Apache Kafka "
            f"and Apache RocketMQ; missing: {', '.join(missing)} (Debian: apt-get install default-jdk-headless maven)"
        )


def _classpath_file(project: str) -> Path:
    digest = hashlib.sha256((POMS / project / "pom.xml").read_bytes()).hexdigest()[:16]
    return OUT / f"{project}-{digest}.classpath"


def _read(path: Path) -> list[str] | None:
    if not path.is_file():
        return None
    jars = [j for j in path.read_text().strip().split(os.pathsep) if j]
    return jars if jars and all(Path(j).is_file() for j in jars) else None


def classpath(system: str) -> list[str]:
    """The jars of ``system``'s pom, fetched with Maven (the script) when missing."""
    project = PROJECTS[system][0]
    jars = _read(_classpath_file(project))
    if jars is None:
        done = subprocess.run(
            ["bash", str(SCRIPT)], capture_output=True, text=True, timeout=FETCH_TIMEOUT_S, check=False
        )
        jars = _read(_classpath_file(project))
        if jars is None:
            said = (done.stdout + done.stderr).strip()
            why = "Maven Central is unreachable" if done.returncode == 2 else "Maven could not fetch them"
            raise PeersUnavailable(f"the jars of tests/java/{project} are missing: {why} ({said})")
    return jars


def driver_command(system: str) -> tuple[list[str], list[str]]:
    """``(java -cp ... Driver, jars)``: the load driver of ``system``, compiled if needed."""
    project, main = PROJECTS[system]
    jars = classpath(system)
    source = POMS / project / f"{main}.java"
    key = hashlib.sha256(source.read_bytes() + os.pathsep.join(jars).encode()).hexdigest()[:16]
    classes = OUT / f"{project}-driver-{key}"
    if not (classes / f"{main}.class").is_file():
        tmp = OUT / f"{project}-driver-{key}.tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        done = subprocess.run(
            ["javac", "-d", str(tmp), "-cp", os.pathsep.join(jars), str(source)],
            capture_output=True,
            text=True,
            timeout=JAVAC_TIMEOUT_S,
            check=False,
        )
        if done.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise PeersUnavailable(f"javac {source.name} failed:\n{done.stdout}{done.stderr}")
        try:
            tmp.rename(classes)
        except OSError:  # built meanwhile by another process
            shutil.rmtree(tmp, ignore_errors=True)
    cmd = ["java", "-Xmx1g", "-Dorg.slf4j.simpleLogger.defaultLogLevel=warn", "-cp"]
    return [*cmd, os.pathsep.join([str(classes), *jars]), main], jars

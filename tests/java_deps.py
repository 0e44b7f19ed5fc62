"""The jars of the Kafka listener's Java judges, found the way scripts/_java_deps.sh left
them: ``build/java-deps/NAME-POMHASH.classpath`` for each pom under ``tests/java/``.

When a classpath is missing (pytest run without scripts/run-tests.sh), the script is run
once. Missing jars fail the test, except when Maven reported that it could not reach its
repository (the script's exit code 2, from network errors in Maven's own log) outside
CI: then the test is skipped, saying so. In CI (``CI`` set) every failure fails.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from functools import cache
from pathlib import Path

import pytest

from tests.jvm import TEST_JVM_OPTIONS

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "_java_deps.sh"
POMS = ROOT / "tests" / "java"
OUT = ROOT / "build" / "java-deps"
HARNESS = POMS / "kafka-harness"
HARNESS_CLASS = "KafkaHarness"

# The exact versions the poms ask for (the tests print them in their failures).
KAFKA_CLIENTS_VERSION = "4.4.0"
SPARK_KAFKA_VERSION = "4.2.0"  # Maven Central serves no spark-sql-kafka-0-10_2.13 4.3.0


class JavaDepsMissing(Exception):
    def __init__(self, message: str, unreachable: bool) -> None:
        super().__init__(message)
        self.unreachable = unreachable


def _classpath_file(name: str) -> Path:
    pom = POMS / name / "pom.xml"
    digest = hashlib.sha256(pom.read_bytes()).hexdigest()[:16]
    return OUT / f"{name}-{digest}.classpath"


def _read(path: Path) -> list[str] | None:
    if not path.is_file():
        return None
    jars = [j for j in path.read_text().strip().split(os.pathsep) if j]
    return jars if jars and all(Path(j).is_file() for j in jars) else None


@cache
def _run_script() -> tuple[int, str]:
    """Run the script (it takes build/java-deps/.fetch.lock itself: pytest-xdist workers,
    run-tests.sh and clmq bench peers wait for the first one's fetch, then find its
    classpath files)."""
    done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=900, check=False)
    return done.returncode, (done.stdout + done.stderr).strip()


def classpath(name: str) -> list[str]:
    """The jars of ``tests/java/NAME/pom.xml``, fetched by the script if missing."""
    path = _classpath_file(name)
    jars = _read(path)
    if jars is None:
        rc, said = _run_script()
        jars = _read(path)
        if jars is None:
            raise JavaDepsMissing(
                f"jars of tests/java/{name} missing: scripts/_java_deps.sh exited {rc}: {said}", rc == 2
            )
    return jars


def require(name: str) -> list[str]:
    """:func:`classpath`, or the test fails (skips if Maven Central is unreachable outside CI)."""
    try:
        return classpath(name)
    except JavaDepsMissing as e:
        if e.unreachable and not os.environ.get("CI"):
            pytest.skip(f"Maven Central unreachable: {e}")
        pytest.fail(str(e))


def spark_kafka_jars_if_any() -> list[str]:
    """Spark's Kafka source jars for the shared SparkSession, or none (the other Spark
    tests must not depend on them; test_kafka_spark.py fails or skips on its own)."""
    try:
        return classpath("spark-kafka")
    except JavaDepsMissing:
        return []


def harness_command() -> list[str]:
    """``java -cp ... KafkaHarness``: the harness compiled by javac once per version of
    its source and classpath (cached under build/java-deps/harness-HASH)."""
    jars = require("kafka-harness")
    javac, java = shutil.which("javac"), shutil.which("java")
    if javac is None or java is None:
        pytest.fail("the Java harness needs a JDK (javac and java on PATH): apt-get install default-jdk-headless")
    source = HARNESS / f"{HARNESS_CLASS}.java"
    key = hashlib.sha256(source.read_bytes() + os.pathsep.join(jars).encode()).hexdigest()[:16]
    classes = OUT / f"harness-{key}"
    if not (classes / f"{HARNESS_CLASS}.class").is_file():
        tmp = OUT / f"harness-{key}.tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        done = subprocess.run(
            [javac, "-Xlint:all", "-Werror", "-d", str(tmp), "-cp", os.pathsep.join(jars), str(source)],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if done.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            pytest.fail(f"javac {source.name} failed:\n{done.stdout}{done.stderr}")
        try:
            tmp.rename(classes)
        except OSError:  # built meanwhile by another process
            shutil.rmtree(tmp, ignore_errors=True)
    return [
        java,
        *TEST_JVM_OPTIONS,
        "-Dorg.slf4j.simpleLogger.defaultLogLevel=" + os.environ.get("KAFKA_HARNESS_LOG", "warn"),
        "-Dorg.slf4j.simpleLogger.showDateTime=true",
        "-cp",
        os.pathsep.join([str(classes), *jars]),
        HARNESS_CLASS,
    ]

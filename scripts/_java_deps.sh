# The jars of the Kafka listener's Java judges (tests/test_kafka_java.py: the official Java
# client; tests/test_kafka_spark.py: Spark's own Kafka source), fetched by Maven into its
# local repository (~/.m2) from the poms under tests/java/. Each pom's classpath is written
# to build/java-deps/NAME-POMHASH.classpath; when that file and its jars are there, Maven
# is not run at all. Prints one line.
#
# Sourced by scripts/run-tests.sh: it never stops that script (the tests then fail, or skip
# when Maven Central cannot be reached). Run directly (tests/java_deps.py does, when the
# jars are missing) it exits 0 when every classpath is ready, 2 when Maven could not reach
# its repository (network errors only), 1 on any other failure. Every pom is tried, and
# every failure named. Callers are serialized by flock on build/java-deps/.fetch.lock.

_java_deps() {
    local root out lock_fd rc
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    out="$root/build/java-deps"
    mkdir -p "$out"
    # One fetch at a time, whoever runs it (run-tests.sh, the tests' xdist workers through
    # tests/java_deps.py, clmq bench peers): the others wait, then find its classpath files.
    exec {lock_fd}>"$out/.fetch.lock"
    if command -v flock >/dev/null 2>&1; then
        flock "$lock_fd"
    fi
    _java_deps_locked "$root" "$out"
    rc=$?
    exec {lock_fd}>&-
    return "$rc"
}

_java_deps_locked() {  # every pom tried, even after one fails; every failure reported
    local root="$1" out="$2" name pom hash cp log network=0 other=0 fetched=() failures=()
    # The harness is compiled with javac (a JDK, not only a JRE); Maven fetches the jars.
    if ! command -v javac >/dev/null 2>&1 && declare -F apt_install >/dev/null; then
        apt_install default-jdk-headless >/dev/null
    fi
    if ! command -v mvn >/dev/null 2>&1 && declare -F apt_install >/dev/null; then
        apt_install maven >/dev/null
    fi
    for pom in "$root"/tests/java/*/pom.xml; do
        [ -f "$pom" ] || continue  # no poms: the pattern itself
        name="$(basename "$(dirname "$pom")")"
        hash="$(sha256sum "$pom" | cut -c1-16)"
        cp="$out/$name-$hash.classpath"
        if [ -s "$cp" ] && _java_deps_present "$cp"; then
            continue
        fi
        if ! command -v mvn >/dev/null 2>&1; then
            other=1; failures+=("$name: mvn is not installed"); continue
        fi
        log="$out/$name.mvn.log"
        if mvn -B -f "$pom" org.apache.maven.plugins:maven-dependency-plugin:3.8.1:build-classpath -Dmdep.outputFile="$cp.tmp" >"$log" 2>&1 \
            && [ -s "$cp.tmp" ]; then
            mv "$cp.tmp" "$cp"
            fetched+=("$name")
        else
            rm -f "$cp.tmp"
            if grep -qE "UnknownHostException|Network is unreachable|No route to host|Connection refused|connect timed out|Connect timed out|Temporary failure in name resolution" "$log"; then
                network=1; failures+=("$name: Maven Central unreachable (see $log)")
            else
                other=1; failures+=("$name: Maven failed (see $log)")
            fi
        fi
    done
    if [ ${#failures[@]} -gt 0 ]; then
        local IFS=";"
        echo "== java deps: NOT ready: ${failures[*]}${fetched:+ (fetched ${fetched[*]})}"
        [ "$other" -eq 1 ] && return 1
        return 2
    fi
    if [ ${#fetched[@]} -eq 0 ]; then
        echo "== java deps: ready (build/java-deps)"
    else
        echo "== java deps: fetched ${fetched[*]} (build/java-deps)"
    fi
    return 0
}

_java_deps_present() {  # every jar of a classpath file is on disk
    local jar
    while IFS= read -r -d: jar || [ -n "$jar" ]; do
        [ -f "$jar" ] || return 1
    done <"$1"
}

if (return 0 2>/dev/null); then
    _java_deps || true  # sourced: the tests report what is missing
else
    set -uo pipefail
    _java_deps
    exit $?
fi

"""A command line that is safe by default (issue 29), through the real ``clmq`` as a
subprocess against a real ``clmq dev``:

- ``group reset-offsets`` prints a plan and changes nothing without ``--execute``;
- ``consume`` without ``--group`` reads with a fresh group of its own that commits
  nothing and takes no queue from anyone; ``--count`` below 1 is a usage error;
- consumed messages carry their id, which ``message get`` finds;
- bodies printed as text cannot drive the terminal; ``-o json`` keeps them exact;
- output that is not a terminal is plain lines, never wrapped nor cut;
- ``-o json`` on every verb, one flag name per setting, durations with units
  everywhere, help on every flag and argument;
- ``clmq dev`` prints a first command that works as printed, and its metrics URL;
- ``produce`` to a missing topic says how to create it; ``clmq --version``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import clmq as clmq_package
from clmq.broker.cli._common import DeprecatedAlias
from clmq.broker.cli._errors import EXIT_FAILED, EXIT_USAGE
from clmq.broker.cli._timefmt import Duration
from clmq.broker.cli.main import build_parser
from clmq.client import BlockingProducer
from tests.cli_helpers import ROOT, clmq, free_port, popen, running_dev
from tests.waiting import wait_until

# No COLUMNS: what rich assumes for a pipe (80 columns), where tables used to fold and cut.
PIPE_ENV = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def ns(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_dev(tmp_path_factory.mktemp("safety")) as addr:
        yield addr


def run(ns: str, tmp_path: Path, *args: str, code: int = 0) -> subprocess.CompletedProcess[str]:
    out = clmq(*args, "--namesrv", ns, cwd=tmp_path)
    assert out.returncode == code, (args, out.returncode, out.stdout, out.stderr)
    return out


def piped(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``clmq args`` with stdout a pipe and no COLUMNS in the environment."""
    return subprocess.run(
        [sys.executable, "-m", "clmq", *args], cwd=cwd, capture_output=True, text=True, env=PIPE_ENV, timeout=60
    )


def json_lines(out: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.stdout.splitlines()]


def topic_with(ns: str, tmp_path: Path, topic: str, queues: int, *bodies: str) -> None:
    run(ns, tmp_path, "topic", "create", topic, "--queues", str(queues))
    run(ns, tmp_path, "produce", topic, *bodies)


def shell(command: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``command`` run by bash as a person would type it, ``clmq`` on the PATH."""
    bin_dir = cwd / "bin"
    bin_dir.mkdir(exist_ok=True)
    shim = bin_dir / "clmq"
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} -m clmq "$@"\n')
    shim.chmod(0o755)
    env = {**PIPE_ENV, "PATH": f"{bin_dir}:/usr/bin:/bin"}
    return subprocess.run(["bash", "-c", command], cwd=cwd, capture_output=True, text=True, env=env, timeout=60)


# ------------------------------------------------------------ 1. reset-offsets
def test_reset_offsets_prints_the_plan_and_changes_nothing_without_execute(ns: str, tmp_path: Path) -> None:
    topic_with(ns, tmp_path, "planned", 1, *[f"m{i}" for i in range(5)])
    run(ns, tmp_path, "consume", "planned", "--group", "pg", "--count", "5")
    reset = ("group", "reset-offsets", "pg", "--topic", "planned", "--to-earliest")
    plan = run(ns, tmp_path, *reset)
    assert "broker-a\t0\t5\t0" in plan.stdout.splitlines(), plan.stdout  # queue 0: current 5 -> new 0
    assert "--execute" in plan.stdout
    assert json.loads(run(ns, tmp_path, "group", "describe", "pg", "-o", "json").stdout)["lag"] == 0
    as_json = json.loads(run(ns, tmp_path, *reset, "-o", "json").stdout)
    assert [(r["before"], r["after"], r["executed"]) for r in as_json] == [(5, 0, False)]
    assert json.loads(run(ns, tmp_path, "group", "describe", "pg", "-o", "json").stdout)["lag"] == 0
    done = json.loads(run(ns, tmp_path, *reset, "--execute", "-o", "json").stdout)
    assert [(r["before"], r["after"], r["executed"]) for r in done] == [(5, 0, True)]
    assert json.loads(run(ns, tmp_path, "group", "describe", "pg", "-o", "json").stdout)["lag"] == 5
    run(ns, tmp_path, *reset, "--execute", "--dry-run", code=EXIT_USAGE)


# ------------------------------------------------------- 2. consume without --group
def console_groups(ns: str, tmp_path: Path) -> list[str]:
    groups = json.loads(run(ns, tmp_path, "group", "list", "-o", "json").stdout)
    return [g["group"] for g in groups if g["group"].startswith("clmq-console-")]


def test_consume_without_a_group_reads_everything_commits_nothing_and_takes_no_queue(ns: str, tmp_path: Path) -> None:
    bodies = [f"look-{i}" for i in range(6)]
    topic_with(ns, tmp_path, "looked", 2, *bodies)
    looking = ("consume", "looked", "--count", "6", "--idle-timeout", "5s", "-o", "json")
    # Someone else is already looking: under one shared default group they would split the queues.
    other = popen(*looking[:2], "--namesrv", ns, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        (group,) = wait_until(lambda: console_groups(ns, tmp_path), 30, "the first console consumer to join")
        for _ in range(2):  # twice: the first commits nothing, so the second reads the same
            out = run(ns, tmp_path, *looking)
            assert sorted(m["body"] for m in json_lines(out)) == bodies, out.stderr
        (member,) = json.loads(run(ns, tmp_path, "group", "members", group, "-o", "json").stdout)
        assert member["mode"] == "broadcasting" and sorted(q[2] for q in member["queues"]) == [0, 1]
    finally:
        os.kill(other.pid, signal.SIGINT)
        other.wait(30)
    assert console_groups(ns, tmp_path) == []  # no group left behind, nothing committed for one


@pytest.mark.parametrize("count", ["0", "-3"])
def test_a_count_below_one_is_a_usage_error(tmp_path: Path, count: str) -> None:
    out = clmq("consume", "t", f"--count={count}", "--namesrv", f"127.0.0.1:{free_port()}", cwd=tmp_path)
    assert out.returncode == EXIT_USAGE and out.stderr.startswith("error: --count"), out.stderr


# ------------------------------------------------------------- 3. message ids
def test_a_consumed_message_s_id_finds_it_with_message_get(ns: str, tmp_path: Path) -> None:
    topic_with(ns, tmp_path, "ids", 2, "first", "second", "third")
    consumed = json_lines(run(ns, tmp_path, "consume", "ids", "--count", "3", "-o", "json"))
    assert len(consumed) == 3
    for m in consumed:
        got = json.loads(run(ns, tmp_path, "message", "get", m["msg_id"], "-o", "json").stdout)
        assert (got["body"], got["queue_id"], got["queue_offset"]) == (m["body"], m["queue_id"], m["queue_offset"])
    details = run(ns, tmp_path, "consume", "ids", "--count", "3", "--details").stdout
    assert sorted(re.findall(r" id=(\S+)", details)) == sorted(m["msg_id"] for m in consumed), details


# ------------------------------------------------------- 4. control characters
NASTY = b"bell\x07 esc\x1b]0;retitled\x07 clear\x1b[2J cr\rnl\nnul\x00 rtl\xe2\x80\xaeend"


def test_bodies_printed_as_text_cannot_drive_the_terminal_and_json_stays_exact(ns: str, tmp_path: Path) -> None:
    run(ns, tmp_path, "topic", "create", "nasty", "--queues", "1")
    with BlockingProducer([ns]) as producer:
        producer.send("nasty", NASTY, tags="t\x1b[31m")
    for args in (("consume", "nasty", "--count", "1", "--details"), ("message", "read", "nasty", "--queue", "0")):
        out = run(ns, tmp_path, *args)
        assert out.stdout.count("\n") == 1 and out.stdout.endswith("\n"), repr(out.stdout)  # one message, one line
        assert not [c for c in out.stdout[:-1] if ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 or c == "\u202e"]
        assert r"bell\x07 esc\x1b]0;retitled\x07 clear\x1b[2J cr\rnl\nnul\x00 rtl\u202eend" in out.stdout
        assert r"[t\x1b[31m]" in out.stdout
    (exact,) = json_lines(run(ns, tmp_path, "consume", "nasty", "--count", "1", "-o", "json"))
    assert exact["body"].encode() == NASTY and exact["tags"] == "t\x1b[31m"


# ---------------------------------------------------------- 5. piped output
def test_piped_tables_keep_long_paths_and_names_whole_on_one_line(ns: str, tmp_path: Path) -> None:
    store = tmp_path / ("d" * 90) / ("e" * 90) / "store"
    assert piped("demo", "--data-dir", str(store), "--messages", "10", "--queues", "1", cwd=tmp_path).returncode == 0
    check = piped("store", "check", str(store), cwd=tmp_path)
    assert check.returncode == 0, check.stdout + check.stderr
    found = [line for line in check.stdout.splitlines() if str(store / "topics.json") in line]  # | grep FILE
    assert found and found[0].split("\t")[0] == str(store / "topics.json"), check.stdout
    assert f"log {store / 'commitlog'}: 1 segments" in check.stdout
    topic = "long-topic-" + "x" * 110
    run(ns, tmp_path, "topic", "create", topic, "--queues", "1")
    listed = piped("topic", "list", "--namesrv", ns, cwd=tmp_path)
    assert f"{topic}\tbroker-a: 1" in listed.stdout.splitlines(), listed.stdout
    assert "…" not in listed.stdout and "┃" not in listed.stdout  # no table frame, nothing cut


# ---------------------------------------------- 6. -o json, flag names, help
def parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("clmq",)) -> Iterator[Any]:
    """(path, parser, is a leaf) for ``parser`` and every sub-command under it."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    yield path, parser, not subs
    for action in subs:
        for name, sub in action.choices.items():
            yield from parsers(sub, (*path, name))


def test_every_flag_argument_and_command_has_help() -> None:
    missing = []
    for path, parser, _ in parsers(build_parser()):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                missing += [f"{' '.join(path)} {c.dest}" for c in action._choices_actions if not (c.help or "").strip()]
            elif not (action.help or "").strip():
                missing.append(f"{' '.join(path)} {'/'.join(action.option_strings) or action.dest}")
            elif action.help == argparse.SUPPRESS:  # hidden: only an old spelling of a visible flag
                assert isinstance(action, DeprecatedAlias), (path, action.option_strings)
                new = action.new.split()[0]  # "-o json": the flag -o
                assert any(new in a.option_strings and a.dest == action.dest for a in parser._actions), action.new
    assert not missing, missing


def test_one_flag_name_per_setting() -> None:
    seen: dict[str, set[str]] = {}
    for path, parser, _ in parsers(build_parser()):
        for action in parser._actions:
            if action.help != argparse.SUPPRESS:
                for option in action.option_strings:
                    seen.setdefault(option, set()).add(" ".join(path))
    assert not {"--port", "--ns", "--nameserver", "--name-server", "--namesrv-addrs"} & set(seen), seen.keys()
    assert {o for o in seen if "namesrv" in o or "nameserver" in o} == {"--namesrv", "--namesrv-port"}
    assert {o for o in seen if o.endswith("port")} == {
        "--listen-port",
        "--namesrv-port",
        "--metrics-port",
        "--kafka-port",
    }
    for path, parser, _ in parsers(build_parser()):  # a format switch is -o json, never --json
        assert not [
            a for a in parser._actions if "--json" in a.option_strings and a.nargs == 0 and a.help != argparse.SUPPRESS
        ], path


def test_every_verb_takes_o_json() -> None:
    without = [
        " ".join(path)
        for path, parser, leaf in parsers(build_parser())
        if leaf
        and not any(
            "-o" in a.option_strings and "--output" in a.option_strings and "json" in (a.choices or ("json",))
            for a in parser._actions
        )
    ]
    assert not without, without


def test_every_duration_option_takes_units() -> None:
    named = re.compile(r"^--(.+-)?(ms|seconds)$|^--(idle-timeout|delay|by-duration)$")
    checked = 0
    for path, parser, _ in parsers(build_parser()):
        for action in parser._actions:
            if any(named.match(o) for o in action.option_strings):
                assert isinstance(action.type, Duration), (path, action.option_strings)
                scale = 1 if action.type.unit == "ms" else 0.001
                assert action.type("2m") == 120_000 * scale and action.type("500ms") == 500 * scale
                checked += 1
    assert checked > 20


def test_produce_promote_demo_and_store_check_print_only_json(ns: str, tmp_path: Path) -> None:
    run(ns, tmp_path, "topic", "create", "js", "--queues", "1")
    sent = json_lines(run(ns, tmp_path, "produce", "js", "a", "b", "-o", "json"))
    assert [(m["topic"], m["queue_offset"]) for m in sent] == [("js", 0), ("js", 1)] and all(m["msg_id"] for m in sent)
    (broker,) = json.loads(run(ns, tmp_path, "cluster", "list", "-o", "json").stdout)["brokers"]
    promoted = clmq("admin", "promote", "--addr", broker["addr"], "-o", "json", cwd=tmp_path)
    assert promoted.returncode == 0, promoted.stderr
    assert json.loads(promoted.stdout) == {
        "addr": broker["addr"],
        "broker_name": "broker-a",
        "broker_id": 0,
        "promoted": False,
        "already_leader": True,
        "epoch": broker["epoch"],
    }
    demo = clmq(
        "demo", "--data-dir", str(tmp_path / "d"), "--messages", "5", "--queues", "1", "-o", "json", cwd=tmp_path
    )
    assert json.loads(demo.stdout)["queues"][0]["max_offset"] == 5, demo.stdout
    check = clmq("store", "check", str(tmp_path / "d"), "-o", "json", cwd=tmp_path)
    assert check.returncode == 0 and json.loads(check.stdout)["damaged"] is False
    idle = clmq("consume", "js", "--idle-timeout", "2x", "--namesrv", ns, cwd=tmp_path)
    assert idle.returncode == EXIT_USAGE and "duration '2x'" in idle.stderr


def test_a_service_and_a_benchmark_print_only_json_with_o_json(tmp_path: Path) -> None:
    """``clmq dev -o json``: one object once it serves (its addresses); a benchmark: its results."""
    proc = popen(
        "dev",
        "--data-dir",
        str(tmp_path / "data"),
        "--listen-port",
        "0",
        "--namesrv-port",
        str(free_port()),
        "-o",
        "json",
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline())  # the first line of stdout, once it serves
        assert ready["brokers"][0]["addr"] and ready["metrics_url"].endswith("/metrics")
        assert (
            ready["first_command"].startswith("clmq topic create demo") and ready["namesrv"] in ready["first_command"]
        )
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.communicate(timeout=30)[0] == ""  # nothing else on stdout
    bench = ("bench", "store", "--sizes", "100", "--queues", "1", "--flush", "async", "--runs", "1")
    out = clmq(
        *bench, "--seconds", "100ms", "--rebuild-messages", "0", "--scale-queues", "0", "-o", "json", cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["append"][0]["msgs_per_s"] > 0 and "JSON written" in out.stderr


# ------------------------------------------------------------------ 7. clmq dev
def start_dev(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen[str], list[str]]:
    """``clmq dev`` on free ports, and what it printed up to "serving;" (its lines are the
    events: no polling)."""
    proc = popen(
        "dev",
        "--data-dir",
        str(tmp_path / "data"),
        "--listen-port",
        "0",
        "--namesrv-port",
        str(free_port()),
        *extra,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    printed = []
    for line in proc.stdout:
        printed.append(line)
        if line.startswith("serving;"):
            break
    return proc, printed


def test_dev_prints_a_first_command_that_works_as_printed_and_its_metrics_url(tmp_path: Path) -> None:
    proc, printed = start_dev(tmp_path)
    try:
        said = dict(re.findall(r"^(first command|read it back|metrics): +(.*)$", "".join(printed), re.MULTILINE))
        assert said.keys() == {"first command", "read it back", "metrics"}, printed
        first = shell(said["first command"], tmp_path)
        assert first.returncode == 0 and "queue" in first.stdout and " id " in first.stdout, first
        back = shell(said["read it back"], tmp_path)
        assert back.returncode == 0 and back.stdout.rstrip().endswith(" hello"), back
        with urllib.request.urlopen(said["metrics"], timeout=10) as answer:
            assert answer.status == 200 and answer.headers["Content-Type"].startswith("text/plain")
            assert 'clmq_messages_in_total{topic="demo"}' in answer.read().decode()
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)


# ------------------------------------------------------ 8. produce, 9. --version
def test_produce_to_a_missing_topic_says_how_to_create_it(ns: str, tmp_path: Path) -> None:
    missing = clmq("produce", "absent-topic", "x", "--namesrv", ns, cwd=tmp_path)
    assert missing.returncode == EXIT_FAILED and len(missing.stderr.splitlines()) == 1, missing.stderr
    (create,) = re.findall(r"create it first: (clmq topic create absent-topic .*)$", missing.stderr.strip())
    assert shell(create, tmp_path).returncode == 0
    run(ns, tmp_path, "produce", "absent-topic", "x")


def test_version_is_the_package_s() -> None:
    out = clmq("--version", cwd=ROOT)
    assert out.returncode == 0 and out.stdout == f"clmq {clmq_package.__version__}\n"


def test_dev_with_a_kafka_port_serves_kafka_clients(tmp_path: Path) -> None:
    """``clmq dev --kafka-port``: the ready block names bootstrap.servers, and kcat
    produces and reads back through it, into the topic the first command created."""
    kafka_port = free_port()
    proc, printed = start_dev(tmp_path, "--kafka-port", str(kafka_port))
    try:
        assert f"Kafka clients: bootstrap.servers=127.0.0.1:{kafka_port}\n" in printed, printed
        said = dict(re.findall(r"^(first command|read it back): +(.*)$", "".join(printed), re.MULTILINE))
        assert shell(said["first command"], tmp_path).returncode == 0  # creates topic demo
        kcat = ["kcat", "-b", f"127.0.0.1:{kafka_port}", "-t", "demo"]
        sent = subprocess.run([*kcat, "-P", "-p", "0", "-K:"], input="k1:from kafka\n", text=True, timeout=30)
        assert sent.returncode == 0
        read = subprocess.run(
            [*kcat, "-C", "-p", "0", "-o", "beginning", "-e", "-f", "%k=%s\\n"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert "k1=from kafka" in read.stdout.splitlines(), read
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)


def _alive(pid: int) -> bool:
    """``pid`` runs (a zombie, dead and not yet reaped, counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_a_test_server_process_dies_with_the_test_process_that_started_it(tmp_path: Path) -> None:
    """The module fixture's ``clmq dev`` is started so: a pytest worker killed outright
    (pytest-timeout's os._exit, SIGKILL) leaves no server running under pid 1."""
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys\n"
            "from tests.process_groups import spawn_options\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import sys; sys.stdin.read()'],\n"
            "                         stdin=subprocess.PIPE, **spawn_options())\n"
            "print(child.pid, flush=True)\n"
            "sys.stdin.read()\n",
        ],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    assert _alive(child)
    parent.kill()  # as pytest-timeout's os._exit: no finally, no atexit
    parent.wait(30)
    wait_until(lambda: not _alive(child), 30, "the child to die with its parent")


def test_store_offsets_write_v1_with_o_json_prints_what_it_converted(tmp_path: Path) -> None:
    """``clmq store offsets --write-v1 DIR -o json``: stdout is one JSON document of what it
    did (the files rewritten, the offsets and groups in them); nothing to convert is a result too."""
    from clmq.broker.service._offsets import ConsumerOffsets

    data = tmp_path / "data"
    data.mkdir()
    empty = clmq("store", "offsets", "--write-v1", str(data), "-o", "json", cwd=tmp_path)
    assert empty.returncode == 0, empty.stderr
    assert json.loads(empty.stdout) == {
        "directory": str(data),
        "version": 1,
        "converted": False,
        "files": [],
        "offsets": 0,
        "groups": [],
    }
    offsets = ConsumerOffsets(data / "consumer_offsets.json")
    for group, queue, offset in (("g1", 0, 5), ("g1", 1, 7), ("g2", 0, 3)):
        offsets.commit(group, "t", queue, offset)
        assert offsets.flush()  # two generations, both version 2
    done = clmq("store", "offsets", "--write-v1", str(data), "-o", "json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    path = data / "consumer_offsets.json"
    assert json.loads(done.stdout) == {
        "directory": str(data),
        "version": 1,
        "converted": True,
        "files": [str(path), str(path) + ".prev"],
        "offsets": 3,
        "groups": ["g1", "g2"],
    }

"""The operator verbs of ``clmq`` (issue 18), through the real CLI against a real
``clmq dev``: groups (describe, members, delete, reset-offsets with --dry-run),
messages (read a queue without a group, get by id, find by key), produce with
properties, a chosen queue and a file, topics (update, describe), ``-o json``."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from clmq.broker.cli._services import _demo
from tests.cli_helpers import clmq, running_dev


@pytest.fixture(scope="module")
def ns(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_dev(tmp_path_factory.mktemp("verbs")) as addr:
        yield addr


def run(
    ns: str, tmp_path: Path, *args: str, code: int = 0, stdin: bytes | None = None
) -> subprocess.CompletedProcess[str]:
    out = clmq(*args, "--namesrv", ns, cwd=tmp_path, stdin=stdin)
    assert out.returncode == code, (args, out.returncode, out.stdout, out.stderr)
    if code:
        assert out.stderr.startswith("error: ") and len(out.stderr.strip().splitlines()) == 1, out.stderr
    return out


def js(out: subprocess.CompletedProcess[str]) -> Any:
    return json.loads(out.stdout)


def lines(out: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def topic_with(ns: str, tmp_path: Path, topic: str, queues: int, messages: int) -> list[str]:
    """A topic with ``messages`` bodies b0.. spread over its queues; their ids."""
    run(ns, tmp_path, "topic", "create", topic, "--queues", str(queues))
    out = run(ns, tmp_path, "produce", topic, *[f"b{i}" for i in range(messages)], "--keys", "k-all")
    return [line.split()[-1] for line in out.stdout.splitlines()]


def test_topic_update_grows_and_refuses_to_shrink(ns: str, tmp_path: Path) -> None:
    topic_with(ns, tmp_path, "grow", 2, 6)
    run(ns, tmp_path, "topic", "update", "grow", "--queues", "3")
    refused = run(ns, tmp_path, "topic", "update", "grow", "--queues", "1", code=1)
    assert "can grow, not shrink" in refused.stderr
    refused = run(ns, tmp_path, "topic", "create", "grow", "--queues", "2", code=1)  # the old defect: "success"
    assert "can grow, not shrink" in refused.stderr
    rows = js(run(ns, tmp_path, "topic", "describe", "grow", "-o", "json"))
    assert [r["queue_id"] for r in rows] == [0, 1, 2] and sum(r["messages"] for r in rows) == 6
    for r in rows:  # a queue's bytes: the sizes of the records it holds
        held = lines(
            run(ns, tmp_path, "message", "read", "grow", "--queue", str(r["queue_id"]), "--count", "10", "-o", "json")
        )
        assert r["size_bytes"] == sum(m["size"] for m in held) and (r["size_bytes"] > 0) == bool(held)
    run(ns, tmp_path, "topic", "update", "absent", "--queues", "3", code=1)
    run(ns, tmp_path, "topic", "describe", "absent", code=1)
    run(ns, tmp_path, "topic", "delete", "absent", code=1)
    assert "grow" in js(run(ns, tmp_path, "topic", "list", "-o", "json"))


def test_produce_with_properties_a_queue_a_file_and_binary_bodies(ns: str, tmp_path: Path) -> None:
    run(ns, tmp_path, "topic", "create", "props", "--queues", "4")
    run(
        ns,
        tmp_path,
        "produce",
        "props",
        "hello",
        "--queue",
        "2",
        "--property",
        "colour=red",
        "--property",
        "n=1",
        "--tags",
        "T",
        "--keys",
        "key-1",
    )
    (tmp_path / "in.txt").write_bytes(b"one\ntwo\n")
    run(ns, tmp_path, "produce", "props", "--file", str(tmp_path / "in.txt"), "--queue", "2")
    run(ns, tmp_path, "produce", "props", "--queue", "2", stdin=b"\xff\xfe\x00binary\n")
    got = lines(
        run(ns, tmp_path, "message", "read", "props", "--queue", "2", "--offset", "0", "--count", "10", "-o", "json")
    )
    assert [g.get("body") for g in got] == ["hello", "one", "two", None]
    assert got[3]["body_base64"] == "//4AYmluYXJ5"  # not UTF-8: base64, not a traceback
    assert got[0]["properties"]["colour"] == "red" and got[0]["tags"] == "T" and got[0]["keys"] == "key-1"
    run(ns, tmp_path, "produce", "props", "x", "--queue", "9", code=1)
    run(ns, tmp_path, "produce", "props", "x", "--property", "novalue", code=2)
    run(ns, tmp_path, "produce", "props", "--file", str(tmp_path / "absent.txt"), code=2)


def test_a_message_by_id_and_by_key(ns: str, tmp_path: Path) -> None:
    ids = topic_with(ns, tmp_path, "lookup", 2, 4)
    got = js(run(ns, tmp_path, "message", "get", ids[2], "-o", "json"))
    assert got["body"] == "b2" and got["msg_id"] == ids[2]
    addr, _, hexoff = ids[2].rpartition("@")
    run(ns, tmp_path, "message", "get", f"{addr}@{int(hexoff, 16) + 3:016X}", code=1)  # no record starts there
    run(ns, tmp_path, "message", "get", "not-an-id", code=2)
    run(ns, tmp_path, "produce", "lookup", "keyed", "--keys", "order-7 other")
    found = lines(run(ns, tmp_path, "message", "find", "lookup", "--key", "order-7", "-o", "json"))
    assert [f["body"] for f in found] == ["keyed"]
    run(ns, tmp_path, "message", "find", "lookup", "--key", "order-8", code=1)
    assert len(lines(run(ns, tmp_path, "message", "find", "lookup", "--key", "k-all", "-o", "json"))) == 4
    run(ns, tmp_path, "message", "find", "lookup", "--key", "k-all", "--since", "2001-01-01", "--until=-1d", code=1)
    run(ns, tmp_path, "message", "read", "lookup", "--queue", "7", code=1)


def test_group_reset_offsets_dry_run_then_each_target(ns: str, tmp_path: Path) -> None:
    topic_with(ns, tmp_path, "resets", 1, 5)
    run(ns, tmp_path, "consume", "resets", "--group", "rg", "--count", "5")
    dry = js(
        run(
            ns,
            tmp_path,
            "group",
            "reset-offsets",
            "rg",
            "--topic",
            "resets",
            "--to-earliest",
            "--dry-run",
            "-o",
            "json",
        )
    )
    assert [(r["before"], r["after"]) for r in dry] == [(5, 0)]
    assert js(run(ns, tmp_path, "group", "describe", "rg", "-o", "json"))["lag"] == 0  # a dry run changes nothing
    for target, after in (
        (["--to-earliest"], 0),
        (["--to-offset", "3"], 3),
        (["--to-offset", "99"], 5),
        (["--to-latest"], 5),
        (["--to-time", "2001-01-01T00:00:00Z"], 0),
        (["--by-duration", "1h"], 0),
    ):
        rows = js(
            run(ns, tmp_path, "group", "reset-offsets", "rg", "--topic", "resets", *target, "--execute", "-o", "json")
        )
        assert [r["after"] for r in rows] == [after], target
    again = lines(run(ns, tmp_path, "consume", "resets", "--group", "rg", "--idle-timeout", "2", "-o", "json"))
    assert [r["body"] for r in again] == [f"b{i}" for i in range(5)]  # reset to an hour ago: everything again
    run(ns, tmp_path, "group", "reset-offsets", "rg", "--topic", "nope", "--to-earliest", code=1)
    run(ns, tmp_path, "group", "reset-offsets", "rg", "--topic", "resets", "--to-time", "yesterday", code=2)


def test_group_describe_members_and_delete(ns: str, tmp_path: Path) -> None:
    topic_with(ns, tmp_path, "groups", 1, 2)
    run(ns, tmp_path, "consume", "groups", "--group", "dg", "--count", "2")
    assert js(run(ns, tmp_path, "group", "members", "dg", "-o", "json")) == []  # it left
    assert "dg" in [g["group"] for g in js(run(ns, tmp_path, "group", "list", "-o", "json"))]
    run(ns, tmp_path, "group", "delete", "dg")
    run(ns, tmp_path, "group", "describe", "dg", code=1)  # the old defect: an empty table and exit 0
    run(ns, tmp_path, "group", "delete", "dg", code=1)
    run(ns, tmp_path, "group", "members", "never-was", code=1)


def test_the_dev_demo_leaves_no_group_behind(ns: str, tmp_path: Path) -> None:
    trio.run(_demo, ns)
    groups = [g["group"] for g in js(run(ns, tmp_path, "group", "list", "-o", "json"))]
    assert not [g for g in groups if g.startswith("demo-")], groups


def test_broker_status_shows_store_connections_and_rates(ns: str, tmp_path: Path) -> None:
    topic_with(ns, tmp_path, "status", 1, 3)
    rows = js(run(ns, tmp_path, "cluster", "list", "-o", "json"))
    addr = rows["brokers"][0]["addr"]
    status = clmq("broker", "status", "--addr", addr, "-o", "json", cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    info = json.loads(status.stdout)["broker"]
    assert info["version"] and info["segments"] >= 1 and info["store_bytes"] > 0 and "messages_in_per_s" in info
    table = clmq("broker", "status", "--addr", addr, cwd=tmp_path)
    assert "store bytes" in table.stdout and "messages in per" in table.stdout, table.stdout
    bad = clmq("broker", "status", "--addr", "nowhere", cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.startswith("error: address 'nowhere'"), bad.stderr


def test_members_and_their_queues_while_one_consumes_and_delete_refused_meanwhile(ns: str, tmp_path: Path) -> None:
    import os
    import signal

    from tests.cli_helpers import popen
    from tests.waiting import wait_until

    topic_with(ns, tmp_path, "membered", 3, 3)
    proc = popen(
        "consume",
        "membered",
        "--group",
        "mg",
        "--namesrv",
        ns,
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:

        def members() -> list[dict[str, Any]]:
            out = clmq("group", "members", "mg", "-o", "json", "--namesrv", ns, cwd=tmp_path)
            return json.loads(out.stdout) if out.returncode == 0 else []

        wait_until(lambda: len(members()) == 1, 30, "the consumer to join group mg")
        (member,) = members()
        assert member["mode"] == "clustering" and [q[2] for q in member["queues"]] == [0, 1, 2]
        refused = run(ns, tmp_path, "group", "delete", "mg", code=1)
        assert "member(s) connected" in refused.stderr
        refused = run(ns, tmp_path, "group", "reset-offsets", "mg", "--topic", "membered", "--to-earliest", code=1)
        assert "members connected" in refused.stderr
    finally:
        os.kill(proc.pid, signal.SIGINT)
        proc.wait(30)

"""``clmq user`` and ``clmq acl`` through the real CLI: online against a ``clmq dev``
and a cluster of two broker groups (one with a follower), offline on a stopped broker's
data directory and a name server's file; ``-o json``; the password never in any
output; bad input one line with its exit code; ``clmq store check`` showing
``security.json``."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from clmq.broker.store import Store, StoreConfig
from clmq.commitlog import previous_path, write_json
from clmq.protocol import RequestCode
from clmq.protocol.auth import ScramClient, ScramError, ScramServer, SecurityState, decoy_credential, load_security
from tests.cli_helpers import ENV, clmq, free_port, running_dev
from tests.replica_procs import open_group
from tests.waiting import await_until

PASSWORD = "Wh1te-Rabbit-42"  # must never be printed
OTHER = "Ch3shire-Cat-77"
FAST = ("--iterations", "4096")


@pytest.fixture(scope="module")
def ns(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_dev(tmp_path_factory.mktemp("security")) as addr:
        yield addr


def run(
    tmp_path: Path, *args: str, code: int | None = 0, stdin: bytes | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``clmq args`` (with ``env`` added to its environment): its exit code must be
    ``code`` (None: any; an error: one line), and no password appears in what it printed."""
    done = subprocess.run(
        [sys.executable, "-m", "clmq", *args],
        cwd=tmp_path,
        capture_output=True,
        timeout=120,
        env={**ENV, **(env or {})},
        input=stdin if stdin is not None else b"",
    )
    out = subprocess.CompletedProcess(done.args, done.returncode, done.stdout.decode(), done.stderr.decode())
    assert code is None or out.returncode == code, (args, out.returncode, out.stdout, out.stderr)
    if code:
        assert out.stderr.startswith("error: ") and len(out.stderr.strip().splitlines()) == 1, out.stderr
    for secret in (PASSWORD, OTHER):
        assert secret not in out.stdout and secret not in out.stderr, (args, out.stdout, out.stderr)
    return out


def js(out: subprocess.CompletedProcess[str]) -> Any:
    return json.loads(out.stdout)


def logs_in(state: SecurityState, user: str, password: str, mechanism: str = "SCRAM-SHA-256") -> bool:
    """Does a SCRAM exchange of ``user`` with ``password`` succeed against ``state``?"""
    server = ScramServer(
        mechanism, lambda u: state.credential(u, mechanism), lambda u: decoy_credential(b"s" * 32, mechanism, u)
    )
    client = ScramClient(mechanism, user, password)
    try:
        client.check(server.final(client.final(server.first(client.first()))))
    except ScramError:
        return False
    return True


# ------------------------------------------------------------------ online, one group
def test_user_add_list_passwd_delete_online(ns: str, tmp_path: Path) -> None:
    at = ("--namesrv", ns)
    added = js(
        run(
            tmp_path,
            "user",
            "add",
            "alice",
            "--password-stdin",
            *FAST,
            *at,
            "-o",
            "json",
            stdin=f"{PASSWORD}\n".encode(),
        )
    )
    assert added == {"user": "alice", "mechanisms": ["SCRAM-SHA-256", "SCRAM-SHA-512"], "on": ["broker-a"]}
    env = {"NEWPW": OTHER}
    run(
        tmp_path,
        "user",
        "add",
        "bob",
        "--new-password-env",
        "NEWPW",
        "--mechanism",
        "SCRAM-SHA-512",
        *FAST,
        *at,
        env=env,
    )
    listed = {u["user"]: u for u in js(run(tmp_path, "user", "list", *at, "-o", "json"))}
    assert listed["alice"]["mechanisms"] == ["SCRAM-SHA-256", "SCRAM-SHA-512"]
    assert listed["bob"] == {"user": "bob", "mechanisms": ["SCRAM-SHA-512"], "on": ["broker-a"]}
    piped = run(tmp_path, "user", "list", *at).stdout.splitlines()  # a pipe: tab-separated lines
    assert "user\tmechanisms\ton" in piped and "bob\tSCRAM-SHA-512\tbroker-a" in piped

    # passwd keeps the user's mechanisms unless told; an unknown user is refused before any prompt
    changed = js(
        run(tmp_path, "user", "passwd", "bob", "--password-stdin", *FAST, *at, "-o", "json", stdin=PASSWORD.encode())
    )
    assert changed["mechanisms"] == ["SCRAM-SHA-512"]
    missing = run(tmp_path, "user", "passwd", "carol", "--password-stdin", *at, code=1, stdin=b"x\n")
    assert "no user 'carol'" in missing.stderr

    deleted = js(run(tmp_path, "user", "delete", "bob", *at, "-o", "json"))
    assert deleted == {"user": "bob", "on": ["broker-a"]}
    assert "no user 'bob'" in run(tmp_path, "user", "delete", "bob", *at, code=1).stderr
    assert [u["user"] for u in js(run(tmp_path, "user", "list", *at, "-o", "json"))] == ["alice"]
    run(tmp_path, "user", "delete", "alice", *at)


def test_acl_add_list_remove_online(ns: str, tmp_path: Path) -> None:
    at = ("--namesrv", ns)
    added = js(
        run(tmp_path, "acl", "add", "--allow", "--principal", "User:app", "--principal", "User:ops",
            "--operation", "read,write", "--topic", "orders", *at, "-o", "json")
    )  # fmt: skip
    assert len(added["acls"]) == 4 and added["on"] == ["broker-a"]
    assert added["acls"][0] == {
        "resource_type": "topic", "name": "orders", "pattern": "literal", "principal": "User:app",
        "host": "*", "operation": "read", "permission": "allow",
    }  # fmt: skip
    run(tmp_path, "acl", "add", "--deny", "--principal", "User:app", "--operation", "describe", "--group", "pay",
        "--prefixed", "--host", "10.0.0.9", *at)  # fmt: skip
    run(tmp_path, "acl", "add", "--allow", "--principal", "User:*", "--operation", "cluster-action", "--cluster", *at)

    every = js(run(tmp_path, "acl", "list", *at, "-o", "json"))
    assert len(every) == 6 and all(a["on"] == ["broker-a"] for a in every)
    mine = js(run(tmp_path, "acl", "list", "--principal", "User:app", "--allow", *at, "-o", "json"))
    assert {(a["operation"], a["name"]) for a in mine} == {("read", "orders"), ("write", "orders")}
    prefixed = js(run(tmp_path, "acl", "list", "--group", "payments", "--match", *at, "-o", "json"))
    assert [(a["name"], a["pattern"], a["host"]) for a in prefixed] == [("pay", "prefixed", "10.0.0.9")]
    assert len(js(run(tmp_path, "acl", "list", "--topic", *at, "-o", "json"))) == 4  # --topic alone: any topic
    piped = run(tmp_path, "acl", "list", "--cluster", *at).stdout.splitlines()
    assert "User:*\tallow\tcluster-action\t*\tcluster\tliteral\tbroker-a" in piped

    refused = run(tmp_path, "acl", "remove", *at, code=2)  # an empty filter: safe by default
    assert "--all" in refused.stderr
    gone = js(run(tmp_path, "acl", "remove", "--principal", "User:ops", *at, "-o", "json"))
    assert len(gone["removed"]) == 2 and {a["principal"] for a in gone["removed"]} == {"User:ops"}
    assert "no ACL matches" in run(tmp_path, "acl", "remove", "--principal", "User:ops", *at, code=1).stderr
    assert len(js(run(tmp_path, "acl", "remove", "--all", *at, "-o", "json"))["removed"]) == 4
    assert js(run(tmp_path, "acl", "list", *at, "-o", "json")) == []


def test_bad_input_is_one_line_with_its_exit_code(ns: str, tmp_path: Path) -> None:
    at = ("--namesrv", ns)
    stdin = f"{PASSWORD}\n".encode()
    for args, code, said in [
        (("user", "add", "bad:name", "--password-stdin"), 2, "a user name is"),
        (("user", "add", "dave"), 2, "no password"),  # stdin is not a terminal: no prompt
        (("user", "add", "dave", "--new-password-env", "NOT_SET_ANYWHERE"), 2, "NOT_SET_ANYWHERE"),
        (("user", "add", "dave", "--password-stdin", "--iterations", "10"), 2, "--iterations"),
        (("acl", "add", "--allow", "--principal", "alice", "--operation", "read", "--topic", "t"), 2, "User:"),
        (("acl", "add", "--allow", "--principal", "User:a", "--operation", "fly", "--topic", "t"), 2, "'fly'"),
        (("acl", "list", "--topic", "--match"), 2, "--match needs a resource"),
        (("acl", "remove", "--deny"), 1, "no ACL matches"),
    ]:
        assert said in run(tmp_path, *args, *at, code=code, stdin=stdin).stderr
    run(tmp_path, "user", "add", "dave", "--password-stdin", code=2, stdin=b"\n")  # an empty password
    unreachable = ("--namesrv", f"127.0.0.1:{free_port()}")
    run(tmp_path, "user", "list", *unreachable, code=3)
    run(tmp_path, "user", "add", "dave", "--password-stdin", *FAST, *unreachable, code=3, stdin=stdin)
    both = clmq("acl", "list", "--data-dir", str(tmp_path), "--file", str(tmp_path / "f"), cwd=tmp_path)
    assert both.returncode == 2 and "not allowed with" in both.stderr  # argparse's own usage error


# ------------------------------------------------------------------ offline
def test_offline_on_a_stopped_brokers_data_dir_and_a_name_servers_file(tmp_path: Path) -> None:
    data = tmp_path / "b0"
    data.mkdir()
    # the first super user, before the broker's first start
    env = {"BOOT": PASSWORD}
    out = run(
        tmp_path,
        "user",
        "add",
        "admin",
        "--data-dir",
        str(data),
        "--password-env",
        "BOOT",
        *FAST,
        "-o",
        "json",
        env=env,
    )
    assert js(out)["on"] == [str(data / "security.json")]
    run(
        tmp_path,
        "acl",
        "add",
        "--allow",
        "--principal",
        "User:admin",
        "--operation",
        "all",
        "--cluster",
        "--data-dir",
        str(data),
    )
    state = load_security(data / "security.json")
    assert set(state.users) == {"admin"} and len(state.acls) == 1
    assert logs_in(state, "admin", PASSWORD) and logs_in(state, "admin", PASSWORD, "SCRAM-SHA-512")
    assert not logs_in(state, "admin", OTHER)
    assert PASSWORD.encode() not in (data / "security.json").read_bytes()

    run(tmp_path, "user", "passwd", "admin", "--data-dir", str(data), "--password-stdin", *FAST, stdin=OTHER.encode())
    state = load_security(data / "security.json")
    assert logs_in(state, "admin", OTHER) and not logs_in(state, "admin", PASSWORD)
    assert previous_path(data / "security.json").exists()  # the previous generation kept
    listed = js(run(tmp_path, "user", "list", "--data-dir", str(data), "-o", "json"))
    assert [u["user"] for u in listed] == ["admin"]
    assert "no user 'nobody'" in run(tmp_path, "user", "delete", "nobody", "--data-dir", str(data), code=1).stderr
    missing_dir = run(tmp_path, "user", "list", "--data-dir", str(tmp_path / "nowhere"), code=2)
    assert "does not exist" in missing_dir.stderr

    # a name server's security_file: created where its directory exists
    ns_file = tmp_path / "ns-security.json"
    run(tmp_path, "user", "add", "broker", "--file", str(ns_file), "--password-stdin", *FAST, stdin=PASSWORD.encode())
    run(tmp_path, "acl", "add", "--allow", "--principal", "User:broker", "--operation", "cluster_action", "--cluster",
        "--file", str(ns_file))  # fmt: skip
    acls = js(run(tmp_path, "acl", "list", "--file", str(ns_file), "-o", "json"))
    assert [(a["principal"], a["operation"], a["on"]) for a in acls] == [
        ("User:broker", "cluster-action", [str(ns_file)])
    ]
    assert logs_in(load_security(ns_file), "broker", PASSWORD)
    run(tmp_path, "acl", "remove", "--all", "--file", str(ns_file))
    assert load_security(ns_file).acls == ()


def test_offline_change_refused_while_the_broker_runs(tmp_path: Path) -> None:
    with running_dev(tmp_path) as ns:
        data = tmp_path / "dev-data"
        refused = run(tmp_path, "user", "add", "x", "--data-dir", str(data), "--password-stdin", *FAST, code=1,
                      stdin=PASSWORD.encode())  # fmt: skip
        assert "in use" in refused.stderr and "stop the broker" in refused.stderr
        run(tmp_path, "acl", "add", "--allow", "--principal", "User:x", "--operation", "read", "--topic", "t",
            "--data-dir", str(data), code=1)  # fmt: skip
        run(tmp_path, "user", "add", "x", "--password-stdin", *FAST, "--namesrv", ns, stdin=PASSWORD.encode())
        # reading needs no lock: the running broker's file shows the user added online
        assert [u["user"] for u in js(run(tmp_path, "user", "list", "--data-dir", str(data), "-o", "json"))] == ["x"]
    # stopped: the change goes in, and the broker has it at its next start
    run(tmp_path, "user", "delete", "x", "--data-dir", str(data))
    assert load_security(data / "security.json").users == {}


def test_store_check_shows_the_users_and_acls_file(tmp_path: Path) -> None:
    data = tmp_path / "store"
    Store.open(StoreConfig(data)).close()
    run(tmp_path, "user", "add", "admin", "--data-dir", str(data), "--password-stdin", *FAST, stdin=PASSWORD.encode())
    run(tmp_path, "acl", "add", "--allow", "--principal", "User:admin", "--operation", "read,write", "--topic", "t",
        "--data-dir", str(data))  # fmt: skip
    report = js(run(tmp_path, "store", "check", str(data), "-o", "json"))
    sec = next(m for m in report["metadata"] if m["file"].endswith("security.json"))
    assert (sec["state"], sec["users"], sec["acls"]) == ("ok", 1, 2), sec
    assert "1 users, 2 ACLs" in run(tmp_path, "store", "check", str(data)).stdout

    path = data / "security.json"
    path.write_bytes(path.read_bytes()[:-3] + b"xyz")  # the current generation damaged: the previous one is used
    damaged = clmq("store", "check", str(data), "-o", "json", cwd=tmp_path)
    assert damaged.returncode == 1
    sec = next(m for m in json.loads(damaged.stdout)["metadata"] if m["file"].endswith("security.json"))
    assert sec["state"] == "previous" and sec["users"] == 1 and sec["acls"] == 0  # as before acl add
    assert clmq("store", "repair", str(data), "--yes", cwd=tmp_path).returncode == 0
    assert clmq("store", "check", str(data), cwd=tmp_path).returncode == 0  # written back

    # a generation that checks but is not users and ACLs is damage too (the broker would refuse it)
    write_json(path, {"version": "x"})
    write_json(path, {"users": 7})
    bad = clmq("store", "check", str(data), cwd=tmp_path)
    assert bad.returncode == 1 and "damaged" in bad.stdout, bad.stdout
    listed = run(tmp_path, "user", "list", "--data-dir", str(data), code=1)
    assert "no generation" in listed.stderr


# ------------------------------------------------------------------ two groups and a follower
async def test_users_and_acls_reach_every_groups_leader_and_a_follower(tmp_path: Path) -> None:
    async with open_group(tmp_path) as g:
        await g.start_broker("a0", 0, broker_name="ga")
        await g.start_broker("a1", 1, broker_name="ga", follow="a0")
        await g.start_broker("b0", 0, broker_name="gb")
        await g.wait_cluster(lambda rows: len(rows) == 3, 30, "three brokers registered")
        await g.wait_in_sync("a0", ["a1"])

        def cli(*args: str, stdin: bytes | None = None) -> Any:
            return js(run(tmp_path, *args, "--namesrv", g.ns_addr, "-o", "json", stdin=stdin))

        added = await trio.to_thread.run_sync(
            lambda: cli("user", "add", "app", "--password-stdin", *FAST, stdin=PASSWORD.encode())
        )
        assert sorted(added["on"]) == ["ga", "gb"]
        acl = ("acl", "add", "--allow", "--principal", "User:app", "--operation", "write", "--topic", "orders")
        assert sorted((await trio.to_thread.run_sync(lambda: cli(*acl)))["on"]) == ["ga", "gb"]
        for key in ("a0", "b0"):  # each leader has its own copy
            reply = await g.call(key, RequestCode.ACL_DESCRIBE, {"filter": [""] * 7})
            assert reply.fields["acls"] == [["TOPIC", "orders", "LITERAL", "User:app", "*", "WRITE", "ALLOW"]]
        listed = await trio.to_thread.run_sync(lambda: cli("acl", "list"))
        assert [sorted(a["on"]) for a in listed] == [["ga", "gb"]]

        async def follower_has_it() -> bool:
            reply = await g.call("a1", RequestCode.USER_LIST)
            return reply.fields.get("users") == [["app", ["SCRAM-SHA-256", "SCRAM-SHA-512"]]]

        await await_until(follower_has_it, 30, "the follower to copy the users")
        acls = (await g.call("a1", RequestCode.ACL_DESCRIBE, {"filter": [""] * 7})).fields["acls"]
        assert acls == [["TOPIC", "orders", "LITERAL", "User:app", "*", "WRITE", "ALLOW"]]
        # the follower refuses changes: they go to the leader
        refused = await g.call("a1", RequestCode.ACL_DELETE, {"filter": [""] * 7})
        assert refused.error_code

        removed = await trio.to_thread.run_sync(lambda: cli("acl", "remove", "--principal", "User:app"))
        assert len(removed["removed"]) == 1
        assert await trio.to_thread.run_sync(lambda: cli("acl", "list")) == []
        await trio.to_thread.run_sync(lambda: cli("user", "delete", "app"))
        state = load_security(g["a0"].data_dir / "security.json")
        assert state.users == {} and not state.acls


# ------------------------------------------------------------------ a cluster that requires logins
async def test_with_logins_required_the_first_super_user_made_offline_manages_the_rest(tmp_path: Path) -> None:
    data, ns_file = tmp_path / "a0", tmp_path / "ns-security.json"
    data.mkdir()
    env = {"ADMIN_PW": PASSWORD, "APP_PW": OTHER, "BROKER_PW": "broker-pw"}

    def cli(
        *args: str, code: int | None = 0, stdin: bytes | None = None, **more: str
    ) -> subprocess.CompletedProcess[str]:
        return run(tmp_path, *args, code=code, env={**env, **more}, stdin=stdin)

    # offline, before the first start: the super user on the broker, and the name server's users and ACLs
    cli("user", "add", "admin", "--data-dir", str(data), "--password-env", "ADMIN_PW", *FAST)
    for user, var in (("admin", "ADMIN_PW"), ("app", "APP_PW"), ("broker", "BROKER_PW")):
        cli("user", "add", user, "--file", str(ns_file), "--password-env", var, *FAST)
    for user, op in (("broker", "cluster-action"), ("app", "describe")):
        cli(
            "acl",
            "add",
            "--allow",
            "--principal",
            f"User:{user}",
            "--operation",
            op,
            "--cluster",
            "--file",
            str(ns_file),
        )
    async with open_group(tmp_path) as g:
        assert g.nameserver is not None
        await g.nameserver.kill()  # again, with logins
        secured = {"auth_enabled": True, "super_users": ["User:admin"], "auth_failure_delay_ms": 0}
        await g.start_nameserver(security_file=str(ns_file), **secured)
        await g.start_broker("a0", 0, broker_name="ga", broker_user="broker", broker_password="broker-pw", **secured)
        at = ("--namesrv", g.ns_addr)
        admin = ("--user", "admin", "--password-env", "ADMIN_PW")
        app = ("--user", "app", "--password-env", "APP_PW")

        def in_thread(*args: str, code: int | None = 0, stdin: bytes | None = None, **more: str) -> Any:
            return trio.to_thread.run_sync(lambda: cli(*args, *at, code=code, stdin=stdin, **more))

        async def registered() -> bool:  # the broker logged in to the name server as "broker"
            return (await in_thread("user", "list", *admin, code=None)).returncode == 0

        await await_until(registered, 30, "the broker to register")
        anonymous = await in_thread("user", "list", code=1)  # refused, not unreachable (3)
        assert "AUTHENTICATION_REQUIRED" in anonymous.stderr
        await in_thread("user", "add", "app", "--new-password-env", "APP_PW", *FAST, *admin)
        assert [u["user"] for u in js(await in_thread("user", "list", *admin, "-o", "json"))] == ["admin", "app"]
        # app may neither list users (DESCRIBE on the cluster) nor change ACLs (ALTER on it)
        assert "NOT_AUTHORIZED" in (await in_thread("user", "list", *app, code=1)).stderr
        add_acl = ("acl", "add", "--allow", "--principal", "User:app", "--operation", "describe", "--cluster")
        assert "NOT_AUTHORIZED" in (await in_thread(*add_acl, *app, code=1)).stderr
        await in_thread(*add_acl, *admin)
        assert [u["user"] for u in js(await in_thread("user", "list", *app, "-o", "json"))] == ["admin", "app"]
        wrong = await in_thread("user", "list", *app, code=1, APP_PW="not-it")
        assert "AUTHENTICATION_FAILED" in wrong.stderr, wrong.stderr
        # a new password: online on the broker, offline in the name server's file; the old one fails
        await in_thread("user", "passwd", "app", "--password-stdin", *FAST, *admin, stdin=b"third-pw\n")
        run(tmp_path, "user", "passwd", "app", "--file", str(ns_file), "--password-stdin", *FAST, stdin=b"third-pw\n")
        assert "AUTHENTICATION_FAILED" in (await in_thread("user", "list", *app, code=1)).stderr

        async def new_password_works() -> bool:  # the name server reads its file again when it changes
            return (await in_thread("user", "list", *app, code=None, APP_PW="third-pw")).returncode == 0

        await await_until(new_password_works, 30, "a login with the new password")
        # offline is refused while the broker runs
        assert "in use" in (await in_thread("user", "delete", "app", "--data-dir", str(data), code=1)).stderr

"""``clmq user add|passwd|list|delete`` and ``clmq acl add|list|remove``: the users who
log in (SCRAM-SHA-256/512) and the ACLs that decide what they may do.

Online (``--namesrv``, the default), a change goes to every broker group's leader
(followers copy it). Offline, the file is edited directly: ``--data-dir DIR`` (a
stopped broker's ``security.json``: refused while the broker runs) or ``--file PATH``
(a name server's ``security_file``). The offline form makes the first super user.

A password is never an argument (argv is visible to every user of the machine): it is
typed at a prompt without echo, read from stdin (``--password-stdin``) or from an
environment variable (``--new-password-env VAR``; offline, where there is no login,
``--password-env VAR`` too). The credential is salted here; the password is never
sent, logged nor printed."""

from __future__ import annotations

import argparse
import getpass
import os
import sys
from pathlib import Path
from typing import Any

import trio

from clmq.client import Admin, open_admin
from clmq.protocol.auth import (
    CLUSTER_NAME,
    DEFAULT_ITERATIONS,
    MECHANISMS,
    MIN_ITERATIONS,
    AclBinding,
    AclFilter,
    Operation,
    PatternType,
    Permission,
    ResourceType,
    check_user_name,
    make_credential,
)

from ._common import add_client_args, addrs, run_client
from ._errors import EXIT_FAILED, EXIT_USAGE, CliError
from ._output import emit, note
from ._security_files import OfflineSecurity

OPERATIONS = [op for op in Operation if op is not Operation.ANY]


def add_command(sub: Any) -> None:
    """Add ``clmq user`` and ``clmq acl`` to the parser."""
    user = sub.add_parser("user", help="users who log in (SCRAM-SHA-256/512): add, passwd, list, delete")
    usub = user.add_subparsers(dest="user_command", required=True)
    add = usub.add_parser("add", help="add a user (or set its password); the password is asked, never an argument")
    passwd = usub.add_parser("passwd", help="set an existing user's password")
    for p in (add, passwd):
        p.add_argument("name", help="the user's name (letters, digits, . _ @ -)")
        _password_args(p, default_mechanisms=p is add)
    usub.add_parser("list", help="every user and its SCRAM mechanisms")
    usub.add_parser("delete", help="delete a user").add_argument("name", help="the user")
    _target_args(usub.choices)
    user.set_defaults(func=cmd_user)

    acl = sub.add_parser("acl", help="access control lists: who may do what on which topic, group or the cluster")
    asub = acl.add_subparsers(dest="acl_command", required=True)
    _acl_add_args(asub.add_parser("add", help="allow or deny principals operations on a resource"))
    lst = asub.add_parser("list", help="the ACLs (all, or those the selectors pick)")
    _filter_args(lst, match=True)
    remove = asub.add_parser("remove", help="remove the ACLs the selectors pick (every ACL only with --all)")
    _filter_args(remove, match=False)
    remove.add_argument("--all", action="store_true", dest="remove_all", help="allow an empty filter: remove every ACL")
    _target_args(asub.choices)
    acl.set_defaults(func=cmd_acl)


def _password_args(p: argparse.ArgumentParser, default_mechanisms: bool) -> None:
    source = p.add_mutually_exclusive_group()
    source.add_argument(
        "--password-stdin", action="store_true", help="read the new password from stdin (its first line)"
    )
    source.add_argument("--new-password-env", metavar="VAR", help="read the new password from environment variable VAR")
    p.add_argument(
        "--mechanism",
        action="append",
        dest="mechanisms",
        choices=list(MECHANISMS),
        help="SCRAM mechanism (repeatable; default "
        + ("both" if default_mechanisms else "the user's present ones")
        + ")",
    )
    p.add_argument(
        "--iterations",
        type=int,
        default=DEFAULT_ITERATIONS,
        help=f"PBKDF2 iterations of the salted password (default {DEFAULT_ITERATIONS}, at least {MIN_ITERATIONS})",
    )


def _target_args(parsers: dict[str, argparse.ArgumentParser]) -> None:
    """``--namesrv`` (online) or, offline, ``--data-dir`` or ``--file``; ``-o``."""
    add_client_args(parsers)
    for p in parsers.values():
        offline = p.add_mutually_exclusive_group()
        offline.add_argument(
            "--data-dir", type=Path, help="offline: a stopped broker's data directory (its security.json)"
        )
        offline.add_argument("--file", type=Path, help="offline: a name server's security_file")


def _resource_args(p: argparse.ArgumentParser, required: bool) -> None:
    what = p.add_mutually_exclusive_group(required=required)
    # A filter may name no resource (``--topic`` alone: every topic's ACLs).
    more: dict[str, Any] = {} if required else {"nargs": "?", "const": ""}
    what.add_argument("--topic", metavar="NAME", help="a topic ('*': every topic)", **more)
    what.add_argument("--group", metavar="NAME", help="a consumer group ('*': every group)", **more)
    what.add_argument("--cluster", action="store_true", help="the cluster (admin actions, replication)")


def _acl_add_args(p: argparse.ArgumentParser) -> None:
    permission = p.add_mutually_exclusive_group(required=True)
    permission.add_argument("--allow", action="store_true", help="allow the operations")
    permission.add_argument("--deny", action="store_true", help="deny them (a deny wins over any allow)")
    p.add_argument(
        "--principal", action="append", required=True, help="User:NAME or User:* (repeatable)", metavar="User:NAME"
    )
    p.add_argument("--host", default="*", help="only from this address (default *: any)")
    p.add_argument(
        "--operation",
        action="append",
        required=True,
        help="comma-separated, repeatable: " + ", ".join(_op_name(o) for o in OPERATIONS),
    )
    _resource_args(p, required=True)
    p.add_argument("--prefixed", action="store_true", help="the name is a prefix: every resource it begins")


def _filter_args(p: argparse.ArgumentParser, match: bool) -> None:
    permission = p.add_mutually_exclusive_group()
    permission.add_argument("--allow", action="store_true", help="only ACLs that allow")
    permission.add_argument("--deny", action="store_true", help="only ACLs that deny")
    p.add_argument("--principal", help="only this principal's (User:NAME)")
    p.add_argument("--host", help="only ACLs of this host")
    p.add_argument("--operation", help="only ACLs of this operation")
    _resource_args(p, required=False)
    pattern = p.add_mutually_exclusive_group()
    pattern.add_argument("--prefixed", action="store_true", help="only prefixed ACLs")
    pattern.add_argument("--literal", action="store_true", help="only literal ACLs")
    if match:
        pattern.add_argument(
            "--match", action="store_true", help="every ACL that applies to the named resource (wildcard, prefixes)"
        )


# ------------------------------------------------------------------ names
def _op_name(op: Operation) -> str:
    return op.name.lower().replace("_", "-")


def _operation(text: str) -> Operation:
    key = text.strip().upper().replace("-", "_")
    if key not in Operation.__members__ or key == "ANY":
        choices = ", ".join(_op_name(o) for o in OPERATIONS)
        raise CliError(f"--operation {text.strip()!r}: one of {choices}", EXIT_USAGE)
    return Operation[key]


def binding_fields(b: AclBinding) -> dict[str, str]:
    """A binding for ``-o json``: lower-case names, as the flags take them."""
    return {
        "resource_type": b.resource_type.name.lower(),
        "name": b.name,
        "pattern": b.pattern.name.lower(),
        "principal": b.principal,
        "host": b.host,
        "operation": _op_name(b.operation),
        "permission": b.permission.name.lower(),
    }


def _binding_row(b: AclBinding, on: list[str]) -> list[Any]:
    resource = "cluster" if b.resource_type is ResourceType.CLUSTER else f"{b.resource_type.name.lower()}:{b.name}"
    return [b.principal, b.permission.name.lower(), _op_name(b.operation), b.host, resource, b.pattern.name.lower()] + (
        [", ".join(on)] if on else []
    )


ACL_COLUMNS = ["principal", "permission", "operation", "host", "resource", "pattern"]


def _resource(args: argparse.Namespace) -> tuple[ResourceType, str | None]:
    if args.cluster:
        return ResourceType.CLUSTER, CLUSTER_NAME
    if args.topic is not None:
        return ResourceType.TOPIC, args.topic or None
    if args.group is not None:
        return ResourceType.GROUP, args.group or None
    return ResourceType.ANY, None


def bindings_of(args: argparse.Namespace) -> list[AclBinding]:
    """``acl add``'s bindings: every principal times every operation."""
    rtype, name = _resource(args)
    if not name:
        raise CliError("acl add: name the resource (--topic NAME, --group NAME or --cluster)", EXIT_USAGE)
    pattern = PatternType.PREFIXED if args.prefixed else PatternType.LITERAL
    ops = list(dict.fromkeys(_operation(o) for text in args.operation for o in text.split(",") if o.strip()))
    if not ops:
        raise CliError("--operation: name at least one operation", EXIT_USAGE)
    permission = Permission.ALLOW if args.allow else Permission.DENY
    try:
        return [AclBinding(rtype, name, pattern, p, args.host, op, permission) for p in args.principal for op in ops]
    except ValueError as e:
        raise CliError(str(e), EXIT_USAGE) from None


def filter_of(args: argparse.Namespace) -> AclFilter:
    """``acl list``'s and ``acl remove``'s filter (an empty one matches every ACL)."""
    rtype, name = _resource(args)
    pattern = PatternType.ANY
    if args.prefixed or args.literal:
        pattern = PatternType.PREFIXED if args.prefixed else PatternType.LITERAL
    elif getattr(args, "match", False):
        if not name or rtype is ResourceType.ANY:
            raise CliError("--match needs a resource: --topic NAME, --group NAME or --cluster", EXIT_USAGE)
        pattern = PatternType.MATCH
    permission = Permission.ALLOW if args.allow else Permission.DENY if args.deny else Permission.ANY
    operation = _operation(args.operation) if args.operation else Operation.ANY
    return AclFilter(rtype, name, pattern, args.principal, args.host, operation, permission)


# ------------------------------------------------------------------ passwords
def read_password(args: argparse.Namespace) -> str:
    """The new password: from ``--new-password-env``, ``--password-stdin``, or typed
    twice at a prompt without echo. Never from argv, never printed."""
    var, flag = args.new_password_env, "--new-password-env"
    if not var and not args.password_stdin and (args.data_dir is not None or args.file is not None):
        var, flag = getattr(args, "password_env", None), "--password-env"  # offline there is no login to use it
    if var:
        password = os.environ.get(var, "")
        if not password:
            raise CliError(f"{flag}: ${var} is not set or empty", EXIT_USAGE)
        return password
    if args.password_stdin:
        password = sys.stdin.readline().rstrip("\r\n")
        if not password:
            raise CliError("--password-stdin: stdin gave no password (its first line is the password)", EXIT_USAGE)
        return password
    if not sys.stdin.isatty():
        raise CliError(
            "no password: type it at a terminal, or give --password-stdin or --new-password-env VAR", EXIT_USAGE
        )
    password = getpass.getpass(f"new password for {args.name}: ")
    if not password:
        raise CliError("the password must not be empty", EXIT_USAGE)
    if getpass.getpass("again: ") != password:
        raise CliError("the passwords typed differ: nothing changed", EXIT_USAGE)
    return password


def _check_user_args(args: argparse.Namespace) -> None:
    try:
        check_user_name(args.name)
    except ValueError as e:
        raise CliError(str(e), EXIT_USAGE) from None
    if args.iterations < MIN_ITERATIONS:
        raise CliError(f"--iterations must be at least {MIN_ITERATIONS}, got {args.iterations}", EXIT_USAGE)


# ------------------------------------------------------------------ the verbs
def _offline(args: argparse.Namespace) -> OfflineSecurity | None:
    if args.data_dir is not None:
        return OfflineSecurity.of_data_dir(args.data_dir)
    if args.file is not None:
        return OfflineSecurity.of_file(args.file)
    return None


def cmd_user(args: argparse.Namespace) -> int:
    if args.user_command in ("add", "passwd"):
        _check_user_args(args)
    offline = _offline(args)
    if offline is not None:
        return _user_offline(args, offline)

    async def main() -> int:
        async with open_admin(addrs(args)) as admin:
            return await _user_online(args, admin)

    return run_client(main)


async def _user_online(args: argparse.Namespace, admin: Admin) -> int:
    if args.user_command == "list":
        per_broker = await admin.users_by_broker()
        users: dict[str, tuple[set[str], list[str]]] = {}
        for broker, held in per_broker.items():
            for name, mechs in held.items():
                users.setdefault(name, (set(), []))[0].update(mechs)
                users[name][1].append(broker)
        _show_users(args, {u: (sorted(m), on) for u, (m, on) in users.items()}, list(per_broker))
    elif args.user_command == "delete":
        on = await admin.delete_user(args.name)
        if not on:
            raise CliError(f"no user {args.name!r} (clmq user list shows the users)", EXIT_FAILED)
        _show_user(args, "deleted", [], on)
    else:
        mechanisms = args.mechanisms or list(MECHANISMS)
        if args.user_command == "passwd":
            present = (await admin.list_users()).get(args.name)
            if present is None:
                raise CliError(f"no user {args.name!r} (clmq user add makes one)", EXIT_FAILED)
            mechanisms = args.mechanisms or present
        password = await trio.to_thread.run_sync(read_password, args)  # a prompt blocks
        try:
            on = await admin.add_user(args.name, password, mechanisms=mechanisms, iterations=args.iterations)
        except ValueError as e:
            raise CliError(str(e), EXIT_USAGE) from None
        _show_user(args, "added" if args.user_command == "add" else "password set", mechanisms, on)
    return 0


def _user_offline(args: argparse.Namespace, offline: OfflineSecurity) -> int:
    where = [str(offline.path)]
    if args.user_command == "list":
        users = offline.read().users
        _show_users(args, {u: (sorted(creds), where) for u, creds in users.items()}, where)
        return 0
    present = offline.read().users.get(args.name)
    if present is None and args.user_command != "add":
        what = "clmq user add makes one" if args.user_command == "passwd" else "clmq user list shows the users"
        raise CliError(f"no user {args.name!r} in {offline.path} ({what})", EXIT_FAILED)
    if args.user_command == "delete":
        offline.change(lambda s: s.without_user(args.name))
        _show_user(args, "deleted", [], where)
        return 0
    mechanisms = args.mechanisms or (sorted(present) if args.user_command == "passwd" and present else list(MECHANISMS))
    password = read_password(args)
    try:
        creds = [make_credential(m, password, iterations=args.iterations) for m in dict.fromkeys(mechanisms)]
    except ValueError as e:
        raise CliError(str(e), EXIT_USAGE) from None
    offline.change(lambda s: s.with_user(args.name, creds))
    _show_user(args, "added" if args.user_command == "add" else "password set", mechanisms, where)
    return 0


def _show_user(args: argparse.Namespace, what: str, mechanisms: list[str], on: list[str]) -> None:
    data: dict[str, Any] = {"user": args.name, "mechanisms": mechanisms, "on": on}
    if not mechanisms:
        data.pop("mechanisms")
    emit(
        args,
        f"user {args.name} {what}",
        ["user", "mechanisms", "on"],
        [[args.name, ", ".join(mechanisms) or "-", ", ".join(on)]],
        data=data,
    )


def _show_users(args: argparse.Namespace, users: dict[str, tuple[list[str], list[str]]], everywhere: list[str]) -> None:
    rows = sorted(users.items())
    emit(
        args,
        "users",
        ["user", "mechanisms", "on"],
        [[u, ", ".join(m), ", ".join(on)] for u, (m, on) in rows],
        data=[{"user": u, "mechanisms": m, "on": on} for u, (m, on) in rows],
    )
    partial = [u for u, (_m, on) in rows if len(on) < len(everywhere)]
    if partial:
        note(args, f"not on every group's leader: {', '.join(partial)} (clmq user passwd sets them everywhere)")


def cmd_acl(args: argparse.Namespace) -> int:
    bindings = bindings_of(args) if args.acl_command == "add" else []
    match = filter_of(args) if args.acl_command != "add" else AclFilter()
    if args.acl_command == "remove" and match == AclFilter() and not args.remove_all:
        raise CliError("this would remove every ACL: give selectors, or --all to mean it", EXIT_USAGE)
    offline = _offline(args)
    if offline is not None:
        return _acl_offline(args, offline, bindings, match)

    async def main() -> int:
        async with open_admin(addrs(args)) as admin:
            return await _acl_online(args, admin, bindings, match)

    return run_client(main)


async def _acl_online(args: argparse.Namespace, admin: Admin, bindings: list[AclBinding], match: AclFilter) -> int:
    if args.acl_command == "add":
        _show_change(args, "ACLs added", bindings, await admin.create_acls(bindings), "acls")
    elif args.acl_command == "list":
        per_broker = await admin.acls_by_broker(match)
        found: dict[AclBinding, list[str]] = {}
        for broker, held in per_broker.items():
            for b in held:
                found.setdefault(b, []).append(broker)
        _show_list(args, found, list(per_broker))
    else:
        gone = await admin.delete_acls(match)
        if not gone:
            raise CliError("no ACL matches (clmq acl list shows them)", EXIT_FAILED)
        _show_change(args, "ACLs removed", gone, [b["broker_name"] for b in await admin.leaders()], "removed")
    return 0


def _acl_offline(
    args: argparse.Namespace, offline: OfflineSecurity, bindings: list[AclBinding], match: AclFilter
) -> int:
    where = [str(offline.path)]
    if args.acl_command == "add":
        offline.change(lambda s: s.with_acls(bindings))
        _show_change(args, "ACLs added", bindings, where, "acls")
    elif args.acl_command == "list":
        _show_list(args, {b: where for b in offline.read().acls if match.matches(b)}, where)
    else:
        gone: list[AclBinding] = []

        def remove(s: Any) -> Any:
            new, removed = s.without_acls(match)
            gone.extend(removed)
            return new

        offline.change(remove)
        if not gone:
            raise CliError("no ACL matches (clmq acl list shows them)", EXIT_FAILED)
        _show_change(args, "ACLs removed", gone, where, "removed")
    return 0


def _show_change(args: argparse.Namespace, what: str, bindings: list[AclBinding], on: list[str], key: str) -> None:
    emit(
        args,
        f"{what} on {', '.join(on)}",
        ACL_COLUMNS,
        [_binding_row(b, []) for b in bindings],
        data={key: [binding_fields(b) for b in bindings], "on": on},
    )


def _show_list(args: argparse.Namespace, found: dict[AclBinding, list[str]], everywhere: list[str]) -> None:
    rows = sorted(found.items())
    emit(
        args,
        "ACLs",
        [*ACL_COLUMNS, "on"],
        [_binding_row(b, on) for b, on in rows],
        data=[{**binding_fields(b), "on": on} for b, on in rows],
    )
    partial = [b for b, on in rows if len(on) < len(everywhere)]
    if partial:
        note(args, f"{len(partial)} ACLs are not on every group's leader: add them again (clmq acl add)")

"""The ``clmq`` verbs of replication: ``clmq cluster list`` (every broker the name
servers know, with its replication state), ``clmq broker status --addr`` (one broker)
and ``clmq admin promote --addr [--force]`` (manual promotion)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

import trio
from rich.markup import escape
from rich.text import Text

from clmq.protocol import ErrorCode

from ._common import add_json_alias, addrs, check_addr, namesrv_arg, run_client
from ._errors import EXIT_FAILED, EXIT_USAGE, CliError
from ._output import add_output_arg, console, is_json, print_table, write_json

if TYPE_CHECKING:  # the client loads when a verb runs: `clmq broker`, which adds `status` here, needs none of it
    from clmq.client import Admin

# A row of ``clmq cluster list``, in this order (the table's columns, the JSON's keys).
CLUSTER_COLUMNS = (
    "group",
    "broker_id",
    "addr",
    "role",
    "epoch",
    "end_offset",
    "confirmed_offset",
    "lag_bytes",
    "lag_ms",
    "in_sync",
)
# Added when some broker is in ZooKeeper mode (``coordination.mode == "zookeeper"``):
# its session's state, the group's epoch and in-sync set as ZooKeeper records them, and
# (a leader) how long its lease still lets it acknowledge writes.
ZK_COLUMNS = {
    "zk_session": "ZK session",
    "zk_epoch": "ZK epoch",
    "zk_isr": "ZK in-sync set",
    "lease_ms_left": "lease left",
}


def add_replication_commands(sub: Any) -> None:
    """Add ``clmq cluster list`` and ``clmq admin promote`` to the ``clmq`` parser."""
    cluster = sub.add_parser("cluster", help="the brokers the name servers know, with their replication state")
    csub = cluster.add_subparsers(dest="cluster_command", required=True)
    ls = csub.add_parser(
        "list",
        help="every broker: group, id, address, role, epoch, log end, confirmed offset, lag (bytes, ms), in sync",
    )
    add_output_arg(ls)
    add_json_alias(ls)
    namesrv_arg(ls)
    cluster.set_defaults(func=cmd_cluster)
    admin = sub.add_parser("admin", help="operator actions on one broker: promote")
    asub = admin.add_subparsers(dest="admin_command", required=True)
    promote = asub.add_parser(
        "promote",
        help="make the follower at --addr the leader of its group (a new epoch); the "
        "old leader steps down when it next registers with the name servers",
    )
    promote.add_argument("--addr", required=True, help="the follower, host:port")
    promote.add_argument(
        "--force",
        action="store_true",
        help="promote even if the follower is not known to be in sync: messages it has not copied yet are lost",
    )
    add_output_arg(promote)
    admin.set_defaults(func=cmd_admin)


def add_status_args(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``clmq broker status`` (on the ``clmq broker`` parser)."""
    parser.add_argument("--addr", help="status: the broker to ask, host:port")
    add_output_arg(parser)
    add_json_alias(parser)


# ------------------------------------------------------------------ cluster list
async def cluster_rows(admin: Admin) -> list[dict[str, Any]]:
    """One row per broker the name servers know: the name server's entry joined with
    the broker's own REPLICA_STATUS and, for a follower, its leader's view of it
    (which is what decides the in-sync set). A broker that does not answer keeps
    its name server's entry and an ``error``."""
    from clmq.client import ConnectionFailed, RpcError

    brokers = sorted(await admin.brokers(), key=lambda b: (b["broker_name"], b.get("broker_id", 0), b["addr"]))
    statuses: dict[str, dict[str, Any]] = {}

    async def ask(addr: str) -> None:
        try:
            statuses[addr] = await admin.replica_status(addr)
        except (ConnectionFailed, RpcError, trio.TooSlowError) as e:
            statuses[addr] = {"error": str(e) or "timed out"}

    async with trio.open_nursery() as nursery:
        for b in brokers:
            nursery.start_soon(ask, b["addr"])
    views = _leaders_views(brokers, statuses)
    return [_row(b, statuses[b["addr"]], views.get(b["broker_name"], {})) for b in brokers]


def _leaders_views(brokers: list[dict[str, Any]], statuses: dict[str, dict[str, Any]]) -> dict[str, dict[int, Any]]:
    """group -> follower id -> the group's leader's view of that follower."""
    views: dict[str, dict[int, Any]] = {}
    for b in brokers:
        s = statuses[b["addr"]]
        if s.get("role") == "leader":
            views.setdefault(b["broker_name"], {}).update({r["broker_id"]: r for r in s.get("replicas", [])})
    return views


def _row(entry: dict[str, Any], status: dict[str, Any], view: dict[int, Any]) -> dict[str, Any]:
    registered_role = entry.get("role", "leader")
    row: dict[str, Any] = {
        "group": entry["broker_name"],
        "broker_id": entry.get("broker_id", 0),
        "addr": entry["addr"],
        "role": status.get("role", registered_role),
        "registered_role": registered_role,
        "epoch": status.get("epoch", entry.get("epoch", -1)),
        "end_offset": status.get("end_offset"),
        "confirmed_offset": status.get("confirmed_offset"),
        "lag_bytes": status.get("lag_bytes"),
        "lag_ms": status.get("lag_ms"),
        "in_sync": status.get("in_sync"),
        "healthy": entry.get("healthy", True),
        "age_ms": entry.get("age_ms"),
        "error": status.get("error", ""),
    }
    if "coordination" in status:
        row["coordination"] = status["coordination"]
    if row["role"] == "follower":
        row["leader_addr"] = status.get("leader_addr", "")
        seen = view.get(row["broker_id"])
        if seen is not None:  # the leader's word: it decides who is in sync
            row.update(
                acked_offset=seen["acked_offset"],
                lag_bytes=seen["lag_bytes"],
                lag_ms=seen["lag_ms"],
                in_sync=seen["in_sync"],
            )
    elif row["role"] == "leader":
        row["followers_in_sync"] = sum(1 for r in status.get("replicas", []) if r["in_sync"])
    return row


def cmd_cluster(args: argparse.Namespace) -> int:
    from clmq.client import open_admin

    async def main() -> int:
        async with open_admin(addrs(args)) as admin:
            rows = await cluster_rows(admin)
        if is_json(args):
            write_json({"brokers": rows})
            return 0
        print_cluster_table(rows, f"brokers known to {args.namesrv}")
        return 0

    return run_client(main)


def print_cluster_table(rows: list[dict[str, Any]], title: str) -> None:
    """The rows of :func:`cluster_rows` as a table, then any broker's error."""
    zk = any(_zk_mode(r) for r in rows)
    right = {"id", "epoch", "log end", "confirmed", "lag bytes", "lag ms", "ZK epoch", "lease left"}
    headers = ["group", "id", "address", "role", "epoch", "log end", "confirmed", "lag bytes", "lag ms", "in sync"]
    print_table(
        title,
        headers + (list(ZK_COLUMNS.values()) if zk else []),
        [[_cell(k, r) for k in CLUSTER_COLUMNS] + (_zk_cells(r) if zk else []) for r in rows],
        right=sorted(right),
    )
    for r in rows:
        if r["error"]:
            console.print(f"[yellow]{r['group']}/{r['broker_id']} at {r['addr']}: {r['error']}")
    if not rows:
        console.print("no broker is registered with the name servers")


def _zk_mode(row: dict[str, Any]) -> bool:
    return bool(row.get("coordination", {}).get("mode") == "zookeeper")


def _zk_cells(row: dict[str, Any]) -> list[Any]:
    """The ZooKeeper columns of one row ("-" for a broker in manual mode or not answering)."""
    if not _zk_mode(row):
        return ["-"] * len(ZK_COLUMNS)
    c = row["coordination"]
    session = c.get("session", "-")
    colour = {"CONNECTED": "green", "SUSPENDED": "yellow"}.get(session, "red")
    isr = c.get("isr")
    lease = c.get("lease_ms_left")
    return [
        Text(str(session), style=colour),
        str(c.get("epoch", "-")),
        "-" if isr is None else ",".join(str(i) for i in isr),
        f"{lease:,} ms" if row["role"] == "leader" and isinstance(lease, int) else "-",
    ]


def _cell(key: str, row: dict[str, Any]) -> Any:
    value = row[key]
    if key == "role" and row["registered_role"] != value and value is not None:
        return f"{value} (name server: {row['registered_role']})"  # e.g. an old leader about to step down
    if value is None:
        return "-"
    if key == "in_sync":
        return Text("yes", style="green") if value else Text("no", style="red")
    if key == "lag_ms" and value < 0:
        return "-"  # never caught up yet
    return str(value) if key in {"broker_id", "epoch"} else value  # print_table groups the digits of counts


# ---------------------------------------------------------------- broker status
def cmd_broker_status(args: argparse.Namespace) -> int:
    """``clmq broker status --addr host:port``: one broker's REPLICA_STATUS."""
    if not args.addr:
        raise CliError("clmq broker status needs --addr host:port", EXIT_USAGE)
    check_addr(args.addr)
    from clmq.client import open_admin

    async def main() -> int:
        async with open_admin(broker_addrs=[args.addr]) as admin:
            status = await admin.replica_status(args.addr)
            status["broker"] = await admin.broker_info(args.addr)
        if is_json(args):
            write_json(status)
            return 0
        _print_status(args.addr, status)
        _print_info(status["broker"])
        return 0

    return run_client(main)


# BROKER_INFO's fields ``clmq broker status`` shows, in this order (each name says its unit).
INFO_ROWS = (
    "version",
    "uptime_s",
    "storage_mode",
    "flush_mode",
    "healthy",
    "failure",
    "store_bytes",
    "segments",
    "disk_used_bytes",
    "disk_free_bytes",
    "dispatch_lag_bytes",
    "connections",
    "topics",
    "messages_in_per_s",
    "bytes_in_per_s",
    "messages_out_per_s",
    "bytes_out_per_s",
)


def _print_info(info: dict[str, Any]) -> None:
    rows = [[key.replace("_", " "), info[key]] for key in INFO_ROWS if key in info and (key != "failure" or info[key])]
    print_table("store, connections and rates (last ~10 s)", ["field", "value"], rows, show_header=False)


def _print_status(addr: str, s: dict[str, Any]) -> None:
    keys = ["role", "epoch", "end_offset", "confirmed_offset", "durable_offset"]
    if s["role"] == "follower":
        keys += ["leader_addr", "in_sync", "lag_bytes", "lag_ms", "error"]
    rows: list[list[Any]] = [[k.replace("_", " "), s[k]] for k in keys]
    coordination = s.get("coordination", {})
    if coordination.get("mode") == "zookeeper":
        for k in ("session", "leader", "epoch", "isr", "lease_ms_left"):
            rows.append([f"ZooKeeper {k.replace('_', ' ')}", str(coordination.get(k, "-"))])
    print_table(f"broker {s['broker_name']}/{s['broker_id']} at {addr}", ["field", "value"], rows, show_header=False)
    if s["role"] != "leader":
        return
    if not s["replicas"]:
        console.print("no follower has joined")
        return
    print_table(
        "followers (the leader's view)",
        ["id", "address", "acked offset", "flushed offset", "lag bytes", "lag ms", "in sync"],
        [
            [
                str(r["broker_id"]),
                r["addr"],
                r["acked_offset"],
                r["flushed_offset"],
                r["lag_bytes"],
                "-" if r["lag_ms"] < 0 else r["lag_ms"],
                Text("yes", style="green") if r["in_sync"] else Text("no", style="red"),
            ]
            for r in s["replicas"]
        ],
    )


# ---------------------------------------------------------------------- promote
def cmd_admin(args: argparse.Namespace) -> int:
    """``clmq admin promote --addr host:port [--force]``."""
    from clmq.client import RpcError, open_admin

    async def main() -> int:
        async with open_admin(broker_addrs=[args.addr]) as admin:
            before = await admin.replica_status(args.addr)
            result = {"addr": args.addr, "broker_name": before["broker_name"], "broker_id": before["broker_id"]}
            if before["role"] == "leader":
                _promoted(args, {**result, "promoted": False, "already_leader": True, "epoch": before["epoch"]})
                return 0
            try:
                epoch = await admin.promote(args.addr, force=args.force)
            except RpcError as e:
                if e.code != ErrorCode.NOT_IN_SYNC:
                    raise
                _refused(args, result, e.text)
                return EXIT_FAILED
        _promoted(args, {**result, "promoted": True, "already_leader": False, "epoch": epoch, "forced": args.force})
        if not is_json(args) and before.get("coordination", {}).get("mode") == "zookeeper":
            console.print("the old leader handed the group over through ZooKeeper and follows; see: clmq cluster list")
        elif not is_json(args):
            console.print(
                "the old leader steps down when it next registers with the name servers; see: clmq cluster list"
            )
        return 0

    return run_client(main)


def _promoted(args: argparse.Namespace, result: dict[str, Any]) -> None:
    if is_json(args):
        write_json(result)
        return
    name = f"{result['broker_name']}/{result['broker_id']} at {result['addr']}"
    if result["already_leader"]:
        console.print(f"{name} already leads its group (epoch {result['epoch']}); nothing to do", highlight=False)
        return
    console.print(
        f"{name} is now the leader of group {result['broker_name']}, epoch {result['epoch']}"
        + (" (forced: it may have lacked the latest messages)" if result["forced"] else ""),
        highlight=False,
    )


def _refused(args: argparse.Namespace, result: dict[str, Any], why: str) -> None:
    """A follower not known to be in sync: say what --force would cost (exit 1)."""
    if is_json(args):
        write_json({**result, "promoted": False, "already_leader": False, "refused": why})
        return
    console.print(
        f"[red]refused:[/red] {result['broker_name']}/{result['broker_id']} at {result['addr']} is not known to be "
        f"in sync with its leader ({escape(why)}).\n"
        "Promoting it anyway with --force makes it the leader with what it has: "
        "messages the old leader acknowledged that it has not copied are LOST, and the old "
        "leader cuts them from its log when it rejoins as a follower."
    )

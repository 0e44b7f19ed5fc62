"""``clmq group``: list, describe, members, delete, reset-offsets."""

from __future__ import annotations

import argparse
from typing import Any

from clmq.client import Admin, open_admin

from ._common import add_client_args, addrs, run_client
from ._errors import EXIT_FAILED, EXIT_USAGE, CliError
from ._output import emit, is_json, note
from ._pop_view import pop_members, show_pop
from ._timefmt import FORMS, Duration, parse_time_ms


def add_command(sub: Any) -> None:
    """Add ``clmq group ...`` to the ``clmq`` parser."""
    group = sub.add_parser(
        "group", help="consumer groups: list, describe (per-queue lag), members, delete, reset-offsets"
    )
    gsub = group.add_subparsers(dest="group_command", required=True)
    gsub.add_parser("list", help="list consumer groups")
    gsub.add_parser("describe", help="committed offsets, lag and members of a group").add_argument(
        "name", help="the consumer group"
    )
    gsub.add_parser("members", help="the members connected and the topics they read").add_argument(
        "name", help="the consumer group"
    )
    gsub.add_parser(
        "delete", help="forget a group's committed offsets (refused while members are connected)"
    ).add_argument("name", help="the consumer group")
    _add_reset(gsub)
    add_client_args(gsub.choices)
    group.set_defaults(func=cmd_group)


def _add_reset(gsub: Any) -> None:
    reset = gsub.add_parser(
        "reset-offsets",
        help="plan moving a group's committed offsets, and move them with --execute "
        "(kafka-consumer-groups --reset-offsets)",
    )
    reset.add_argument("name", help="the consumer group")
    reset.add_argument("--topic", required=True, help="the topic whose offsets move")
    reset.add_argument(
        "--queue", type=int, action="append", dest="queues", help="only this queue (repeatable; default all)"
    )
    to = reset.add_mutually_exclusive_group(required=True)
    to.add_argument("--to-earliest", action="store_true", help="the oldest message still stored")
    to.add_argument("--to-latest", action="store_true", help="past the newest message (skip everything stored)")
    to.add_argument("--to-offset", type=int, help="an exact offset (clamped to what each queue holds)")
    to.add_argument("--to-time", help=f"the first message stored at or after a time: {FORMS}")
    to.add_argument(
        "--by-duration",
        type=Duration("ms", bare=False),
        help="the first message stored this long ago, e.g. 1h, 30m, 2d",
    )
    run = reset.add_mutually_exclusive_group()
    run.add_argument(
        "--execute", action="store_true", help="move the offsets (without it: print the plan, change nothing)"
    )
    run.add_argument("--dry-run", action="store_true", help="print the plan and change nothing (the default)")
    reset.add_argument("--force", action="store_true", help="even while members are connected (they may overwrite it)")


def cmd_group(args: argparse.Namespace) -> int:
    async def main() -> int:
        async with open_admin(addrs(args)) as admin:
            if args.group_command == "list":
                emit(args, "consumer groups", ["group"], [[g] for g in await admin.list_groups()])
            elif args.group_command == "describe":
                await _describe(args, admin)
            elif args.group_command == "members":
                pops = await _existing(admin, args.name)
                members = await admin.group_members(args.name) + pop_members(pops)
                emit(
                    args,
                    f"members of group {args.name}",
                    ["client_id", "mode", "queues"],
                    [[m["client_id"], m["mode"], _member_queues(m)] for m in members],
                    data=members,
                )
            elif args.group_command == "delete":
                await _delete(args, admin)
            else:
                await _reset(args, admin)
        return 0

    return run_client(main)


def _member_queues(member: dict[str, Any]) -> str:
    """What a member reads: its queues, or any queue of its topics (a POP member)."""
    if member["mode"] == "pop":
        return "any queue of " + ", ".join(member["topics"]) + " (POP)"
    return _queues_text(member["queues"])


def _queues_text(queues: list[list[Any]]) -> str:
    """[[topic, broker, id], ...] -> "orders@broker-a: 0,1,2; audit@broker-a: 3"."""
    grouped: dict[str, list[str]] = {}
    for topic, broker, qid in queues:
        grouped.setdefault(f"{topic}@{broker}", []).append(str(qid))
    return "; ".join(f"{k}: {','.join(v)}" for k, v in grouped.items()) or "-"


async def _existing(admin: Admin, group: str) -> list[dict[str, Any]]:
    """The group's POP parts (``describe_group``'s ``pop``); CliError if the group has
    no committed offsets, no members and no POP state."""
    info = await admin.describe_group(group)
    pops = list(info.get("pop") or [])
    if not info["queues"] and not info["members"] and not pops:
        raise CliError(f"group {group!r} does not exist (clmq group list shows the groups)", EXIT_FAILED)
    return pops


async def _describe(args: argparse.Namespace, admin: Admin) -> None:
    """Committed offsets and lag per queue, members, retries and dead letters; for a
    group that pops, its POP state too (``_pop_view``)."""
    info = await admin.describe_group(args.name)
    pops = info.get("pop") or []
    if not (info["queues"] or info["members"] or info["dead_letters"] or info["retry_backlog"] or pops):
        raise CliError(f"group {args.name!r} does not exist (clmq group list shows the groups)", EXIT_FAILED)
    title = (
        f"group {args.name} (total lag {info['lag']:,}, retry backlog {info['retry_backlog']:,}, "
        f"dead letters {info['dead_letters']:,})"
    )
    if info["queues"] or not pops or is_json(args):
        emit(
            args,
            title,
            ["broker", "topic", "queue", "committed", "max offset", "lag"],
            [
                [q["broker_name"], q["topic"], q["queue_id"], q["committed"], q["max_offset"], q["lag"]]
                for q in info["queues"]
            ],
            data=info,
        )
    show_pop(args, args.name, pops)
    if info["members"] or not pops:
        note(args, "members: " + (", ".join(m["client_id"] for m in info["members"]) or "none connected"))
    per_broker = ", ".join(
        f"{r['broker_name']}: {r['retry_backlog']:,} / {r['dead_letters']:,}" for r in info["retries"]
    )
    note(
        args,
        f"retry backlog {info['retry_backlog']:,}, dead letters {info['dead_letters']:,}"
        + (f" (per broker, retries / dead letters: {per_broker})" if len(info["retries"]) > 1 else "")
        + (" (clmq dlq show shows them)" if info["dead_letters"] else ""),
    )


async def _delete(args: argparse.Namespace, admin: Admin) -> None:
    on = await admin.delete_group(args.name)
    if not on:
        raise CliError(f"group {args.name!r} does not exist (clmq group list shows the groups)", EXIT_FAILED)
    emit(args, f"group {args.name} deleted", ["broker"], [[b] for b in on], data={"group": args.name, "deleted_on": on})


async def _reset(args: argparse.Namespace, admin: Admin) -> None:
    """Without --execute a plan: each queue's current and new offset, nothing changed."""
    if args.to_offset is not None and args.to_offset < 0:
        raise CliError("--to-offset must not be negative", EXIT_USAGE)
    try:
        rows = await admin.reset_offsets(
            args.name,
            args.topic,
            to=_reset_target(args),
            timestamp_ms=_reset_time(args),
            queue_ids=args.queues,
            dry_run=not args.execute,
            force=args.force,
        )
    except ValueError as e:
        raise CliError(str(e), EXIT_FAILED) from None
    if not rows:
        raise CliError(f"topic {args.topic!r} does not exist, or has none of the queues named", EXIT_FAILED)
    for r in rows:
        r["executed"] = args.execute
    done = "offsets moved" if args.execute else "plan, nothing changed (--execute moves the offsets)"
    emit(
        args,
        f"group {args.name}, topic {args.topic}: {done}",
        ["broker", "queue", "current", "new"],
        [[r["broker_name"], r["queue_id"], r["before"] if r["before"] >= 0 else "-", r["after"]] for r in rows],
        data=rows,
    )
    if not args.execute and not is_json(args):
        note(args, "nothing changed: run it again with --execute to move the offsets")


def _reset_target(args: argparse.Namespace) -> str | int:
    if args.to_earliest:
        return "earliest"
    if args.to_latest:
        return "latest"
    return int(args.to_offset or 0)


def _reset_time(args: argparse.Namespace) -> int | None:
    """--to-time, or --by-duration ago, in ms since the epoch (None: neither)."""
    if args.to_time is not None:
        return parse_time_ms(args.to_time)
    if args.by_duration is not None:
        return parse_time_ms(f"-{args.by_duration}ms")
    return None

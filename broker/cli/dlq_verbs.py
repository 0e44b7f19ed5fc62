"""``clmq dlq list|show|resend``: a consumer group's dead letters (``%DLQ%group``, one
queue per broker): which groups have some, what they are (origin topic, queue and
offset, attempts, body), and sending them again to their origin topic.

A resend is recorded per broker as the committed offset of the reserved group
``%DLQ_RESENT%group`` on the dead-letter queue: a second ``resend`` sends only letters
that arrived since (``--all`` sends every letter again)."""

from __future__ import annotations

import argparse
from typing import Any

from clmq.client import Admin, DeadLetter, open_admin

from ._common import add_client_args, addrs, run_client
from ._errors import EXIT_FAILED, EXIT_USAGE, CliError
from ._output import emit, is_json, note, preview, record_fields

DEFAULT_SHOW_MESSAGES = 20  # `dlq show` without -n
BODY_PREVIEW_CHARS = 60  # the body column of `dlq show` on a terminal (a pipe and JSON get the whole body)


def add_command(sub: Any) -> None:
    """Add ``clmq dlq`` to the parser."""
    dlq = sub.add_parser("dlq", help="dead letters: messages a consumer group gave up on (list, show, resend)")
    dsub = dlq.add_subparsers(dest="dlq_command", required=True)
    lst = dsub.add_parser("list", help="groups with dead letters, and how many (per broker)")
    lst.add_argument("--group", help="only this group")
    show = dsub.add_parser("show", help="a group's dead letters: id, origin topic/queue/offset, attempts, body")
    show.add_argument("group", help="the consumer group whose dead letters to show")
    show.add_argument(
        "-n",
        "--count",
        type=int,
        default=DEFAULT_SHOW_MESSAGES,
        help=f"at most this many (default {DEFAULT_SHOW_MESSAGES})",
    )
    show.add_argument("--offset", type=int, default=0, help="first dead-letter queue offset (default 0)")
    resend = dsub.add_parser("resend", help="send dead letters again to their origin topic, as fresh messages")
    resend.add_argument("group", help="the consumer group whose dead letters to resend")
    resend.add_argument(
        "--all", action="store_true", dest="resend_all", help="also letters resent before (ignore the resend mark)"
    )
    resend.add_argument(
        "--offset",
        type=int,
        action="append",
        dest="offsets",
        metavar="N",
        help="only the dead letter at this DLQ offset (repeatable)",
    )
    add_client_args(dsub.choices)
    dlq.set_defaults(func=cmd_dlq)


def cmd_dlq(args: argparse.Namespace) -> int:
    if getattr(args, "count", 1) < 1:
        raise CliError("-n/--count must be at least 1", EXIT_USAGE)
    if getattr(args, "offset", 0) < 0 or any(o < 0 for o in getattr(args, "offsets", None) or []):
        raise CliError("--offset must not be negative", EXIT_USAGE)

    async def main() -> int:
        async with open_admin(addrs(args)) as admin:
            if args.dlq_command == "list":
                await _list(args, admin)
            elif args.dlq_command == "show":
                await _show(args, admin)
            else:
                return await _resend(args, admin)
        return 0

    return run_client(main)


async def _list(args: argparse.Namespace, admin: Admin) -> None:
    rows = await admin.dead_letter_counts(args.group)
    if args.group and not rows:
        raise CliError(f"group {args.group!r} has no dead letters", EXIT_FAILED)
    emit(
        args,
        "dead letters",
        ["group", "broker", "dead letters", "not resent"],
        [[r["group"], r["broker_name"], r["dead_letters"], r["not_resent"]] for r in rows],
        data=rows,
    )


def letter_fields(letter: DeadLetter) -> dict[str, Any]:
    """A dead letter as JSON-ready fields: the record's, plus its id, broker and origin."""
    return {
        **record_fields(letter.record, letter.msg_id),
        "broker_name": letter.broker_name,
        "origin_topic": letter.origin_topic,
        "origin_queue_id": letter.origin_queue_id,
        "origin_offset": letter.origin_offset,
    }


async def _show(args: argparse.Namespace, admin: Admin) -> None:
    letters = await admin.dead_letters(args.group, max_messages=args.count, start=args.offset)
    if not letters and not await admin.dead_letter_counts(args.group):
        raise CliError(
            f"group {args.group!r} has no dead letters (clmq dlq list shows the groups that have)", EXIT_FAILED
        )
    rows = [
        [
            lt.broker_name,
            lt.record.queue_offset,
            lt.msg_id,
            f"{lt.origin_topic} q{lt.origin_queue_id} @{lt.origin_offset}",
            lt.record.reconsume_times,
            preview(lt.record.body.decode("utf-8", errors="backslashreplace"), BODY_PREVIEW_CHARS),
            " ".join(f"{k}={v}" for k, v in sorted(lt.record.properties.items())),
        ]
        for lt in letters
    ]
    emit(
        args,
        f"dead letters of group {args.group}",
        ["broker", "offset", "msg id", "origin", "attempts", "body", "properties"],
        rows,
        data=[letter_fields(lt) for lt in letters],
    )


async def _resend(args: argparse.Namespace, admin: Admin) -> int:
    if not await admin.dead_letter_counts(args.group):
        raise CliError(
            f"group {args.group!r} has no dead letters (clmq dlq list shows the groups that have)", EXIT_FAILED
        )
    result = await admin.resend_dead_letters(args.group, offsets=args.offsets, resend_all=args.resend_all)
    data = {
        "group": args.group,
        "resent": [vars(r) for r in result.resent],
        "skipped": result.skipped,
        "errors": result.errors,
    }
    emit(
        args,
        f"dead letters of group {args.group} resent",
        ["broker", "dlq offset", "to topic", "new msg id"],
        [[r.broker_name, r.dlq_offset, r.origin_topic, r.msg_id] for r in result.resent],
        data=data,
    )
    if not is_json(args):
        skipped = f"; {result.skipped} resent before, skipped (--all resends them)" if result.skipped else ""
        note(args, f"{len(result.resent)} resent{skipped}")
    if result.errors:
        raise CliError("not all resent: " + "; ".join(result.errors), EXIT_FAILED)
    return 0

"""``clmq message``: read one queue from an offset without a group, look a message up
by its id or by key (printed with timestamps, queue, offset, keys and properties);
cancel a scheduled message."""

from __future__ import annotations

import argparse
from typing import Any

import trio

from clmq.client import Admin, open_admin
from clmq.protocol import ErrorCode
from clmq.protocol.transport import RpcError

from ._common import add_client_args, addrs, run_client
from ._errors import EXIT_FAILED, EXIT_USAGE, CliError
from ._output import emit, is_json, note, print_record, tally
from ._timefmt import FORMS, format_time_ms, parse_time_ms
from ._trace_view import add_trace_parser, show_trace

FOLLOW_POLL_MS = 500  # --follow: how often an idle queue is asked again


def add_command(sub: Any) -> None:
    """Add ``clmq message read|get|find|cancel|trace`` to the ``clmq`` parser."""
    msg = sub.add_parser("message", help="read a queue without a group; look a message up by id or key")
    msub = msg.add_subparsers(dest="message_command", required=True)
    read = msub.add_parser("read", help="messages of one queue from an offset (no group, nothing committed)")
    read.add_argument("topic", help="the topic to read")
    read.add_argument("--queue", type=int, required=True, help="the queue id to read")
    read.add_argument("--offset", type=int, default=0, help="first offset (default 0; clamped to what is stored)")
    read.add_argument("--count", type=int, default=32, help="at most this many messages (default 32)")
    read.add_argument("--broker-name", help="the broker group's name, when several serve the topic")
    read.add_argument("--follow", action="store_true", help="keep waiting for new messages (Ctrl-C stops)")
    get = msub.add_parser("get", help="the message a send's id names (host:port@HEXOFFSET)")
    get.add_argument("msg_id", help="the message id: host:port@HEXOFFSET, as produce and consume --details print it")
    find = msub.add_parser("find", help="messages carrying a key or unique id (the brokers' key index)")
    find.add_argument("topic", help="the topic to search")
    find.add_argument("--key", required=True, help="one of the keys the message was sent with, or its UNIQ_KEY")
    find.add_argument("--since", help=f"only messages stored at or after: {FORMS}")
    find.add_argument("--until", help="only messages stored at or before (same forms)")
    find.add_argument("--count", type=int, default=32, help="at most this many messages, newest first (default 32)")
    find.add_argument(
        "--max-scan-messages",
        type=int,
        default=100_000,
        help="without a key index (partition-per-file): read at most this many messages (default 100000)",
    )
    for p in msub.choices.values():
        p.add_argument("--details", action="store_true", help="also print keys, properties and attempts")
    cancel = msub.add_parser("cancel", help="cancel a scheduled message by the id its send printed")
    cancel.add_argument("msg_id", help="the id a scheduled produce printed (host:port@HEXOFFSET)")
    add_trace_parser(msub)
    add_client_args(msub.choices)
    msg.set_defaults(func=cmd_message)


def cmd_message(args: argparse.Namespace) -> int:
    for name in ("count", "max_scan_messages"):
        if getattr(args, name, 1) < 1:
            raise CliError(f"--{name.replace('_', '-')} must be at least 1", EXIT_USAGE)
    if getattr(args, "offset", 0) < 0 or getattr(args, "queue", 0) < 0:
        raise CliError("--queue and --offset must not be negative", EXIT_USAGE)

    async def main() -> int:
        async with open_admin(addrs(args)) as admin:
            if args.message_command == "read":
                await _read(args, admin)
            elif args.message_command == "get":
                await _get(args, admin)
            elif args.message_command == "cancel":
                await _cancel(args, admin)
            elif args.message_command == "trace":
                await show_trace(args, admin)
            else:
                await _find(args, admin)
        return 0

    return run_client(main)


async def _read(args: argparse.Namespace, admin: Admin) -> None:
    offset, shown = args.offset, 0
    while args.follow or shown < args.count:
        try:
            records = await admin.read_queue(
                args.topic,
                args.queue,
                offset,
                args.count if args.follow else args.count - shown,
                broker_name=args.broker_name,
            )
        except ValueError as e:
            raise CliError(str(e), EXIT_FAILED) from None
        for rec in records:
            print_record(args, rec)
        shown += len(records)
        if records:
            offset = records[-1].queue_offset + 1
        elif args.follow:
            await trio.sleep(FOLLOW_POLL_MS / 1000)  # a poll of a remote queue, not a wait for a local event
        else:
            break
    tally(f"[dim]{shown} messages")


async def _get(args: argparse.Namespace, admin: Admin) -> None:
    try:
        rec = await admin.message_by_id(args.msg_id)
    except ValueError as e:
        raise CliError(str(e), EXIT_USAGE) from None
    if rec is None:
        raise CliError(f"no message {args.msg_id} (retention may have removed it)", EXIT_FAILED)
    args.details = True
    print_record(args, rec, msg_id=args.msg_id)


async def _find(args: argparse.Namespace, admin: Admin) -> None:
    """Through the brokers' key indexes; a broker without one (partition-per-file) makes
    it a bounded scan of each queue's newest messages, and says so."""
    since = parse_time_ms(args.since) if args.since else None
    until = parse_time_ms(args.until) if args.until else None
    try:
        hit = await admin.find_by_key(args.topic, args.key, since_ms=since, until_ms=until, max_results=args.count)
    except RpcError as e:
        if e.code != ErrorCode.REQUEST_NOT_SUPPORTED:
            raise
        tally(f"[yellow]no key index ({e.text}): scanning each queue's newest messages instead")
        await _scan(args, admin, since, until)
        return
    for rec in hit.records:
        print_record(args, rec)
    if hit.index_lag_bytes:  # index writes fail or failed on some broker: only then is a look-up behind
        tally(
            f"[yellow]the key index is {hit.index_lag_bytes} bytes of log behind (its writes fail or just failed: "
            "index_error in clmq broker status -o json): the newest messages, stored in those bytes, may be missing"
        )
    if not hit.records:
        raise CliError(f"no message of topic {args.topic!r} has key {args.key!r} (key index)", EXIT_FAILED)
    more = f"; more matched than --count {args.count}" if hit.truncated else ""
    tally(f"[dim]{len(hit.records)} found (key index){more}")


async def _scan(args: argparse.Namespace, admin: Admin, since: int | None, until: int | None) -> None:
    found = await admin.messages_by_key(
        args.topic,
        args.key,
        max_messages=args.count,
        since_ms=since,
        until_ms=until,
        max_scan_messages=args.max_scan_messages,
    )
    for rec in found.records:
        print_record(args, rec)
    cut = "" if found.complete else f"; older messages not searched (--max-scan-messages {args.max_scan_messages:,})"
    if not found.records:  # the error alone says it: stderr stays one line
        raise CliError(
            f"no message of topic {args.topic!r} has key {args.key!r} ({found.scanned:,} messages read{cut})",
            EXIT_FAILED,
        )
    tally(f"[dim]{len(found.records)} found, {found.scanned:,} messages read{cut}")


async def _cancel(args: argparse.Namespace, admin: Admin) -> None:
    """Cancelled (or cancelled before): exit 0; too late or unknown: exit 1, saying so."""
    try:
        result = await admin.cancel_message(args.msg_id)
    except ValueError as e:
        raise CliError(str(e), EXIT_USAGE) from None
    due = format_time_ms(result.deliver_at_ms) if result.deliver_at_ms else "-"
    data = {"msg_id": args.msg_id, "state": result.state, "deliver_at_ms": result.deliver_at_ms}
    if result.state == "not_found":
        raise CliError(f"no scheduled message {args.msg_id} (give the id a delayed send printed)", EXIT_FAILED)
    if result.state == "too_late":
        raise CliError(f"message {args.msg_id} is delivered or due too soon ({due}) to cancel", EXIT_FAILED)
    if is_json(args):
        emit(args, "", [], [], data=data)
    else:
        note(args, f"message {args.msg_id}: {result.state.replace('_', ' ')} (was due {due})")

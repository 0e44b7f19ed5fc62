"""``clmq transaction list|show``: transactional (half) messages not ended yet, on every
broker group's leader, and one half message by its id: where it goes (real topic,
queue, tags), its keys and body, and its state (pending with its check-backs, or
committed / ended). docs/transactions.md."""

from __future__ import annotations

import argparse
from typing import Any

from clmq.client import Admin, open_admin

from ._common import add_client_args, addrs, run_client
from ._errors import EXIT_FAILED, EXIT_USAGE, CliError
from ._output import emit, is_json, note, preview, record_fields, write_json
from ._timefmt import format_time_ms

BODY_PREVIEW_CHARS = 60  # the body in `transaction show` on a terminal (JSON gets all of it)


def add_command(sub: Any) -> None:
    """Add ``clmq transaction`` to the parser."""
    tx = sub.add_parser("transaction", help="transactional (half) messages: list the pending ones, show one")
    tsub = tx.add_subparsers(dest="transaction_command", required=True)
    lst = tsub.add_parser("list", help="half messages not committed or rolled back yet, per broker, and counts")
    lst.add_argument("--group", help="only this producer (transaction) group")
    show = tsub.add_parser("show", help="one half message: real topic/queue/tags, keys, body, state, checks")
    show.add_argument("msg_id", metavar="ID", help="the half message's id (host:port@HEXOFFSET, as a send returns it)")
    add_client_args(tsub.choices)
    tx.set_defaults(func=cmd_transaction)


def cmd_transaction(args: argparse.Namespace) -> int:
    async def main() -> int:
        async with open_admin(addrs(args)) as admin:
            if args.transaction_command == "list":
                await _list(args, admin)
            else:
                await _show(args, admin)
        return 0

    return run_client(main)


async def _list(args: argparse.Namespace, admin: Admin) -> None:
    found = await admin.list_transactions(args.group)
    rows = [
        [
            p.broker_name,
            p.msg_id,
            p.group,
            f"{p.topic} q{p.queue_id}",
            p.keys,
            format_time_ms(p.stored_ms),
            p.checks,
            format_time_ms(p.last_check_ms) if p.last_check_ms else "-",
        ]
        for p in found.pending
    ]
    data = {"pending": [{**vars(p), "msg_id": p.msg_id} for p in found.pending], "brokers": found.brokers}
    emit(
        args,
        f"pending transactions{f' of group {args.group}' if args.group else ''}",
        ["broker", "half msg id", "group", "real queue", "keys", "stored", "checks", "last check"],
        rows,
        data=data,
    )
    if not is_json(args):
        per = ", ".join(
            f"{b['broker_name']}: {b['total']} pending ({b['listed']} listed), {b['committed']} committed, "
            f"{b['rolled_back']} rolled back, {b['checks']} checks"
            for b in found.brokers
        )
        note(args, f"{found.total} pending in all; since start: {per or 'no broker'}")


async def _show(args: argparse.Namespace, admin: Admin) -> None:
    try:
        view = await admin.transaction(args.msg_id)
    except ValueError as e:  # not an id, or not a half message
        raise CliError(str(e), EXIT_USAGE) from None
    if view is None:
        raise CliError(f"no message at {args.msg_id} (retention removed it, or the id is made up)", EXIT_FAILED)
    p = view.pending
    fields: dict[str, Any] = {
        "msg_id": view.msg_id,
        "state": view.state,
        "group": view.group,
        "real_topic": view.topic,
        "real_queue_id": view.queue_id,
        "real_tags": view.tags,
        "keys": view.record.keys,
        "uniq_key": view.record.properties.get("UNIQ_KEY", ""),
        "stored": format_time_ms(view.record.store_timestamp_ms),
        "checks": p.checks if p else None,
        "last_check": format_time_ms(p.last_check_ms) if p and p.last_check_ms else None,
        "committed_msg_id": view.committed_msg_id or None,
    }
    if is_json(args):
        write_json({**fields, "half": record_fields(view.record, view.msg_id)})
        return
    body = preview(view.record.body.decode("utf-8", errors="backslashreplace"), BODY_PREVIEW_CHARS)
    rows = [[k, "-" if v is None or v == "" else v] for k, v in fields.items()] + [["body", body]]
    emit(args, f"transaction {view.msg_id}", ["field", "value"], rows)

"""``clmq consume``: receive messages as a member of a consumer group.

What is committed is what was printed: ``--count N`` prints and commits exactly N
messages, and Ctrl-C commits the messages printed before it, never the rest of the
batch being printed (the group's next reader gets those).
"""

from __future__ import annotations

import argparse
from typing import Any

import trio

from clmq.client import Consumer, open_admin, open_consumer
from clmq.common import Record

from ._common import addrs, namesrv_arg, run_client
from ._errors import EXIT_FAILED, EXIT_USAGE, CliError
from ._output import add_output_arg, note, print_record
from ._timefmt import FORMS, parse_time_ms


def add_command(sub: Any) -> None:
    """Add ``clmq consume`` to the ``clmq`` parser."""
    cons = sub.add_parser("consume", help="receive messages as a member of a consumer group")
    cons.add_argument("topic")
    cons.add_argument("--group", default="clmq-cli", help="consumer group (default clmq-cli)")
    cons.add_argument("--tags", default="*", help="tag expression, e.g. 'TagA || TagB' (default *)")
    cons.add_argument(
        "--from",
        dest="start_from",
        default="earliest",
        type=start_arg,
        help=f"where a queue without a committed offset starts: earliest (default), latest, or a time: {FORMS}",
    )
    cons.add_argument(
        "--count",
        type=int,
        default=0,
        help="print and commit exactly this many messages, then stop (default: run until Ctrl-C)",
    )
    cons.add_argument("--idle-timeout", type=float, default=0, help="stop after this many seconds without messages")
    cons.add_argument("--broadcast", action="store_true", help="broadcasting mode (every member gets every message)")
    cons.add_argument("--details", action="store_true", help="also print keys, properties and attempts")
    add_output_arg(cons)
    namesrv_arg(cons)
    cons.set_defaults(func=cmd_consume)


def start_arg(text: str) -> str | int:
    """``earliest``, ``latest`` or a time (milliseconds since the epoch)."""
    return text if text in ("earliest", "latest") else parse_time_ms(text)


def cmd_consume(args: argparse.Namespace) -> int:
    if args.count < 0 or args.idle_timeout < 0:
        raise CliError("--count and --idle-timeout must not be negative", EXIT_USAGE)

    async def main() -> int:
        await _check_topic(args)
        async with open_consumer(
            addrs(args),
            args.group,
            {args.topic: args.tags},
            start_from=args.start_from,
            mode="broadcasting" if args.broadcast else "clustering",
        ) as consumer:
            seen = await _print_until_done(args, consumer)
        note(args, f"[dim]{seen} messages")
        return 0

    return run_client(main)


async def _check_topic(args: argparse.Namespace) -> None:
    """An unknown topic is an error (exit 1), an unreachable name server too (exit 3),
    rather than a consumer waiting forever for a topic that is not there."""
    async with open_admin(addrs(args)) as admin:
        if not await admin.describe_topic(args.topic):
            raise CliError(f"topic {args.topic!r} does not exist (clmq topic list shows the topics)", EXIT_FAILED)


async def _print_until_done(args: argparse.Namespace, consumer: Consumer) -> int:
    """Print messages until --count, --idle-timeout or Ctrl-C; acknowledge exactly the
    ones printed (the consumer commits them when it closes)."""
    seen = 0
    while not args.count or seen < args.count:
        with trio.move_on_after(args.idle_timeout or float("inf")) as scope:
            batch = await consumer.receive()
        if scope.cancelled_caught:
            break
        printed: list[Record] = []
        try:
            for rec in batch:
                if args.count and seen == args.count:
                    break
                print_record(args, rec)
                printed.append(rec)
                seen += 1
        finally:  # also on Ctrl-C: what was printed is processed, the rest is not
            consumer.ack(printed)
    return seen

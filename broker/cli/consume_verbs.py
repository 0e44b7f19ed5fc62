"""``clmq consume``: receive messages, as a member of a consumer group or just to look.

- ``--group NAME``: a member of that group. What is committed is what was printed:
  ``--count N`` prints and commits exactly N messages, and Ctrl-C commits the messages
  printed before it, never the rest of the batch being printed (the group's next
  reader gets those).
- no ``--group``: a fresh group of its own (``clmq-console-<random>``, as Kafka's
  console consumer) that reads every queue and commits nothing: two people trying the
  command line never take each other's messages, nor queues from a real group.
"""

from __future__ import annotations

import argparse
import secrets
from typing import Any, Literal

import trio

from clmq.client import Consumer, format_msg_id, open_admin, open_consumer
from clmq.common import Record

from ._common import addrs, namesrv_arg, run_client
from ._errors import EXIT_FAILED, EXIT_USAGE, CliError
from ._output import add_output_arg, print_record, tally
from ._timefmt import DURATION_S, FORMS, parse_time_ms

CONSOLE_GROUP_PREFIX = "clmq-console-"  # the group of a consume without --group
Mode = Literal["clustering", "broadcasting"]


def add_command(sub: Any) -> None:
    """Add ``clmq consume`` to the ``clmq`` parser."""
    cons = sub.add_parser(
        "consume", help="receive messages: as a member of --group (committing), or just to look (without it)"
    )
    cons.add_argument("topic", help="the topic to read")
    cons.add_argument(
        "--group",
        help="consumer group: commit what is printed, share the queues with its other members (default: a "
        f"fresh group of its own, {CONSOLE_GROUP_PREFIX}<random>, that reads every queue and commits nothing)",
    )
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
        help="print (and with --group commit) exactly this many messages, then stop (default: until Ctrl-C)",
    )
    cons.add_argument(
        "--idle-timeout",
        type=DURATION_S,
        default=0.0,
        help="stop after this long without messages: seconds, or 500ms, 30s, 2m (default: never)",
    )
    cons.add_argument("--broadcast", action="store_true", help="broadcasting mode (every member gets every message)")
    cons.add_argument("--details", action="store_true", help="also print keys, message id, properties and attempts")
    add_output_arg(cons)
    namesrv_arg(cons)
    cons.set_defaults(func=cmd_consume)


def start_arg(text: str) -> str | int:
    """``earliest``, ``latest`` or a time (milliseconds since the epoch)."""
    return text if text in ("earliest", "latest") else parse_time_ms(text)


def cmd_consume(args: argparse.Namespace) -> int:
    if args.count is not None and args.count < 1:
        raise CliError(f"--count {args.count}: give at least 1 (or leave it out to run until Ctrl-C)", EXIT_USAGE)
    group, mode = _group_and_mode(args)

    async def main() -> int:
        await _check_topic(args)
        subscription = {args.topic: args.tags}
        async with open_consumer(addrs(args), group, subscription, start_from=args.start_from, mode=mode) as consumer:
            seen = await _print_until_done(args, consumer)
        tally(f"[dim]{seen} messages" + ("" if args.group else f" (group {group}: nothing committed)"))
        return 0

    return run_client(main)


def _group_and_mode(args: argparse.Namespace) -> tuple[str, Mode]:
    """The group and mode to consume with. Without --group: a fresh group in
    broadcasting mode, whose offsets stay in this process (nothing is committed) and
    which reads every queue itself (no rebalance with anyone)."""
    if args.group is None:
        return CONSOLE_GROUP_PREFIX + secrets.token_hex(4), "broadcasting"
    if not args.group.strip():
        raise CliError("--group '': give a group name, or leave --group out to read without committing", EXIT_USAGE)
    return args.group, "broadcasting" if args.broadcast else "clustering"


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
    while args.count is None or seen < args.count:
        with trio.move_on_after(args.idle_timeout or float("inf")) as scope:
            batch = await consumer.receive()
        if scope.cancelled_caught:
            break
        queues = consumer.pending.where(batch, strict=False)  # the queue (and its broker) of each record
        printed: list[Record] = []
        try:
            for rec in batch:
                if seen == args.count:
                    break
                mq = queues.get(id(rec))
                print_record(args, rec, msg_id=format_msg_id(mq.addr, rec.commitlog_offset) if mq else None)
                printed.append(rec)
                seen += 1
        finally:  # also on Ctrl-C: what was printed is processed, the rest is not
            consumer.ack(printed)
    return seen

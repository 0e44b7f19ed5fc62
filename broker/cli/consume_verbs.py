"""``clmq consume``: receive messages as a member of a consumer group."""

from __future__ import annotations

import argparse
from typing import Any

import trio

from client import open_consumer

from ._common import addrs, console, namesrv_arg, run_client


def add_command(sub: Any) -> None:
    """Add ``clmq consume`` to the ``clmq`` parser."""
    cons = sub.add_parser("consume", help="receive messages as a member of a consumer group")
    cons.add_argument("topic")
    cons.add_argument("--group", default="clmq-cli", help="consumer group (default clmq-cli)")
    cons.add_argument("--tags", default="*", help="tag expression, e.g. 'TagA || TagB' (default *)")
    cons.add_argument("--from", dest="start_from", default="earliest", help="earliest, latest, or a timestamp in ms")
    cons.add_argument("--count", type=int, default=0, help="stop after this many messages (default: run until Ctrl-C)")
    cons.add_argument("--idle-timeout", type=float, default=0, help="stop after this many seconds without messages")
    cons.add_argument("--broadcast", action="store_true", help="broadcasting mode (every member gets every message)")
    namesrv_arg(cons)
    cons.set_defaults(func=cmd_consume)


def cmd_consume(args: argparse.Namespace) -> int:
    start: str | int = int(args.start_from) if args.start_from.isdigit() else args.start_from

    async def main() -> int:
        seen = 0
        async with open_consumer(addrs(args), args.group, {args.topic: args.tags}, start_from=start,
                                 mode="broadcasting" if args.broadcast else "clustering") as consumer:  # fmt: skip
            while not args.count or seen < args.count:
                with trio.move_on_after(args.idle_timeout or float("inf")) as scope:
                    batch = await consumer.receive()
                if scope.cancelled_caught:
                    break
                for rec in batch:
                    seen += 1
                    print(
                        f"{rec.topic} q{rec.queue_id} @{rec.queue_offset} [{rec.tags}] {rec.body.decode(errors='replace')}",
                        flush=True,
                    )
        console.print(f"{seen} messages", style="dim")
        return 0

    return run_client(main)

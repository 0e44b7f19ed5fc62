"""The ``clmq`` verbs that talk to a running cluster through the client library: topic,
group, produce (``consume`` is in ``consume_verbs.py``)."""

from __future__ import annotations

import argparse
import collections
import os
import sys
from typing import Any, AsyncIterator

import trio

from client import open_admin, open_producer

from ._common import addrs, console, namesrv_arg, print_rows, run_client
from .consume_verbs import add_command as add_consume
from .settings import SettingsError

DEFAULT_MAX_LINE_BYTES = 4 << 20  # a broker's default max_message_bytes
STDIN_READ_BYTES = 64 << 10  # one read of stdin: whatever has arrived, up to this much


def add_client_commands(sub: Any) -> None:
    """Add the verbs that talk to a running cluster: topic, group, produce, consume."""
    _add_topic_commands(sub)
    _add_client_commands(sub)
    add_consume(sub)


def _add_topic_commands(sub: Any) -> None:
    topic = sub.add_parser("topic", help="create, list, describe, delete topics")
    tsub = topic.add_subparsers(dest="topic_command", required=True)
    create = tsub.add_parser("create", help="create a topic (or grow its queue count) on every broker")
    create.add_argument("name")
    create.add_argument("--queues", type=int, default=8, help="queue count (default 8)")
    for name, helptext in (("list", "list topics"), ("describe", "queues and offsets of a topic"), ("delete", "delete a topic")):
        p = tsub.add_parser(name, help=helptext)
        if name != "list":
            p.add_argument("name")
    for p in tsub.choices.values():
        namesrv_arg(p)
    topic.set_defaults(func=cmd_topic)
    group = sub.add_parser("group", help="consumer groups: list, describe (per-queue lag)")
    gsub = group.add_subparsers(dest="group_command", required=True)
    namesrv_arg(gsub.add_parser("list", help="list consumer groups"))
    gd = gsub.add_parser("describe", help="committed offsets, lag and members of a group")
    gd.add_argument("name")
    namesrv_arg(gd)
    group.set_defaults(func=cmd_group)


def _add_client_commands(sub: Any) -> None:
    prod = sub.add_parser("produce", help="send messages (arguments, or lines of stdin as they arrive)")
    prod.add_argument("topic")
    prod.add_argument("messages", nargs="*", help="message bodies (default: each line of stdin, sent as it arrives)")
    prod.add_argument("--tags", default="")
    prod.add_argument("--keys", default="")
    prod.add_argument("--sharding-key", help="send every message to the queue of this key, in order")
    prod.add_argument("--linger-ms", type=int, help="wait up to this long to fill a request (producer default 5)")
    prod.add_argument("--batch-max-bytes", type=int, help="bytes per request to a broker (producer default 1 MiB)")
    prod.add_argument("--retry-budget-ms", type=int, help="give a message up after trying this long (default 15000)")
    prod.add_argument("--max-line-bytes", type=int, default=DEFAULT_MAX_LINE_BYTES,
                      help=f"longest line of stdin taken as a message (default {DEFAULT_MAX_LINE_BYTES:,}): "
                           "a longer one is reported and skipped")  # fmt: skip
    namesrv_arg(prod)
    prod.set_defaults(func=cmd_produce)


# ------------------------------------------------------------------ services
def cmd_topic(args: argparse.Namespace) -> int:
    async def main() -> int:
        async with open_admin(addrs(args)) as admin:
            if args.topic_command == "create":
                on = await admin.create_topic(args.name, args.queues)
                console.print(f"topic {args.name}: {args.queues} queues on {', '.join(on)}")
            elif args.topic_command == "delete":
                on = await admin.delete_topic(args.name)
                console.print(f"topic {args.name} deleted on {', '.join(on)}" if on else f"[red]no broker has topic {args.name}")
                return 0 if on else 1
            elif args.topic_command == "list":
                print_rows("topics", ["topic", "queues per broker"],
                            [[t, ", ".join(f"{b}: {n}" for b, n in by.items())] for t, by in (await admin.list_topics()).items()])  # fmt: skip
            else:
                rows = await admin.describe_topic(args.name)
                if not rows:
                    console.print(f"[red]no broker has topic {args.name}")
                    return 1
                print_rows(f"topic {args.name}", ["broker", "queue", "min offset", "max offset"],
                            [[r["broker_name"], r["queue_id"], r["min_offset"], r["max_offset"]] for r in rows])  # fmt: skip
        return 0

    return run_client(main)


def cmd_group(args: argparse.Namespace) -> int:
    async def main() -> int:
        async with open_admin(addrs(args)) as admin:
            if args.group_command == "list":
                print_rows("consumer groups", ["group"], [[g] for g in await admin.list_groups()])
                return 0
            info = await admin.describe_group(args.name)
            print_rows(f"group {args.name} (total lag {info['lag']:,})", ["broker", "topic", "queue", "committed", "max offset", "lag"],
                        [[q["broker_name"], q["topic"], q["queue_id"], q["committed"], q["max_offset"], q["lag"]] for q in info["queues"]])  # fmt: skip
            console.print("members: " + (", ".join(m["client_id"] for m in info["members"]) or "none connected"))
        return 0

    return run_client(main)


def cmd_produce(args: argparse.Namespace) -> int:
    """Send each argument, or each line of stdin as it arrives (bytes, the newline
    stripped), through the producer's buffer (``submit``; waits when it is full) and
    print each message's queue and offset in input order; a failed message is reported
    on stderr with its reason, and any failure makes the exit status 1."""
    options = {name: value for name, value in (("linger_ms", args.linger_ms), ("batch_max_bytes", args.batch_max_bytes),
                                               ("retry_budget_ms", args.retry_budget_ms)) if value is not None}  # fmt: skip

    async def main() -> int:
        if args.max_line_bytes <= 0:
            raise SettingsError(f"--max-line-bytes {args.max_line_bytes}: must be positive")
        report = _ProduceReport()
        bodies = _argument_bodies(args.messages) if args.messages else _stdin_lines(args.max_line_bytes, report)
        async with open_producer(addrs(args), **options) as producer:
            number = 0
            async for body in bodies:
                number += 1
                if body is None:  # a line over --max-line-bytes: reported by _stdin_lines
                    continue
                fut = await producer.submit(args.topic, body, tags=args.tags, keys=args.keys, sharding_key=args.sharding_key)
                report.add(number, fut)
            await producer.flush()
        return report.finish()

    return run_client(main)


async def _argument_bodies(messages: list[str]) -> AsyncIterator[bytes | None]:
    for m in messages:
        yield m.encode()


async def _stdin_lines(max_line_bytes: int, report: _ProduceReport) -> AsyncIterator[bytes | None]:
    """Each line of stdin as bytes (newline stripped), as soon as it arrives: reads take
    whatever is there (a thread, so trio goes on meanwhile; files, pipes and terminals
    alike). A line longer than ``max_line_bytes`` yields None (reported, not kept)."""
    fd, rest, number, too_long = sys.stdin.fileno(), b"", 0, False
    while True:
        chunk = await trio.to_thread.run_sync(os.read, fd, STDIN_READ_BYTES, abandon_on_cancel=True)
        if not chunk:
            break
        lines = (rest + chunk).split(b"\n")
        rest = lines.pop()
        for line in lines:
            number += 1
            if too_long or len(line) > max_line_bytes:
                report.too_long(number, max_line_bytes)
                too_long = False
                yield None
            else:
                yield line
        if len(rest) > max_line_bytes:  # drop what is read of it: memory stays bounded
            rest, too_long = b"", True
    if rest or too_long:
        number += 1
        if too_long:
            report.too_long(number, max_line_bytes)
        yield None if too_long else rest


class _ProduceReport:
    """Prints the outcome of each message in input order, as soon as it and every
    message before it are answered (stdout: where stored; stderr: why it failed)."""

    def __init__(self) -> None:
        self.waiting: collections.deque[tuple[int, Any]] = collections.deque()  # (message number, SendFuture)
        self.stored = 0
        self.failed = 0

    def add(self, number: int, fut: Any) -> None:
        self.waiting.append((number, fut))
        fut.add_done_callback(self._print_ready)

    def too_long(self, number: int, max_line_bytes: int) -> None:
        self.failed += 1
        print(f"error: message {number}: line longer than --max-line-bytes {max_line_bytes:,}: not sent", file=sys.stderr)

    def _print_ready(self, _: Any = None) -> None:
        while self.waiting and self.waiting[0][1].done():
            number, fut = self.waiting.popleft()
            error = fut.exception()
            if error is None:
                r = fut.result()
                self.stored += 1
                sys.stdout.write(f"{r.queue.broker_name} queue {r.queue.queue_id} offset {r.queue_offset} id {r.msg_ids[0]}\n")
            else:
                self.failed += 1
                print(f"error: message {number}: {error}", file=sys.stderr)
        sys.stdout.flush()

    def finish(self) -> int:
        self._print_ready()
        if self.failed:
            print(f"error: {self.failed:,} of {self.failed + self.stored:,} messages not stored", file=sys.stderr)
        return 1 if self.failed or self.waiting else 0

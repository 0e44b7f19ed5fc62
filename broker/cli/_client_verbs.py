"""The ``clmq`` verbs that talk to a running cluster through the client library: topic,
group, produce (``consume`` is in ``consume_verbs.py``)."""

from __future__ import annotations

import argparse
import collections
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import trio

from clmq.client import Admin, NoRouteError, Routes, SendError, open_admin, open_producer

from ._common import add_client_args, addrs, namesrv_arg, run_client
from ._errors import EXIT_FAILED, EXIT_USAGE, CliError
from ._output import add_output_arg, emit, is_json, note, write_json
from ._timefmt import DURATION_MS, FORMS_WHEN, Duration, format_time_ms, parse_when_ms
from .consume_verbs import add_command as add_consume
from .group_verbs import add_command as add_group
from .message_verbs import add_command as add_message

DEFAULT_MAX_LINE_BYTES = 4 << 20  # a broker's default max_message_bytes
STDIN_READ_BYTES = 64 << 10  # one read of stdin: whatever has arrived, up to this much
ROUTE_WAIT_S = 10.0  # topic create/update: how long to wait for the name servers to route the topic
ROUTE_POLL_S = 0.05  # the name servers send no notification: their routes are asked for again


def add_client_commands(sub: Any) -> None:
    """Add the verbs that talk to a running cluster: topic, group, produce, consume."""
    _add_topic_commands(sub)
    _add_client_commands(sub)
    add_consume(sub)
    add_group(sub)
    add_message(sub)


def _add_topic_commands(sub: Any) -> None:
    topic = sub.add_parser("topic", help="create, list, describe, update, delete topics")
    tsub = topic.add_subparsers(dest="topic_command", required=True)
    create = tsub.add_parser(
        "create", help="create a topic (or grow it), its queues spread over the broker groups; returns once routed"
    )
    create.add_argument("name", help="the topic")
    create.add_argument("--queues", type=int, default=8, help="queue count, the total over the groups (default 8)")
    update = tsub.add_parser("update", help="change an existing topic: grow its queue count (queues cannot be removed)")
    update.add_argument("name", help="the topic")
    update.add_argument(
        "--queues",
        type=int,
        help="the new total queue count (at least the current one); new queues go to the groups holding fewest",
    )
    for p in (create, update):
        p.add_argument(
            "--groups",
            help="broker groups to spread over: 'all' or names (broker-a,broker-b); default: create, every "
            "group; update, the groups holding the topic. update --groups all without --queues: a new group "
            "gets as many queues as the fullest group",
        )
    for name, helptext in (
        ("list", "list topics"),
        ("describe", "per queue: min and max offsets, messages held"),
        ("delete", "delete a topic"),
    ):
        p = tsub.add_parser(name, help=helptext)
        if name != "list":
            p.add_argument("name", help="the topic")
        else:  # system topics: %TIMER%, %RETRY%group, %DLQ%group
            p.add_argument(
                "--all",
                "--include-system",
                action="store_true",
                dest="include_system",
                help="also the system topics (%%TIMER%%, %%RETRY%%group, %%DLQ%%group)",
            )
    add_client_args(tsub.choices)
    topic.set_defaults(func=cmd_topic)


def _add_client_commands(sub: Any) -> None:
    prod = sub.add_parser("produce", help="send messages (arguments, or lines of stdin as they arrive)")
    prod.add_argument("topic", help="the topic to send to (clmq topic create makes one)")
    prod.add_argument("messages", nargs="*", help="message bodies (default: each line of stdin, sent as it arrives)")
    prod.add_argument("--tags", default="", help="the messages' tag, for consumers' tag filters (e.g. PAID)")
    prod.add_argument("--keys", default="", help="the messages' keys, space separated (clmq message find --key)")
    prod.add_argument(
        "--property", action="append", default=[], metavar="KEY=VALUE", help="a message property (header), repeatable"
    )
    prod.add_argument("--queue", type=int, help="send to this queue id (default: spread, or --sharding-key's queue)")
    prod.add_argument("--file", type=Path, help="read the messages from this file, one per line, instead of stdin")
    prod.add_argument("--sharding-key", help="send every message to the queue of this key, in order")
    prod.add_argument(
        "--linger-ms", type=DURATION_MS, help="wait up to this long to fill a request: ms, or 1s (producer default 5)"
    )
    prod.add_argument("--batch-max-bytes", type=int, help="bytes per request to a broker (producer default 1 MiB)")
    prod.add_argument(
        "--retry-budget-ms", type=DURATION_MS, help="give a message up after trying this long: ms, or 30s (default 15s)"
    )
    prod.add_argument(
        "--max-line-bytes",
        type=int,
        default=DEFAULT_MAX_LINE_BYTES,
        help=f"longest line of stdin taken as a message (default {DEFAULT_MAX_LINE_BYTES:,}): "
        "a longer one is reported and skipped",
    )
    when = prod.add_mutually_exclusive_group()
    when.add_argument(
        "--delay",
        type=Duration("ms", bare=False),
        help="schedule each message: deliver it this long after it is sent (30s, 5m, 1h, 1500ms)",
    )
    when.add_argument("--deliver-at", help=f"schedule the messages: deliver them at this time: {FORMS_WHEN}")
    add_output_arg(prod)
    namesrv_arg(prod)
    prod.set_defaults(func=cmd_produce)


# ------------------------------------------------------------------ services
def cmd_topic(args: argparse.Namespace) -> int:
    if getattr(args, "queues", None) is not None and args.queues < 1:
        raise CliError(f"--queues must be at least 1, got {args.queues}", EXIT_USAGE)

    async def main() -> int:
        async with open_admin(addrs(args)) as admin:
            if args.topic_command in ("create", "update"):
                await _create_or_update(args, admin)
            elif args.topic_command == "delete":
                on = await admin.delete_topic(args.name)
                if not on:
                    raise CliError(f"no broker has topic {args.name!r}", EXIT_FAILED)
                if is_json(args):
                    write_json({"topic": args.name, "brokers": on})
                else:
                    note(args, f"topic {args.name} deleted on {', '.join(on)}")
            elif args.topic_command == "list":
                topics = await admin.list_topics(include_system=args.include_system)
                emit(
                    args,
                    "topics",
                    ["topic", "queues per broker"],
                    [[t, ", ".join(f"{b}: {n}" for b, n in by.items())] for t, by in topics.items()],
                    data=topics,
                )
            else:
                await _describe_topic(args, admin)
        return 0

    return run_client(main)


async def _create_or_update(args: argparse.Namespace, admin: Admin) -> None:
    """``topic create`` or ``topic update`` (queues spread over the broker groups), then
    wait until the name servers route it on every group holding it."""
    if args.topic_command == "update" and args.queues is None and args.groups is None:
        raise CliError("topic update: give --queues N, --groups all, or both", EXIT_USAGE)
    groups = None if args.groups is None else [g.strip() for g in args.groups.split(",") if g.strip()]
    try:
        counts = await admin.spread_topic(args.name, args.queues, groups=groups, grow=args.topic_command == "update")
    except ValueError as e:
        raise CliError(str(e), EXIT_FAILED) from None
    await _wait_routed(admin, addrs(args), args.name, sorted(counts))
    if is_json(args):
        write_json({"topic": args.name, "queues": sum(counts.values()), "groups": counts})
    else:
        per = ", ".join(f"{g}: {n}" for g, n in counts.items())
        note(args, f"topic {args.name}: {sum(counts.values())} queues ({per})")


async def _wait_routed(admin: Admin, namesrv: list[str], topic: str, on: list[str]) -> None:
    """Return once the name servers route ``topic`` to every broker group of ``on`` (the
    brokers register it a moment after creating it): ``clmq topic create t && clmq
    produce t ...`` then finds it. After ROUTE_WAIT_S a note, not a failure: the topic
    exists, and the route follows."""
    routes = Routes(admin.rpc, namesrv)
    with trio.move_on_after(ROUTE_WAIT_S):
        while True:
            try:
                if set(on) <= {mq.broker_name for mq in await routes.queues(topic, refresh=True)}:
                    return
            except NoRouteError:
                pass  # not registered yet
            await trio.sleep(ROUTE_POLL_S)
    print(f"note: the name servers do not route topic {topic!r} yet; they will shortly", file=sys.stderr)


async def _describe_topic(args: argparse.Namespace, admin: Any) -> None:
    rows = await admin.describe_topic(args.name)
    if not rows:
        raise CliError(f"no broker has topic {args.name!r} (clmq topic list shows the topics)", EXIT_FAILED)
    for r in rows:
        r["messages"] = r["max_offset"] - r["min_offset"]
    emit(
        args,
        f"topic {args.name}",
        ["broker", "queue", "min offset", "max offset", "messages", "bytes"],
        [
            [
                r["broker_name"],
                r["queue_id"],
                r["min_offset"],
                r["max_offset"],
                r["messages"],
                r["size_bytes"] if r.get("size_bytes", -1) >= 0 else "-",
            ]
            for r in rows
        ],
        data=rows,
    )


def cmd_produce(args: argparse.Namespace) -> int:
    """Send each argument, or each line of stdin as it arrives (bytes, the newline
    stripped), through the producer's buffer (``submit``; waits when it is full) and
    print each message's queue and offset in input order; a failed message is reported
    on stderr with its reason, and any failure makes the exit status 1."""
    options = {
        name: value
        for name, value in (
            ("linger_ms", args.linger_ms),
            ("batch_max_bytes", args.batch_max_bytes),
            ("retry_budget_ms", args.retry_budget_ms),
        )
        if value is not None
    }

    async def main() -> int:
        if args.max_line_bytes <= 0:
            raise CliError(f"--max-line-bytes {args.max_line_bytes}: must be positive", EXIT_USAGE)
        report = _ProduceReport(args.topic, is_json(args))
        properties = _properties(args.property)
        fd = _input_fd(args)
        bodies = _argument_bodies(args.messages) if args.messages else _stdin_lines(args.max_line_bytes, report, fd)
        schedule = _schedule(args)
        async with open_producer(addrs(args), **options) as producer:
            await _check_routed(producer, args)
            selector = await _queue_selector(producer, args.topic, args.queue)
            if schedule is not None:
                return await _produce_scheduled(args, producer, bodies, properties, selector, schedule)
            await _submit_all(args, producer, bodies, properties, selector, report)
        return report.finish()

    return run_client(main)


async def _submit_all(
    args: argparse.Namespace,
    producer: Any,
    bodies: AsyncIterator[bytes | None],
    properties: dict[str, str],
    selector: Any,
    report: _ProduceReport,
) -> None:
    """Hand every message to the producer's buffer as it comes, then flush it."""
    number = 0
    async for body in bodies:
        number += 1
        if body is None:  # a line over --max-line-bytes: reported by _stdin_lines
            continue
        fut = await producer.submit(
            args.topic,
            body,
            tags=args.tags,
            keys=args.keys,
            properties=properties,
            sharding_key=args.sharding_key,
            selector=selector,
        )
        report.add(number, fut)
    await producer.flush()


def _schedule(args: argparse.Namespace) -> dict[str, int] | None:
    """--delay / --deliver-at as the send's ``delay_ms`` or ``deliver_at`` (None: send
    now). A delay counts from each message's send: stdin may bring lines much later."""
    if args.deliver_at is not None:
        return {"deliver_at": parse_when_ms(args.deliver_at)}
    return None if args.delay is None else {"delay_ms": int(args.delay)}


async def _check_routed(producer: Any, args: argparse.Namespace) -> None:
    """A topic no broker serves is one line saying how to create it (exit 1), before
    any message is read from stdin. Name servers that do not answer are left to the
    sends, which report each message that could not go (exit 1)."""
    try:
        await producer.routes.queues(args.topic)
    except NoRouteError as e:
        if getattr(e, "unreachable", False):
            return
        create = f"clmq topic create {shlex.quote(args.topic)} --queues 8 --namesrv {args.namesrv}"
        raise CliError(f"{e}; create it first: {create}", EXIT_FAILED) from None


async def _produce_scheduled(
    args: argparse.Namespace,
    producer: Any,
    bodies: AsyncIterator[bytes | None],
    properties: dict[str, str],
    selector: Any,
    schedule: dict[str, int],
) -> int:
    """Send each message scheduled as ``schedule`` says, one after another; print each
    one's queue, due time and id (``clmq message cancel`` takes it)."""
    sent = failed = 0
    async for body in bodies:
        if body is None:  # a line over --max-line-bytes: reported by _stdin_lines
            failed += 1
            continue
        due = schedule.get("deliver_at") or int(time.time() * 1000) + schedule["delay_ms"]
        try:
            r = await producer.send(
                args.topic,
                body,
                tags=args.tags,
                keys=args.keys,
                properties=properties,
                sharding_key=args.sharding_key,
                selector=selector,
                **schedule,
            )
        except SendError as e:
            failed += 1
            print(f"error: message {sent + failed}: {e}", file=sys.stderr)
            continue
        sent += 1
        _print_scheduled(args, r, due)
    if failed:
        print(f"error: {failed:,} of {failed + sent:,} messages not scheduled", file=sys.stderr)
    return 1 if failed else 0


def _print_scheduled(args: argparse.Namespace, r: Any, due: int) -> None:
    if is_json(args):
        write_json(
            {
                "topic": args.topic,
                "broker_name": r.queue.broker_name,
                "queue_id": r.queue.queue_id,
                "scheduled": True,
                "deliver_at": format_time_ms(due),
                "deliver_at_ms": due,
                "msg_id": r.msg_ids[0],
            }
        )
        return
    sys.stdout.write(
        f"{r.queue.broker_name} queue {r.queue.queue_id} scheduled {format_time_ms(due)} id {r.msg_ids[0]}\n"
    )
    sys.stdout.flush()


def _properties(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise CliError(f"--property {pair!r}: give KEY=VALUE", EXIT_USAGE)
        out[key] = value
    return out


def _input_fd(args: argparse.Namespace) -> int:
    """stdin, or the --file opened (closed when the process ends)."""
    if args.file is None:
        return sys.stdin.fileno()
    if args.messages:
        raise CliError("give messages as arguments or --file, not both", EXIT_USAGE)
    try:
        return os.open(args.file, os.O_RDONLY)
    except OSError as e:
        raise CliError(f"--file {args.file}: {e.strerror}", EXIT_USAGE) from None


async def _queue_selector(producer: Any, topic: str, queue_id: int | None) -> Callable[..., Any] | None:
    """With --queue: a selector that picks that queue (an error if the topic has none)."""
    if queue_id is None:
        return None
    queues = await producer.routes.queues(topic)
    chosen = [mq for mq in queues if mq.queue_id == queue_id]
    if not chosen:
        raise CliError(f"topic {topic!r} has no queue {queue_id} (queues 0..{len(queues) - 1})", EXIT_FAILED)
    return lambda mqs, _msg: next((mq for mq in mqs if mq.queue_id == queue_id), chosen[0])


async def _argument_bodies(messages: list[str]) -> AsyncIterator[bytes | None]:
    for m in messages:
        yield m.encode()


async def _stdin_lines(max_line_bytes: int, report: _ProduceReport, fd: int) -> AsyncIterator[bytes | None]:
    """Each line of stdin as bytes (newline stripped), as soon as it arrives: reads take
    whatever is there (a thread, so trio goes on meanwhile; files, pipes and terminals
    alike). A line longer than ``max_line_bytes`` yields None (reported, not kept)."""
    rest, number, too_long = b"", 0, False
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

    def __init__(self, topic: str, json_lines: bool) -> None:
        self.topic, self.json_lines = topic, json_lines
        self.waiting: collections.deque[tuple[int, Any]] = collections.deque()  # (message number, SendFuture)
        self.stored = 0
        self.failed = 0

    def add(self, number: int, fut: Any) -> None:
        self.waiting.append((number, fut))
        fut.add_done_callback(self._print_ready)

    def too_long(self, number: int, max_line_bytes: int) -> None:
        self.failed += 1
        print(
            f"error: message {number}: line longer than --max-line-bytes {max_line_bytes:,}: not sent", file=sys.stderr
        )

    def _print_ready(self, _: Any = None) -> None:
        while self.waiting and self.waiting[0][1].done():
            number, fut = self.waiting.popleft()
            error = fut.exception()
            if error is None:
                self.stored += 1
                self._print_stored(fut.result())
            else:
                self.failed += 1
                print(f"error: message {number}: {error}", file=sys.stderr)
        sys.stdout.flush()

    def _print_stored(self, r: Any) -> None:
        q = r.queue
        msg_id = r.msg_ids[0] if r.msg_ids else None  # partition-per-file brokers give no CommitLog offsets
        if self.json_lines:
            fields = {"broker_name": q.broker_name, "queue_id": q.queue_id, "queue_offset": r.queue_offset}
            write_json({"topic": self.topic, **fields, "msg_id": msg_id})
        else:
            sys.stdout.write(f"{q.broker_name} queue {q.queue_id} offset {r.queue_offset} id {msg_id or '-'}\n")

    def finish(self) -> int:
        self._print_ready()
        if self.failed:
            print(f"error: {self.failed:,} of {self.failed + self.stored:,} messages not stored", file=sys.stderr)
        return 1 if self.failed or self.waiting else 0

"""``clmq bench pop``: POP consumption against queue-based consumption, issue 33.

One fresh ``clmq broker`` process (``e2e.BrokerProcess``, commitlog mode, async flush,
its own data directory). The members run in member processes (``pop_member.py``, the
members of a run spread over at most ``--member-processes`` of them, each member its
own consumer and connections, as separate workers would be).

- Throughput: a ``--queues`` topic is filled with ``--messages`` of ``--size-bytes``.
  For each handler time (``--handler-ms-list``: 0, a receive-and-acknowledge loop; more, a
  wait per message as a call to another service would take), member count
  (``--members``) and kind (``pop``: ``open_pop_consumer``, each batch acknowledged
  with ``ack``; ``queue``: ``open_consumer``, each batch acknowledged by the next
  ``receive``), a fresh group reads the topic from its start, until every message is
  acknowledged or ``--seconds`` (handler 0) / ``--handler-seconds`` pass from its first
  acknowledgement. The rate is
  the messages handled and acknowledged per second from the group's first to its last
  (the members' opening is not in it; with a handler time, neither is the first
  ``--ramp-seconds``); ``--runs`` runs, the kinds alternated; medians and the POP /
  queue-based ratio of each run. A queue-based member counts a message when handled
  (the next ``receive`` acknowledges it), so messages handled twice around a
  rebalance count twice.
- Redelivery after a member crash: one POP member process receives all of
  ``--crash-messages`` fresh messages (``--crash-invisible-ms``) and acknowledges none;
  ``--crash-survivors`` other members start; the first is ``kill -9``'ed. For each of
  its messages: when a survivor received it, against the deadline the broker gave the
  dead member (its pop time + the invisible time). Aim: within invisible time + 1 s.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import trio

from clmq.client import open_admin, open_producer

from .commands import _ints
from .cpu import cpu_seconds
from .delay import _broker
from .e2e import BrokerProcess
from .pop_procs import MemberProcess, split
from .pop_report import aims, crash_summary, markdown, plot, rate_of, throughput_summary

TOPIC = "pop-bench"
CRASH_TOPIC = "pop-crash"
KINDS = ("queue", "pop")
FILL_BATCH_BYTES = 512 << 10  # send_batch holds about this many bytes while filling
REPORT_INTERVAL_MS = 50  # member processes report their acknowledged count this often
FIRST_ACK_TIMEOUT_S = 60.0  # a run's window opens at its first acknowledgement; none by then: rate 0
CRASH_WAIT_AFTER_DEADLINE_S = 30.0  # the survivors get this long past the invisible time


def _floats(text: str) -> list[float]:
    """Comma-separated numbers >= 0 (``0,5``)."""
    try:
        values = [float(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected numbers >= 0, got {text!r}")
    return values


def _counts(text: str) -> list[int]:
    """Comma-separated counts >= 1 (``1,8,64``)."""
    try:
        values = _ints(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated counts, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected counts >= 1, got {text!r}")
    return values


def _count(text: str) -> int:
    """One count >= 1."""
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a count >= 1, got {text!r}")
    return value


def add_command(bench_sub: Any) -> None:
    """Add ``clmq bench pop`` to the parser."""
    p = bench_sub.add_parser("pop", help="POP consumption against queue-based: throughput by members, redelivery")
    a = p.add_argument
    a("--messages", type=_count, default=200_000, help="messages the throughput topic is filled with (default 200000)")
    a("--size-bytes", type=_count, default=1024, help="message body size (default 1024)")
    a("--queues", type=_count, default=4, help="queues of the topics (default 4)")
    a("--members", type=_counts, default=[1, 8, 64], help="member counts, comma-separated (default 1,8,64)")
    a(
        "--handler-ms-list",
        dest="handler_ms",
        type=_floats,
        default=[0.0, 5.0],
        help="waits per message handled, ms, comma-separated: one set of cases each (default 0,5)",
    )
    a("--runs", type=_count, default=3, help="runs of each case, the kinds alternated; medians (default 3)")
    a("--seconds", type=float, default=15.0, help="handler 0: a run ends after this at most (default 15)")
    a("--handler-seconds", type=float, default=6.0, help="handler > 0: seconds a run lasts (default 6)")
    a(
        "--ramp-seconds",
        type=float,
        default=1.0,
        help="handler > 0: the rate leaves out this long after the first acknowledgement (default 1)",
    )
    a("--member-processes", type=_count, default=4, help="processes the members of a run share (default 4)")
    a("--pop-batch", type=_count, default=32, help="POP: messages per POP request and per receive (default 32)")
    a("--prefetch", type=_count, default=64, help="POP: messages a member prefetches at most (default 64)")
    a("--invisible-ms", type=int, default=30_000, help="POP: invisible time of the throughput runs (default 30 s)")
    _add_crash_args(a)
    a("--settle-seconds", type=float, default=2.0, help="os.sync(), then idle this long before the broker (default 2)")
    a("--json", type=Path, default=None, help="every figure as JSON")
    a("--markdown", type=Path, default=None, help="also write the tables and the aims as Markdown here")
    a("--plot", type=Path, default=None, help="draw the figures here (matplotlib)")
    p.set_defaults(func=cmd_bench_pop)


def _add_crash_args(a: Any) -> None:
    """The redelivery part's options."""
    a(
        "--crash-messages",
        type=_count,
        default=1000,
        help="redelivery: messages the crashed member holds (default 1000)",
    )
    a("--crash-invisible-ms", type=int, default=3000, help="redelivery: the invisible time (default 3 s)")
    a("--crash-survivors", type=_count, default=4, help="redelivery: members left after the crash (default 4)")


def _spec(addr: str, args: argparse.Namespace, **fields: Any) -> dict[str, Any]:
    return {
        "addr": addr,
        "topic": TOPIC,
        "kind": "pop",
        "role": "throughput",
        "handler_ms": 0.0,
        "invisible_ms": args.invisible_ms,
        "pop_batch": args.pop_batch,
        "prefetch": args.prefetch,
        "report_interval_ms": REPORT_INTERVAL_MS,
        **fields,
    }


async def _fill(addr: str, topic: str, n: int, size: int) -> None:
    body = os.urandom(size)
    per = max(1, FILL_BATCH_BYTES // max(1, size))
    async with open_producer(broker_addrs=[addr]) as p:
        for start in range(0, n, per):
            await p.send_batch(topic, [body] * min(per, n - start))


async def _follow(
    proc: MemberProcess, index: int, last: list[int], timeline: list[tuple[float, int]], refused: list[int]
) -> None:
    """Read a member process's reports into ``last``, the group's ``timeline`` and
    ``refused`` (its POP acknowledgements the broker did not answer ok)."""
    while (line := await proc.line()) is not None:
        doc = json.loads(line)
        if "t" in doc:
            last[index] = doc["acked"]
            timeline.append((doc["t"], sum(last)))
        refused[index] = doc.get("not_ok", refused[index])


async def _window(timeline: list[tuple[float, int]], target: int, limit_s: float) -> None:
    """Until ``target`` messages are acknowledged or ``limit_s`` pass from the first
    acknowledgement (a loaded machine may take seconds to deliver the first: the
    window measures handling, not that wait; FIRST_ACK_TIMEOUT_S at most)."""
    with trio.move_on_after(FIRST_ACK_TIMEOUT_S):
        while timeline[-1][1] == 0:  # noqa: ASYNC110 - the reports are the event
            await trio.sleep(REPORT_INTERVAL_MS / 1000)
    with trio.move_on_after(limit_s):
        while timeline[-1][1] < target:  # noqa: ASYNC110 - the reports are the event
            await trio.sleep(REPORT_INTERVAL_MS / 1000)


async def one_run(addr: str, pid: int, args: argparse.Namespace, case: dict[str, Any]) -> dict[str, Any]:
    """One group of ``case['members']`` members of ``case['kind']`` reading the topic."""
    specs = [
        _spec(
            addr, args, kind=case["kind"], handler_ms=case["handler_ms"], group=case["group"], name=f"m{i}", members=n
        )
        for i, n in enumerate(split(case["members"], args.member_processes))
    ]
    procs = [await MemberProcess.start(s) for s in specs]
    try:
        for proc in procs:
            await proc.expect("ready")
        last, refused, timeline = [0] * len(procs), [0] * len(procs), [(time.monotonic(), 0)]
        limit = args.handler_seconds if case["handler_ms"] else args.seconds
        cpu0 = cpu_seconds(pid)
        async with trio.open_nursery() as nursery:
            for i, proc in enumerate(procs):
                nursery.start_soon(_follow, proc, i, last, timeline, refused)
                await proc.send("go")
            await _window(timeline, args.messages, limit)
            broker_cpu, member_cpu = cpu_seconds(pid) - cpu0, sum(cpu_seconds(p.pid) for p in procs)
            for proc in procs:
                await proc.send("stop")
            for proc in procs:
                await proc.finish()
    finally:
        for proc in procs:
            proc.close()
    skip = args.ramp_seconds if case["handler_ms"] else 0.0
    rate = rate_of(timeline, args.messages, skip)
    return {**case, **rate, "acks_refused": sum(refused), "broker_cpu_s": broker_cpu, "member_cpu_s": member_cpu}


async def _throughput(addr: str, pid: int, args: argparse.Namespace, report: Callable[[str], None]) -> list[Any]:
    samples = []
    for handler_ms in args.handler_ms:
        for members in args.members:
            for r in range(args.runs):
                for kind in KINDS if r % 2 == 0 else KINDS[::-1]:
                    group = f"bench-{kind}-{members}-{handler_ms:g}-{r}".replace(".", "_")
                    case = {"kind": kind, "members": members, "handler_ms": handler_ms, "run": r, "group": group}
                    s = await one_run(addr, pid, args, case)
                    samples.append(s)
                    report(
                        f"handler {handler_ms:g} ms, {members} members, run {r + 1}/{args.runs}: {kind}: "
                        f"{s['msgs_per_s']:,.0f} msgs/s ({s['acked']:,} acknowledged in {s['elapsed_s']:.2f} s, "
                        f"first after {s['startup_s']:.2f} s), broker CPU {s['broker_cpu_s']:.1f} s"
                        + (f", {s['acks_refused']:,} acknowledgements refused" if s["acks_refused"] else "")
                    )
    return samples


async def _victim(addr: str, args: argparse.Namespace) -> tuple[MemberProcess, dict[tuple[int, int], Any]]:
    spec = _spec(addr, args, topic=CRASH_TOPIC, role="victim", group="bench-crash", name="victim", members=1)
    spec["invisible_ms"], spec["hold"] = args.crash_invisible_ms, args.crash_messages
    victim = await MemberProcess.start(spec)
    held: dict[tuple[int, int], Any] = {}
    with trio.fail_after(60):
        while (line := await victim.line()) != "held":
            if line is None:
                raise RuntimeError(f"the crash victim exited: {victim.stderr_tail()}")
            doc = json.loads(line)
            held[(doc["q"], doc["o"])] = doc
    return victim, held


async def _crash(addr: str, args: argparse.Namespace, report: Callable[[str], None]) -> dict[str, Any]:
    """kill -9 of a member holding every message of the crash topic; when each came back."""
    await _fill(addr, CRASH_TOPIC, args.crash_messages, args.size_bytes)
    victim, held = await _victim(addr, args)
    spec = _spec(addr, args, topic=CRASH_TOPIC, role="survivor", group="bench-crash", name="survivor")
    spec["invisible_ms"], spec["members"] = args.crash_invisible_ms, args.crash_survivors
    survivors = await MemberProcess.start(spec)
    got: dict[tuple[int, int], Any] = {}
    try:
        await survivors.expect("ready")
        victim.kill()
        killed_ms = time.time() * 1000
        report(f"redelivery: a member holding {len(held):,} messages killed (kill -9)")
        with trio.move_on_after(args.crash_invisible_ms / 1000 + CRASH_WAIT_AFTER_DEADLINE_S):
            while len(got.keys() & held.keys()) < len(held):
                line = await survivors.line()
                if line is None:
                    break
                doc = json.loads(line)
                got.setdefault((doc["q"], doc["o"]), doc)
        await survivors.send("stop")
        await survivors.finish()
    finally:
        victim.close()
        survivors.close()
    return crash_summary(held, got, args.crash_invisible_ms, killed_ms)


async def _all(broker: BrokerProcess, args: argparse.Namespace, report: Callable[[str], None]) -> dict[str, Any]:
    addr, pid = broker.addr, broker.proc.pid
    async with open_admin(broker_addrs=[addr]) as admin:
        await admin.create_topic(TOPIC, args.queues, on=[addr])
        await admin.create_topic(CRASH_TOPIC, args.queues, on=[addr])
    t0 = time.perf_counter()
    await _fill(addr, TOPIC, args.messages, args.size_bytes)
    report(f"filled {TOPIC}: {args.messages:,} messages of {args.size_bytes} B in {time.perf_counter() - t0:.1f} s")
    samples = await _throughput(addr, pid, args, report)
    crash = await _crash(addr, args, report)
    report(
        f"redelivery: {crash['redelivered']:,} of {crash['held']:,} back; past the deadline p50 "
        f"{crash['p50_ms']:.0f} ms, p99 {crash['p99_ms']:.0f} ms, max {crash['max_ms']:.0f} ms"
    )
    async with open_admin(broker_addrs=[addr]) as admin:
        info = await admin.broker_info(addr)
    return {"throughput": throughput_summary(samples), "samples": samples, "crash": crash, "broker": info}


def run_all(args: argparse.Namespace, report: Callable[[str], None]) -> dict[str, Any]:
    """Start the broker, run every part, stop it; the results document."""
    root = Path(tempfile.mkdtemp(prefix="clmq-bench-pop-"))
    try:
        broker = _broker(root, args.settle_seconds)
        try:
            figures = trio.run(_all, broker, args, report)
        finally:
            broker.stop()
    finally:
        subprocess.run(["rm", "-rf", str(root)], check=False)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"}
    result: dict[str, Any] = {
        "settings": settings,
        "machine": {"cpus": os.cpu_count(), "load_after": os.getloadavg()},
        **figures,
    }
    result["aims"] = aims(result)
    return result


def cmd_bench_pop(args: argparse.Namespace) -> int:
    """``clmq bench pop``: run, print the tables, write the JSON and the plot."""
    from rich.console import Console

    from .report import save
    from .results import draw

    console = Console(soft_wrap=True)
    result = run_all(args, lambda line: console.print(line, highlight=False))
    save(result, markdown(result), args.json, args.markdown, console)
    if args.plot is not None:
        draw(plot, result, args.plot, console)
    return 0

"""One load process of ``clmq bench latency``: ``python -m clmq.bench.latency_load SPEC``.

SPEC (JSON) names the broker, the topic, the role and the schedule. Every message
carries its *intended* send time (CLOCK_MONOTONIC ns, the same clock in every process
of this machine), its producer's index and its sequence number in the first 16 bytes
of its body.

- ``producer``: opens a producer, sends one probe message (routes and connection
  ready), prints ``ready``, waits for ``go <t0 ns>`` on stdin. Producer ``k`` of ``P``
  owns messages ``k, k + P, k + 2P, ...`` of the run's schedule, message ``i`` due at
  ``t0 + i / rate``: arrivals at a constant rate whatever the answers (open loop). It
  submits each message once due (never before), however late it is; a late generator
  shows in the latency (measured from the intended time) and in ``late_*``. Then it
  waits for the answers (at most ``ack_max_s``) and prints one JSON line of results.
- ``consumer``: a long-polling consumer group member reading the topic from its start;
  prints ``ready`` once it has received a probe, then receives until every message of
  the schedule has arrived (or ``stop`` comes), and prints its results; the end-to-end
  latency of a message is from its intended send time to the ``receive()`` that
  returned it.
"""

from __future__ import annotations

import json
import resource
import struct
import sys
import time
from array import array
from functools import partial
from typing import Any

import trio

from clmq.client import Producer, SendFuture, open_consumer, open_producer

from . import latency_hist

HEADER = struct.Struct(">qii")  # intended send time (CLOCK_MONOTONIC ns), producer index, sequence (-1: probe)
NS_PER_US = 1000
NS_PER_S = 1_000_000_000
BEHIND_MAX_S = 5.0  # a spec without behind_max_s: stop this far behind the schedule's end
SEND_TIMEOUT_MS = 30_000  # an answer slower than this is a failure (counted, never dropped silently)


def _out(doc: Any) -> None:
    print(doc if isinstance(doc, str) else json.dumps(doc), flush=True)


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Schedule:
    """Which messages of the run are this producer's and when each is due."""

    def __init__(self, spec: dict[str, Any], t0_ns: int) -> None:
        self.index: int = spec["index"]
        self.stride: int = spec["producers"]
        self.rate: int = spec["rate"]
        self.t0_ns = t0_ns
        self.total = int(self.rate * (spec["warmup_s"] + spec["seconds"]))  # the run's messages, all producers
        self.count = len(range(self.index, self.total, self.stride))  # this producer's
        self.warmup_ns = int(spec["warmup_s"] * NS_PER_S)
        # a generator this far behind the schedule's end stops: what it did not send is counted
        behind_max_s = spec.get("behind_max_s", BEHIND_MAX_S)
        self.stop_ns = t0_ns + int((spec["warmup_s"] + spec["seconds"] + behind_max_s) * NS_PER_S)

    def due_ns(self, j: int) -> int:
        """The intended send time of this producer's ``j``-th message."""
        return self.t0_ns + (j * self.stride + self.index) * NS_PER_S // self.rate


class Recorder:
    """Per message of this producer: how late it was submitted and when it was answered."""

    def __init__(self, count: int) -> None:
        self.late_ns = array("q", bytes(8 * count))
        self.ack_ns = array("q", bytes(8 * count))  # 0: no answer (yet)
        self.failed = 0
        self.first_error = ""
        self.submitted = 0

    def answered(self, j: int, fut: SendFuture) -> None:
        """The done callback of message ``j``."""
        now = time.monotonic_ns()
        error = fut.exception()
        if error is None:
            self.ack_ns[j] = now
        else:
            self.failed += 1
            self.first_error = self.first_error or repr(error)


async def send_one(p: Producer, topic: str, body: bytes, callback: Any) -> None:
    """How one message is handed to the client: the public ``submit`` (the accumulator
    makes the requests). The one place to switch to a cheaper client path."""
    await p.submit(topic, body, callback=callback)


async def generate(p: Producer, topic: str, sched: Schedule, rec: Recorder, pad: bytes) -> int:
    """Submit every message of the schedule once due (unless so far behind that the
    schedule's ``stop_ns`` passed); returns when the last was submitted (ns)."""
    j, n, k = 0, sched.count, sched.index
    while j < n:
        now = time.monotonic_ns()
        if now > sched.stop_ns:
            break
        due = sched.due_ns(j)
        if due > now:
            await trio.sleep((due - now) / NS_PER_S)
            continue
        while j < n and (due := sched.due_ns(j)) <= now:
            body = HEADER.pack(due, k, j) + pad
            rec.late_ns[j] = time.monotonic_ns() - due
            await send_one(p, topic, body, partial(rec.answered, j))
            j += 1
            rec.submitted = j
    return time.monotonic_ns()


async def _go(stdin: trio.lowlevel.FdStream) -> int:
    """Wait for ``go <t0 ns>``."""
    buf = b""
    while b"\n" not in buf:
        data = await stdin.receive_some(4096)
        if not data:
            raise SystemExit("stdin closed before go")
        buf += data
    word, t0 = buf.split(b"\n", 1)[0].split()
    assert word == b"go"
    return int(t0)


def producer_result(spec: dict[str, Any], sched: Schedule, rec: Recorder) -> dict[str, Any]:
    """The JSON line of a producer: counts and encoded histograms of the measured window
    (intended times after the warm-up), and per-second histograms of the whole run."""
    ack_us, service_us, late_us, all_us, seconds = [], [], [], [], []
    window_start = sched.t0_ns + sched.warmup_ns
    measured = 0
    for j in range(sched.count):
        due, acked, late = sched.due_ns(j), rec.ack_ns[j], rec.late_ns[j]
        in_window = due >= window_start
        measured += in_window
        if in_window:
            late_us.append(late // NS_PER_US)
        if not acked:
            continue
        seconds.append((due - sched.t0_ns) // NS_PER_S)
        all_us.append((acked - due) // NS_PER_US)
        if in_window:
            ack_us.append((acked - due) // NS_PER_US)
            service_us.append((acked - due - late) // NS_PER_US)
    return {
        "role": "producer",
        "index": sched.index,
        "scheduled": sched.count,
        "submitted": rec.submitted,
        "measured": measured,
        "acked": sum(1 for v in rec.ack_ns if v),
        "acked_measured": len(ack_us),
        "failed": rec.failed,
        "first_error": rec.first_error,
        "hist": {
            "ack": latency_hist.encode(latency_hist.of(ack_us)),
            "ack_from_submit": latency_hist.encode(latency_hist.of(service_us)),
            "late": latency_hist.encode(latency_hist.of(late_us)),
        },
        "per_second": latency_hist.per_second(all_us, seconds),
    }


async def run_producer(spec: dict[str, Any]) -> None:
    """The producer role (see the module)."""
    pad = bytes(max(0, spec["message_bytes"] - HEADER.size))
    stdin = trio.lowlevel.FdStream(sys.stdin.fileno())
    async with open_producer(broker_addrs=[spec["addr"]], send_timeout_ms=SEND_TIMEOUT_MS) as p:
        await p.send(spec["topic"], HEADER.pack(time.monotonic_ns(), spec["index"], -1) + pad)
        _out("ready")
        sched = Schedule(spec, await _go(stdin))
        rec = Recorder(sched.count)
        cpu0 = _cpu_s()
        last_submit_ns = await generate(p, spec["topic"], sched, rec, pad)
        gen_cpu = _cpu_s() - cpu0
        with trio.move_on_after(spec["ack_max_s"]):
            await p.flush()
        cpu = _cpu_s() - cpu0
        wall = (time.monotonic_ns() - sched.t0_ns) / NS_PER_S
    result = producer_result(spec, sched, rec)
    result.update(cpu_s=cpu, gen_cpu_s=gen_cpu, wall_s=wall, last_submit_ns=last_submit_ns, t0_ns=sched.t0_ns)
    _out(result)


class Delivered:
    """What the consumer received: each message once (duplicates counted), with the time
    from its intended send to the ``receive()`` that returned it."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.duplicates = 0
        self.due_ns = array("q")
        self.latency_ns = array("q")
        self.probe = trio.Event()
        self.expected = 1 << 62  # until the benchmark says how many were sent (``expect N``)

    def take(self, bodies: list[bytes], now: int) -> None:
        """Count the bodies of one ``receive()`` returned at ``now``."""
        for body in bodies:
            due, k, j = HEADER.unpack_from(body)
            if j < 0:
                self.probe.set()
                continue
            key = k << 32 | j
            if key in self.seen:
                self.duplicates += 1
                continue
            self.seen.add(key)
            self.due_ns.append(due)
            self.latency_ns.append(now - due)


async def _consume(spec: dict[str, Any], got: Delivered, done: trio.Event) -> None:
    """Receive until every message of the run arrived; then set ``done``."""
    async with open_consumer(None, spec["group"], {spec["topic"]: "*"}, broker_addrs=[spec["addr"]]) as c:
        while len(got.seen) < got.expected:
            records = await c.receive()
            got.take([r.body for r in records], time.monotonic_ns())
    done.set()


async def _commands(stdin: trio.lowlevel.FdStream, t0: list[int], got: Delivered, stop: trio.Event) -> None:
    """``go <t0 ns>`` sets ``t0``; ``expect N`` the count to wait for; ``stop``, the end of
    stdin or every expected message there sets ``stop``."""
    buf = b""
    while True:
        data = await stdin.receive_some(4096)
        if not data:
            stop.set()
            return
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            words = line.split()
            if words[:1] == [b"go"]:
                t0.append(int(words[1]))
            elif words[:1] == [b"expect"]:
                got.expected = int(words[1])
                if len(got.seen) >= got.expected:
                    stop.set()
            elif words[:1] == [b"stop"]:
                stop.set()


def consumer_result(spec: dict[str, Any], got: Delivered, t0_ns: int) -> dict[str, Any]:
    """The consumer's JSON line: counts, the measured window's histogram, per-second ones."""
    window_start = t0_ns + int(spec["warmup_s"] * NS_PER_S)
    measured = [lat // NS_PER_US for due, lat in zip(got.due_ns, got.latency_ns, strict=True) if due >= window_start]
    seconds = [(due - t0_ns) // NS_PER_S for due in got.due_ns]
    return {
        "role": "consumer",
        "delivered": len(got.seen),
        "delivered_measured": len(measured),
        "duplicates": got.duplicates,
        "hist": {"e2e": latency_hist.encode(latency_hist.of(measured))},
        "per_second": latency_hist.per_second([lat // NS_PER_US for lat in got.latency_ns], seconds),
    }


async def run_consumer(spec: dict[str, Any]) -> None:
    """The consumer role (see the module)."""
    got, finish, t0 = Delivered(), trio.Event(), list[int]()
    stdin = trio.lowlevel.FdStream(sys.stdin.fileno())
    cpu0 = _cpu_s()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_consume, spec, got, finish)  # every message arrived
        nursery.start_soon(_commands, stdin, t0, got, finish)  # or stop
        await got.probe.wait()
        _out("ready")
        with trio.move_on_after(spec["deliver_max_s"]):
            await finish.wait()
        nursery.cancel_scope.cancel()
    result = consumer_result(spec, got, t0[0] if t0 else 0)
    result["cpu_s"] = _cpu_s() - cpu0
    _out(result)


def main() -> None:
    spec = json.loads(sys.argv[1])
    trio.run(run_producer if spec["role"] == "producer" else run_consumer, spec)


if __name__ == "__main__":
    main()

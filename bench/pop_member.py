"""One process of ``clmq bench pop``'s members: ``python -m clmq.bench.pop_member SPEC``.

SPEC (JSON) names the broker, topic, group, kind (``pop``: :func:`open_pop_consumer`,
``queue``: :func:`open_consumer`), how many members this process runs (each its own
consumer, as separate worker processes would have) and the role:

- ``throughput``: prints ``ready``, waits for ``go`` on stdin, then every member
  receives, handles each message (``handler_ms`` of waiting, as a call to another
  service would, 0: none) and acknowledges; every ``report_interval_ms`` the process
  prints ``{"t": <CLOCK_MONOTONIC s>, "acked": <messages handled and acknowledged>}``
  until ``stop`` arrives; then closes its consumers and prints ``{"done": ...}``.
- ``victim``: one POP member receives until it holds ``hold`` messages, acknowledges
  none, prints one line per message (queue, offset, the deadline the broker gave it)
  and then ``held``; it then waits to be killed (``kill -9``).
- ``survivor``: POP members that print ``ready``, then receive and acknowledge, printing
  one line per message (queue, offset, attempt, the wall-clock receipt time).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import trio

from clmq.client import open_consumer, open_pop_consumer

CLOSE_MAX_S = 10.0  # members get this long to close after stop


async def _lines(ready: trio.Event, stop: trio.Event) -> None:
    """``go`` sets ``ready``; ``stop`` (or the end of stdin) sets ``stop``."""
    stdin = trio.lowlevel.FdStream(sys.stdin.fileno())
    buf = b""
    while not stop.is_set():
        data = await stdin.receive_some(4096)
        if not data:
            stop.set()
            break
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            if line.strip() == b"go":
                ready.set()
            elif line.strip() == b"stop":
                stop.set()


def _out(doc: Any) -> None:
    print(doc if isinstance(doc, str) else json.dumps(doc), flush=True)


def _open(spec: dict[str, Any], index: int) -> Any:
    """The async context manager of member ``index``'s consumer."""
    client_id = f"{spec['name']}-{index}"
    if spec["kind"] == "queue":
        return open_consumer(
            None, spec["group"], {spec["topic"]: "*"}, broker_addrs=[spec["addr"]], client_id=client_id
        )
    return open_pop_consumer(
        None,
        spec["group"],
        {spec["topic"]: "*"},
        broker_addrs=[spec["addr"]],
        client_id=client_id,
        invisible_time_ms=spec["invisible_ms"],
        max_messages=spec["pop_batch"],
        receive_max_messages=spec["pop_batch"],
        prefetch_max_messages=spec["prefetch"],
    )


async def _member(
    spec: dict[str, Any], index: int, acked: list[int], scopes: list[trio.CancelScope], stop: trio.Event
) -> None:
    """Open a consumer, then receive, handle and acknowledge until its scope is
    cancelled; the consumer then closes normally (a queue-based one commits)."""
    wait = spec["handler_ms"] / 1000
    pop = spec["kind"] == "pop"
    async with _open(spec, index) as consumer:
        with trio.CancelScope() as scope:
            scopes.append(scope)
            if stop.is_set():  # stopped while it was opening
                scope.cancel()
            while True:
                records = await consumer.receive()  # queue-based: acknowledges the previous batch
                for _ in records:
                    if wait:
                        await trio.sleep(wait)
                    acked[0] += not pop  # queue-based: counted when handled (acknowledged by the next receive)
                if pop:
                    statuses = await consumer.ack(records)
                    acked[0] += statuses.count("ok")  # what the broker settled
                    acked[1] += len(statuses) - statuses.count("ok")  # refused: expired, gone, ...


async def _throughput(spec: dict[str, Any]) -> None:
    ready, stop = trio.Event(), trio.Event()
    acked = [0, 0]  # acknowledged (POP: answered ok), POP acknowledgements answered otherwise
    scopes: list[trio.CancelScope] = []
    _out("ready")
    async with trio.open_nursery() as outer:
        outer.start_soon(_lines, ready, stop)
        await ready.wait()
        async with trio.open_nursery() as members:
            for i in range(spec["members"]):
                members.start_soon(_member, spec, i, acked, scopes, stop)
            while not stop.is_set():
                _out({"t": time.monotonic(), "acked": acked[0], "not_ok": acked[1]})
                with trio.move_on_after(spec["report_interval_ms"] / 1000):
                    await stop.wait()
            for scope in scopes:
                scope.cancel()
            members.cancel_scope.deadline = trio.current_time() + CLOSE_MAX_S  # members still opening, a stuck close
        _out({"done": True, "acked": acked[0], "not_ok": acked[1]})
        outer.cancel_scope.cancel()


def _where(consumer: Any, record: Any) -> dict[str, Any]:
    receipt = consumer.receipt(record)
    return {
        "q": record.queue_id,
        "o": record.queue_offset,
        "deadline_ms": receipt.deadline_ms if receipt is not None else None,
        "attempt": receipt.attempt if receipt is not None else None,
    }


async def _victim(spec: dict[str, Any]) -> None:
    async with _open(spec, 0) as consumer:
        held = 0
        while held < spec["hold"]:
            for record in await consumer.receive():
                _out({"popped_ms": time.time() * 1000, **_where(consumer, record)})
                held += 1
        _out("held")
        await trio.sleep_forever()  # until kill -9


async def _survivor(spec: dict[str, Any]) -> None:
    async def member(index: int) -> None:
        async with _open(spec, index) as consumer:
            opened[0] += 1
            if opened[0] == spec["members"]:
                _out("ready")
            while True:
                records = await consumer.receive()
                now = time.time() * 1000
                for record in records:
                    _out({"received_ms": now, **_where(consumer, record)})
                await consumer.ack(records)

    opened = [0]
    async with trio.open_nursery() as nursery:
        for i in range(spec["members"]):
            nursery.start_soon(member, i)
        stop = trio.Event()
        nursery.start_soon(_lines, trio.Event(), stop)
        await stop.wait()
        nursery.cancel_scope.cancel()


ROLES = {"throughput": _throughput, "victim": _victim, "survivor": _survivor}


def main() -> None:
    """Run the role SPEC (argv[1], JSON) names."""
    spec = json.loads(sys.argv[1])
    trio.run(ROLES[spec["role"]], spec)


if __name__ == "__main__":
    main()

"""Run as a subprocess by test_pop_members.py: one POP consumer member that handles
messages one at a time and writes a line per step to its file (line buffered, so a
kill -9 loses no line written before it):

    READY
    start <body> <reconsume_times>
    ack <body> <status>
    hang <body>          (then it blocks until killed: ``--hang-after N`` messages)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TextIO

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import trio

from clmq.client import open_pop_consumer


async def main(args: argparse.Namespace, out: TextIO) -> None:
    async with open_pop_consumer(
        args.namesrv,
        args.group,
        {args.topic: "*"},
        client_id=args.client_id,
        invisible_time_ms=args.invisible_time_ms,
        max_messages=4,
        prefetch_max_messages=4,
        receive_max_messages=4,
        pop_wait_ms=500,
        route_refresh_interval_ms=500,
    ) as consumer:
        out.write("READY\n")
        handled = 0
        while True:
            for record in await consumer.receive():
                body = record.body.decode()
                out.write(f"start {body} {record.reconsume_times}\n")
                if args.hang_after is not None and handled >= args.hang_after:
                    out.write(f"hang {body}\n")
                    await trio.sleep_forever()  # mid-message: the test kills this process now
                (status,) = await consumer.ack([record])
                out.write(f"ack {body} {status}\n")
                handled += 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("namesrv")
    parser.add_argument("group")
    parser.add_argument("topic")
    parser.add_argument("client_id")
    parser.add_argument("out")
    parser.add_argument("--invisible-time-ms", type=int, default=2000)
    parser.add_argument("--hang-after", type=int, default=None)
    arguments = parser.parse_args()
    with open(arguments.out, "a", buffering=1) as out_file:
        trio.run(main, arguments, out_file)

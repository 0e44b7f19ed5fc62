"""``clmq group describe``'s POP part: for a group that pops (POP consumers, Kafka
share groups), per queue the next and settled offsets, the lag, the messages in
flight (invisible) and those being delivered again; the members; and the counts since
each broker's leader started (pops, acks, refused acks, redeliveries, dead letters)."""

from __future__ import annotations

import argparse
from typing import Any

from ._output import is_json, note, print_table

POP_COLUMNS = [
    "broker",
    "topic",
    "queue",
    "next offset",
    "settled offset",
    "max offset",
    "lag",
    "in flight",
    "redelivering",
]
COUNTS = [  # (DESCRIBE_GROUP's field, what people read)
    ("popped", "popped"),
    ("acked", "acked"),
    ("ack_expired", "expired acks (refused)"),
    ("redelivered", "redelivered"),
    ("dead_lettered", "dead-lettered"),
]


def pop_rows(pops: list[dict[str, Any]]) -> list[list[Any]]:
    """One row per queue of every broker's POP part, in POP_COLUMNS' order."""
    return [
        [
            p["broker_name"],
            q["topic"],
            q["queue_id"],
            q["next_offset"],
            q["settled_offset"],
            q["max_offset"],
            q["lag"],
            q["inflight"],
            q["redelivering"],
        ]
        for p in pops
        for q in sorted(p.get("queues", []), key=lambda q: (q["topic"], q["queue_id"]))
    ]


def pop_totals(pops: list[dict[str, Any]]) -> dict[str, Any]:
    """The counts summed over brokers, the members (union), in flight and lag."""
    queues = [q for p in pops for q in p.get("queues", [])]
    return {
        **{field: sum(int(p.get(field, 0)) for p in pops) for field, _ in COUNTS},
        "members": sorted({m for p in pops for m in p.get("members", [])}),
        "inflight": sum(q["inflight"] for q in queues),
        "redelivering": sum(q["redelivering"] for q in queues),
        "lag": sum(q["lag"] for q in queues),
    }


def pop_members(pops: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``clmq group members``' rows for the members that popped lately: mode ``pop``,
    no queues of their own (a POP member takes from any queue), each broker named."""
    brokers: dict[str, list[str]] = {}
    for p in pops:
        for client_id in p.get("members", []):
            brokers.setdefault(client_id, []).append(p["broker_name"])
    return [
        {"client_id": c, "mode": "pop", "topics": sorted({q["topic"] for p in pops for q in p.get("queues", [])}),
         "queues": [], "brokers": b}
        for c, b in sorted(brokers.items())
    ]  # fmt: skip


def show_pop(args: argparse.Namespace, group: str, pops: list[dict[str, Any]]) -> None:
    """The POP table and its notes (nothing with ``-o json``: the document has ``pop``)."""
    if is_json(args) or not pops:
        return
    t = pop_totals(pops)
    print_table(
        f"group {group}, POP (lag {t['lag']:,}, in flight {t['inflight']:,}, redelivering {t['redelivering']:,})",
        POP_COLUMNS,
        pop_rows(pops),
    )
    note(args, "POP members: " + (", ".join(t["members"]) or "none popped lately"))
    note(args, "POP since the leader started: " + ", ".join(f"{name} {t[field]:,}" for field, name in COUNTS))

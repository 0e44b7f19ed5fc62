"""The admin client's view of consumer groups and its changes to them: a group
described across the brokers, its members and the queues each reads, offsets reset,
a group deleted."""

from __future__ import annotations

from typing import Any

from clmq.protocol import ErrorCode, RequestCode
from clmq.protocol.transport import RpcError

from ._admin_calls import AdminCalls
from ._admin_reads import describe_topic, retry_counts, topic_leaders
from .consumer import allocate_averagely


async def describe_group(calls: AdminCalls, group: str) -> dict[str, Any]:
    """See :meth:`Admin.describe_group`."""
    queues, members, retries, pops = [], {}, [], []
    for b in await calls.leaders():
        info = await calls.call(b["addr"], RequestCode.DESCRIBE_GROUP, {"group": group})
        queues += [{"broker_name": b["broker_name"], **q} for q in info["queues"]]
        if info.get("pop"):  # the group's POP state on that broker (absent: none)
            pops.append({"broker_name": b["broker_name"], **info["pop"]})
        members.update({m["client_id"]: m for m in info["members"]})
        retries.append(await retry_counts(calls, b, group))
    return {
        "group": group,
        "queues": queues,
        "members": sorted(members.values(), key=lambda m: m["client_id"]),
        "lag": sum(q["lag"] for q in queues),
        "retry_backlog": sum(r["retry_backlog"] for r in retries),
        "dead_letters": sum(r["dead_letters"] for r in retries),
        "retries": retries,
        "pop": pops,
    }


async def group_members(calls: AdminCalls, group: str) -> list[dict[str, Any]]:
    """See :meth:`Admin.group_members`."""
    members = list((await describe_group(calls, group))["members"])
    ids = [m["client_id"] for m in members]
    by_topic: dict[str, list[tuple[str, str, int]]] = {}
    for m in members:
        m["queues"] = []
        for topic in m["topics"]:
            if topic not in by_topic:
                rows = await describe_topic(calls, topic)
                by_topic[topic] = sorted((topic, r["broker_name"], r["queue_id"]) for r in rows)
            share = (
                by_topic[topic]
                if m["mode"] == "broadcasting"
                else allocate_averagely(by_topic[topic], ids, m["client_id"])
            )
            m["queues"] += [list(q) for q in share]
    return members


async def delete_group(calls: AdminCalls, group: str) -> list[str]:
    """See :meth:`Admin.delete_group`."""
    done = []
    for b in await calls.leaders():
        try:
            await calls.call(b["addr"], RequestCode.DELETE_GROUP, {"group": group})
            done.append(b["broker_name"])
        except RpcError as e:
            if e.code != ErrorCode.NOT_FOUND:
                raise
    return done


async def reset_offsets(
    calls: AdminCalls,
    group: str,
    topic: str,
    to: str | int,
    timestamp_ms: int | None,
    queue_ids: list[int] | None,
    dry_run: bool,
) -> list[dict[str, Any]]:
    """See :meth:`Admin.reset_offsets` (the caller checked the group has no members)."""
    rows = []
    for b in await topic_leaders(calls, topic):
        queues = [q for q in b["queues"] if queue_ids is None or q["queue_id"] in queue_ids]
        commits = []
        for q in queues:
            after = await _reset_target(calls, b["addr"], topic, q, to, timestamp_ms)
            asked = {"group": group, "topic": topic, "queue_id": q["queue_id"]}
            before = (await calls.call(b["addr"], RequestCode.QUERY_CONSUMER_OFFSET, asked))["offset"]
            rows.append(
                {
                    "broker_name": b["broker_name"],
                    "topic": topic,
                    "queue_id": q["queue_id"],
                    "before": before,
                    "after": after,
                }
            )
            commits.append([topic, q["queue_id"], after])
        if commits and not dry_run:
            await calls.call(b["addr"], RequestCode.COMMIT_OFFSET, {"group": group, "offsets": commits})
    return rows


async def _reset_target(
    calls: AdminCalls, addr: str, topic: str, q: dict[str, Any], to: str | int, timestamp_ms: int | None
) -> int:
    if timestamp_ms is not None:
        found = await calls.call(
            addr,
            RequestCode.SEARCH_OFFSET,
            {"topic": topic, "queue_id": q["queue_id"], "timestamp_ms": timestamp_ms},
        )
        return int(found["offset"])
    if to == "earliest":
        return int(q["min_offset"])
    if to == "latest":
        return int(q["max_offset"])
    if isinstance(to, int):
        return max(int(q["min_offset"]), min(to, int(q["max_offset"])))
    raise ValueError(f"to={to!r}: use 'earliest', 'latest' or an offset")

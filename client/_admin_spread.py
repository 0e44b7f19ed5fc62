"""A topic's queues spread over the cluster's broker groups (RocketMQ's model: a topic
lives on several broker names, each holding some of its queues, numbered from 0 on
each; a client routes ``MessageQueue(topic, broker_name, queue_id, addr)``).

A queue count here is the topic's TOTAL over its groups (Kafka's partition count; in
RocketMQ's ``mqadmin updateTopic -c cluster -w N`` the N is per broker instead, so
``--queues 8`` on two groups is RocketMQ's ``-w 4``). New queues go one at a time to
the chosen group holding the fewest (ties: broker names in order); no group ever loses
a queue, so existing queue ids keep their messages and offsets."""

from __future__ import annotations

from typing import Any, Sequence

from clmq.protocol import ErrorCode, RequestCode
from clmq.protocol.transport import RpcError

from ._admin_calls import AdminCalls

ALL_GROUPS = "all"  # ``groups``: every group registered with the name servers


def spread(current: dict[str, int], groups: Sequence[str], total: int | None) -> dict[str, int]:
    """Each group's queue count after spreading ``total`` queues over ``current``'s
    groups and ``groups`` (current: broker name -> queues it holds now). ``total`` None:
    every chosen group gets as many as the fullest group holds now (growing a topic
    onto new groups at the same size per group). ValueError for a total below the
    queues there are (queues cannot be removed) or below 1."""
    counts = {g: current.get(g, 0) for g in sorted(set(groups) | set(current))}
    have = sum(counts.values())
    if total is None:
        per_group = max(counts.values(), default=0) or 1
        return {g: max(n, per_group) if g in groups else n for g, n in counts.items()}
    if total < 1:
        raise ValueError(f"a topic needs at least 1 queue, asked {total}")
    if total < have:
        raise ValueError(
            f"the topic has {have} queues over {len(current)} group(s): "
            f"a queue count can grow, not shrink (asked {total})"
        )
    targets = [g for g in counts if g in groups] or list(counts)
    for _ in range(total - have):
        fewest = min(targets, key=lambda g: (counts[g], g))
        counts[fewest] += 1
    return counts


async def spread_topic(
    calls: AdminCalls, topic: str, total: int | None, groups: Sequence[str] | str | None, grow: bool
) -> dict[str, int]:
    """Create (``grow`` False) or grow ``topic`` to ``total`` queues spread over
    ``groups`` (broker names, or ``"all"``; None: every group for a new topic, the
    groups holding it for a grown one); each group's queue count after. ValueError
    for an unknown group, a group without a leader, a missing topic to grow, or a shrink."""
    leaders = _leaders(await calls.brokers())
    current = await _queue_counts(calls, topic, grow, leaders)
    if grow and not current:
        raise ValueError(f"topic {topic!r} does not exist")
    chosen = _chosen(groups, leaders, current, grow)
    if total is None and not grow:
        raise ValueError("a new topic needs a queue count")
    counts = spread(current, chosen, total)
    for name, count in counts.items():
        if count != current.get(name, 0):
            await calls.call(leaders[name], RequestCode.CREATE_TOPIC, {"topic": topic, "queue_count": count})
    return counts


def _leaders(brokers: list[dict[str, Any]]) -> dict[str, str]:
    """Broker name -> its leader's address, from one look at the name servers. ValueError
    naming every group registered without a leader (its leader down, or not yet elected):
    what that group holds cannot be read, so a spread would count its queues as none and
    put them all on the other groups."""
    leaders = {b["broker_name"]: b["addr"] for b in brokers if b.get("role", "leader") != "follower"}
    leaderless = sorted({b["broker_name"] for b in brokers} - set(leaders))
    if leaderless:
        raise ValueError(
            f"broker group {', '.join(leaderless)} has no leader (down, or not yet elected): "
            "its queues cannot be counted; try again once it has one"
        )
    if not leaders:
        raise ValueError("no broker group is registered with the name servers yet")
    return leaders


async def _queue_counts(calls: AdminCalls, topic: str, grow: bool, leaders: dict[str, str]) -> dict[str, int]:
    """Broker name -> queues of ``topic`` each group's leader holds. A user allowed to
    CREATE the topic but not to DESCRIBE it (CREATE does not imply DESCRIBE) creates it
    as a new topic: each broker still refuses to shrink what it has."""
    counts = {}
    try:
        for name, addr in leaders.items():
            try:
                info = await calls.call(addr, RequestCode.DESCRIBE_TOPIC, {"topic": topic})
            except RpcError as e:
                if e.code != ErrorCode.TOPIC_NOT_FOUND:
                    raise
                continue
            counts[name] = len(info["queues"])
    except RpcError as e:
        if e.code != ErrorCode.NOT_AUTHORIZED or grow:
            raise
        return {}
    return counts


def _chosen(
    groups: Sequence[str] | str | None, leaders: dict[str, str], current: dict[str, int], grow: bool
) -> list[str]:
    if groups is None:
        return sorted(current if grow else leaders)
    if groups == ALL_GROUPS or list(groups) == [ALL_GROUPS]:
        return sorted(leaders)
    names = [groups] if isinstance(groups, str) else list(groups)
    unknown = sorted(set(names) - set(leaders))
    if unknown:
        raise ValueError(
            f"no broker group named {', '.join(unknown)} has a leader (groups: {', '.join(sorted(leaders))})"
        )
    return sorted(names)

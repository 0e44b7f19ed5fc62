"""Kafka's classic consumer-group coordinator (clmq.broker.service.kafka._coordinator).

Every test runs on trio's MockClock with autojump (pytest-trio takes the clock only from a
test's own arguments, hence ``autojump_clock`` on each): session timeouts, rebalance
timeouts and the initial rebalance delay pass as soon as every task waits.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import pytest
import trio
from trio.testing import MockClock

from clmq.broker.service.kafka._coordinator import GroupSettings, KafkaGroups
from clmq.broker.service.kafka._group_state import (
    FENCED_INSTANCE_ID,
    GROUP_ID_NOT_FOUND,
    GROUP_MAX_SIZE_REACHED,
    ILLEGAL_GENERATION,
    INCONSISTENT_GROUP_PROTOCOL,
    INVALID_GROUP_ID,
    INVALID_SESSION_TIMEOUT,
    MEMBER_ID_REQUIRED,
    NON_EMPTY_GROUP,
    NONE,
    REBALANCE_IN_PROGRESS,
    UNKNOWN_MEMBER_ID,
)

SESSION_MS = 10_000
REBALANCE_MS = 30_000
RANGE = [("range", b"meta-range")]


@dataclass
class Env:
    kg: KafkaGroups
    native: dict[str, int] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)


@pytest.fixture
async def env(nursery: trio.Nursery) -> Env:
    native: dict[str, int] = {}
    dropped: list[str] = []
    kg = KafkaGroups(GroupSettings(), lambda gid: native.get(gid, 0), dropped.append)
    await nursery.start(kg.run)
    return Env(kg, native, dropped)


def join_body(
    gid: str = "g",
    member_id: str = "",
    *,
    instance: str | None = None,
    protocols: list[tuple[str, bytes]] = RANGE,
    ptype: str = "consumer",
    session: int = SESSION_MS,
) -> dict[str, Any]:
    return {
        "group_id": gid,
        "session_timeout_ms": session,
        "rebalance_timeout_ms": REBALANCE_MS,
        "member_id": member_id,
        "group_instance_id": instance,
        "protocol_type": ptype,
        "protocols": [{"name": n, "metadata": m} for n, m in protocols],
    }


async def join(kg: KafkaGroups, gid: str = "g", member_id: str = "", *, version: int = 9, **kw: Any) -> dict[str, Any]:
    """One JoinGroup; a new dynamic member (v4+) does the MEMBER_ID_REQUIRED round first."""
    r = await kg.join_group(join_body(gid, member_id, **kw), version, "cli", "/10.0.0.1")
    if r["error_code"] == MEMBER_ID_REQUIRED:
        r = await kg.join_group(join_body(gid, r["member_id"], **kw), version, "cli", "/10.0.0.1")
    return r


async def join_all(kg: KafkaGroups, bodies: list[dict[str, Any]], gid: str = "g") -> list[dict[str, Any]]:
    """Several JoinGroups at once (kw arguments of :func:`join` per member)."""
    out: list[dict[str, Any]] = [{} for _ in bodies]

    async def one(i: int) -> None:
        out[i] = await join(kg, gid, bodies[i].pop("member_id", ""), **bodies[i])

    async with trio.open_nursery() as n:
        for i in range(len(bodies)):
            n.start_soon(one, i)
    return out


async def sync(kg: KafkaGroups, r: dict[str, Any], assignments: dict[str, bytes] | None = None, **kw: Any) -> Any:
    body = {"group_id": "g", "generation_id": r["generation_id"], "member_id": r["member_id"], **kw}
    body["assignments"] = [{"member_id": m, "assignment": a} for m, a in (assignments or {}).items()]
    return await kg.sync_group(body, 5)


async def sync_all(kg: KafkaGroups, joined: list[dict[str, Any]], skip: str = "") -> list[dict[str, Any]]:
    """Every member syncs (followers first, parked); the leader assigns b"a-<member id>" to all but ``skip``."""
    out: list[dict[str, Any]] = [{} for _ in joined]

    async def one(i: int) -> None:
        r = joined[i]
        mine = {m["member_id"]: b"a-" + m["member_id"].encode() for m in r["members"] if m["member_id"] != skip}
        out[i] = await sync(kg, r, mine)

    async with trio.open_nursery() as n:
        for i in sorted(range(len(joined)), key=lambda i: bool(joined[i]["members"])):
            n.start_soon(one, i)
            await trio.testing.wait_all_tasks_blocked()
    return out


async def hb(kg: KafkaGroups, r: dict[str, Any], **kw: Any) -> int:
    body = {"group_id": "g", "generation_id": r["generation_id"], "member_id": r["member_id"], **kw}
    return int((await kg.heartbeat(body, 4))["error_code"])


async def stable(kg: KafkaGroups, n: int) -> list[dict[str, Any]]:
    joined = await join_all(kg, [{} for _ in range(n)])
    await sync_all(kg, joined)
    return joined


def state(kg: KafkaGroups, gid: str = "g") -> str:
    return str(next(g["state"] for g in kg.groups() if g["group_id"] == gid))


# -- joining and syncing ------------------------------------------------------------------


async def test_three_members_form_one_generation_with_one_leader(autojump_clock: MockClock, env: Env) -> None:
    joined = await join_all(env.kg, [{} for _ in range(3)])
    assert {r["error_code"] for r in joined} == {NONE}
    assert {r["generation_id"] for r in joined} == {1}
    assert {r["protocol_name"] for r in joined} == {"range"}
    assert len({r["leader"] for r in joined}) == 1
    leader = [r for r in joined if r["member_id"] == r["leader"]]
    assert len(leader) == 1
    assert sorted(m["member_id"] for m in leader[0]["members"]) == sorted(r["member_id"] for r in joined)
    assert {m["metadata"] for m in leader[0]["members"]} == {b"meta-range"}
    assert all(r["members"] == [] for r in joined if r is not leader[0])
    assert state(env.kg) == "CompletingRebalance"


async def test_leader_sync_hands_every_member_its_assignment(autojump_clock: MockClock, env: Env) -> None:
    joined = await join_all(env.kg, [{} for _ in range(3)])
    left_out = next(r["member_id"] for r in joined if r["member_id"] != r["leader"])
    synced = await sync_all(env.kg, joined, skip=left_out)
    for r, s in zip(joined, synced):
        assert s["error_code"] == NONE
        assert s["protocol_name"] == "range" and s["protocol_type"] == "consumer"
        want = b"" if r["member_id"] == left_out else b"a-" + r["member_id"].encode()
        assert s["assignment"] == want
    assert state(env.kg) == "Stable"
    # A late SyncGroup in the stable group gets the same assignment again.
    again = await sync(env.kg, joined[0])
    assert again["assignment"] == synced[0]["assignment"]


async def test_a_member_leaving_makes_the_others_rejoin_to_the_next_generation(
    autojump_clock: MockClock, env: Env
) -> None:
    a, b, c = await stable(env.kg, 3)
    out = await env.kg.leave_group({"group_id": "g", "members": [{"member_id": c["member_id"]}]}, 4)
    assert out["error_code"] == NONE and [m["error_code"] for m in out["members"]] == [NONE]
    assert await hb(env.kg, a) == REBALANCE_IN_PROGRESS
    assert await hb(env.kg, b) == REBALANCE_IN_PROGRESS
    again = await join_all(env.kg, [{"member_id": a["member_id"]}, {"member_id": b["member_id"]}])
    assert {r["generation_id"] for r in again} == {2}
    assert sorted(m["member_id"] for r in again for m in r["members"]) == sorted([a["member_id"], b["member_id"]])
    await sync_all(env.kg, again)
    assert await hb(env.kg, again[0]) == NONE
    assert await hb(env.kg, c) == UNKNOWN_MEMBER_ID


async def test_leave_v0_carries_the_member_error_at_the_top(autojump_clock: MockClock, env: Env) -> None:
    (a,) = await stable(env.kg, 1)
    out = await env.kg.leave_group({"group_id": "g", "member_id": "nobody"}, 0)
    assert out["error_code"] == UNKNOWN_MEMBER_ID
    out = await env.kg.leave_group({"group_id": "g", "member_id": a["member_id"]}, 0)
    assert out["error_code"] == NONE
    assert state(env.kg) == "Empty" and not env.kg.has_members("g")


async def keep_beating(kg: KafkaGroups, r: dict[str, Any], codes: list[int]) -> None:
    while True:
        codes.append(await hb(kg, r))
        await trio.sleep(2)


async def test_a_silent_member_is_removed_when_its_session_expires(
    autojump_clock: MockClock, env: Env, nursery: trio.Nursery
) -> None:
    a, b = await stable(env.kg, 2)
    codes: list[int] = []
    nursery.start_soon(keep_beating, env.kg, a, codes)
    await trio.sleep(SESSION_MS / 1000 + 1)
    assert [m["member_id"] for g in env.kg.groups() for m in g["members"]] == [a["member_id"]]
    assert codes[-1] == REBALANCE_IN_PROGRESS
    assert await hb(env.kg, b) == UNKNOWN_MEMBER_ID
    (again,) = await join_all(env.kg, [{"member_id": a["member_id"]}])
    assert again["generation_id"] == 2 and again["leader"] == a["member_id"]


async def test_a_member_that_does_not_rejoin_is_dropped_at_the_rebalance_timeout(
    autojump_clock: MockClock, env: Env, nursery: trio.Nursery
) -> None:
    a, b = await stable(env.kg, 2)
    leader, follower = (a, b) if a["member_id"] == a["leader"] else (b, a)
    codes: list[int] = []
    nursery.start_soon(keep_beating, env.kg, follower, codes)  # alive, but never rejoins
    start = trio.current_time()
    again = await join(env.kg, member_id=leader["member_id"])  # the leader's rejoin starts a rebalance
    assert trio.current_time() - start == pytest.approx(REBALANCE_MS / 1000)
    assert again["generation_id"] == 2
    assert [m["member_id"] for m in again["members"]] == [leader["member_id"]]
    assert REBALANCE_IN_PROGRESS in codes
    await trio.sleep(3)
    assert codes[-1] == UNKNOWN_MEMBER_ID


async def test_a_member_that_joins_but_never_syncs_is_dropped(
    autojump_clock: MockClock, env: Env, nursery: trio.Nursery
) -> None:
    a, b = await join_all(env.kg, [{}, {}])
    leader, follower = (a, b) if a["member_id"] == a["leader"] else (b, a)
    codes: list[int] = []
    leader_codes: list[int] = []
    nursery.start_soon(keep_beating, env.kg, follower, codes)  # heartbeats, but no SyncGroup
    synced = await sync(env.kg, leader, {leader["member_id"]: b"x", follower["member_id"]: b"y"})
    assert synced["assignment"] == b"x"
    nursery.start_soon(keep_beating, env.kg, leader, leader_codes)
    await trio.sleep(REBALANCE_MS / 1000 + 1)
    assert codes[-1] == UNKNOWN_MEMBER_ID
    assert leader_codes[-1] == REBALANCE_IN_PROGRESS


async def test_the_initial_rebalance_waits_for_members_arriving_during_the_delay(
    autojump_clock: MockClock, env: Env
) -> None:
    out: list[dict[str, Any]] = []
    start = trio.current_time()

    async def late() -> None:
        await trio.sleep(2)
        out.append(await join(env.kg))

    async with trio.open_nursery() as n:
        n.start_soon(late)
        out.append(await join(env.kg))
    assert {r["generation_id"] for r in out} == {1}
    assert sorted(len(r["members"]) for r in out) == [0, 2]
    # Extended once by the second member: two delays, within the rebalance timeout.
    assert trio.current_time() - start == pytest.approx(6)


# -- member ids, protocols, limits ------------------------------------------------------------


async def test_member_id_required_then_rejoin_with_it(autojump_clock: MockClock, env: Env) -> None:
    first = await env.kg.join_group(join_body(), 4, "my-client", "/h")
    assert first["error_code"] == MEMBER_ID_REQUIRED
    assert first["member_id"].startswith("my-client-") and len(first["member_id"]) == len("my-client-") + 36
    assert env.kg.has_members("g")
    second = await env.kg.join_group(join_body(member_id=first["member_id"]), 4, "my-client", "/h")
    assert second["error_code"] == NONE and second["member_id"] == first["member_id"]
    # Before v4 the id is made and used at once.
    old = await env.kg.join_group(join_body("g3"), 3, "old", "/h")
    assert old["error_code"] == NONE and old["member_id"].startswith("old-")
    assert old["protocol_name"] == "range"


async def test_a_pending_member_id_expires_with_its_session(autojump_clock: MockClock, env: Env) -> None:
    first = await env.kg.join_group(join_body(), 9, "c", "/h")
    assert first["error_code"] == MEMBER_ID_REQUIRED
    await trio.sleep(SESSION_MS / 1000 + 1)
    assert not env.kg.has_members("g")


async def test_inconsistent_protocols_are_refused(autojump_clock: MockClock, env: Env) -> None:
    await join_all(env.kg, [{}])
    for kw in ({"protocols": [("roundrobin", b"")]}, {"ptype": "connect"}):
        assert (await join(env.kg, **kw))["error_code"] == INCONSISTENT_GROUP_PROTOCOL
    assert (await join(env.kg, "other", protocols=[]))["error_code"] == INCONSISTENT_GROUP_PROTOCOL
    assert (await join(env.kg, "other2", ptype=""))["error_code"] == INCONSISTENT_GROUP_PROTOCOL
    assert [g["group_id"] for g in env.kg.groups()] == ["g"]  # refused first joins leave nothing
    assert env.kg.check_commit("simple", -1, "", None) == NONE
    assert (await join(env.kg, "simple", ptype=""))["error_code"] == INCONSISTENT_GROUP_PROTOCOL
    assert [g["group_id"] for g in env.kg.groups()] == ["g", "simple"]  # but do not drop an existing group
    # Old versions get a string protocol name, even on errors.
    old = await env.kg.join_group(join_body(ptype="connect"), 6, "c", "/h")
    assert old["error_code"] == INCONSISTENT_GROUP_PROTOCOL and old["protocol_name"] == ""


async def test_the_protocol_most_members_prefer_wins(autojump_clock: MockClock, env: Env) -> None:
    rr, rng, sticky = ("roundrobin", b"r"), ("range", b"g"), ("sticky", b"s")
    joined = await join_all(
        env.kg, [{"protocols": [sticky, rr, rng]}, {"protocols": [rr, rng]}, {"protocols": [rr, rng]}]
    )
    assert {r["protocol_name"] for r in joined} == {"roundrobin"}
    leader = next(r for r in joined if r["members"])
    assert {m["metadata"] for m in leader["members"]} == {b"r"}


@pytest.mark.parametrize("session", [5_999, 1_800_001])
async def test_session_timeout_out_of_bounds(autojump_clock: MockClock, env: Env, session: int) -> None:
    assert (await join(env.kg, session=session))["error_code"] == INVALID_SESSION_TIMEOUT


async def test_group_size_limit(autojump_clock: MockClock, nursery: trio.Nursery) -> None:
    kg = KafkaGroups(GroupSettings(max_group_size=2), lambda gid: 0, lambda gid: None)
    await nursery.start(kg.run)
    a, b = await join_all(kg, [{}, {}])
    await sync_all(kg, [a, b])
    assert (await join(kg))["error_code"] == GROUP_MAX_SIZE_REACHED
    assert (await join(kg, member_id=a["member_id"]))["error_code"] == NONE  # a known member may rejoin


async def test_join_is_refused_while_native_members_use_the_group(
    autojump_clock: MockClock, env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    env.native["g"] = 2
    with caplog.at_level(logging.INFO, logger="clmq.broker"):
        r = await join(env.kg)
    assert r["error_code"] == INCONSISTENT_GROUP_PROTOCOL
    assert any("native" in rec.getMessage() and "g" in rec.getMessage() for rec in caplog.records)
    assert not env.kg.has_members("g")
    env.native["g"] = 0
    await join_all(env.kg, [{}])
    assert env.kg.has_members("g") and not env.kg.has_members("other")


async def test_a_cancelled_join_leaves_the_member_until_its_session_ends(
    autojump_clock: MockClock, env: Env, nursery: trio.Nursery
) -> None:
    (a,) = await stable(env.kg, 1)
    new = await env.kg.join_group(join_body(), 9, "b", "/h")
    with trio.move_on_after(1):  # the connection closes while B's join is parked
        await env.kg.join_group(join_body(member_id=new["member_id"]), 9, "b", "/h")
    members = [m["member_id"] for g in env.kg.groups() for m in g["members"]]
    assert new["member_id"] in members
    again = await join(env.kg, member_id=a["member_id"])  # completes at once: B counts as rejoined
    assert again["generation_id"] == 2 and len(again["members"]) == 2
    await sync(env.kg, again, {a["member_id"]: b"x"})
    codes: list[int] = []
    nursery.start_soon(keep_beating, env.kg, again, codes)
    await trio.sleep(REBALANCE_MS / 1000 + 1)
    assert [m["member_id"] for g in env.kg.groups() for m in g["members"]] == [a["member_id"]]
    assert REBALANCE_IN_PROGRESS in codes


# -- static membership ----------------------------------------------------------------------


async def test_a_static_member_replaces_itself_without_rebalance(autojump_clock: MockClock, env: Env) -> None:
    a, b = await join_all(env.kg, [{"instance": "i-1"}, {}])
    assert a["member_id"].startswith("i-1-")  # static members get their id at once
    await sync_all(env.kg, [a, b])
    before = env.kg.groups()[0]
    restarted = await join(env.kg, instance="i-1", version=9)
    assert restarted["error_code"] == NONE and restarted["member_id"] != a["member_id"]
    assert restarted["generation_id"] == a["generation_id"]
    assert state(env.kg) == "Stable"
    assert await hb(env.kg, b) == NONE
    assert await hb(env.kg, a, group_instance_id="i-1") == FENCED_INSTANCE_ID
    assert await hb(env.kg, restarted, group_instance_id="i-1") == NONE
    old_assignment = next(m["assignment"] for m in before["members"] if m["member_id"] == a["member_id"])
    again = await sync(env.kg, restarted, group_instance_id="i-1")
    assert again["assignment"] == old_assignment != b""
    # The static member joined first (no MEMBER_ID_REQUIRED round), so it led: v9 says skip the assignment.
    assert a["leader"] == a["member_id"]
    assert restarted["skip_assignment"] and restarted["leader"] == restarted["member_id"]
    assert [m["member_id"] for m in restarted["members"]] == [b["member_id"], restarted["member_id"]]


async def test_a_static_leader_rejoining_on_an_old_version_keeps_the_old_leader_id(
    autojump_clock: MockClock, env: Env
) -> None:
    (a,) = await join_all(env.kg, [{"instance": "i-1"}])
    await sync_all(env.kg, [a])
    restarted = await join(env.kg, instance="i-1", version=5)
    assert restarted["leader"] == a["member_id"] and restarted["members"] == []
    assert not restarted["skip_assignment"]


async def test_a_static_member_parked_in_sync_is_fenced_by_its_replacement(autojump_clock: MockClock, env: Env) -> None:
    a, b = await join_all(env.kg, [{"instance": "i-1"}, {"instance": "i-2"}])
    follower = a if a["member_id"] != a["leader"] else b
    instance = "i-1" if follower is a else "i-2"
    out: list[dict[str, Any]] = []

    async def parked_sync() -> None:
        out.append(await sync(env.kg, follower, group_instance_id=instance))

    async with trio.open_nursery() as n:
        n.start_soon(parked_sync)
        await trio.testing.wait_all_tasks_blocked()
        n.start_soon(partial(join, env.kg, instance=instance))
    assert out[0]["error_code"] == FENCED_INSTANCE_ID


# -- describe, list, delete -----------------------------------------------------------------


async def test_describe_groups(autojump_clock: MockClock, env: Env) -> None:
    joined = await join_all(env.kg, [{}, {}])
    mid = joined[0]["member_id"]
    d = env.kg.describe_groups({"groups": ["g", "nope", ""]}, 5)["groups"]
    assert d[0]["group_state"] == "CompletingRebalance" and d[0]["protocol_type"] == "consumer"
    assert d[0]["protocol_data"] == "" and {m["member_metadata"] for m in d[0]["members"]} == {b""}
    assert (d[1]["group_state"], d[1]["error_code"], d[1]["members"]) == ("Dead", NONE, [])
    assert d[2]["error_code"] == INVALID_GROUP_ID
    await sync_all(env.kg, joined)
    (g,) = env.kg.describe_groups({"groups": ["g"]}, 5)["groups"]
    assert (g["group_state"], g["protocol_data"]) == ("Stable", "range")
    m = next(m for m in g["members"] if m["member_id"] == mid)
    assert (m["client_id"], m["client_host"], m["member_metadata"]) == ("cli", "/10.0.0.1", b"meta-range")
    assert m["member_assignment"] == b"a-" + mid.encode()


async def test_list_groups_with_filters(autojump_clock: MockClock, env: Env) -> None:
    await stable(env.kg, 1)
    assert env.kg.check_commit("simple", -1, "", None) == NONE  # a standalone committer's group
    listed = env.kg.list_groups({}, 0)["groups"]
    assert {(g["group_id"], g["group_state"], g["protocol_type"]) for g in listed} == {
        ("g", "Stable", "consumer"),
        ("simple", "Empty", ""),
    }
    assert [g["group_id"] for g in env.kg.list_groups({"states_filter": [" stable"]}, 4)["groups"]] == ["g"]
    assert [g["group_id"] for g in env.kg.list_groups({"states_filter": ["Empty"]}, 4)["groups"]] == ["simple"]
    assert len(env.kg.list_groups({"types_filter": ["Classic"]}, 5)["groups"]) == 2
    assert env.kg.list_groups({"types_filter": ["consumer"]}, 5)["groups"] == []


async def test_delete_groups(autojump_clock: MockClock, env: Env) -> None:
    (a,) = await stable(env.kg, 1)
    body = {"groups_names": ["g", "nope", ""]}
    codes = [r["error_code"] for r in env.kg.delete_groups(body, 2)["results"]]
    assert codes == [NON_EMPTY_GROUP, GROUP_ID_NOT_FOUND, INVALID_GROUP_ID]
    assert env.dropped == []
    await env.kg.leave_group({"group_id": "g", "members": [{"member_id": a["member_id"]}]}, 3)
    assert env.kg.delete_groups({"groups_names": ["g"]}, 2)["results"] == [{"group_id": "g", "error_code": NONE}]
    assert env.dropped == ["g"] and env.kg.groups() == []
    assert (await join(env.kg, member_id=a["member_id"]))["error_code"] == UNKNOWN_MEMBER_ID


async def test_groups_summary(autojump_clock: MockClock, env: Env) -> None:
    (a,) = await stable(env.kg, 1)
    (g,) = env.kg.groups()
    assert (g["group_id"], g["state"], g["protocol_type"], g["protocol_name"]) == ("g", "Stable", "consumer", "range")
    assert g["members"] == [
        {
            "member_id": a["member_id"],
            "group_instance_id": None,
            "client_id": "cli",
            "client_host": "/10.0.0.1",
            "assignment": b"a-" + a["member_id"].encode(),
        }
    ]


# -- error codes: classes of faults ---------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    """How a request goes wrong, and what each call answers for it (None: the call cannot express it)."""

    name: str
    heartbeat: int
    sync: int
    leave: int | None
    join: int | None
    commit: int


FAULTS = [
    Fault(
        "unknown-group", UNKNOWN_MEMBER_ID, UNKNOWN_MEMBER_ID, UNKNOWN_MEMBER_ID, UNKNOWN_MEMBER_ID, ILLEGAL_GENERATION
    ),
    Fault("empty-group-id", INVALID_GROUP_ID, INVALID_GROUP_ID, INVALID_GROUP_ID, INVALID_GROUP_ID, INVALID_GROUP_ID),
    Fault(
        "unknown-member", UNKNOWN_MEMBER_ID, UNKNOWN_MEMBER_ID, UNKNOWN_MEMBER_ID, UNKNOWN_MEMBER_ID, UNKNOWN_MEMBER_ID
    ),
    Fault("old-generation", ILLEGAL_GENERATION, ILLEGAL_GENERATION, None, None, ILLEGAL_GENERATION),
    Fault("future-generation", ILLEGAL_GENERATION, ILLEGAL_GENERATION, None, None, ILLEGAL_GENERATION),
    Fault(
        "fenced-instance",
        FENCED_INSTANCE_ID,
        FENCED_INSTANCE_ID,
        FENCED_INSTANCE_ID,
        FENCED_INSTANCE_ID,
        FENCED_INSTANCE_ID,
    ),
    Fault(
        "unknown-instance",
        UNKNOWN_MEMBER_ID,
        UNKNOWN_MEMBER_ID,
        UNKNOWN_MEMBER_ID,
        UNKNOWN_MEMBER_ID,
        UNKNOWN_MEMBER_ID,
    ),
    Fault("none", NONE, NONE, NONE, NONE, NONE),
]


def faulty(fault: str, static: dict[str, Any]) -> tuple[str, int, str, str | None]:
    """(group id, generation, member id, instance id) of a request with the fault, from a static member's view."""
    gid: str = "g"
    gen: int = static["generation_id"]
    mid: str = static["member_id"]
    iid: str | None = "i-1"
    if fault == "unknown-group":
        gid = "nope"
    elif fault == "empty-group-id":
        gid = ""
    elif fault == "unknown-member":
        mid, iid = "nobody", None
    elif fault == "old-generation":
        gen -= 1
    elif fault == "future-generation":
        gen += 5
    elif fault == "fenced-instance":
        mid = "cli-someone-else"
    elif fault == "unknown-instance":
        iid = "ghost"
    return gid, gen, mid, iid


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.name)
async def test_each_call_answers_each_fault(autojump_clock: MockClock, env: Env, fault: Fault) -> None:
    (static,) = await join_all(env.kg, [{"instance": "i-1"}])
    await sync_all(env.kg, [static])
    await join_all(env.kg, [{"member_id": static["member_id"], "instance": "i-1"}])  # generation 2, so 1 is old
    static = (await join_all(env.kg, [{"member_id": static["member_id"], "instance": "i-1"}]))[0]
    gid, gen, mid, iid = faulty(fault.name, static)
    ids = {"group_id": gid, "generation_id": gen, "member_id": mid, "group_instance_id": iid}
    assert env.kg.check_commit(gid, gen, mid, iid) == (REBALANCE_IN_PROGRESS if fault.name == "none" else fault.commit)
    assert (await env.kg.sync_group({**ids, "assignments": []}, 5))["error_code"] == fault.sync
    assert (await env.kg.heartbeat(ids, 4))["error_code"] == fault.heartbeat
    assert env.kg.check_commit(gid, gen, mid, iid) == fault.commit
    if fault.join is not None:
        r = await env.kg.join_group(join_body(gid, mid, instance=iid), 9, "cli", "/h")
        if fault.name != "none":
            assert r["error_code"] == fault.join
    if fault.leave is not None:
        out = await env.kg.leave_group({"group_id": gid, "members": [{"member_id": mid, "group_instance_id": iid}]}, 5)
        assert (out["members"][0]["error_code"] if out["members"] else out["error_code"]) == fault.leave


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("simple-commit-unknown-group", NONE),
        ("member-commit-unknown-group", ILLEGAL_GENERATION),
        ("simple-commit-empty-group", NONE),
        ("simple-commit-busy-group", UNKNOWN_MEMBER_ID),
        ("member-commit-stable", NONE),
        ("member-commit-completing", REBALANCE_IN_PROGRESS),
    ],
)
async def test_check_commit(autojump_clock: MockClock, env: Env, case: str, expected: int) -> None:
    kg = env.kg
    if case.endswith("unknown-group"):
        args = ("nope", -1 if case.startswith("simple") else 3, "", None)
    elif case == "simple-commit-empty-group":
        (a,) = await stable(kg, 1)
        await kg.leave_group({"group_id": "g", "members": [{"member_id": a["member_id"]}]}, 3)
        args = ("g", -1, "", None)
    else:
        (a,) = await join_all(kg, [{}])
        if case != "member-commit-completing":
            await sync_all(kg, [a])
        args = ("g", -1, "", None) if case.startswith("simple") else ("g", a["generation_id"], a["member_id"], None)
    assert kg.check_commit(*args) == expected


async def test_commits_while_a_new_member_joins(autojump_clock: MockClock, env: Env) -> None:
    """During the join phase the old generation still commits; once it is over, it may not."""
    (a,) = await stable(env.kg, 1)
    new = await env.kg.join_group(join_body(), 9, "b", "/h")
    async with trio.open_nursery() as n:
        n.start_soon(env.kg.join_group, join_body(member_id=new["member_id"]), 9, "b", "/h")
        await trio.testing.wait_all_tasks_blocked()
        assert state(env.kg) == "PreparingRebalance"
        assert env.kg.check_commit("g", a["generation_id"], a["member_id"], None) == NONE
        n.start_soon(join, env.kg, "g", a["member_id"])
    assert state(env.kg) == "CompletingRebalance"
    assert env.kg.check_commit("g", a["generation_id"], a["member_id"], None) == ILLEGAL_GENERATION
    assert env.kg.check_commit("g", a["generation_id"] + 1, a["member_id"], None) == REBALANCE_IN_PROGRESS


async def test_sync_and_heartbeat_during_the_join_phase(autojump_clock: MockClock, env: Env) -> None:
    (a,) = await stable(env.kg, 1)
    new = await env.kg.join_group(join_body(), 9, "b", "/h")
    async with trio.open_nursery() as n:
        n.start_soon(env.kg.join_group, join_body(member_id=new["member_id"]), 9, "b", "/h")
        await trio.testing.wait_all_tasks_blocked()
        assert (await sync(env.kg, a))["error_code"] == REBALANCE_IN_PROGRESS
        assert await hb(env.kg, a) == REBALANCE_IN_PROGRESS
        n.start_soon(join, env.kg, "g", a["member_id"])


async def test_a_follower_rejoining_unchanged_gets_the_generation_again(autojump_clock: MockClock, env: Env) -> None:
    a, b = await stable(env.kg, 2)
    follower = a if a["member_id"] != a["leader"] else b
    again = await join(env.kg, member_id=follower["member_id"])
    assert (again["generation_id"], again["leader"], again["members"]) == (1, a["leader"], [])
    assert state(env.kg) == "Stable"
    async with trio.open_nursery() as n:  # new metadata: a rebalance the leader must join
        n.start_soon(partial(join, env.kg, member_id=follower["member_id"], protocols=[("range", b"new")]))
        await trio.testing.wait_all_tasks_blocked()
        assert state(env.kg) == "PreparingRebalance"
        n.start_soon(join, env.kg, "g", a["leader"])
    assert state(env.kg) == "CompletingRebalance"

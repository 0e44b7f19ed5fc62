"""The admin client's users and ACLs: changed on every broker group's leader (each
group keeps its own copy, as it keeps its topics; followers copy their leader's), and
read back from every leader, per group or merged.

A password never travels: the credential (salt, iteration count, stored and server
keys, RFC 5802) is made here, once, and the same credential is sent to every leader.
A change is applied leader by leader; when one fails the error is raised and the
leaders before it keep the change: every change is idempotent (a user set again, an ACL
added twice, a filter that removes nothing), so running it again completes it."""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from clmq.protocol import ErrorCode, RequestCode
from clmq.protocol.auth import (
    MECHANISMS,
    AclBinding,
    AclFilter,
    check_user_name,
    make_credential,
)
from clmq.protocol.transport import ConnectionFailed, RpcError

from ._admin_calls import AdminCalls

DEFAULT_MECHANISMS: tuple[str, ...] = tuple(MECHANISMS)  # SCRAM-SHA-256 and SCRAM-SHA-512


def filter_cells(match: AclFilter | None) -> list[str]:
    """An :class:`AclFilter` as ACL_DESCRIBE/ACL_DELETE's seven cells ("" for any)."""
    f = match or AclFilter()
    kinds = (f.resource_type, f.pattern, f.operation, f.permission)
    rtype, pattern, op, permission = ("" if k.name == "ANY" else k.name for k in kinds)
    return [rtype, f.name or "", pattern, f.principal or "", f.host or "", op, permission]


async def _leaders(calls: AdminCalls) -> list[dict[str, Any]]:
    leaders = await calls.leaders()
    if not leaders:
        raise ConnectionFailed("no broker is registered with the name servers yet")
    return leaders


async def add_user(
    calls: AdminCalls, user: str, password: str, mechanisms: Sequence[str], iterations: int
) -> list[str]:
    """See :meth:`Admin.add_user`."""
    check_user_name(user)
    if isinstance(mechanisms, str) or not mechanisms:
        raise ValueError("mechanisms: give a list of one or more of " + ", ".join(MECHANISMS))
    creds = {m: make_credential(m, password, iterations=iterations).to_json() for m in dict.fromkeys(mechanisms)}
    done = []
    for b in await _leaders(calls):
        await calls.call(b["addr"], RequestCode.USER_UPSERT, {"user": user, "credentials": creds})
        done.append(str(b["broker_name"]))
    return done


async def delete_user(calls: AdminCalls, user: str) -> list[str]:
    """See :meth:`Admin.delete_user`."""
    done = []
    for b in await _leaders(calls):
        try:
            await calls.call(b["addr"], RequestCode.USER_DELETE, {"user": user})
            done.append(str(b["broker_name"]))
        except RpcError as e:
            if e.code != ErrorCode.NOT_FOUND:
                raise
    return done


async def users_by_broker(calls: AdminCalls) -> dict[str, dict[str, list[str]]]:
    """See :meth:`Admin.users_by_broker`."""
    out = {}
    for b in await _leaders(calls):
        rows = (await calls.call(b["addr"], RequestCode.USER_LIST))["users"]
        out[str(b["broker_name"])] = {str(u): sorted(map(str, mechs)) for u, mechs in rows}
    return out


def merge_users(per_broker: dict[str, dict[str, list[str]]]) -> dict[str, list[str]]:
    """Every user any leader has, with every mechanism any leader has for it."""
    merged: dict[str, set[str]] = {}
    for users in per_broker.values():
        for user, mechs in users.items():
            merged.setdefault(user, set()).update(mechs)
    return {u: sorted(m) for u, m in sorted(merged.items())}


async def create_acls(calls: AdminCalls, bindings: Iterable[AclBinding]) -> list[str]:
    """See :meth:`Admin.create_acls`."""
    rows = [b.to_json() for b in bindings]
    if not rows:
        raise ValueError("no ACL binding to create")
    done = []
    for b in await _leaders(calls):
        await calls.call(b["addr"], RequestCode.ACL_CREATE, {"acls": rows})
        done.append(str(b["broker_name"]))
    return done


async def acls_by_broker(calls: AdminCalls, match: AclFilter | None) -> dict[str, list[AclBinding]]:
    """See :meth:`Admin.acls_by_broker`."""
    cells, out = filter_cells(match), dict[str, list[AclBinding]]()
    for b in await _leaders(calls):
        rows = (await calls.call(b["addr"], RequestCode.ACL_DESCRIBE, {"filter": cells}))["acls"]
        out[str(b["broker_name"])] = sorted(AclBinding.from_json(r) for r in rows)
    return out


async def delete_acls(calls: AdminCalls, match: AclFilter | None) -> list[AclBinding]:
    """See :meth:`Admin.delete_acls`."""
    cells, gone = filter_cells(match), set[AclBinding]()
    for b in await _leaders(calls):
        rows = (await calls.call(b["addr"], RequestCode.ACL_DELETE, {"filter": cells}))["acls"]
        gone.update(AclBinding.from_json(r) for r in rows)
    return sorted(gone)


def merge_acls(per_broker: dict[str, list[AclBinding]]) -> list[AclBinding]:
    return sorted({b for bindings in per_broker.values() for b in bindings})

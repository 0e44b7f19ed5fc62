"""USER_UPSERT, USER_DELETE, USER_LIST, ACL_CREATE, ACL_DESCRIBE, ACL_DELETE: users
and ACLs changed on the group's leader (followers copy them), listed anywhere."""

from __future__ import annotations

from typing import Any

from clmq.protocol import ErrorCode, Frame, RequestCode
from clmq.protocol.auth import (
    AclBinding,
    AclFilter,
    Operation,
    PatternType,
    Permission,
    ResourceType,
    ScramCredential,
    SecurityState,
    check_user_name,
)
from clmq.protocol.transport import Handler, Peer, Reply, RequestError, need

from ._context import BrokerContext
from ._security import BrokerSecurity


def acl_filter(cells: Any) -> AclFilter:
    """An :class:`AclFilter` from seven cells ("" or None: any); MALFORMED_REQUEST if wrong."""
    if not isinstance(cells, list) or len(cells) != 7 or not all(c is None or isinstance(c, str) for c in cells):
        raise RequestError(ErrorCode.MALFORMED_REQUEST, "filter must be 7 strings ('' for any)")
    rtype, name, pattern, principal, host, op, permission = (c or None for c in cells)
    try:
        return AclFilter(
            ResourceType[rtype.upper()] if rtype else ResourceType.ANY,
            name,
            PatternType[pattern.upper()] if pattern else PatternType.ANY,
            principal,
            host,
            Operation[op.upper()] if op else Operation.ANY,
            Permission[permission.upper()] if permission else Permission.ANY,
        )
    except KeyError as e:
        raise RequestError(ErrorCode.MALFORMED_REQUEST, f"filter: unknown name {e}") from None


class SecurityRequests:
    """The USER_* and ACL_* handlers over a broker's :class:`BrokerSecurity`."""

    def __init__(self, ctx: BrokerContext, security: BrokerSecurity) -> None:
        self.ctx = ctx
        self.security = security

    def handlers(self) -> dict[int, Handler]:
        """Request code -> handler, for the broker's table."""
        return {
            RequestCode.USER_UPSERT: self.user_upsert,
            RequestCode.USER_DELETE: self.user_delete,
            RequestCode.USER_LIST: self.user_list,
            RequestCode.ACL_CREATE: self.acl_create,
            RequestCode.ACL_DESCRIBE: self.acl_describe,
            RequestCode.ACL_DELETE: self.acl_delete,
        }

    async def _change(self, make: Any) -> SecurityState:
        self.ctx.replica.check_writable()  # NOT_LEADER on a follower: changes go to the leader
        try:
            return await self.security.change(make)
        except ValueError as e:
            raise RequestError(ErrorCode.MALFORMED_REQUEST, str(e)) from None

    async def user_upsert(self, frame: Frame, peer: Peer) -> Reply:
        user, given = need(frame.fields, "user", str), need(frame.fields, "credentials", dict)
        try:
            check_user_name(user)
            creds = [ScramCredential.from_json(str(m), c) for m, c in given.items() if isinstance(c, dict)]
        except ValueError as e:
            raise RequestError(ErrorCode.MALFORMED_REQUEST, str(e)) from None
        if len(creds) != len(given) or not creds:
            raise RequestError(ErrorCode.MALFORMED_REQUEST, "credentials must map mechanisms to salted keys")
        state = await self._change(lambda s: s.with_user(user, creds))
        return Reply({"version": state.version})

    async def user_delete(self, frame: Frame, peer: Peer) -> Reply:
        user = need(frame.fields, "user", str)
        self.ctx.replica.check_writable()  # a follower says NOT_LEADER, whatever it holds
        if user not in self.security.state.users:
            raise RequestError(ErrorCode.NOT_FOUND, f"no user {user!r}")
        state = await self._change(lambda s: s.without_user(user))
        return Reply({"version": state.version})

    async def user_list(self, frame: Frame, peer: Peer) -> Reply:
        users = self.security.state.users
        return Reply({"users": [[u, sorted(creds)] for u, creds in sorted(users.items())]})

    async def acl_create(self, frame: Frame, peer: Peer) -> Reply:
        try:
            bindings = [AclBinding.from_json(row) for row in need(frame.fields, "acls", list)]
        except ValueError as e:
            raise RequestError(ErrorCode.MALFORMED_REQUEST, str(e)) from None
        state = await self._change(lambda s: s.with_acls(bindings))
        return Reply({"version": state.version})

    async def acl_describe(self, frame: Frame, peer: Peer) -> Reply:
        match = acl_filter(need(frame.fields, "filter", list))
        return Reply({"acls": [b.to_json() for b in self.security.state.acls if match.matches(b)]})

    async def acl_delete(self, frame: Frame, peer: Peer) -> Reply:
        match = acl_filter(need(frame.fields, "filter", list))
        gone: list[AclBinding] = []

        def make(s: SecurityState) -> SecurityState:
            new, removed = s.without_acls(match)
            gone.extend(removed)
            return new

        state = await self._change(make)
        return Reply({"acls": [b.to_json() for b in gone], "version": state.version})

"""Users and ACLs as one value: what a broker keeps in its ``security.json`` (through
the durable-file format: checksummed, previous generation kept), replicates to its
followers with the metadata, and decides by. Immutable: a change makes a new state
with the next version."""

from __future__ import annotations

import base64
import re
import secrets
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from ._acl import AclBinding, AclFilter, Authorizer
from ._scram import DEFAULT_ITERATIONS, MECHANISMS, ScramCredential, decoy_credential

USER_NAME = re.compile(r"[A-Za-z0-9._@-]{1,128}")  # no ':' (principals), no ',' or '=' (SCRAM's escaping)


def check_user_name(name: str) -> str:
    """``name`` if it can name a user (in principals and SCRAM messages); ValueError otherwise."""
    if not isinstance(name, str) or not USER_NAME.fullmatch(name):
        raise ValueError(f"a user name is 1..128 of letters, digits and . _ @ -, got {name!r:.60}")
    return name


@dataclass(frozen=True)
class SecurityState:
    """Every user's SCRAM credentials and every ACL binding, at ``version``."""

    version: int = 0
    users: Mapping[str, Mapping[str, ScramCredential]] = field(default_factory=dict)
    acls: tuple[AclBinding, ...] = ()
    # Salts of unknown users are derived from this (stable across restarts and replicas,
    # so that an unknown name is answered like a known one every time).
    decoy_secret: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)

    def credential(self, user: str, mechanism: str) -> ScramCredential | None:
        """``user``'s stored credential for ``mechanism``, or None."""
        return self.users.get(user, {}).get(mechanism)

    def decoy(self, mechanism: str, user: str) -> ScramCredential:
        """What an unknown ``user`` is answered with: a salt derived from this state's
        secret, and the iteration count most users of ``mechanism`` have (a count of
        its own would tell that the name is unknown)."""
        counts = Counter(creds[mechanism].iterations for creds in self.users.values() if mechanism in creds)
        iterations = counts.most_common(1)[0][0] if counts else DEFAULT_ITERATIONS
        return decoy_credential(self.decoy_secret, mechanism, user, iterations)

    def authorizer(self, super_users: frozenset[str]) -> Authorizer:
        return Authorizer(self.acls, super_users)

    # ------------------------------------------------------------ changes
    def with_user(self, name: str, credentials: list[ScramCredential]) -> SecurityState:
        """Add a user, or replace its credentials (a password change)."""
        check_user_name(name)
        if not credentials:
            raise ValueError("a user needs at least one credential")
        users = {**self.users, name: {c.mechanism: c for c in credentials}}
        return replace(self, version=self.version + 1, users=users)

    def without_user(self, name: str) -> SecurityState:
        """This state without user ``name`` (itself if there is none)."""
        if name not in self.users:
            return self
        users = {k: v for k, v in self.users.items() if k != name}
        return replace(self, version=self.version + 1, users=users)

    def with_acls(self, added: list[AclBinding]) -> SecurityState:
        """This state with ``added`` (itself if it holds them all: no new version to copy)."""
        merged = set(self.acls) | set(added)
        if len(merged) == len(self.acls):
            return self
        return replace(self, version=self.version + 1, acls=tuple(sorted(merged)))

    def without_acls(self, match: AclFilter) -> tuple[SecurityState, list[AclBinding]]:
        """This state without the bindings ``match`` selects, and those bindings."""
        gone = [b for b in self.acls if match.matches(b)]
        if not gone:
            return self, []
        kept = tuple(b for b in self.acls if not match.matches(b))
        return replace(self, version=self.version + 1, acls=kept), gone

    # ------------------------------------------------------------ JSON
    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "users": {u: {m: c.to_json() for m, c in creds.items()} for u, creds in sorted(self.users.items())},
            "acls": [b.to_json() for b in self.acls],
            "decoy_secret": base64.b64encode(self.decoy_secret).decode(),
        }

    @classmethod
    def from_json(cls, data: Any) -> SecurityState:
        """The state in ``data``; ValueError naming what is wrong."""
        if not isinstance(data, dict):
            raise ValueError("the security state must be an object")
        version, users, acls = data.get("version"), data.get("users"), data.get("acls")
        if type(version) is not int or version < 0:
            raise ValueError(f"the security state's version must be an integer >= 0, got {version!r}")
        if not isinstance(users, dict) or not isinstance(acls, list):
            raise ValueError("the security state needs 'users' (an object) and 'acls' (a list)")
        parsed: dict[str, dict[str, ScramCredential]] = {}
        for name, creds in users.items():
            check_user_name(name)
            if not isinstance(creds, dict) or not creds or not set(creds) <= set(MECHANISMS):
                raise ValueError(f"user {name!r}: credentials must map {' or '.join(MECHANISMS)} to salted keys")
            parsed[name] = {m: ScramCredential.from_json(m, c) for m, c in creds.items()}
        try:
            secret = base64.b64decode(str(data.get("decoy_secret", "")), validate=True)
        except ValueError:
            raise ValueError("the security state's decoy_secret is not base64") from None
        acl_set = tuple(sorted({AclBinding.from_json(row) for row in acls}))
        return cls(version, parsed, acl_set, secret or secrets.token_bytes(32))

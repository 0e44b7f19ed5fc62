"""A password checked against a user's stored SCRAM credential, for logins that carry
the password itself (HTTP Basic on the metrics endpoint) rather than a SCRAM exchange.

The password is salted with the credential's own salt and iteration count, and the
``StoredKey`` it gives is compared in constant time with the stored one. An unknown
user is checked against the decoy credential a SCRAM exchange would answer with, so a
wrong name costs as long as a wrong password and the answer says nothing more."""

from __future__ import annotations

import hmac

from ._scram import MECHANISMS, make_credential
from ._state import SecurityState

MAX_PASSWORD_CHARS = 1024  # longer is refused unhashed (no user has one: it could not be typed at a prompt either)


def password_matches(state: SecurityState, user: str, password: str) -> bool:
    """Whether ``password`` is ``user``'s (checked against its first stored mechanism)."""
    credential = next(
        (c for c in (state.credential(user, m) for m in MECHANISMS) if c is not None),
        None,
    )
    known = credential is not None
    if credential is None:
        credential = state.decoy(next(iter(MECHANISMS)), user[:128])
    if not password or len(password) > MAX_PASSWORD_CHARS:
        return False
    candidate = make_credential(
        credential.mechanism, password, iterations=credential.iterations, salt=credential.salt
    ).stored_key
    return hmac.compare_digest(candidate, credential.stored_key) and known

"""Authentication and authorization, sans-IO: SCRAM exchanges (RFC 5802/7677),
Kafka-style ACLs and their decisions, and the users-and-ACLs state a broker keeps.
Both protocols (the native one and the Kafka listener) use these same pieces, so a
user and a rule mean the same on either."""

from ._acl import (
    CLUSTER_NAME,
    WILDCARD,
    AclBinding,
    AclFilter,
    Authorizer,
    Operation,
    PatternType,
    Permission,
    ResourceType,
    check_principal,
)
from ._file import SECURITY_FILE, load_security, save_security
from ._passwords import password_matches
from ._scram import (
    DEFAULT_ITERATIONS,
    MAX_MESSAGE_BYTES,
    MECHANISMS,
    MIN_ITERATIONS,
    ScramClient,
    ScramCredential,
    ScramError,
    ScramServer,
    check_mechanism,
    decoy_credential,
    make_credential,
)
from ._state import SecurityState, check_user_name

__all__ = [
    "CLUSTER_NAME",
    "DEFAULT_ITERATIONS",
    "MAX_MESSAGE_BYTES",
    "MECHANISMS",
    "MIN_ITERATIONS",
    "SECURITY_FILE",
    "WILDCARD",
    "AclBinding",
    "AclFilter",
    "Authorizer",
    "Operation",
    "PatternType",
    "Permission",
    "ResourceType",
    "ScramClient",
    "ScramCredential",
    "ScramError",
    "ScramServer",
    "SecurityState",
    "check_mechanism",
    "check_principal",
    "check_user_name",
    "decoy_credential",
    "load_security",
    "make_credential",
    "password_matches",
    "save_security",
]

"""The sans-IO security pieces (clmq.protocol.auth): SCRAM against RFC 7677's example
and against itself, forged and replayed exchanges, random bytes at every step; ACL
decisions (deny wins, prefixes, implied operations, super users); the users-and-ACLs
file (checksummed, previous generation)."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clmq.common import MetadataError
from clmq.protocol.auth import (
    AclBinding,
    AclFilter,
    Authorizer,
    Operation,
    PatternType,
    Permission,
    ResourceType,
    ScramClient,
    ScramCredential,
    ScramError,
    ScramServer,
    SecurityState,
    decoy_credential,
    load_security,
    make_credential,
    save_security,
)

SECRET = b"s" * 32


def server_for(users: dict[str, ScramCredential], mechanism: str = "SCRAM-SHA-256") -> ScramServer:
    return ScramServer(mechanism, users.get, lambda u: decoy_credential(SECRET, mechanism, u))


def test_client_matches_rfc_7677_example() -> None:
    client = ScramClient("SCRAM-SHA-256", "user", "pencil", nonce="rOprNGfwEbeRWgbNEkqO")
    assert client.first() == b"n,,n=user,r=rOprNGfwEbeRWgbNEkqO"
    server_first = b"r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096"
    final = client.final(server_first)
    assert final == (
        b"c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ="
    )
    client.check(b"v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4=")
    with pytest.raises(ScramError, match="signature"):
        client.check(b"v=" + base64.b64encode(b"x" * 32))


@pytest.mark.parametrize("mechanism", ["SCRAM-SHA-256", "SCRAM-SHA-512"])
def test_round_trip_and_wrong_password_look_alike(mechanism: str) -> None:
    users = {"alice": make_credential(mechanism, "secret", iterations=4096)}
    client = ScramClient(mechanism, "alice", "secret")
    server = server_for(users, mechanism)
    client.check(server.final(client.final(server.first(client.first()))))
    # A wrong password and an unknown user: the same salt every time for a name, the
    # same failure at the same step.
    answers = []
    for user, password in (("alice", "wrong"), ("mallory", "secret"), ("mallory", "other")):
        server = server_for(users, mechanism)
        c = ScramClient(mechanism, user, password)
        server_first = server.first(c.first())
        answers.append(server_first.split(b",")[1:])
        with pytest.raises(ScramError):
            server.final(c.final(server_first))
    assert answers[1] == answers[2]  # an unknown name is answered alike each time
    assert len(answers[0][0]) == len(answers[1][0])  # salts of the same length


def test_replayed_and_forged_exchanges_fail() -> None:
    users = {"alice": make_credential("SCRAM-SHA-256", "secret")}
    client = ScramClient("SCRAM-SHA-256", "alice", "secret")
    server = server_for(users)
    final = client.final(server.first(client.first()))
    server.final(final)
    # Replayed: the same client-final to a new exchange (a new server nonce).
    again = server_for(users)
    again.first(client.first())
    with pytest.raises(ScramError, match="nonce"):
        again.final(final)
    # Forged: a proof of the right length, but not from the password.
    forged = server_for(users)
    server_first = forged.first(ScramClient("SCRAM-SHA-256", "alice", "x", nonce="abc").first())
    nonce = server_first.split(b",")[0][2:]
    with pytest.raises(ScramError):
        forged.final(b"c=biws,r=" + nonce + b",p=" + base64.b64encode(bytes(32)))
    # Out of turn: final before first; a second final.
    with pytest.raises(ScramError, match="out of turn"):
        server_for(users).final(final)
    with pytest.raises(ScramError, match="out of turn"):
        server.final(final)


@settings(max_examples=300, deadline=None)
@given(first=st.binary(max_size=300), final=st.binary(max_size=300))
def test_random_bytes_only_ever_raise_scram_error(first: bytes, final: bytes) -> None:
    users = {"alice": make_credential("SCRAM-SHA-256", "secret", iterations=4096)}
    server = server_for(users)
    try:
        server.first(first)
    except ScramError:
        return
    with pytest.raises(ScramError):
        server.final(final)


@settings(max_examples=100, deadline=None)
@given(data=st.binary(max_size=200))
def test_random_server_messages_only_ever_raise_scram_error(data: bytes) -> None:
    client = ScramClient("SCRAM-SHA-256", "alice", "secret", nonce="n0nce")
    with pytest.raises(ScramError):
        client.final(b"r=n0nce" + data)
        client.check(data)


def test_user_names_with_commas_and_equals_are_escaped() -> None:
    users = {"a,b=c": make_credential("SCRAM-SHA-256", "pw")}
    client = ScramClient("SCRAM-SHA-256", "a,b=c", "pw")
    assert b"n=a=2Cb=3Dc," in client.first()
    server = server_for(users)
    client.check(server.final(client.final(server.first(client.first()))))
    assert server.user == "a,b=c"


def acl(rtype: str, name: str, op: str, perm: str = "allow", principal: str = "User:alice", **kw: str) -> AclBinding:
    return AclBinding(
        ResourceType[rtype.upper()],
        name,
        PatternType[kw.get("pattern", "literal").upper()],
        principal,
        kw.get("host", "*"),
        Operation[op.upper()],
        Permission[perm.upper()],
    )


def test_decisions() -> None:
    a = Authorizer(
        [
            acl("topic", "orders", "write"),
            acl("topic", "logs-", "read", pattern="prefixed"),
            acl("topic", "logs-secret", "read", perm="deny"),
            acl("group", "*", "read", principal="User:*"),
            acl("topic", "pay", "all", host="10.0.0.1"),
        ],
        super_users=["User:root"],
    )
    yes = lambda op, rt, name, who="User:alice", host="127.0.0.1": a.allowed(  # noqa: E731
        who, host, Operation[op], ResourceType[rt], name
    )
    assert yes("WRITE", "TOPIC", "orders")
    assert yes("DESCRIBE", "TOPIC", "orders")  # implied by WRITE
    assert not yes("READ", "TOPIC", "orders")
    assert not yes("WRITE", "TOPIC", "orders", who="User:bob")  # deny by default
    assert yes("READ", "TOPIC", "logs-app")  # prefixed
    assert not yes("READ", "TOPIC", "logs-secret")  # DENY wins
    assert yes("DESCRIBE", "TOPIC", "logs-secret")  # a DENY of READ does not deny DESCRIBE (Kafka)
    assert yes("READ", "GROUP", "anything", who="User:bob")  # wildcard name and principal
    assert not yes("READ", "TOPIC", "pay")  # other host
    assert yes("DELETE", "TOPIC", "pay", host="10.0.0.1")
    assert yes("ALTER", "CLUSTER", "kafka-cluster", who="User:root")  # super user


def test_bindings_are_checked_and_filters_select() -> None:
    with pytest.raises(ValueError, match="principal"):
        acl("topic", "t", "read", principal="alice")
    with pytest.raises(ValueError, match="cluster resource"):
        acl("cluster", "other", "alter")
    with pytest.raises(ValueError, match="Operation"):
        AclBinding.from_json(["TOPIC", "t", "LITERAL", "User:a", "*", "EAT", "ALLOW"])
    bindings = [acl("topic", "logs-", "read", pattern="prefixed"), acl("topic", "orders", "write")]
    match = AclFilter(ResourceType.TOPIC, "logs-app", PatternType.MATCH)
    assert [b for b in bindings if match.matches(b)] == bindings[:1]
    assert [b for b in bindings if AclFilter(operation=Operation.WRITE).matches(b)] == bindings[1:]


def test_security_file_round_trip_and_previous_generation(tmp_path: Path) -> None:
    path = tmp_path / "security.json"
    assert load_security(path).users == {}
    # A password no base64 salt or key can contain by chance ("pw" did: 1 run in about 20).
    password = "never-stored-password"
    state = SecurityState().with_user("alice", [make_credential("SCRAM-SHA-256", password, iterations=4096)])
    save_security(path, state)
    state2 = state.with_acls([acl("topic", "t", "read")])
    save_security(path, state2)
    assert load_security(path).to_json() == state2.to_json()
    assert password not in path.read_text()  # never the password
    path.write_bytes(path.read_bytes()[:-5] + b"xxxxx")  # damage: the previous generation is used
    assert load_security(path).to_json() == state.to_json()
    (tmp_path / "security.json.prev").write_bytes(b"junk")
    with pytest.raises(MetadataError, match="no generation"):
        load_security(path)


def test_old_librdkafkas_doubled_nonce_is_accepted_only_where_asked() -> None:
    """librdkafka#4895: the client-final's nonce is "client nonce + full nonce", and its
    proof is over what it sent."""
    import hashlib
    import hmac

    cred = make_credential("SCRAM-SHA-256", "secret", iterations=4096)
    salted = hashlib.pbkdf2_hmac("sha256", b"secret", cred.salt, cred.iterations)
    client_key = hmac.new(salted, b"Client Key", "sha256").digest()
    for lenient in (False, True):
        server = ScramServer(
            "SCRAM-SHA-256",
            {"alice": cred}.get,
            lambda u: decoy_credential(SECRET, "SCRAM-SHA-256", u),
            accept_doubled_client_nonce=lenient,
        )
        server_first = server.first(b"n,,n=alice,r=cn")
        full = server_first.split(b",")[0][2:]
        head = b"c=biws,r=cn" + full
        auth = b"n=alice,r=cn," + server_first + b"," + head
        signature = hmac.new(hashlib.sha256(client_key).digest(), auth, "sha256").digest()
        proof = base64.b64encode(bytes(a ^ b for a, b in zip(client_key, signature)))
        if lenient:
            assert server.final(head + b",p=" + proof).startswith(b"v=")
        else:
            with pytest.raises(ScramError, match="nonce"):
                server.final(head + b",p=" + proof)

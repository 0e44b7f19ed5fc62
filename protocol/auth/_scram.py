"""SCRAM (RFC 5802, with SHA-256 and SHA-512: RFC 7677), sans-IO.

Both ends are small state machines that take and give the exchange's messages as
bytes; the native protocol carries them in AUTHENTICATE requests, the Kafka listener
in SaslAuthenticate. Nothing here reads a socket (the model is h11).

A user's credential is what RFC 5802 lets a server keep instead of the password:
salt, iteration count, ``StoredKey = H(HMAC(SaltedPassword, "Client Key"))`` and
``ServerKey = HMAC(SaltedPassword, "Server Key")``. A stolen credential does not give
the password, and cannot log in without a brute-force search per user.

Why an unknown user still gets a salt (derived from a secret of the server and the
name): an answer that differed would tell an attacker which user names exist. The
exchange then fails at the proof, exactly as a wrong password does.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from dataclasses import dataclass
from typing import Callable, Final

MECHANISMS: Final = {"SCRAM-SHA-256": "sha256", "SCRAM-SHA-512": "sha512"}
MIN_ITERATIONS: Final = 4096  # RFC 7677's floor (and Kafka's)
DEFAULT_ITERATIONS: Final = 8192
MAX_ITERATIONS: Final = 1_000_000  # a client told more refuses (a server cannot make it spin for ever)
MAX_MESSAGE_BYTES: Final = 4096  # any SCRAM message longer than this is refused unread
NONCE_BYTES: Final = 24
_GS2_HEADER: Final = b"n,,"  # no channel binding, no authzid


class ScramError(Exception):
    """An exchange that cannot go on: a malformed message, a wrong proof, a
    replayed or forged nonce. The text is for logs; peers are told only that the
    login failed."""


@dataclass(frozen=True)
class ScramCredential:
    """What the server stores for one user and mechanism (never the password)."""

    mechanism: str
    salt: bytes
    iterations: int
    stored_key: bytes
    server_key: bytes

    def to_json(self) -> dict[str, object]:
        b64 = base64.b64encode
        return {
            "salt": b64(self.salt).decode(),
            "iterations": self.iterations,
            "stored_key": b64(self.stored_key).decode(),
            "server_key": b64(self.server_key).decode(),
        }

    @classmethod
    def from_json(cls, mechanism: str, data: dict[str, object]) -> ScramCredential:
        check_mechanism(mechanism)
        try:
            salt, stored, server = (
                base64.b64decode(str(data[k]), validate=True) for k in ("salt", "stored_key", "server_key")
            )
            iterations = data["iterations"]
        except (KeyError, ValueError) as e:
            raise ValueError(f"a {mechanism} credential is malformed: {e}") from None
        if type(iterations) is not int or not MIN_ITERATIONS <= iterations <= MAX_ITERATIONS:
            raise ValueError(f"a {mechanism} credential's iterations must be in {MIN_ITERATIONS}..{MAX_ITERATIONS}")
        return cls(mechanism, salt, iterations, stored, server)


def check_mechanism(mechanism: str) -> str:
    """The hash name of a SCRAM mechanism, or ValueError."""
    try:
        return MECHANISMS[mechanism]
    except KeyError:
        raise ValueError(f"unknown SASL mechanism {mechanism!r}: use one of {', '.join(MECHANISMS)}") from None


def _hmac(algo: str, key: bytes, msg: bytes) -> bytes:
    return hmac.new(key, msg, algo).digest()


def _salted(algo: str, password: str, salt: bytes, iterations: int) -> bytes:
    return hashlib.pbkdf2_hmac(algo, password.encode(), salt, iterations)


def make_credential(
    mechanism: str, password: str, *, iterations: int = DEFAULT_ITERATIONS, salt: bytes | None = None
) -> ScramCredential:
    """A new salted credential for ``password`` (the salt is random unless given)."""
    algo = check_mechanism(mechanism)
    if not MIN_ITERATIONS <= iterations <= MAX_ITERATIONS:
        raise ValueError(f"iterations must be in {MIN_ITERATIONS}..{MAX_ITERATIONS}, got {iterations}")
    if not password:
        raise ValueError("a password must not be empty")
    salt = salt if salt is not None else secrets.token_bytes(16)
    salted = _salted(algo, password, salt, iterations)
    client_key = _hmac(algo, salted, b"Client Key")
    stored_key = hashlib.new(algo, client_key).digest()
    return ScramCredential(mechanism, salt, iterations, stored_key, _hmac(algo, salted, b"Server Key"))


def _escape(name: str) -> str:
    return name.replace("=", "=3D").replace(",", "=2C")


def _unescape(name: str) -> str:
    out, i = [], 0
    while i < len(name):
        if name[i] == "=":
            code = name[i : i + 3]
            if code not in ("=2C", "=3D"):
                raise ScramError("a user name holds '=' not followed by 2C or 3D")
            out.append("," if code == "=2C" else "=")
            i += 3
        else:
            out.append(name[i])
            i += 1
    return "".join(out)


def _attributes(message: bytes, names: str) -> dict[str, str]:
    """The ``k=v`` attributes of a SCRAM message, checked against the expected ``names``
    in order (extensions after them are ignored: Kafka's ``tokenauth``)."""
    if len(message) > MAX_MESSAGE_BYTES:
        raise ScramError(f"a SCRAM message of {len(message)} bytes (at most {MAX_MESSAGE_BYTES})")
    try:
        text = message.decode()
    except UnicodeDecodeError:
        raise ScramError("a SCRAM message that is not UTF-8") from None
    parts = text.split(",")
    if len(parts) < len(names):
        raise ScramError(f"a SCRAM message without its attributes {', '.join(names)}: {text[:80]!r}")
    found: dict[str, str] = {}
    for name, part in zip(names, parts):
        if not part.startswith(name + "="):
            raise ScramError(f"a SCRAM message whose attribute {name!r} is missing: {text[:80]!r}")
        found[name] = part[2:]
    return found


def _b64(data: str, what: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except ValueError:
        raise ScramError(f"{what} is not base64") from None


class ScramServer:
    """The server's side of one exchange: ``first(client_first) -> server_first``,
    then ``final(client_final) -> server_final`` (which raises :class:`ScramError`
    when the proof is wrong). ``lookup(user)`` gives the user's credential or None;
    ``decoy(user)`` the credential an unknown user is answered with."""

    def __init__(
        self,
        mechanism: str,
        lookup: Callable[[str], ScramCredential | None],
        decoy: Callable[[str], ScramCredential],
        *,
        accept_doubled_client_nonce: bool = False,
    ) -> None:
        self.algo = check_mechanism(mechanism)
        # librdkafka before 2.6.1 (kcat, confluent-kafka of those years) answers with the
        # nonce "client nonce + (client nonce + server nonce)" (librdkafka#4895); Kafka
        # 3.8.1-3.9 accept it. That form still holds this exchange's fresh server nonce,
        # so a replayed or forged client-final is refused all the same.
        self._doubled_ok = accept_doubled_client_nonce
        self._client_nonce = ""
        self.mechanism = mechanism
        self._lookup = lookup
        self._decoy = decoy
        self.user = ""
        self._cred: ScramCredential | None = None
        self._known = False
        self._auth_prefix = b""
        self._nonce = ""
        self.done = False

    def first(self, client_first: bytes) -> bytes:
        if self._cred is not None:
            raise ScramError("a second client-first message in one exchange")
        if not client_first.startswith(_GS2_HEADER):
            raise ScramError("a client-first message that asks for channel binding or an authzid (not supported)")
        bare = client_first[len(_GS2_HEADER) :]
        attrs = _attributes(bare, "nr")
        self.user = _unescape(attrs["n"])
        if not self.user or not attrs["r"]:
            raise ScramError("a client-first message with an empty user name or nonce")
        cred = self._lookup(self.user)
        self._known = cred is not None
        self._cred = cred if cred is not None else self._decoy(self.user)
        self._client_nonce = attrs["r"]
        self._nonce = attrs["r"] + base64.b64encode(secrets.token_bytes(NONCE_BYTES)).decode()
        salt = base64.b64encode(self._cred.salt).decode()
        server_first = f"r={self._nonce},s={salt},i={self._cred.iterations}".encode()
        self._auth_prefix = bare + b"," + server_first
        return server_first

    def final(self, client_final: bytes) -> bytes:
        """The server-final message; ScramError for a wrong proof, nonce or binding."""
        cred = self._cred
        if cred is None or self.done:
            raise ScramError("a client-final message out of turn")
        self.done = True
        attrs = _attributes(client_final, "cr")
        if attrs["c"] != base64.b64encode(_GS2_HEADER).decode():
            raise ScramError("a client-final message with a channel binding that differs from its first message")
        doubled = self._doubled_ok and attrs["r"] == self._client_nonce + self._nonce
        if not doubled and not hmac.compare_digest(attrs["r"], self._nonce):
            raise ScramError("a client-final message with a nonce of another exchange (replayed or forged)")
        head, sep, proof_text = client_final.rpartition(b",p=")
        if not sep:
            raise ScramError("a client-final message without a proof")
        auth_message = self._auth_prefix + b"," + head
        signature = _hmac(self.algo, cred.stored_key, auth_message)
        proof = _b64(proof_text.decode(errors="replace"), "the proof")
        if len(proof) != len(signature):
            raise ScramError("a proof of the wrong length")
        client_key = bytes(a ^ b for a, b in zip(proof, signature))
        good = hmac.compare_digest(hashlib.new(self.algo, client_key).digest(), cred.stored_key)
        if not (good and self._known):
            raise ScramError(f"wrong password for {self.user!r}, or no such user")
        server_signature = _hmac(self.algo, cred.server_key, auth_message)
        return b"v=" + base64.b64encode(server_signature)


class ScramClient:
    """The client's side: ``first() -> client_first``, ``final(server_first) ->
    client_final``, ``check(server_final)`` (ScramError if the server could not prove
    it knows the credential: an impostor)."""

    def __init__(self, mechanism: str, user: str, password: str, *, nonce: str | None = None) -> None:
        self.algo = check_mechanism(mechanism)
        self.user = user
        self.password = password
        self._nonce = nonce or base64.b64encode(secrets.token_bytes(NONCE_BYTES)).decode()
        self._bare = f"n={_escape(user)},r={self._nonce}".encode()
        self._server_signature = b""

    def first(self) -> bytes:
        return _GS2_HEADER + self._bare

    def final(self, server_first: bytes) -> bytes:
        attrs = _attributes(server_first, "rsi")
        nonce, salt = attrs["r"], _b64(attrs["s"], "the salt")
        if not nonce.startswith(self._nonce) or len(nonce) == len(self._nonce):
            raise ScramError("the server's nonce does not extend the client's")
        if not attrs["i"].isdigit() or not MIN_ITERATIONS <= int(attrs["i"]) <= MAX_ITERATIONS:
            raise ScramError(f"the server asks for {attrs['i'][:20]!r} iterations")
        salted = _salted(self.algo, self.password, salt, int(attrs["i"]))
        client_key = _hmac(self.algo, salted, b"Client Key")
        head = f"c={base64.b64encode(_GS2_HEADER).decode()},r={nonce}".encode()
        auth_message = self._bare + b"," + server_first + b"," + head
        signature = _hmac(self.algo, hashlib.new(self.algo, client_key).digest(), auth_message)
        proof = bytes(a ^ b for a, b in zip(client_key, signature))
        self._server_signature = _hmac(self.algo, _hmac(self.algo, salted, b"Server Key"), auth_message)
        return head + b",p=" + base64.b64encode(proof)

    def check(self, server_final: bytes) -> None:
        if server_final.startswith(b"e="):
            raise ScramError(f"the server refused the login: {server_final[2:80].decode(errors='replace')}")
        attrs = _attributes(server_final, "v")
        if not self._server_signature or not hmac.compare_digest(
            _b64(attrs["v"], "the server signature"), self._server_signature
        ):
            raise ScramError("the server's signature is wrong: it does not hold this user's credential")


def decoy_credential(secret: bytes, mechanism: str, user: str, iterations: int = DEFAULT_ITERATIONS) -> ScramCredential:
    """The credential an unknown ``user`` is answered with: the same salt every time for
    the same name (a fresh salt per try would tell the name is unknown), and the
    iteration count known users have (:meth:`SecurityState.decoy` picks it)."""
    algo = check_mechanism(mechanism)
    salt = _hmac(algo, secret, b"decoy salt:" + user.encode())[:16]
    key = _hmac(algo, secret, b"decoy key:" + user.encode())
    return ScramCredential(mechanism, salt, iterations, key, key)

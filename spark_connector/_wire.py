"""Network mode: the reader against running brokers, over clmq's wire protocol.

Spark tasks run in plain Python worker processes, so this is a small *blocking* adapter
around the sans-IO codec (``protocol``): a socket, a :class:`FrameDecoder`, one request
at a time. Each task opens its own connection to the broker that holds its split, so
executors need not share the broker's disk.

Secured clusters (docs/security.md): TLS through ``ssl`` on that socket
(:meth:`TlsSettings.client_context`: the server's certificate checked against the CA,
a client certificate for mutual TLS) and a SCRAM login right after connecting, two
AUTHENTICATE requests (:class:`ScramClient`), before anything else; from the options
``tlsCaFile``, ``tlsCertFile``, ``tlsKeyFile``, ``user``, ``password``, else the
``CLMQ_TLS_*``, ``CLMQ_USER`` and ``CLMQ_PASSWORD`` variables where the connection is made.
"""

from __future__ import annotations

import itertools
import os
import socket
import ssl
import time
from typing import Any, Iterator

import numpy as np

from clmq.common import ConnectorError, gather_fields, walk_records
from clmq.protocol import NEED_DATA, ErrorCode, Frame, FrameDecoder, FrameRejected, RequestCode, encode_frame
from clmq.protocol.auth import ScramClient, ScramError
from clmq.protocol.transport import ClientSecurity, tls_settings

from ._layout import LayoutError, LogLayout, SegmentInfo
from ._options import OptionError, ReadOptions

NO_END = 1 << 62  # partition-per-file brokers have no log offsets to bound a snapshot by
PULL_BATCH = 4096  # messages per pull on the index path
SETTLE_POLL_S = 0.05  # how often to ask for a newer snapshot while waiting for a flush


class RemoteError(ConnectorError):
    """A broker or name server answered with an error."""

    def __init__(self, addr: str, code: int, text: str) -> None:
        name = ErrorCode(code).name if code in ErrorCode._value2member_map_ else str(code)
        super().__init__(f"{addr}: {name}: {text}")
        self.code, self.text = code, text


def _scram_data(frame: Frame) -> bytes:
    data = frame.fields.get("data")
    if not isinstance(data, bytes):
        raise ScramError("the server's answer carries no SCRAM message")
    return data


def _tls_reason(e: BaseException) -> str:
    if isinstance(e, ssl.SSLCertVerificationError):
        return f"certificate verify failed: {e.verify_message}"
    if isinstance(e, TimeoutError | socket.timeout):
        return "no answer in time (is it a TLS port?)"
    return str(e) or type(e).__name__


class LoginError(ConnectorError):
    """A broker or name server refused the login of option ``user`` (or the server could
    not prove it holds that user's credential)."""


# The environment each connection falls back on when no security option is given (as
# every clmq client: client/_arguments.py).
SECURITY_ENV = {
    "tlsCaFile": "CLMQ_TLS_CA_FILE",
    "tlsCertFile": "CLMQ_TLS_CERT_FILE",
    "tlsKeyFile": "CLMQ_TLS_KEY_FILE",
    "user": "CLMQ_USER",
    "password": "CLMQ_PASSWORD",
}


def client_security(given: tuple[tuple[str, str], ...]) -> ClientSecurity | None:
    """The connection's TLS and login: the options given, else the environment's; None
    for plaintext without a login. OptionError naming the options for ones that cannot
    work (a file missing here, a password without a user)."""
    values = dict(given) if given else {name: os.environ.get(env, "") for name, env in SECURITY_ENV.items()}
    what = (
        "options tlsCaFile, tlsCertFile, tlsKeyFile, user, password"
        if given
        else "$" + ", $".join(SECURITY_ENV.values())
    )
    try:
        tls = tls_settings(
            cert_file=values.get("tlsCertFile", ""),
            key_file=values.get("tlsKeyFile", ""),
            ca_file=values.get("tlsCaFile", ""),
        )
        user = values.get("user", "")
        if tls is None and not user:
            return None
        return ClientSecurity(tls, user, values.get("password", "") if user else "")
    except ValueError as e:
        raise OptionError(f"{what}: {e}") from None


class Connection:
    """One blocking connection (TLS and a login when ``security`` says so); requests
    are answered in order."""

    def __init__(self, addr: str, timeout_ms: int, security: tuple[tuple[str, str], ...] = ()) -> None:
        host, _, port = addr.rpartition(":")
        self.addr = addr
        sec = client_security(security)
        try:
            raw = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_ms / 1000)
        except OSError as e:
            raise LayoutError(f"cannot connect to {addr}: {e}") from None
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock: socket.socket = raw
        if sec is not None and sec.tls is not None:
            try:  # the handshake, within the socket's timeout
                self.sock = sec.tls.client_context().wrap_socket(
                    raw, server_hostname=sec.tls.server_hostname or host.strip("[]")
                )
            except (ssl.SSLError, OSError) as e:
                raw.close()
                raise LayoutError(f"TLS handshake with {addr} failed: {_tls_reason(e)}") from None
        self.decoder = FrameDecoder(max_frame_bytes=256 << 20)
        self._ids = itertools.count(1)
        self.principal = ""
        if sec is not None and sec.user:
            try:
                self._login(sec)
            except BaseException:
                self.sock.close()
                raise

    def _login(self, sec: ClientSecurity) -> None:
        """The SCRAM exchange (two AUTHENTICATE requests) before any other request. A
        server that serves no logins (REQUEST_NOT_SUPPORTED) is used without one."""
        scram = ScramClient(sec.mechanism, sec.user, sec.password)
        try:
            first = self.call(RequestCode.AUTHENTICATE, {"mechanism": sec.mechanism, "data": scram.first()})
            final = self.call(RequestCode.AUTHENTICATE, {"data": scram.final(_scram_data(first))})
            scram.check(_scram_data(final))
        except RemoteError as e:
            if e.code == ErrorCode.REQUEST_NOT_SUPPORTED:
                return
            if e.code == ErrorCode.TLS_REQUIRED:
                raise  # not the login's fault: the server says what to do
            raise LoginError(f"login as {sec.user!r} to {self.addr} failed: {e.text}") from None
        except ScramError as e:
            raise LoginError(f"login as {sec.user!r} to {self.addr} failed: {e}") from None
        except LayoutError as e:  # the server closed the connection during the exchange
            raise LoginError(f"login as {sec.user!r} to {self.addr} failed: {e}") from None
        principal = final.fields.get("principal")
        self.principal = principal if isinstance(principal, str) else f"User:{sec.user}"

    def call(self, code: RequestCode, fields: dict[str, Any] | None = None) -> Frame:
        rid = next(self._ids)
        self.sock.sendall(encode_frame(Frame(int(code), rid, fields or {})))
        while True:
            event = self.decoder.next_event()
            if event is NEED_DATA:
                data = self.sock.recv(1 << 20)
                if not data:
                    raise LayoutError(f"{self.addr} closed the connection during {code.name}")
                self.decoder.receive_data(data)
                continue
            if isinstance(event, FrameRejected):
                raise LayoutError(f"{self.addr}: answer to {code.name} rejected: {event.reason}")
            if isinstance(event, Frame) and event.request_id == 0 and event.error_code:
                # the connection itself refused (TLS_REQUIRED: a plaintext client at a TLS port)
                hint = "; the reader's option: tlsCaFile" if event.error_code == ErrorCode.TLS_REQUIRED else ""
                raise RemoteError(self.addr, event.error_code, event.error_text + hint)
            if isinstance(event, Frame) and event.request_id == rid:
                if event.error_code:
                    raise RemoteError(self.addr, event.error_code, event.error_text)
                return event

    def close(self) -> None:
        self.sock.close()


def find_brokers(opts: ReadOptions) -> list[str]:
    """The brokers to read: given directly, or every broker a name server knows."""
    if opts.brokers:
        return list(opts.brokers)
    errors = []
    for ns in opts.nameservers:
        try:
            conn = Connection(ns, opts.timeout_ms, opts.security)
        except LayoutError as e:
            errors.append(str(e))
            continue
        try:
            brokers = conn.call(RequestCode.GET_CLUSTER).fields.get("brokers", [])
        finally:
            conn.close()
        return sorted({b["addr"] for b in brokers})
    raise LayoutError("no name server answered: " + "; ".join(errors))


class RemoteStore:
    """A ``QueueSource`` and ``ByteSource`` for one broker."""

    def __init__(
        self, addr: str, timeout_ms: int, fetch_layout: bool = True, security: tuple[tuple[str, str], ...] = ()
    ) -> None:
        self.addr = addr
        self.conn = Connection(addr, timeout_ms, security)
        self._count = 0
        if fetch_layout:  # planning needs it; tasks know their ranges already
            self.layout = self._fetch_layout()

    def _fetch_layout(self) -> LogLayout:
        try:
            f = self.conn.call(RequestCode.GET_LOG_LAYOUT).fields
        except RemoteError as e:
            if e.code != ErrorCode.REQUEST_NOT_SUPPORTED:
                raise
            topics = self.conn.call(RequestCode.LIST_TOPICS).fields["topics"]
            return LogLayout(self.addr, 0, NO_END, (), dict(topics), "partition-per-file")
        self._count = int(f.get("message_count", 0))
        segs = tuple(SegmentInfo(int(b), int(e), tuple(int(x) for x in bs)) for b, e, bs in f["segments"])
        return LogLayout(
            self.addr,
            int(f["min_offset"]),
            int(f["end_offset"]),
            segs,
            dict(f["topics"]),
            f.get("storage_mode", "commitlog"),
        )

    # ------------------------------------------------------------- planning
    def bounds(self, topic: str, qid: int) -> tuple[int, int]:
        f = self.conn.call(RequestCode.QUERY_OFFSETS, {"topic": topic, "queue_id": qid}).fields
        return int(f["min_offset"]), int(f["max_offset"])

    def ensure_readable(self, topic: str, qid: int, end: int, timeout_ms: int) -> None:
        """Make the snapshot cover queue offsets below ``end``: a broker counts records it
        has dispatched but not yet fsynced (async flush) in its queues' ends, while its
        snapshot stops at what is durable. Waits (at most ``timeout_ms``) for the flush
        and takes the newer snapshot; without this an explicit end offset in that window
        would read short without a word."""
        if end <= 0 or self.layout.storage_mode != "commitlog":
            return
        frame = self.conn.call(
            RequestCode.PULL_MESSAGE, {"topic": topic, "queue_id": qid, "offset": end - 1, "max_messages": 1}
        )
        if not frame.fields.get("count"):
            return  # not there at all: the range check reports it
        walk = walk_records(frame.body)
        need = int(
            gather_fields(np.frombuffer(frame.body, np.uint8), walk, ["commitlog_offset"])["commitlog_offset"][0]
        )
        deadline = time.monotonic() + timeout_ms / 1000
        while self.layout.end_offset <= need:
            if time.monotonic() > deadline:
                raise LayoutError(
                    f"broker {self.addr}: queue {topic}/{qid} offset {end - 1} is not durable after "
                    f"{timeout_ms} ms (its snapshot ends at {self.layout.end_offset}); is it flushing?"
                )
            time.sleep(SETTLE_POLL_S)  # the broker fsyncs every flush_interval_ms: nothing to wait on over the wire
            self.layout = self._fetch_layout()

    def offset_for_timestamp(self, topic: str, qid: int, timestamp_ms: int) -> int:
        f = self.conn.call(RequestCode.SEARCH_OFFSET, {"topic": topic, "queue_id": qid, "timestamp_ms": timestamp_ms})
        return int(f.fields["offset"])

    def message_count(self) -> int:
        return self._count

    # -------------------------------------------------------------- reading
    def where(self, seg_base: int) -> str:
        return f"broker {self.addr}" + (f" segment {seg_base:020d}" if seg_base >= 0 else "")

    def read(self, seg_base: int, offset: int, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            ask = {"offset": offset + len(out), "max_bytes": n - len(out), "end_offset": offset + n}
            frame = self.conn.call(RequestCode.READ_LOG, ask)
            if not frame.body:
                break
            out += frame.body
        return bytes(out)

    def queue_records(self, topic: str, qid: int, lo: int, hi: int, end_offset: int) -> Iterator[bytes]:
        """Pulls ``[lo, hi)``; records at or past the snapshot's ``end_offset`` are cut off."""
        offset = lo
        while offset < hi:
            ask = {"topic": topic, "queue_id": qid, "offset": offset, "max_messages": min(PULL_BATCH, hi - offset)}
            frame = self.conn.call(RequestCode.PULL_MESSAGE, ask)
            f = frame.fields
            if f["status"] == "OFFSET_TOO_SMALL":
                offset = int(f["next_offset"])
                continue
            if not f["count"]:
                return
            body, stop = _before(frame.body, end_offset)
            if body:
                yield body
            if stop:
                return
            offset = int(f["next_offset"])

    def close(self) -> None:
        self.conn.close()


def _before(body: bytes, end_offset: int) -> tuple[bytes, bool]:
    """The records of ``body`` stored below ``end_offset``, and whether any were not."""
    if end_offset >= NO_END:
        return body, False
    walk = walk_records(body)
    if not walk.runs:
        return body, False
    offs = gather_fields(np.frombuffer(body, np.uint8), walk, ["commitlog_offset"])["commitlog_offset"]
    past = np.flatnonzero(offs >= end_offset)
    if not len(past):
        return body, False
    return body[: int(walk.starts[past[0]])], True

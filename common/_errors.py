"""clmq's exception hierarchy, rooted here because every package builds on this one.

Expected outcomes (a full segment, an oversized message, an offset that fell out of
retention, an unknown topic) are *results* with a status, not exceptions. Exceptions
are for the unexpected (damaged bytes, broken invariants, an unreachable server) and
for input a codec cannot take. Every one of them is a :class:`ClmqError`::

    ClmqError
    ├── StoreError               storage: the CommitLog, consume queues, the store
    │   ├── CorruptRecordError   bytes on disk that are not a valid record (file, offset,
    │   │                        check, expected, actual)
    │   ├── LogDamageError       log bytes acknowledged once and now gone or damaged:
    │   │                        the store refuses to open (file, byte range, queues)
    │   ├── StoreFailedError     a background thread failed (fsync error, ...): the
    │   │                        store takes no more writes until it is reopened
    │   ├── MetadataError        a metadata file and its previous generation both damaged
    │   ├── ConfigError          a setting that cannot work (also a ValueError)
    │   └── StoreLockedError     (broker.store) the data directory is in use
    ├── InvalidInputError        input a codec rejects (also a ValueError): EncodeError,
    │                            PackError (= protocol.BatchError)
    ├── ProtocolError            (protocol) a byte stream that is not the wire protocol
    ├── TransportError           (protocol.transport) ConnectionFailed, RpcError (the
    │                            server answered with an error code), RequestError (a
    │                            handler's way to answer with one)
    ├── ClientError              (client) SendError, NoRouteError
    ├── ServiceError             (broker.service) BusyError
    ├── SettingsError            (broker.cli) a configuration a person must fix (ValueError)
    └── ConnectorError           (spark_connector) LayoutError, OptionError, RemoteError
"""

from __future__ import annotations


class ClmqError(Exception):
    """Base class of every exception clmq raises on purpose."""


class StoreError(ClmqError):
    """Base class of clmq's storage errors."""


class InvalidInputError(ClmqError, ValueError):
    """Input that a codec cannot take (a message too large, bytes that do not decode)."""


class ProtocolError(ClmqError):
    """The byte stream is not valid protocol; the connection must be closed."""


class TransportError(ClmqError):
    """Base class of the errors of talking to a server (see ``clmq.protocol.transport``)."""


class ClientError(ClmqError):
    """Base class of the client library's errors."""


class ServiceError(ClmqError):
    """Base class of errors a running service reports to its callers."""


class ConnectorError(ClmqError):
    """Base class of the Spark connector's errors."""


class CorruptRecordError(StoreError):
    """Bytes on disk that do not form a valid record.

    Carries the file, the log offset, which check failed, and the expected and actual
    values, so that an operator can look at exactly those bytes.
    """

    def __init__(self, file: str, offset: int, check: str, expected: str, actual: str) -> None:
        self.file = file
        self.offset = offset
        self.check = check
        self.expected = expected
        self.actual = actual
        super().__init__(f"corrupt record in {file} at offset {offset}: {check} expected {expected}, got {actual}")


class ConfigError(StoreError, ValueError):
    """A setting that cannot work (for example a message limit larger than a segment)."""


class LogDamageError(StoreError):
    """Log bytes that were promised (below the checkpoint's durable offset, or inside a
    segment a later one continues) are gone or damaged, so the store will not open.

    ``file`` and the log offsets ``[start, end)`` name the damage; ``queues`` lists the
    affected ``(topic, queue id, first queue offset, last queue offset)`` when the
    store could tell them (it fills them in from the consume queues). Nothing is cut
    implicitly: ``clmq store repair`` does that, and says what it dropped.
    """

    def __init__(
        self, file: str, start: int, end: int, reason: str, queues: list[tuple[str, int, int, int]] | None = None
    ) -> None:
        self.file = file
        self.start = start
        self.end = end
        self.reason = reason
        self.queues = list(queues or [])
        super().__init__(self._message())

    def _message(self) -> str:
        text = f"log damaged in {self.file}, log offsets {self.start}..{self.end}: {self.reason}"
        if self.queues:
            shown = ", ".join(f"{t}/{q} offsets {a}..{b}" for t, q, a, b in self.queues[:10])
            more = f" and {len(self.queues) - 10} more" if len(self.queues) > 10 else ""
            text += f"; affected queues: {shown}{more}"
        return text + "; run `clmq store check` for a report, `clmq store repair` to cut the log there"

    def with_queues(self, queues: list[tuple[str, int, int, int]]) -> LogDamageError:
        """The same damage, naming the queues it affects."""
        return LogDamageError(self.file, self.start, self.end, self.reason, queues)


class StoreFailedError(StoreError):
    """A background thread of the store failed (``where``, ``cause``). After an fsync
    error the page cache cannot be trusted, so the store takes no more writes; reopening
    it (a restart) recovers from what is on disk."""

    def __init__(self, where: str, cause: BaseException) -> None:
        self.where = where
        self.cause = cause
        super().__init__(f"store failed in {where}: {type(cause).__name__}: {cause}; restart the broker to recover")


class MetadataError(StoreError):
    """A metadata file and its previous generation are both missing or damaged."""

"""clmq's exception hierarchy, rooted here because every package builds on this one.

Expected outcomes (a full segment, an oversized message, an offset that fell out of
retention, an unknown topic) are *results* with a status, not exceptions. Exceptions
are for the unexpected (damaged bytes, broken invariants, an unreachable server) and
for input a codec cannot take. Every one of them is a :class:`ClmqError`::

    ClmqError
    ├── StoreError               storage: the CommitLog, consume queues, the store
    │   ├── CorruptRecordError   bytes on disk that are not a valid record (file, offset,
    │   │                        check, expected, actual)
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
    """Base class of the errors of talking to a server (see ``protocol.transport``)."""


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

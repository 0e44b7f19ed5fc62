"""The exceptions of the Kafka codec and framing.

Decoding raises only :class:`KafkaDecodeError` (bytes that are not the protocol) and
:class:`KafkaFrameTooLarge`; both are :class:`clmq.common.ProtocolError`, after which
the connection is closed. Encoding raises :class:`KafkaEncodeError` (also a ValueError),
naming the field path, e.g. ``topics[0].partitions[2].index: expected int32, got 'x'``.
"""

from __future__ import annotations

from clmq.common import InvalidInputError, ProtocolError


def join_path(segment: str, path: str) -> str:
    """``topics`` + ``[0].name`` → ``topics[0].name``; ``topics`` + ``name`` → ``topics.name``."""
    if not path:
        return segment
    if not segment:
        return path
    return segment + path if path.startswith("[") else f"{segment}.{path}"


class KafkaProtocolError(ProtocolError):
    """Base class of the Kafka stream errors: the connection must be closed."""


class KafkaDecodeError(KafkaProtocolError):
    """Truncated or malformed Kafka bytes: where (field path, byte offset) and why.

    When the frame's header was readable, the framing layer sets ``api_key``,
    ``api_version`` and ``correlation_id`` (else they are None).
    """

    def __init__(self, reason: str, offset: int, path: str = "") -> None:
        self.reason = reason
        self.offset = offset
        self.path = path
        self.api_key: int | None = None
        self.api_version: int | None = None
        self.correlation_id: int | None = None
        super().__init__(f"{path or '<body>'}: {reason} (at byte {offset})")

    def within(self, segment: str) -> KafkaDecodeError:
        """The same error, its path prefixed by ``segment`` (a field name or ``[i]``)."""
        return KafkaDecodeError(self.reason, self.offset, join_path(segment, self.path))


class KafkaFrameTooLarge(KafkaProtocolError):
    """A frame's 4-byte size is over ``max_frame_bytes``: raised before its body is buffered."""

    def __init__(self, size: int, max_frame_bytes: int) -> None:
        self.size = size
        self.max_frame_bytes = max_frame_bytes
        super().__init__(f"Kafka frame of {size} bytes is over the limit of {max_frame_bytes} bytes")


class KafkaUnsupportedVersion(KafkaProtocolError):
    """The codec has no schema for this API key or version."""

    def __init__(self, api_key: int, api_version: int) -> None:
        self.api_key = api_key
        self.api_version = api_version
        super().__init__(f"unsupported Kafka API key {api_key} version {api_version}")


class KafkaEncodeError(InvalidInputError):
    """A value the schema cannot take (None where not nullable, wrong type, out of range)."""

    def __init__(self, reason: str, path: str = "") -> None:
        self.reason = reason
        self.path = path
        super().__init__(f"{path or '<body>'}: {reason}")

    def within(self, segment: str) -> KafkaEncodeError:
        """The same error, its path prefixed by ``segment``."""
        return KafkaEncodeError(self.reason, join_path(segment, self.path))

"""clmq's Kafka wire protocol, sans-IO: message schemas, a codec for their bodies, framing.

Pure codecs and state machines with no socket and no event loop (the model is h11): a
listener feeds :class:`KafkaRequestReader` the bytes it reads and writes the bytes
:func:`encode_response` returns.

- Bodies are plain Python values: a struct is a ``dict`` keyed by snake_case field names
  (``topic_name``, ``partition_index``), arrays are lists, strings ``str``, bytes and
  records ``bytes``, uuids :class:`uuid.UUID`, nulls ``None``
  (:func:`decode_request_body`, :func:`encode_response_body`, :func:`codec`).
- The schemas are generated from Apache Kafka's JSON message definitions by
  ``scripts/gen_kafka_schemas.py`` into ``_schemas``; each (API, version) is compiled
  into straight-line code on first use.
- Decoding raises only :class:`KafkaDecodeError` and :class:`KafkaFrameTooLarge`
  (both :class:`clmq.common.ProtocolError`); encoding raises :class:`KafkaEncodeError`.
"""

from ._apis import SUPPORTED_VERSIONS, ApiKey, ErrorCode, api_name
from ._codec import (
    MessageCodec,
    codec,
    decode_request_body,
    decode_response_body,
    encode_request_body,
    encode_response_body,
    is_flexible,
)
from ._errors import (
    KafkaDecodeError,
    KafkaEncodeError,
    KafkaFrameTooLarge,
    KafkaProtocolError,
    KafkaUnsupportedVersion,
)
from ._frames import (
    DEFAULT_MAX_FRAME_BYTES,
    NEED_DATA,
    KafkaRequest,
    KafkaRequestReader,
    KafkaResponse,
    KafkaResponseReader,
    NeedData,
    UnsupportedRequest,
    api_versions_keys,
    decode_request_frame,
    encode_api_versions_unsupported,
    encode_request,
    encode_response,
    response_header_version,
)
from ._records import (
    Compression,
    KafkaRecord,
    RecordBatch,
    RecordsError,
    batch_header_info,
    build_batch,
    parse_batches,
)

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "NEED_DATA",
    "SUPPORTED_VERSIONS",
    "ApiKey",
    "Compression",
    "ErrorCode",
    "KafkaDecodeError",
    "KafkaEncodeError",
    "KafkaFrameTooLarge",
    "KafkaProtocolError",
    "KafkaRecord",
    "KafkaRequest",
    "KafkaRequestReader",
    "KafkaResponse",
    "KafkaResponseReader",
    "KafkaUnsupportedVersion",
    "MessageCodec",
    "NeedData",
    "RecordBatch",
    "RecordsError",
    "UnsupportedRequest",
    "api_name",
    "api_versions_keys",
    "batch_header_info",
    "build_batch",
    "codec",
    "decode_request_body",
    "decode_request_frame",
    "decode_response_body",
    "encode_api_versions_unsupported",
    "encode_request",
    "encode_request_body",
    "encode_response",
    "encode_response_body",
    "is_flexible",
    "parse_batches",
    "response_header_version",
]

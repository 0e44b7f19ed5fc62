"""clmq's wire protocol, sans-IO: frames, request and error codes, message batches,
and the typed rows of multi-queue requests.

Pure codecs and state machines, with no socket and no trio: adapters feed them bytes
from their streams (the model is h11). The trio adapter every service and client
shares is the sub-package :mod:`clmq.protocol.transport`; nothing here imports it.
"""

from clmq.common import ProtocolError

from ._batch import BatchError, decode_batch, decode_records, encode_batch, set_queue_id
from ._codes import (
    DEFAULT_MAX_RECONSUME_TIMES,
    MAX_I64,
    MAX_QUEUE_ID,
    MAX_RECONSUME_TIMES,
    REQUEST_FIELDS,
    ErrorCode,
    RequestCode,
    request_error,
)
from ._frame import (
    DEFAULT_MAX_FRAME_BYTES,
    FLAG_ONEWAY,
    FLAG_RESPONSE,
    NEED_DATA,
    PROTOCOL_VERSION,
    SUPPORTED_VERSIONS,
    Frame,
    FrameDecoder,
    FrameRejected,
    check_request,
    encode_frame,
    encode_frame_prefix,
    response_to,
)
from ._rows import FetchAsk, FetchResult, PullStatus, RowError

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "DEFAULT_MAX_RECONSUME_TIMES",
    "FLAG_ONEWAY",
    "FLAG_RESPONSE",
    "MAX_I64",
    "MAX_QUEUE_ID",
    "MAX_RECONSUME_TIMES",
    "NEED_DATA",
    "PROTOCOL_VERSION",
    "REQUEST_FIELDS",
    "SUPPORTED_VERSIONS",
    "BatchError",
    "ErrorCode",
    "FetchAsk",
    "FetchResult",
    "Frame",
    "FrameDecoder",
    "FrameRejected",
    "ProtocolError",
    "PullStatus",
    "RequestCode",
    "RowError",
    "check_request",
    "decode_batch",
    "decode_records",
    "encode_batch",
    "encode_frame",
    "encode_frame_prefix",
    "request_error",
    "response_to",
    "set_queue_id",
]

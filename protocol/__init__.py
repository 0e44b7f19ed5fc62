"""clmq's wire protocol, sans-IO: frames, request and error codes, message batches.

Pure codecs and state machines, with no socket and no trio: adapters in the broker,
name server and clients feed them bytes from their streams (the model is h11).
"""

from ._batch import BatchError, decode_batch, decode_records, encode_batch, set_queue_id
from ._codes import ErrorCode, RequestCode
from ._frame import (
    DEFAULT_MAX_FRAME_BYTES,
    FLAG_ONEWAY,
    FLAG_RESPONSE,
    NEED_DATA,
    PROTOCOL_VERSION,
    Frame,
    FrameDecoder,
    FrameRejected,
    ProtocolError,
    encode_frame,
    encode_frame_prefix,
    response_to,
)  # fmt: skip

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "FLAG_ONEWAY",
    "FLAG_RESPONSE",
    "NEED_DATA",
    "PROTOCOL_VERSION",
    "BatchError",
    "ErrorCode",
    "Frame",
    "FrameDecoder",
    "FrameRejected",
    "ProtocolError",
    "RequestCode",
    "decode_batch",
    "decode_records",
    "encode_batch",
    "encode_frame",
    "encode_frame_prefix",
    "response_to",
    "set_queue_id",
]  # fmt: skip

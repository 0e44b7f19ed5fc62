"""The plain door's one transaction check: a message sent to a user topic may not carry
``TRAN_HALF`` (the mark of a committed half's copy, which a rebuild reads as a commit).
Cheap on the hot path: a batch's properties are decoded only if its bytes hold the
mark at all."""

from __future__ import annotations

import struct

from clmq.common import PROP_TRAN_HALF, PackError, decode_properties, packed_heads
from clmq.protocol import ErrorCode
from clmq.protocol.transport import RequestError

_MARK = PROP_TRAN_HALF.encode()


def refuse_tran_half(body: bytes) -> None:
    """Refuse (INVALID_MESSAGE naming the message) a plain SEND_MESSAGE batch whose
    messages carry ``TRAN_HALF``; a batch that cannot be read is left to the store,
    whose own checks refuse it as before."""
    if _MARK not in body:
        return
    try:
        heads = packed_heads(body)
    except PackError:
        return
    for i, (_qid, _tags, raw) in enumerate(heads):
        try:
            props = decode_properties(raw)
        except (ValueError, struct.error, UnicodeDecodeError):
            continue  # the store refuses it
        if PROP_TRAN_HALF in props:
            raise RequestError(
                ErrorCode.INVALID_MESSAGE,
                f"message {i}: {PROP_TRAN_HALF} is set by the broker on a committed transactional message only",
            )

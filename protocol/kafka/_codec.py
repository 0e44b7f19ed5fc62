"""Kafka message bodies ↔ plain Python values, for any version of the APIs clmq speaks.

A struct is a ``dict`` keyed by snake_case field names, an array a ``list``, a string a
``str``, bytes and records ``bytes``, a uuid a :class:`uuid.UUID`, null ``None``.
Decoding fills the fields of that version (tagged ones absent from the bytes take their
defaults); encoding ignores keys the version lacks and gives missing ones their defaults.

Each (API, version, request/response) is compiled once, on first use (``_decoders``,
``_encoders``); a failure of the fast path is explained by the careful walk (``_walk``).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ._compile import Decoder, Encoder
from ._decoders import compile_decoder
from ._encoders import compile_encoder
from ._errors import KafkaDecodeError, KafkaUnsupportedVersion
from ._primitives import Buffer
from ._schema import REQUEST_HEADER, RESPONSE_HEADER, Field, Message, in_range, message
from ._walk import diagnose_decode, diagnose_encode


@dataclass(frozen=True, slots=True)
class MessageCodec:
    """The compiled codec of one message schema at one version."""

    name: str
    version: int
    flexible: bool
    fields: tuple[Field, ...]
    decoder: Decoder
    encoder: Encoder

    def decode(self, data: Buffer, offset: int = 0) -> dict[str, Any]:
        """The body in ``data[offset:]``, which it must fill exactly (trailing bytes are an error)."""
        try:
            body, end = self.decoder(data, offset)
            if end == len(data):
                return body
        except Exception:  # the fast path says nothing; the walk says where and why
            pass
        diagnose_decode(data, offset, self.fields, self.version, self.flexible)
        raise KafkaDecodeError("the compiled decoder failed where the careful walk did not", offset)

    def decode_prefix(self, data: Buffer, offset: int = 0) -> tuple[dict[str, Any], int]:
        """A struct at ``data[offset:]`` followed by more bytes (a header): (value, next offset)."""
        try:
            return self.decoder(data, offset)
        except Exception:
            pass
        diagnose_decode(data, offset, self.fields, self.version, self.flexible, whole=False)
        raise KafkaDecodeError("the compiled decoder failed where the careful walk did not", offset)

    def encode_into(self, body: Mapping[str, Any], out: bytearray) -> None:
        """Append the encoded body to ``out``; KafkaEncodeError (nothing appended) if a value does not fit."""
        mark = len(out)
        try:
            self.encoder(body, out)
        except Exception as e:
            del out[mark:]
            raise diagnose_encode(body, self.fields, self.version, e) from None

    def encode(self, body: Mapping[str, Any]) -> bytes:
        """The encoded body."""
        out = bytearray()
        self.encode_into(body, out)
        return bytes(out)


def _compile(schema: Message, version: int) -> MessageCodec:
    flexible = schema.flexible(version)
    return MessageCodec(
        schema.name,
        version,
        flexible,
        schema.fields,
        compile_decoder(schema.fields, version, flexible),
        compile_encoder(schema.fields, version, flexible),
    )


_CODECS: dict[tuple[int, int, bool], MessageCodec] = {}


def codec(api_key: int, api_version: int, response: bool = False) -> MessageCodec:
    """The codec of a request (or response) body; KafkaUnsupportedVersion if there is no such schema."""
    key = (api_key, api_version, response)
    found = _CODECS.get(key)
    if found is not None:
        return found
    try:
        schema = message(api_key, response)
    except KeyError:
        raise KafkaUnsupportedVersion(api_key, api_version) from None
    if not in_range(schema.valid_versions, api_version):
        raise KafkaUnsupportedVersion(api_key, api_version)
    found = _CODECS[key] = _compile(schema, api_version)
    return found


@functools.cache
def request_header_codec(header_version: int) -> MessageCodec:
    """The request header codec (v1: client id; v2: and tagged fields)."""
    return _compile(REQUEST_HEADER, header_version)


@functools.cache
def response_header_codec(header_version: int) -> MessageCodec:
    """The response header codec (v0: correlation id; v1: and tagged fields)."""
    return _compile(RESPONSE_HEADER, header_version)


def is_flexible(api_key: int, api_version: int, response: bool = False) -> bool:
    """Whether this version of the API's request (response) uses the flexible (compact, tagged) encoding."""
    return message(api_key, response).flexible(api_version)


def decode_request_body(api_key: int, api_version: int, data: Buffer, offset: int = 0) -> dict[str, Any]:
    """A request body (the bytes after the request header)."""
    return codec(api_key, api_version).decode(data, offset)


def decode_response_body(api_key: int, api_version: int, data: Buffer, offset: int = 0) -> dict[str, Any]:
    """A response body (the bytes after the response header)."""
    return codec(api_key, api_version, True).decode(data, offset)


def encode_request_body(api_key: int, api_version: int, body: Mapping[str, Any]) -> bytes:
    """A request body's bytes."""
    return codec(api_key, api_version).encode(body)


def encode_response_body(api_key: int, api_version: int, body: Mapping[str, Any]) -> bytes:
    """A response body's bytes."""
    return codec(api_key, api_version, True).encode(body)

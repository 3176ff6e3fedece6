"""Serialization: msgpack (msgspec) for values, requests and replies. Nothing here ever unpickles."""

from __future__ import annotations

from typing import Any

import msgspec

from charon.errors import SerializationError
from charon.messages import Reply, Request

_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder()
_req_dec = msgspec.msgpack.Decoder(Request)
_rep_dec = msgspec.msgpack.Decoder(Reply)


def encode(value: Any) -> bytes:
    """Encode a value as msgpack; raises SerializationError for values msgpack cannot carry."""
    try:
        return _enc.encode(value)
    except (TypeError, OverflowError, UnicodeEncodeError, msgspec.EncodeError) as exc:
        raise SerializationError(f"value of type {type(value).__name__} is not serializable: {exc}") from None


def decode(data: bytes) -> Any:
    """Decode msgpack bytes; raises SerializationError on malformed input."""
    try:
        return _dec.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise SerializationError(f"malformed msgpack payload: {exc}") from None


def encode_request(req: Request) -> bytes:
    return _enc.encode(req)


def decode_request(data: bytes) -> Request:
    return _req_dec.decode(data)


def encode_reply(rep: Reply) -> bytes:
    return _enc.encode(rep)


def decode_reply(data: bytes) -> Reply:
    return _rep_dec.decode(data)

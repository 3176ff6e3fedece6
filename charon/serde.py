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
    except (TypeError, OverflowError, UnicodeEncodeError, RecursionError, msgspec.EncodeError) as exc:
        raise SerializationError(f"value of type {type(value).__name__} is not serializable: {exc}") from None


def decode(data: bytes) -> Any:
    """Decode msgpack bytes; raises SerializationError on malformed input."""
    try:
        return _dec.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError) as exc:
        raise SerializationError(f"malformed msgpack payload: {exc}") from None


_PLAIN_SCALARS = (str, int, float, bool, bytes, type(None))
_SCALARS = frozenset(_PLAIN_SCALARS)


def check_value(value: Any) -> None:
    """Raise SerializationError unless ``value`` belongs to the value model (it round-trips faithfully).

    The value model: None, bool, int (64-bit), float, str, bytes, lists (and tuples, which come back as
    lists), and dicts whose keys are str or int, nested. Exact types only: sets, frozensets, datetimes,
    dates, Decimals, UUIDs, enums, dataclasses, bytearrays, str/int subclasses and other objects are refused
    (msgpack would silently turn them into something else: a list, a timestamp, a string, a dict).
    Called after a successful encode, so the value has no cycles; scalars return at the first test.
    """
    if type(value) in _SCALARS:
        return
    scalars = _SCALARS
    stack = [value]
    while stack:
        v = stack.pop()
        t = type(v)
        if t is list or t is tuple:
            for x in v:
                if type(x) not in scalars:
                    stack.append(x)
        elif t is dict:
            for k, x in v.items():
                if type(k) is not str and type(k) is not int:
                    raise SerializationError(
                        f"map keys must be str or int, got {type(k).__name__} (the value model: see README)")
                if type(x) not in scalars:
                    stack.append(x)
        elif t not in scalars:
            raise SerializationError(_unfaithful(t))


def _unfaithful(t: type) -> str:
    hint = {"set": "a list (e.g. sorted(s))", "frozenset": "a list (e.g. sorted(s))",
            "datetime": "a number or an ISO string (ctx.now() is seconds since the epoch)",
            "date": "an ISO string", "Decimal": "a str or int", "UUID": "a str", "bytearray": "bytes"}.get(
        t.__name__, "plain data (dicts, lists, str, int, float, bool, bytes, None)")
    return (f"values of type {t.__name__} are not part of the value model and would not come back as they were "
            f"stored; convert it to {hint}")


def encode_value(value: Any) -> bytes:
    """Encode a user value (state, argument, return value, event): :func:`encode`, then :func:`check_value`."""
    try:
        data = _enc.encode(value)
    except (TypeError, OverflowError, UnicodeEncodeError, RecursionError, msgspec.EncodeError) as exc:
        raise SerializationError(f"value of type {type(value).__name__} is not serializable: {exc}") from None
    if type(value) not in _SCALARS:
        check_value(value)
    return data


def check_plain(value: Any, max_depth: int) -> None:
    """Raise SerializationError unless ``value`` is plain JSON/msgpack data nested at most ``max_depth`` deep.

    Plain: None, bool, int, float, str, bytes, lists, and dicts with str or int keys (no msgpack extension
    types, no timestamps). Iterative, so any depth is checked without recursion.
    """
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        t = type(v)
        if t in _PLAIN_SCALARS:
            continue
        if depth >= max_depth:
            raise SerializationError(f"value nested deeper than {max_depth} levels")
        if t is list:
            stack.extend((x, depth + 1) for x in v)
        elif t is dict:
            for k, x in v.items():
                if type(k) not in (str, int):
                    raise SerializationError(f"map keys must be strings or integers, got {type(k).__name__}")
                stack.append((x, depth + 1))
        else:
            raise SerializationError(f"unsupported value type {t.__name__} (only plain JSON/msgpack data)")


def encode_request(req: Request) -> bytes:
    return _enc.encode(req)


def decode_request(data: bytes) -> Request:
    return _req_dec.decode(data)


def encode_reply(rep: Reply) -> bytes:
    return _enc.encode(rep)


def decode_reply(data: bytes) -> Reply:
    return _rep_dec.decode(data)

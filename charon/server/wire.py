"""What every route shares on the wire: media types, the typed errors and their HTTP statuses, body decoding,
response encoding, and :func:`guard`, which turns a route's typed error into its JSON (or msgpack) answer.

Every error answer has the shape ``{"error": {"type", "message"}}`` with the status :data:`STATUS_OF_ERROR`
gives its type; bodies are decoded with msgspec (nothing is ever unpickled).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from starlette.requests import Request as HTTPRequest
from starlette.responses import Response

from charon.errors import EngineUnavailable

__all__ = [
    "MSGPACK",
    "MSGPACK_TYPES",
    "STATUS_OF_ERROR",
    "IDEMPOTENCY_KEY",
    "RESERVED_ID_PREFIX",
    "RETRY_AFTER_S",
    "HTTPError",
    "json_encoder",
    "parse_args",
    "parse_body",
    "parse_fields",
    "encode_answer",
    "error_answer",
    "respond",
    "guard",
]

MSGPACK = "application/msgpack"
#: HTTP status of each typed error the gateway answers with (the body names the type).
STATUS_OF_ERROR: dict[str, int] = {
    "BadRequest": 400,
    "ReservedRequestId": 400,
    "SerializationError": 400,
    "Unauthorized": 401,
    "InvalidKey": 400,
    "NotFound": 404,
    "UnknownOperator": 404,
    "UnknownFunction": 404,
    "RequestTimeout": 408,
    "PayloadTooLarge": 413,
    "UnsupportedMediaType": 415,
    "BadArguments": 422,
    "IdempotencyConflict": 422,
    "Unavailable": 503,
    "LogUnavailable": 503,
    "StreamReadersFull": 503,
    "BacklogFull": 503,
    # the admin routes' (charon.server.admin)
    "EpochNotRetained": 410,
    "NotSupported": 501,
    "Forbidden": 403,
    "SQLRejected": 422,
    "SQLSyntaxError": 400,
    "SQLTimeout": 422,
    "StateTooLarge": 413,
    "SQLBusy": 429,
    "SQLTooExpensive": 422,
    "SQLResultTooLarge": 413,
    "RescaleRunning": 409,
    "RescaleTimeout": 503,
    "Paused": 409,
    "NotParked": 409,
    # the promise and schedule routes' (charon.server.promises, charon.server.schedules)
    "UnknownPromise": 404,
    "UnknownSchedule": 404,
    "ScheduleExists": 409,
    "UnknownWorkflow": 404,  # the workflow routes' (charon.server.workflows)
    "WorkflowExists": 409,
    "NotMigratable": 409,
    "VersionInUse": 409,  # a code update that would drop a version with workflows in flight (charon.server.admin)
    "RateLimited": 429,  # admission (charon.core.admission): with Retry-After
    "Overloaded": 429,
}
MSGPACK_TYPES = (MSGPACK, "application/x-msgpack", "application/vnd.msgpack")
#: what a client-chosen request id (the ``Idempotency-Key``, an admin update's ``id``) may be
IDEMPOTENCY_KEY = re.compile(r"^[A-Za-z0-9._~:@+=-]{1,200}$")
#: request ids the runtimes use for their own input-log records; clients may not take them
RESERVED_ID_PREFIX = "__charon"
#: seconds a 503 (starting, recovering, failed to take a request) asks the client to wait before retrying
RETRY_AFTER_S = 2
json_encoder = msgspec.json.Encoder()
_json_dec = msgspec.json.Decoder()
_mp_enc = msgspec.msgpack.Encoder()
_mp_dec = msgspec.msgpack.Decoder()


class HTTPError(Exception):
    """A typed refusal: answered as ``{"error": {"type": error_type, "message"}}`` with ``status`` (by default
    :data:`STATUS_OF_ERROR`'s for the type)."""

    def __init__(self, error_type: str, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.error_type = error_type
        self.message = message
        self.status = status if status is not None else STATUS_OF_ERROR.get(error_type, 400)


def parse_args(request: HTTPRequest, body: bytes, field: str = "args") -> list[Any]:
    """The list in the body's ``field`` (an empty body without a type: no arguments); typed 4xx otherwise."""
    return parse_body(request.headers.get("content-type"), body, field)


def parse_body(raw_ctype: str | None, body: bytes, field: str = "args") -> list[Any]:
    """:func:`parse_args` given the request's ``Content-Type`` header (None: none)."""
    if raw_ctype is None and not body:
        return []  # `POST` with no body at all: no arguments
    doc = parse_fields(raw_ctype, body, {field}, f'body must be an object {{"{field}": [...]}}')
    args = doc.get(field, [])
    if not isinstance(args, list):
        raise HTTPError("BadArguments", f'"{field}" must be a list')
    return args  # plain data: checked by validate (every route's one validator)


def parse_fields(raw_ctype: str | None, body: bytes, fields: set[str], shape: str = "body must be an object"
                 ) -> dict[str, Any]:
    """A JSON or msgpack body's object, with no field but ``fields`` (an empty JSON body: ``{}``); typed 4xx
    otherwise."""
    ctype = (raw_ctype or "").split(";")[0].strip().lower()
    try:
        if ctype in MSGPACK_TYPES:
            doc = _mp_dec.decode(body)
        elif ctype in ("application/json", "text/json") or (ctype.startswith("application/") and
                                                             ctype.endswith("+json")):
            if not body.strip():
                return {}
            doc = _json_dec.decode(body)
        else:
            raise HTTPError(
                "UnsupportedMediaType",
                f"Content-Type must be application/json or {MSGPACK}, got {raw_ctype or 'none'!r}",
            )
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
        raise HTTPError("BadRequest", f"malformed body: {exc}") from None
    except RecursionError:
        raise HTTPError("BadRequest", "malformed body: nested too deeply") from None
    if not isinstance(doc, dict):
        raise HTTPError("BadRequest", shape)
    extra = set(doc) - fields
    if extra:
        raise HTTPError("BadRequest", f"unexpected body fields: {sorted(map(str, extra))}")
    return doc


def encode_answer(accept: str | None, status: int, body: Any) -> tuple[int, bytes, str]:
    """``(status, data, media type)`` of an answer: ``body`` as msgpack if ``accept`` (the request's ``Accept``
    header) names it, else JSON; 500 if it cannot be encoded."""
    mp = accept is not None and MSGPACK in accept
    try:
        data = _mp_enc.encode(body) if mp else json_encoder.encode(body)
    except (TypeError, ValueError, RecursionError, msgspec.EncodeError) as exc:  # a stored value it cannot show
        status, mp = 500, False
        data = json_encoder.encode({"error": {"type": "SerializationError", "message": f"cannot encode: {exc}"}})
    return status, data, MSGPACK if mp else "application/json"


def respond(
    request: HTTPRequest, status: int, body: Any, headers: dict[str, str] | None = None
) -> Response:
    """``body`` encoded as msgpack if the request accepts it, else JSON (500 if it cannot be encoded)."""
    status, data, media = encode_answer(request.headers.get("accept"), status, body)
    return Response(data, status, headers=headers, media_type=media)


def error_answer(exc: Exception) -> tuple[int, dict[str, Any], dict[str, str] | None] | None:
    """``(status, body, headers)`` of a route's typed refusal (:class:`HTTPError`, or a runtime that cannot serve
    now: :class:`charon.errors.EngineUnavailable`, 503 with ``Retry-After``); None for any other exception."""
    if isinstance(exc, EngineUnavailable):  # the runtime cannot serve (recovering, failed): retry later
        return 503, {"error": {"type": "Unavailable", "message": str(exc)}}, {"Retry-After": str(RETRY_AFTER_S)}
    if isinstance(exc, HTTPError):
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        if exc.status in (408, 413):
            headers = {"Connection": "close"}
        if exc.status in (429, 503):
            headers = {"Retry-After": str(RETRY_AFTER_S)}
        return exc.status, {"error": {"type": exc.error_type, "message": exc.message}}, headers
    return None


def guard(fn: Callable[[HTTPRequest], Awaitable[Response]]) -> Callable[[HTTPRequest], Awaitable[Response]]:
    """The route ``fn`` answering its typed errors (:func:`error_answer`)."""

    async def endpoint(request: HTTPRequest) -> Response:
        try:
            return await fn(request)
        except (EngineUnavailable, HTTPError) as exc:
            answer = error_answer(exc)
            assert answer is not None  # both are typed refusals
            return respond(request, answer[0], answer[1], answer[2])

    endpoint.__name__ = fn.__name__
    endpoint.__doc__ = fn.__doc__
    return endpoint

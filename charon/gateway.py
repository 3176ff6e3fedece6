"""HTTP gateway: the ASGI front door of a Charon runtime (starlette, served by uvicorn).

Routes (every body is JSON unless the request says ``Content-Type: application/msgpack``; every response
is JSON unless the request says ``Accept: application/msgpack``):

- ``POST /invoke/{operator}/{key}/{function}`` with body ``{"args": [...]}`` runs one transaction.
  200 ``{"request_id", "tid", "epoch", "value", "status": "committed"}`` when it committed;
  409 ``{"error": {"type", "message"}, "request_id", "tid", "epoch", "status": "aborted"}`` when a function
  in its call graph raised (nothing was applied). The ``Idempotency-Key`` header becomes the request id:
  a retried request executes once and every retry gets the first reply. ``?mode=async`` answers at once
  with 202 ``{"request_id", "status_url"}``. A synchronous call still unanswered after ``wait_timeout``
  seconds also turns into that 202 (the transaction keeps running).
- ``GET /requests/{request_id}[?wait=SECONDS]`` polls: the reply (200 or 409 as above), 202
  ``{"status": "pending"}``, or 404 when neither this gateway nor the runtime knows the id. ``wait``
  long-polls up to that many seconds (at most 30) while the request is in flight here.
- ``GET /state/{operator}/{key}`` returns ``{"operator", "key", "value"}`` (an admin read).
- ``GET /health`` (open) and ``GET /openapi.json`` (open): the OpenAPI 3.1 description of these routes,
  including one ``/invoke`` path per function of the application with its parameter names and types.

Everything is checked *before* anything reaches the runtime (and so its input log): the bearer token
(401; ``Authorization: Bearer <token>`` on every route but ``/health`` and ``/openapi.json`` when a token
is configured), the body size (413, from ``Content-Length`` and again while streaming), the body syntax
(400), the operator and function names (404) and the arguments' arity and types (422, through
``Application.validate``). Keys may contain ``/`` (the last path segment is the function). Bodies are
decoded with msgspec (JSON or msgpack); nothing is ever unpickled.

Decisions: a reused ``Idempotency-Key`` returns the first reply even if the payload differs (the key
*is* the request's identity, as in the runtime); requests without one get a fresh uuid4 hex id. The
gateway keeps in-flight transactions in a map so concurrent duplicates share one submission, and a bounded
cache of recent replies so polling works even where the runtime's own reply lookup is slow.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import inspect
import re
import socket
import threading
import time
import typing
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import msgspec
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request as HTTPRequest
from starlette.responses import Response
from starlette.routing import Route

from charon import serde
from charon.errors import (
    BadArguments,
    CharonError,
    PayloadTooLarge,
    SerializationError,
    UnknownFunction,
    UnknownOperator,
)
from charon.messages import Reply

__all__ = ["RuntimeLike", "create_app", "serve", "BackgroundServer", "describe_app", "STATUS_OF_ERROR"]

MSGPACK = "application/msgpack"
#: HTTP status of each typed error the gateway answers with (the body names the type).
STATUS_OF_ERROR: dict[str, int] = {
    "BadRequest": 400,
    "SerializationError": 400,
    "Unauthorized": 401,
    "NotFound": 404,
    "UnknownOperator": 404,
    "UnknownFunction": 404,
    "PayloadTooLarge": 413,
    "BadArguments": 422,
    "Unavailable": 503,
}
_IDEMPOTENCY_KEY = re.compile(r"^[\x21-\x7e]{1,200}$")
_json_enc = msgspec.json.Encoder()
_json_dec = msgspec.json.Decoder()
_mp_enc = msgspec.msgpack.Encoder()
_mp_dec = msgspec.msgpack.Decoder()


class RuntimeLike(Protocol):
    """What the gateway needs from a runtime (the in-process and the Spark runtime both provide it)."""

    app: Any

    async def submit(
        self, operator: str, key: str, function: str, args: list, *, request_id: str | None = None
    ) -> Reply: ...

    def get_reply(self, request_id: str) -> Reply | None: ...

    def read_state(self, operator: str, key: str) -> Any: ...


class _HTTPError(Exception):
    def __init__(self, error_type: str, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.error_type = error_type
        self.message = message
        self.status = status if status is not None else STATUS_OF_ERROR.get(error_type, 400)


# --------------------------------------------------------------------------------------------------
# Application introspection (for the OpenAPI document)


def _operators(app: Any) -> list[Any]:
    ops = getattr(app, "operators", None)
    if ops is None:
        return []
    if isinstance(ops, dict):
        return list(ops.values())
    return list(ops)


def _op_name(op: Any) -> str:
    return op if isinstance(op, str) else str(getattr(op, "name", op))


def _functions(op: Any) -> dict[str, Callable[..., Any]]:
    fns = getattr(op, "functions", None)
    if fns is None:
        return {}
    if isinstance(fns, dict):
        return {str(k): v for k, v in fns.items()}
    return {getattr(f, "__name__", str(f)): f for f in fns}


def _callable_of(fn: Any) -> Callable[..., Any] | None:
    for attr in ("body", "fn", "func", "__wrapped__"):
        inner = getattr(fn, attr, None)
        if callable(inner):
            return inner
    return fn if callable(fn) else None


_TYPE_SCHEMAS: dict[Any, dict[str, Any]] = {
    int: {"type": "integer"},
    float: {"type": "number"},
    str: {"type": "string"},
    bool: {"type": "boolean"},
    bytes: {"type": "string", "contentEncoding": "base64"},
    type(None): {"type": "null"},
    list: {"type": "array"},
    dict: {"type": "object"},
    Any: {},
}


def _schema_of(tp: Any) -> dict[str, Any]:
    if tp in _TYPE_SCHEMAS:
        return dict(_TYPE_SCHEMAS[tp])
    origin = typing.get_origin(tp)
    targs = typing.get_args(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return {"anyOf": [_schema_of(a) for a in targs]}
    if origin in (list, tuple, set, frozenset):
        s: dict[str, Any] = {"type": "array"}
        if targs and origin is list:
            s["items"] = _schema_of(targs[0])
        return s
    if origin is dict:
        s = {"type": "object"}
        if len(targs) == 2:
            s["additionalProperties"] = _schema_of(targs[1])
        return s
    return {}


def describe_app(app: Any) -> dict[str, dict[str, list[tuple[str, dict[str, Any]]]]]:
    """``{operator: {function: [(parameter name, JSON schema), ...]}}`` for the application's functions.

    The first parameter (the ``Context``) is left out.
    """
    out: dict[str, dict[str, list[tuple[str, dict[str, Any]]]]] = {}
    for op in _operators(app):
        fns: dict[str, list[tuple[str, dict[str, Any]]]] = {}
        for name, fn in _functions(op).items():
            target = _callable_of(fn)
            params: list[tuple[str, dict[str, Any]]] = []
            if target is not None:
                try:
                    sig = inspect.signature(target)
                    hints = typing.get_type_hints(target)
                except (TypeError, ValueError, NameError):
                    sig, hints = None, {}
                if sig is not None:
                    for i, p in enumerate(sig.parameters.values()):
                        if i == 0:
                            continue  # ctx
                        params.append((p.name, _schema_of(hints.get(p.name, Any))))
            fns[name] = params
        out[_op_name(op)] = fns
    return out


_ERROR_SCHEMA = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
            "required": ["type", "message"],
        },
        "request_id": {"type": "string"},
        "tid": {"type": "integer"},
        "epoch": {"type": "integer"},
    },
    "required": ["error"],
}


def _openapi(app: Any, secured: bool) -> dict[str, Any]:
    def err(desc: str) -> dict[str, Any]:
        return {
            "description": desc,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
        }

    reply_ok = {
        "description": "the transaction committed",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Reply"}}},
    }
    accepted = {
        "description": "accepted (async mode, or still running after the gateway's wait timeout)",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Accepted"}}},
    }
    security = [{"bearer": []}] if secured else []

    def invoke_op(summary: str, args_schema: dict[str, Any], params: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "post": {
                "summary": summary,
                "security": security,
                "parameters": params
                + [
                    {"name": "mode", "in": "query", "schema": {"type": "string", "enum": ["sync", "async"]}},
                    {
                        "name": "Idempotency-Key",
                        "in": "header",
                        "schema": {"type": "string", "maxLength": 200},
                    },
                ],
                "requestBody": {
                    "required": False,
                    "content": {
                        ctype: {
                            "schema": {
                                "type": "object",
                                "properties": {"args": args_schema},
                            }
                        }
                        for ctype in ("application/json", MSGPACK)
                    },
                },
                "responses": {
                    "200": reply_ok,
                    "202": accepted,
                    "400": err("malformed body"),
                    "401": err("missing or wrong bearer token"),
                    "404": err("unknown operator or function"),
                    "409": err("the transaction aborted: a function raised (error.type is its class name)"),
                    "413": err("body larger than the gateway's limit"),
                    "422": err("wrong number or types of arguments"),
                    "503": err("the runtime could not take the request; retry with the same Idempotency-Key"),
                },
            }
        }

    def path_param(name: str, desc: str) -> dict[str, Any]:
        return {
            "name": name,
            "in": "path",
            "required": True,
            "schema": {"type": "string"},
            "description": desc,
        }

    paths: dict[str, Any] = {
        "/invoke/{operator}/{key}/{function}": invoke_op(
            "Invoke a function of an entity as one transaction",
            {"type": "array"},
            [
                path_param("operator", "operator name"),
                path_param("key", "entity key"),
                path_param("function", "function name"),
            ],
        )
    }
    operators: dict[str, Any] = {}
    for op, fns in describe_app(app).items():
        operators[op] = {"functions": {}}
        for fn, params in fns.items():
            operators[op]["functions"][fn] = {"parameters": [{"name": n, "schema": s} for n, s in params]}
            args_schema = {
                "type": "array",
                "prefixItems": [dict(s, title=n) for n, s in params],
                "minItems": len(params),
                "maxItems": len(params),
                "description": "positional arguments: " + ", ".join(n for n, _ in params),
            }
            item = invoke_op(
                f"{op}.{fn}({', '.join(n for n, _ in params)})",
                args_schema,
                [path_param("key", "entity key")],
            )
            item["post"]["x-charon-parameters"] = [n for n, _ in params]
            paths[f"/invoke/{op}/{{key}}/{fn}"] = item
    paths["/requests/{request_id}"] = {
        "get": {
            "summary": "Poll the reply of a request",
            "security": security,
            "parameters": [
                path_param("request_id", "request id (the Idempotency-Key)"),
                {"name": "wait", "in": "query", "schema": {"type": "number", "maximum": 30}},
            ],
            "responses": {
                "200": reply_ok,
                "202": {"description": "still pending"},
                "401": err("missing or wrong bearer token"),
                "404": err("unknown request id"),
                "409": err("the transaction aborted"),
            },
        }
    }
    paths["/state/{operator}/{key}"] = {
        "get": {
            "summary": "Read an entity's committed state (admin)",
            "security": security,
            "parameters": [path_param("operator", "operator name"), path_param("key", "entity key")],
            "responses": {
                "200": {"description": "the entity's value"},
                "401": err("missing or wrong bearer token"),
                "404": err("unknown operator"),
            },
        }
    }
    paths["/health"] = {"get": {"summary": "Liveness", "responses": {"200": {"description": "ok"}}}}
    paths["/openapi.json"] = {
        "get": {"summary": "This document", "responses": {"200": {"description": "ok"}}}
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": f"Charon gateway: {getattr(app, 'name', 'app')}", "version": "1"},
        "paths": paths,
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "Error": _ERROR_SCHEMA,
                "Reply": {
                    "type": "object",
                    "properties": {
                        "request_id": {"type": "string"},
                        "tid": {"type": "integer"},
                        "epoch": {"type": "integer"},
                        "value": {},
                        "status": {"type": "string", "enum": ["committed"]},
                    },
                    "required": ["request_id", "tid", "epoch", "value"],
                },
                "Accepted": {
                    "type": "object",
                    "properties": {"request_id": {"type": "string"}, "status_url": {"type": "string"}},
                },
            },
        },
        "x-charon-operators": operators,
    }


# --------------------------------------------------------------------------------------------------
# The gateway


class _Gateway:
    def __init__(
        self, runtime: RuntimeLike, token: str | None, max_body: int, wait_timeout: float, recent: int
    ) -> None:
        self.runtime = runtime
        self.token = token.encode() if token else None
        self.max_body = max_body
        self.wait_timeout = wait_timeout
        self.inflight: dict[str, asyncio.Future[Reply]] = {}
        self.recent: OrderedDict[str, Reply] = OrderedDict()
        self.recent_max = recent
        self.known_ops = set(describe_app(runtime.app))
        self._openapi: bytes | None = None

    # ---- helpers

    def check_auth(self, request: HTTPRequest) -> None:
        if self.token is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not given:
            raise _HTTPError("Unauthorized", "missing bearer token")
        if not hmac.compare_digest(given.strip().encode(), self.token):
            raise _HTTPError("Unauthorized", "wrong bearer token")

    async def read_body(self, request: HTTPRequest) -> bytes:
        cl = request.headers.get("content-length")
        if cl is not None:
            try:
                n = int(cl)
            except ValueError:
                raise _HTTPError("BadRequest", "invalid Content-Length") from None
            if n > self.max_body:
                raise _HTTPError("PayloadTooLarge", f"body of {n} bytes exceeds the limit of {self.max_body}")
        chunks: list[bytes] = []
        total = 0
        async for chunk in request.stream():
            total += len(chunk)
            if total > self.max_body:
                raise _HTTPError("PayloadTooLarge", f"body exceeds the limit of {self.max_body} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    def parse_args(self, request: HTTPRequest, body: bytes) -> list[Any]:
        if not body.strip():
            return []
        ctype = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
        try:
            if ctype in (MSGPACK, "application/x-msgpack", "application/vnd.msgpack"):
                doc = _mp_dec.decode(body)
            elif ctype in ("application/json", "", "text/json", "text/plain") or ctype.endswith("+json"):
                doc = _json_dec.decode(body)
            elif ctype == "application/x-www-form-urlencoded" and body.lstrip()[:1] in (b"{", b"["):
                doc = _json_dec.decode(body)  # `curl -d '{"args": ...}'` without a Content-Type header
            else:
                raise _HTTPError("BadRequest", f"unsupported content type {ctype!r}", 415)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise _HTTPError("BadRequest", f"malformed body: {exc}") from None
        if not isinstance(doc, dict):
            raise _HTTPError("BadRequest", 'body must be an object {"args": [...]}')
        extra = set(doc) - {"args"}
        if extra:
            raise _HTTPError("BadRequest", f"unexpected body fields: {sorted(map(str, extra))}")
        args = doc.get("args", [])
        if not isinstance(args, list):
            raise _HTTPError("BadArguments", '"args" must be a list of positional arguments')
        return args

    def validate(self, operator: str, function: str, args: list[Any]) -> None:
        try:
            self.runtime.app.validate(operator, function, args)
        except (UnknownOperator, UnknownFunction, BadArguments, PayloadTooLarge, SerializationError) as exc:
            raise _HTTPError(type(exc).__name__, str(exc) or type(exc).__name__) from None

    def request_id(self, request: HTTPRequest) -> str:
        rid = request.headers.get("idempotency-key")
        if rid is None:
            return uuid.uuid4().hex
        if not _IDEMPOTENCY_KEY.match(rid):
            raise _HTTPError("BadRequest", "Idempotency-Key must be 1-200 printable ASCII characters")
        return rid

    def start(
        self, rid: str, operator: str, key: str, function: str, args: list[Any]
    ) -> asyncio.Future[Reply]:
        fut = self.inflight.get(rid)
        if fut is not None:
            return fut
        loop = asyncio.get_running_loop()
        rep = self.recent.get(rid)
        if rep is not None:
            done: asyncio.Future[Reply] = loop.create_future()
            done.set_result(rep)
            return done
        task = asyncio.ensure_future(self.runtime.submit(operator, key, function, args, request_id=rid))
        self.inflight[rid] = task
        task.add_done_callback(lambda t: self._finished(rid, t))
        return task

    def _finished(self, rid: str, task: asyncio.Future[Reply]) -> None:
        if self.inflight.get(rid) is task:
            del self.inflight[rid]
        if task.cancelled() or task.exception() is not None:
            return
        self.recent[rid] = task.result()
        self.recent.move_to_end(rid)
        while len(self.recent) > self.recent_max:
            self.recent.popitem(last=False)

    def lookup(self, rid: str) -> Reply | None:
        rep = self.recent.get(rid)
        if rep is None:
            rep = self.runtime.get_reply(rid)
        return rep

    # ---- responses

    @staticmethod
    def respond(
        request: HTTPRequest, status: int, body: Any, headers: dict[str, str] | None = None
    ) -> Response:
        if MSGPACK in request.headers.get("accept", ""):
            return Response(_mp_enc.encode(body), status, headers=headers, media_type=MSGPACK)
        return Response(_json_enc.encode(body), status, headers=headers, media_type="application/json")

    def reply_response(self, request: HTTPRequest, rep: Reply) -> Response:
        if rep.ok:
            try:
                value = serde.decode(rep.value) if rep.value else None
            except SerializationError as exc:
                raise _HTTPError("SerializationError", str(exc), 500) from None
            body = {
                "request_id": rep.request_id,
                "tid": rep.tid,
                "epoch": rep.epoch,
                "value": value,
                "status": "committed",
            }
            return self.respond(request, 200, body)
        body = {
            "error": {"type": rep.error_type, "message": rep.error_message},
            "request_id": rep.request_id,
            "tid": rep.tid,
            "epoch": rep.epoch,
            "status": "aborted",
        }
        return self.respond(request, 409, body)

    def accepted(self, request: HTTPRequest, rid: str) -> Response:
        url = str(request.url_for("request_status", request_id=rid))
        return self.respond(
            request, 202, {"request_id": rid, "status_url": url, "status": "pending"}, {"Location": url}
        )

    # ---- endpoints

    async def invoke(self, request: HTTPRequest) -> Response:
        self.check_auth(request)
        operator = request.path_params["operator"]
        key = request.path_params["key"]
        function = request.path_params["function"]
        mode = request.query_params.get("mode", "sync")
        if mode not in ("sync", "async"):
            raise _HTTPError("BadRequest", "mode must be 'sync' or 'async'")
        if not key:
            raise _HTTPError("BadRequest", "empty key")
        rid = self.request_id(request)
        body = await self.read_body(request)
        args = self.parse_args(request, body)
        self.validate(operator, function, args)
        fut = self.start(rid, operator, key, function, args)
        if mode == "async":
            return self.accepted(request, rid)
        return await self.await_reply(request, rid, fut, self.wait_timeout)

    async def await_reply(
        self, request: HTTPRequest, rid: str, fut: asyncio.Future[Reply], timeout: float
    ) -> Response:
        if not fut.done():
            await asyncio.wait({fut}, timeout=timeout)
        if not fut.done():
            return self.accepted(request, rid)
        exc = fut.exception()
        if exc is not None:
            if isinstance(exc, CharonError) and type(exc).__name__ in STATUS_OF_ERROR:
                raise _HTTPError(type(exc).__name__, str(exc))
            raise _HTTPError(
                "Unavailable", f"the runtime failed to take the request: {type(exc).__name__}: {exc}"
            )
        return self.reply_response(request, fut.result())

    async def request_status(self, request: HTTPRequest) -> Response:
        self.check_auth(request)
        rid = request.path_params["request_id"]
        fut = self.inflight.get(rid)
        if fut is not None:
            try:
                wait = min(max(float(request.query_params.get("wait", 0)), 0.0), 30.0)
            except ValueError:
                raise _HTTPError("BadRequest", "wait must be a number of seconds") from None
            return await self.await_reply(request, rid, fut, wait)
        rep = self.lookup(rid)
        if rep is None:
            raise _HTTPError("NotFound", f"unknown request id {rid!r}")
        return self.reply_response(request, rep)

    async def state(self, request: HTTPRequest) -> Response:
        self.check_auth(request)
        operator = request.path_params["operator"]
        key = request.path_params["key"]
        if self.known_ops and operator not in self.known_ops:
            raise _HTTPError("UnknownOperator", f"unknown operator {operator!r}")
        value = self.runtime.read_state(operator, key)
        if inspect.isawaitable(value):
            value = await value
        return self.respond(request, 200, {"operator": operator, "key": key, "value": value})

    async def health(self, request: HTTPRequest) -> Response:
        return self.respond(request, 200, {"status": "ok", "inflight": len(self.inflight)})

    async def openapi(self, request: HTTPRequest) -> Response:
        if self._openapi is None:
            self._openapi = _json_enc.encode(_openapi(self.runtime.app, self.token is not None))
        return Response(self._openapi, media_type="application/json")


def _guard(
    gw: _Gateway, fn: Callable[[HTTPRequest], Awaitable[Response]]
) -> Callable[[HTTPRequest], Awaitable[Response]]:
    async def endpoint(request: HTTPRequest) -> Response:
        try:
            return await fn(request)
        except _HTTPError as exc:
            headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
            if exc.status == 413:
                headers = {"Connection": "close"}
            return gw.respond(
                request, exc.status, {"error": {"type": exc.error_type, "message": exc.message}}, headers
            )

    endpoint.__name__ = fn.__name__
    endpoint.__doc__ = fn.__doc__
    return endpoint


async def _call_lifecycle(method: Callable[[], Any]) -> None:
    """Await an async start/stop; run a blocking one (the Spark runtime's) in a thread."""
    if inspect.iscoroutinefunction(method):
        await method()
    else:
        await asyncio.to_thread(method)


def create_app(
    runtime: RuntimeLike,
    *,
    token: str | None,
    max_body: int = 1 << 20,
    wait_timeout: float = 25.0,
    manage_runtime: bool = False,
    recent_replies: int = 100_000,
) -> Starlette:
    """Build the gateway's ASGI app over ``runtime``.

    ``token``: the bearer token required on every route but ``/health`` and ``/openapi.json`` (``None``
    disables authentication: development only). ``max_body``: the largest request body in bytes.
    ``wait_timeout``: how long a synchronous invoke waits before answering 202 with a status URL.
    ``manage_runtime``: start and stop the runtime with the app's lifespan (the runtime then lives on the
    server's event loop, which is what the in-process runtime needs).
    """
    gw = _Gateway(runtime, token, max_body, wait_timeout, recent_replies)

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        if manage_runtime:
            await _call_lifecycle(runtime.start)  # type: ignore[attr-defined]
        try:
            yield
        finally:
            pending = list(gw.inflight.values())
            if pending:
                await asyncio.wait(pending, timeout=5.0)
            if manage_runtime:
                await _call_lifecycle(runtime.stop)  # type: ignore[attr-defined]

    routes = [
        Route(
            "/invoke/{operator}/{key:path}/{function}", _guard(gw, gw.invoke), methods=["POST"], name="invoke"
        ),
        Route(
            "/requests/{request_id}", _guard(gw, gw.request_status), methods=["GET"], name="request_status"
        ),
        Route("/state/{operator}/{key:path}", _guard(gw, gw.state), methods=["GET"], name="state"),
        Route("/health", _guard(gw, gw.health), methods=["GET"], name="health"),
        Route("/openapi.json", gw.openapi, methods=["GET"], name="openapi"),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.gateway = gw
    app.state.runtime = runtime
    return app


def serve(
    runtime: RuntimeLike,
    host: str = "127.0.0.1",
    port: int = 8000,
    token: str | None = None,
    *,
    max_body: int = 1 << 20,
    log_level: str = "warning",
    recent_replies: int = 100_000,
) -> None:
    """Run the gateway with uvicorn until interrupted; the runtime is started and stopped with it."""
    app = create_app(runtime, token=token, max_body=max_body, manage_runtime=True, recent_replies=recent_replies)
    uvicorn.run(app, host=host, port=port, log_level=log_level, lifespan="on", access_log=False)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class BackgroundServer:
    """The gateway served by uvicorn on a background thread (its own event loop); for tests and the demo.

    The runtime is started on that loop (``manage_runtime``). Use :meth:`call` to run a coroutine on it.
    """

    def __init__(
        self,
        runtime: RuntimeLike,
        *,
        token: str | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        max_body: int = 1 << 20,
        wait_timeout: float = 25.0,
    ) -> None:
        self.runtime = runtime
        self.host = host
        self.port = port or free_port(host)
        self.app = create_app(
            runtime, token=token, max_body=max_body, wait_timeout=wait_timeout, manage_runtime=True
        )
        config = uvicorn.Config(
            self.app, host=host, port=self.port, log_level="warning", lifespan="on", access_log=False
        )
        self.server = uvicorn.Server(config)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self.loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self.server.serve())
        except BaseException as exc:  # noqa: BLE001 - reported by start()
            self._error = exc
        finally:
            loop.close()

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self._thread = threading.Thread(target=self._run, name="charon-gateway", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if self._error is not None or not self._thread.is_alive():
                raise RuntimeError(f"gateway failed to start: {self._error!r}")
            if time.monotonic() > deadline:
                raise TimeoutError("gateway did not start in time")
            time.sleep(0.01)
        return self

    def call(self, coro: Awaitable[Any], timeout: float | None = 60.0) -> Any:
        """Run a coroutine on the server's loop (where the runtime lives) and return its result."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)  # type: ignore[arg-type]

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

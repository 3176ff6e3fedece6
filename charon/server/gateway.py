"""HTTP gateway: the ASGI front door of a Charon runtime (starlette, served by uvicorn).

Routes (bodies of mutating routes must be ``application/json`` or ``application/msgpack``, 415 otherwise; an
empty body without a type means no arguments; every response is JSON unless the request says
``Accept: application/msgpack``):

- ``POST /invoke/{operator}/{key}/{function}`` with body ``{"args": [...]}`` runs one transaction.
  200 ``{"request_id", "tid", "epoch", "position", "value", "status": "committed"}`` when it committed;
  409 ``{"error": {"type", "message"}, "request_id", "tid", "epoch", "position", "status": "aborted"}`` when
  a function in its call graph raised (nothing was applied). Replies ordered by (epoch, position) form a
  serial order equivalent to the execution. With the in-process runtime both also carry ``"code_version"``,
  the application version the transaction ran (code updates, :mod:`charon.server.admin`). The ``Idempotency-Key``
  header becomes the request id:
  a retried request executes once and every retry gets the first reply. ``?mode=async`` answers at once
  with 202 ``{"request_id", "status_url"}``. A synchronous call still unanswered after ``wait_timeout``
  seconds also turns into that 202 (the transaction keeps running).
- ``GET /requests/{request_id}[?wait=SECONDS]`` polls: the reply (200 or 409 as above), 202
  ``{"status": "pending"}`` (also for a request in the runtime's input log that this gateway never saw,
  e.g. after a restart), or 404 when nobody knows the id. ``wait`` long-polls up to that many seconds (at
  most 30) while the request is in flight here.
- ``GET /state/{operator}/{key}`` returns ``{"operator", "key", "value"}`` (an admin read).
- ``GET /timers/{operator}/{key}`` returns ``{"operator", "key", "timers": [{"id", "due", "operator", "key",
  "function", "args"}, ...]}``: the entity's pending timers (an admin read, see :mod:`charon.core.timers`).
- ``POST /batch`` with body ``{"calls": [[operator, key, function, [args...]], ...]}`` (1..``max_batch_calls``)
  runs a client atomic batch: one transaction whose root calls each invocation in order (each sees the
  writes of those before it), so all commit or none; 200 with ``value`` = the list of the calls' values,
  409 when any call raised. Every call is validated first (typed 4xx naming the call). The
  ``Idempotency-Key`` is the batch id: it runs once; reused with other calls it gets 422.
- ``GET /streams/{stream}?from_offset=N&limit=M&wait=S`` reads an output stream (``ctx.emit``): 200
  ``{"stream", "events": [{"offset", "epoch", "value"}], "next_offset", "first_offset", "end_offset"}``
  with whole atoms (at most ``limit``, capped by ``stream_max_events``, events, except that a larger first
  atom is returned whole); long-polls up to ``wait`` seconds (at most 30) when nothing is there yet. With
  ``Accept: text/event-stream`` it answers with server-sent events instead (``id`` = the offset after the
  event, ``data`` = the JSON event; resumable with ``Last-Event-ID``), for at most ``stream_sse_seconds``.
- Admin, metrics and dashboard routes (``/admin/status``, ``/admin/pause``, ``/admin/resume``,
  ``/admin/state/{operator}``, ``/admin/summary``, ``/metrics``, ``/dashboard``): :mod:`charon.server.admin`.
- ``GET /health`` (open): 200 while the runtime serves, else 503 with its ``status`` (``starting`` while a
  runtime started in the background comes up, ``recovering``, ``failed``, ``stopped``). While starting, state
  reads answer 503 with ``Retry-After`` and invokes are accepted into the runtime's durable input log.
- ``GET /openapi.json`` (open): the OpenAPI 3.1 description of these routes,
  including one ``/invoke`` path per function of the application with its parameter names and types.

Everything is checked *before* anything reaches the runtime (and so its input log): the bearer token
(401), the body size (413, from ``Content-Length`` and again while streaming) and arrival time (408), the
content type (415), the body syntax and plainness (400: malformed, non-UTF-8 strings, msgpack extension
types, nesting deeper than ``max_depth``), the URL path (400 unless it percent-decodes to valid UTF-8), the
key (400 ``InvalidKey``, by :func:`charon.core.routing.check_key`), the operator and function names (404) and the
arguments' arity and types (422, through ``Application.validate``). Keys may contain ``/`` (the last path
segment is the function) and any other character ``check_key`` accepts, line breaks included (percent-encoded):
every valid key is addressable by every route. Bodies are decoded with msgspec; nothing is ever unpickled.

Idempotency: a reused ``Idempotency-Key`` with the same operator, key, function and arguments gets the
first reply; with anything else it is refused with 422 ``IdempotencyConflict`` (checked against the
gateway's in-flight and recent requests and the runtime's input log, :func:`check_same_request`). Request
ids are 1-200 characters of ``A-Z a-z 0-9 . _ ~ : @ + = -``; requests without one get a uuid4 hex id.
Status URLs are relative, or under ``public_url``; never built from the ``Host`` header.

Limits (:class:`charon.config.GatewayConfig`): retained replies are bounded by count and bytes, requests in
flight (accepted, not answered: e.g. the backlog while paused) by ``max_inflight_bytes`` (503 ``BacklogFull`` with
``Retry-After`` beyond), waiting stream readers by ``stream_max_waiters`` (503 ``StreamReadersFull``), runtime
reads run in a small thread pool (never on the event loop), and the uvicorn protocol closes connections
that do not deliver a request head within ``header_timeout`` and caps open connections at
``max_connections`` by shedding the one that has waited longest for its head.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import inspect
import os
import re
import socket
import sys
import threading
import time
import typing
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol
from urllib.parse import quote, unquote_to_bytes

import msgspec
import uvicorn
from starlette.applications import Starlette
from starlette.convertors import PathConvertor, register_url_convertor
from starlette.requests import Request as HTTPRequest
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

from charon import serde
from charon.config import GatewayConfig
from charon.core.routing import check_key, check_stream
from charon.errors import (
    BadArguments,
    CharonError,
    EngineUnavailable,
    IdempotencyConflict,
    InvalidKey,
    PayloadTooLarge,
    SerializationError,
    UnknownFunction,
    UnknownOperator,
)
from charon.log.client import check_same_request, stored_request
from charon.messages import Reply, Request
from charon.operator import BATCH_FUNCTION, BATCH_OPERATOR, batch_request, check_batch

__all__ = ["RuntimeLike", "create_app", "serve", "BackgroundServer", "describe_app", "STATUS_OF_ERROR"]

MSGPACK = "application/msgpack"
#: HTTP status of each typed error the gateway answers with (the body names the type).
STATUS_OF_ERROR: dict[str, int] = {
    "BadRequest": 400,
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
}
MSGPACK_TYPES = (MSGPACK, "application/x-msgpack", "application/vnd.msgpack")
_IDEMPOTENCY_KEY = re.compile(r"^[A-Za-z0-9._~:@+=-]{1,200}$")
#: request ids the runtimes use for their own input-log records; clients may not take them
RESERVED_ID_PREFIX = "__charon"
#: how often the gateway's one stream watcher looks for atoms appended by another process while readers wait (the
#: runtime's own appends wake them at once); a log that cannot notify is polled every _STREAM_POLL_S
_STREAM_FOREIGN_POLL_S = 1.0
_STREAM_POLL_S = 0.05
#: seconds a 503 (starting, recovering, failed to take a request) asks the client to wait before retrying
RETRY_AFTER_S = 2
_json_enc = msgspec.json.Encoder()
_json_dec = msgspec.json.Decoder()
_mp_enc = msgspec.msgpack.Encoder()
_mp_dec = msgspec.msgpack.Decoder()


class RuntimeLike(Protocol):
    """What the gateway needs from a runtime (the in-process and the Spark runtime both provide it).

    Optional: an ``input_log`` attribute (:class:`charon.log.sqlite.InputLog`). With it, a request id reused for
    another operation is refused from the log (not only from the gateway's memory), and a request in the log
    without a reply polls as 202 pending (e.g. after a gateway restart) instead of 404.

    Optional control methods (:mod:`charon.server.admin`; a route answers 501 ``NotSupported`` without
    them): ``pause(after_epoch)``, ``resume()``, ``control_status()``, ``inspect(operator, keys, epoch,
    limit)``, ``run_alone(...)``, ``update_code(ref, version, migration)``, ``version_at(epoch)``, and the
    ``epoch_stats`` list the metrics read.
    """

    app: Any

    async def submit(
        self, operator: str, key: str, function: str, args: list, *, request_id: str | None = None
    ) -> Reply: ...

    def get_reply(self, request_id: str) -> Reply | None: ...

    def read_state(self, operator: str, key: str) -> Any: ...


def _enqueuer(runtime: Any) -> Callable[[Request], asyncio.Future[Reply]] | None:
    """A runtime's ``enqueue(request) -> Future[Reply]`` (the in-process runtime's), if its ``submit`` is the
    one defined beside it (a subclass that overrides ``submit`` keeps getting every request through it)."""
    cls = type(runtime)
    enqueue, submit = getattr(cls, "enqueue", None), getattr(cls, "submit", None)
    if enqueue is None or submit is None:
        return None
    if getattr(cls, "health", None) is None:
        return None
    if enqueue.__qualname__.rsplit(".", 1)[0] != submit.__qualname__.rsplit(".", 1)[0]:
        return None
    return runtime.enqueue


class _KeyConvertor(PathConvertor):
    """A key path segment: any characters, ``/`` and line breaks included (starlette's ``path`` is ``.*``, which
    does not match a newline): every key :func:`charon.core.routing.check_key` accepts is addressable by URL."""

    regex = r"[\s\S]*"


register_url_convertor("charonkey", _KeyConvertor())


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


_POSITION_SCHEMA = {
    "type": ["integer", "null"],
    "description": "place in the epoch's serial order: replies ordered by (epoch, position) form a serial "
    "order equivalent to the execution (increasing, not consecutive; null only for replies recorded before "
    "positions existed)",
}

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
        "position": _POSITION_SCHEMA,
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
    security: list[dict[str, list[str]]] = [{"bearer": []}] if secured else []

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
                        "schema": {"type": "string", "pattern": _IDEMPOTENCY_KEY.pattern},
                    },
                ],
                "requestBody": {
                    "required": True,
                    "content": {
                        ctype: {
                            "schema": {
                                "type": "object",
                                "properties": {"args": args_schema},
                                "required": ["args"],
                                "additionalProperties": False,
                            }
                        }
                        for ctype in ("application/json", MSGPACK)
                    },
                },
                "responses": {
                    "200": reply_ok,
                    "202": accepted,
                    "400": err("malformed body, invalid key (InvalidKey) or invalid Idempotency-Key"),
                    "401": err("missing or wrong bearer token"),
                    "404": err("unknown operator or function"),
                    "408": err("the body did not arrive in time"),
                    "409": err("the transaction aborted: a function raised (error.type is its class name)"),
                    "413": err("body larger than the gateway's limit"),
                    "415": err("the body is neither application/json nor application/msgpack"),
                    "422": err("wrong arguments (BadArguments), or an Idempotency-Key reused for another "
                               "operation (IdempotencyConflict)"),
                    "503": err("the runtime could not take the request; retry with the same Idempotency-Key"),
                },
            }
        }

    def path_param(name: str, desc: str) -> dict[str, Any]:
        return {
            "name": name,
            "in": "path",
            "required": True,
            "schema": {"type": "string", "minLength": 1},
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
            args_schema: dict[str, Any] = {
                "type": "array",
                "minItems": len(params),
                "maxItems": len(params),
                "description": "positional arguments: " + (", ".join(n for n, _ in params) or "none"),
            }
            if params:
                args_schema["prefixItems"] = [dict(s, title=n) for n, s in params]
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
                "202": accepted,
                "400": err("bad wait parameter"),
                "401": err("missing or wrong bearer token"),
                "404": err("unknown request id"),
                "409": err("the transaction aborted"),
                "422": err("the request id was reused for another operation"),
                "503": err("the runtime could not take the request; retry with the same Idempotency-Key"),
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
                "400": err("invalid key"),
                "401": err("missing or wrong bearer token"),
                "404": err("unknown operator"),
            },
        }
    }
    paths["/batch"] = {
        "post": {
            "summary": "Run a client atomic batch: the calls in order, as one transaction (all or none)",
            "security": security,
            "parameters": [{"name": "Idempotency-Key", "in": "header", "schema": {"type": "string"},
                            "description": "the batch id"}],
            "requestBody": {"required": True, "content": {ct: {"schema": {
                "type": "object", "required": ["calls"], "properties": {"calls": {
                    "type": "array", "minItems": 1,
                    "items": {"type": "array", "minItems": 4, "maxItems": 4,
                              "description": "[operator, key, function, [args...]]"}}}}}
                for ct in ("application/json", MSGPACK)}},
            "responses": {
                "200": reply_ok,
                "202": accepted,
                "400": err("malformed body or invalid key"),
                "401": err("missing or wrong bearer token"),
                "404": err("unknown operator or function in a call"),
                "409": err("a call raised: the whole batch aborted"),
                "422": err("bad arguments, or the batch id was reused for other calls"),
            },
        }
    }
    paths["/streams/{stream}"] = {
        "get": {
            "summary": "Read an output stream from an offset (whole atoms; long polling or server-sent events)",
            "security": security,
            "parameters": [
                path_param("stream", "stream name"),
                {"name": "from_offset", "in": "query", "schema": {"type": "integer", "minimum": 0}},
                {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1}},
                {"name": "wait", "in": "query", "schema": {"type": "number", "minimum": 0, "maximum": 30}},
            ],
            "responses": {
                "200": {"description": "events (JSON page, or text/event-stream when accepted)"},
                "400": err("invalid stream name or parameters"),
                "401": err("missing or wrong bearer token"),
                "404": err("the runtime has no output streams"),
                "503": err("too many stream readers; retry later"),
            },
        }
    }
    paths["/timers/{operator}/{key}"] = {
        "get": {
            "summary": "List the pending timers an entity registered (admin)",
            "security": security,
            "parameters": [path_param("operator", "operator name"), path_param("key", "entity key")],
            "responses": {
                "200": {"description": "the entity's pending timers"},
                "400": err("invalid key"),
                "401": err("missing or wrong bearer token"),
                "404": err("unknown operator"),
            },
        }
    }
    paths["/health"] = {"get": {"summary": "Liveness", "responses": {
        "200": {"description": "the runtime serves"},
        "503": {"description": "the runtime does not serve (starting, recovering, failed, stopped)"},
    }}}
    paths["/openapi.json"] = {
        "get": {"summary": "This document", "responses": {"200": {"description": "ok"}}}
    }
    from charon.server.admin import openapi_paths  # imports this module

    paths.update(openapi_paths(security))
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
                        "position": _POSITION_SCHEMA,
                        "value": {},
                        "status": {"type": "string", "enum": ["committed"]},
                        "code_version": {"type": "string"},
                    },
                    "required": ["request_id", "tid", "epoch", "position", "value"],
                },
                "Accepted": {
                    "type": "object",
                    "properties": {
                        "request_id": {"type": "string"},
                        "status_url": {"type": "string"},
                        "status": {"type": "string", "enum": ["pending"]},
                    },
                },
            },
        },
        "x-charon-operators": operators,
    }


# --------------------------------------------------------------------------------------------------
# The gateway


class _StreamWatch:
    """Wakes the waiting readers of an output stream (long polls, server-sent events) when an atom is appended:
    one watcher for all of them, so an idle reader costs nothing but its connection.

    The runtime's own appends notify it at once (:meth:`charon.log.streams.StreamLog.add_listener`, called on
    the appending thread); atoms another process appends to the same file are seen by one cheap query per
    ``_STREAM_FOREIGN_POLL_S`` while anyone waits (every ``_STREAM_POLL_S`` for a log that cannot notify)."""

    def __init__(self, log: Any) -> None:
        self.log = log
        self.loop = asyncio.get_running_loop()
        self.events: dict[str, asyncio.Event] = {}  # per stream, replaced when it fires
        self.waiting = 0
        self._poller: asyncio.Task[None] | None = None
        add = getattr(log, "add_listener", None)
        self.notified = add is not None
        if add is not None:
            add(self._appended)

    def close(self) -> None:
        remove = getattr(self.log, "remove_listener", None)
        if remove is not None:
            remove(self._appended)
        if self._poller is not None:
            self._poller.cancel()

    def _appended(self, streams: frozenset[str]) -> None:  # on the appending thread
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            self.loop.call_soon_threadsafe(self._fire, streams)

    def _fire(self, streams: frozenset[str] | None) -> None:
        for name in (list(self.events) if streams is None else streams):
            ev = self.events.pop(name, None)
            if ev is not None:
                ev.set()

    def event(self, stream: str) -> asyncio.Event:
        """The event the next append to ``stream`` sets (take it *before* reading, then wait on it)."""
        ev = self.events.get(stream)
        if ev is None:
            ev = self.events[stream] = asyncio.Event()
        return ev

    async def wait(self, ev: asyncio.Event, timeout: float, also: asyncio.Future[Any] | None = None) -> None:
        """Until ``ev`` fires, ``also`` is done, or ``timeout`` passes."""
        self.waiting += 1
        if self._poller is None or self._poller.done():
            self._poller = asyncio.ensure_future(self._poll())
        waiter = asyncio.ensure_future(ev.wait())
        try:
            await asyncio.wait({waiter} if also is None else {waiter, also}, timeout=timeout,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            self.waiting -= 1

    async def _poll(self) -> None:
        """Appends by other processes: one query per interval while anyone waits (then it ends)."""
        interval = _STREAM_FOREIGN_POLL_S if self.notified else _STREAM_POLL_S
        last = await asyncio.to_thread(self.log.last_epoch) if hasattr(self.log, "last_epoch") else None
        while self.waiting:
            await asyncio.sleep(interval)
            if last is None:
                self._fire(None)
                continue
            now = await asyncio.to_thread(self.log.last_epoch)
            if now != last:
                last = now
                self._fire(None)


async def _until_disconnected(receive: Callable[[], Awaitable[Any]]) -> None:
    """Returns when the client of a request (whose body was read or is empty) disconnects."""
    while (await receive())["type"] != "http.disconnect":
        pass


class _SlotResponse(StreamingResponse):
    """A streaming response that gives back its stream-reader slot when it ends, however it ends (finished,
    client gone, or never started)."""

    def __init__(self, *args: Any, release: Callable[[], None], **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._release = release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


def _inflight_size(req: Request) -> int:
    """What an in-flight request counts toward ``max_inflight_bytes``: its arguments and a fixed overhead."""
    return 512 + len(req.args) + len(req.key)


def _reply_size(rep: Reply) -> int:
    return 128 + len(rep.request_id) + len(rep.value) + len(rep.error_type) + len(rep.error_message)


class _Gateway:
    def __init__(self, runtime: RuntimeLike, token: str | None, cfg: GatewayConfig) -> None:
        self.runtime = runtime
        self._enqueue = _enqueuer(runtime)
        self.token = token.encode() if token else None
        self.cfg = cfg
        self.max_body = cfg.max_body
        self.wait_timeout = cfg.wait_timeout
        # in-flight submissions and recent replies, each with the fingerprint of its request
        self.inflight: dict[str, asyncio.Future[Reply]] = {}
        self.inflight_req: dict[str, Request] = {}
        self.recent: OrderedDict[str, tuple[Reply, Request]] = OrderedDict()
        self.recent_size = 0
        self.inflight_bytes = 0  # of the in-flight requests (see _inflight_size), at most cfg.max_inflight_bytes
        self.known_ops = set(describe_app(runtime.app))
        self._openapi: bytes | None = None
        self._pool = ThreadPoolExecutor(cfg.read_threads, thread_name_prefix="charon-gateway-read")
        # /health has a thread of its own: reads waiting for an epoch boundary never delay it
        self._health_pool = ThreadPoolExecutor(1, thread_name_prefix="charon-gateway-health")
        self.stream_waiters = 0  # long polls and server-sent-event connections open now
        self._watch: _StreamWatch | None = None
        # a runtime started in the background (see create_app's ``background_start``): until it is up,
        # /health answers 503 starting and state reads a 503 with Retry-After; invokes go to the input log
        self.starting = False
        self.start_error: str | None = None
        self.metrics: Any = None  # charon.server.metrics.GatewayMetrics, set by create_app

    def check_ready(self) -> None:
        """503 (with Retry-After) while the runtime is starting in the background or failed to start."""
        if self.start_error is not None:
            raise _HTTPError("Unavailable", f"the runtime failed to start: {self.start_error}")
        if self.starting:
            raise _HTTPError("Unavailable", "the runtime is starting; retry shortly")

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

    async def off_loop(self, method: Callable[..., Any], *args: Any) -> Any:
        """Call a runtime method without blocking the event loop (awaited if it is a coroutine function)."""
        if inspect.iscoroutinefunction(method):
            return await method(*args)
        value = await asyncio.get_running_loop().run_in_executor(self._pool, method, *args)
        if inspect.isawaitable(value):
            value = await value
        return value

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
        try:
            async with asyncio.timeout(self.cfg.body_timeout):
                async for chunk in request.stream():
                    total += len(chunk)
                    if total > self.max_body:
                        raise _HTTPError("PayloadTooLarge", f"body exceeds the limit of {self.max_body} bytes")
                    chunks.append(chunk)
        except TimeoutError:
            raise _HTTPError("RequestTimeout", f"body not received within {self.cfg.body_timeout} s") from None
        return b"".join(chunks)

    def parse_args(self, request: HTTPRequest, body: bytes, field: str = "args") -> list[Any]:
        raw_ctype = request.headers.get("content-type")
        if raw_ctype is None and not body:
            return []  # `POST` with no body at all: no arguments
        ctype = (raw_ctype or "").split(";")[0].strip().lower()
        try:
            if ctype in MSGPACK_TYPES:
                doc = _mp_dec.decode(body)
            elif ctype in ("application/json", "text/json") or (ctype.startswith("application/") and
                                                                 ctype.endswith("+json")):
                if not body.strip():
                    return []
                doc = _json_dec.decode(body)
            else:
                raise _HTTPError(
                    "UnsupportedMediaType",
                    f"Content-Type must be application/json or {MSGPACK}, got {raw_ctype or 'none'!r}",
                )
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
            raise _HTTPError("BadRequest", f"malformed body: {exc}") from None
        except RecursionError:
            raise _HTTPError("BadRequest", "malformed body: nested too deeply") from None
        if not isinstance(doc, dict):
            raise _HTTPError("BadRequest", f'body must be an object {{"{field}": [...]}}')
        extra = set(doc) - {field}
        if extra:
            raise _HTTPError("BadRequest", f"unexpected body fields: {sorted(map(str, extra))}")
        args = doc.get(field, [])
        if not isinstance(args, list):
            raise _HTTPError("BadArguments", f'"{field}" must be a list')
        return args  # plain data: checked by validate (every route's one validator)

    def validate(self, operator: str, key: str, function: str, args: list[Any]) -> Request:
        """The request, if its names, key and arguments are valid (typed 4xx otherwise).

        The one validator of every call a client sends, whatever the route (``/invoke``, each call of a
        ``/batch``, ``/admin/update``): the arguments are plain data (400), the names exist (404), the key is
        valid (400) and the arguments fit the function (422). A call of the built-in batch operator (a batch
        nested in a batch, or sent to ``/invoke``) has each of its inner calls validated the same way, and
        every call at every level counts toward ``max_batch_calls``."""
        try:
            serde.check_plain(args, self.cfg.max_depth)
        except SerializationError as exc:
            raise _HTTPError("BadRequest", f"malformed body: {exc}") from None
        self._check_call(operator, key, function, args, [0])
        try:
            return Request("", operator, key, function, serde.encode(list(args)))
        except SerializationError as exc:  # e.g. an integer msgpack cannot carry
            raise _HTTPError("SerializationError", str(exc)) from None

    def _check_call(self, operator: str, key: str, function: str, args: list[Any], count: list[int]) -> None:
        try:
            self.runtime.app.validate(operator, function, args, key=key)
        except (UnknownOperator, UnknownFunction, BadArguments, PayloadTooLarge, SerializationError,
                InvalidKey) as exc:
            raise _HTTPError(type(exc).__name__, str(exc) or type(exc).__name__) from None
        if operator != BATCH_OPERATOR:
            return
        cap = self.cfg.max_batch_calls
        try:
            calls = check_batch(args[0], cap)
        except BadArguments as exc:
            raise _HTTPError("BadArguments", str(exc)) from None
        for i, (op, k, fn, a) in enumerate(calls):
            count[0] += 1
            if count[0] > cap:
                raise _HTTPError("BadArguments", f"a batch holds at most {cap} calls, nested batches' calls "
                                 "included (max_batch_calls)")
            try:
                self._check_call(op, k, fn, a, count)
            except _HTTPError as exc:
                raise _HTTPError(exc.error_type, f"batch call {i}: {exc.message}", exc.status) from None

    def request_id(self, request: HTTPRequest) -> str | None:
        rid = request.headers.get("idempotency-key")
        if rid is None:
            return None
        if not _IDEMPOTENCY_KEY.match(rid):
            raise _HTTPError(
                "BadRequest", "Idempotency-Key must be 1-200 characters of A-Z a-z 0-9 and . _ ~ : @ + = -"
            )
        if rid.startswith(RESERVED_ID_PREFIX):  # the runtimes' own log records (e.g. Spark's epoch ticks)
            raise _HTTPError("BadRequest", f"Idempotency-Key must not start with {RESERVED_ID_PREFIX!r} (reserved)")
        return rid

    def conflict(self, req: Request) -> None:
        """422 if a request id this gateway knows was used for another operation."""
        known = self.inflight_req.get(req.request_id)
        if known is None:
            entry = self.recent.get(req.request_id)
            known = entry[1] if entry is not None else None
        try:
            check_same_request(known, req)
        except IdempotencyConflict as exc:
            raise _HTTPError("IdempotencyConflict", str(exc)) from None

    async def check_log(self, req: Request) -> None:
        """422 if the runtime's input log holds this request id for another operation."""
        log = getattr(self.runtime, "input_log", None)
        if log is None or req.request_id in self.inflight or req.request_id in self.recent:
            return
        stored = await self.off_loop(stored_request, log, req.request_id)
        self.conflict(req)  # the caches may have learned the id meanwhile
        try:
            check_same_request(stored, req)
        except IdempotencyConflict as exc:
            raise _HTTPError("IdempotencyConflict", str(exc)) from None

    def start(self, req: Request, args: list[Any]) -> asyncio.Future[Reply]:
        rid = req.request_id
        self.conflict(req)
        fut = self.inflight.get(rid)
        if fut is not None:
            return fut
        loop = asyncio.get_running_loop()
        entry = self.recent.get(rid)
        if entry is not None:
            done: asyncio.Future[Reply] = loop.create_future()
            done.set_result(entry[0])
            return done
        size = _inflight_size(req)
        if self.inflight_bytes + size > self.cfg.max_inflight_bytes:
            raise _HTTPError("BacklogFull", f"{len(self.inflight)} requests ({self.inflight_bytes} bytes) are waiting "
                             f"for their replies (max_inflight_bytes {self.cfg.max_inflight_bytes}); retry later")
        task: asyncio.Future[Reply]
        if self._enqueue is not None and self.runtime.health()["status"] != "stopped":  # type: ignore[attr-defined]
            # the request as built here, without a task per request (a stopped runtime: submit says why)
            try:
                task = self._enqueue(Request(rid, req.operator, req.key, req.function, req.args, time.time()))
            except Exception as exc:  # noqa: BLE001 - as the task below would hold it (503 Unavailable)
                task = loop.create_future()
                task.set_exception(exc)
        else:
            task = asyncio.ensure_future(
                self.runtime.submit(req.operator, req.key, req.function, args, request_id=rid)
            )
        self.inflight[rid] = task
        self.inflight_req[rid] = req
        self.inflight_bytes += size
        t0 = time.perf_counter()
        if self.metrics is not None:
            self.metrics.observe_request(req)
        task.add_done_callback(lambda t: self._finished(rid, t, t0))
        return task

    def _finished(self, rid: str, task: asyncio.Future[Reply], t0: float = 0.0) -> None:
        if self.inflight.get(rid) is task:
            del self.inflight[rid]
            req = self.inflight_req.pop(rid)
            self.inflight_bytes -= _inflight_size(req)
        else:  # pragma: no cover - a finished task is replaced only after it finished
            return
        if task.cancelled() or task.exception() is not None:
            return
        self.remember(task.result(), req)
        if self.metrics is not None:
            self.metrics.observe_reply(task.result(), time.perf_counter() - t0)

    def remember(self, rep: Reply, req: Request) -> None:
        """Keep a reply for polls and retries, within the count and byte bounds."""
        old = self.recent.pop(rep.request_id, None)
        if old is not None:
            self.recent_size -= _reply_size(old[0])
        self.recent[rep.request_id] = (rep, req)
        self.recent_size += _reply_size(rep)
        while self.recent and (
            len(self.recent) > self.cfg.recent_replies or self.recent_size > self.cfg.recent_bytes
        ):
            _, (dropped, _) = self.recent.popitem(last=False)
            self.recent_size -= _reply_size(dropped)

    async def lookup(self, rid: str) -> Reply | None:
        entry = self.recent.get(rid)
        if entry is not None:
            return entry[0]
        return await self.off_loop(self.runtime.get_reply, rid)

    async def known_pending(self, rid: str) -> bool:
        """Whether the runtime's input log holds the request (it is pending if it has no reply)."""
        log = getattr(self.runtime, "input_log", None)
        if log is None:
            return False
        return bool(await self.off_loop(log.contains, rid))

    # ---- responses

    @staticmethod
    def respond(
        request: HTTPRequest, status: int, body: Any, headers: dict[str, str] | None = None
    ) -> Response:
        mp = MSGPACK in request.headers.get("accept", "")
        try:
            data = _mp_enc.encode(body) if mp else _json_enc.encode(body)
        except (TypeError, ValueError, RecursionError, msgspec.EncodeError) as exc:  # a stored value it cannot show
            status, mp = 500, False
            data = _json_enc.encode({"error": {"type": "SerializationError", "message": f"cannot encode: {exc}"}})
        return Response(data, status, headers=headers, media_type=MSGPACK if mp else "application/json")

    def reply_response(self, request: HTTPRequest, rep: Reply) -> Response:
        version_at = getattr(self.runtime, "version_at", None)  # code updates: the version its epoch ran
        extra = {}
        if version_at is not None and rep.epoch >= 0:
            modes = getattr(self.runtime, "code_update_modes", ())  # compatible updates: by transaction too
            extra["code_version"] = version_at(rep.epoch, rep.tid) if "compatible" in modes else version_at(rep.epoch)
        if rep.ok:
            try:
                value = serde.decode(rep.value) if rep.value else None
            except SerializationError as exc:
                raise _HTTPError("SerializationError", str(exc), 500) from None
            body = {
                "request_id": rep.request_id,
                "tid": rep.tid,
                "epoch": rep.epoch,
                "position": rep.position,
                "value": value,
                "status": "committed",
                **extra,
            }
            return self.respond(request, 200, body)
        body = {
            "error": {"type": rep.error_type, "message": rep.error_message},
            "request_id": rep.request_id,
            "tid": rep.tid,
            "epoch": rep.epoch,
            "position": rep.position,
            "status": "aborted",
            **extra,
        }
        return self.respond(request, 409, body)

    def status_url(self, request: HTTPRequest, rid: str) -> str:
        """The poll URL of a request: under the configured public URL, else relative (never the Host header)."""
        path = f"{request.scope.get('root_path', '')}/requests/{quote(rid, safe='')}"
        base = self.cfg.public_url
        return base.rstrip("/") + path if base else path

    def accepted(self, request: HTTPRequest, rid: str) -> Response:
        url = self.status_url(request, rid)
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
        given = self.request_id(request)
        body = await self.read_body(request)
        args = self.parse_args(request, body)
        req = self.validate(operator, key, function, args)
        rid = given or uuid.uuid4().hex
        req = Request(rid, req.operator, req.key, req.function, req.args)
        if self.start_error is not None:  # nothing would ever run it (while starting, the log takes it)
            self.check_ready()
        if given is not None:
            self.conflict(req)
            await self.check_log(req)
        fut = self.start(req, args)
        if mode == "async":
            return self.accepted(request, rid)
        return await self.await_reply(request, rid, fut, self.wait_timeout)

    async def batch(self, request: HTTPRequest) -> Response:
        """A client atomic batch: the calls run in order as one transaction (all commit or none)."""
        self.check_auth(request)
        mode = request.query_params.get("mode", "sync")
        if mode not in ("sync", "async"):
            raise _HTTPError("BadRequest", "mode must be 'sync' or 'async'")
        given = self.request_id(request)
        calls = self.parse_args(request, await self.read_body(request), "calls")
        rid = given or uuid.uuid4().hex
        _, function, args = BATCH_OPERATOR, BATCH_FUNCTION, [calls]
        self.validate(BATCH_OPERATOR, rid, function, args)  # every call, nested ones too (typed 4xx naming it)
        _, function, args = batch_request(calls)
        req = Request(rid, BATCH_OPERATOR, rid, function, serde.encode(args))
        if self.start_error is not None:  # as for invoke: nothing would ever run it
            self.check_ready()
        if given is not None:
            self.conflict(req)
            await self.check_log(req)
        fut = self.start(req, args)
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
        try:
            wait = min(max(float(request.query_params.get("wait", 0)), 0.0), 30.0)
        except ValueError:
            raise _HTTPError("BadRequest", "wait must be a number of seconds") from None
        if wait != wait:  # NaN
            raise _HTTPError("BadRequest", "wait must be a number of seconds")
        fut = self.inflight.get(rid)
        if fut is not None:
            return await self.await_reply(request, rid, fut, wait)
        rep = await self.lookup(rid)
        if rep is None:
            if await self.known_pending(rid):  # e.g. accepted before a gateway restart
                rep = await self.lookup(rid)  # it may have been answered in between
                if rep is None:
                    return self.accepted(request, rid)
            else:
                raise _HTTPError("NotFound", f"unknown request id {rid!r}")
        return self.reply_response(request, rep)

    async def state(self, request: HTTPRequest) -> Response:
        self.check_auth(request)
        operator = request.path_params["operator"]
        key = request.path_params["key"]
        if self.known_ops and operator not in self.known_ops:
            raise _HTTPError("UnknownOperator", f"unknown operator {operator!r}")
        try:
            check_key(key)
        except InvalidKey as exc:
            raise _HTTPError("InvalidKey", str(exc)) from None
        self.check_ready()
        value = await self.off_loop(self.runtime.read_state, operator, key)
        return self.respond(request, 200, {"operator": operator, "key": key, "value": value})

    def _stream_params(self, request: HTTPRequest) -> tuple[Any, str, int, int, float]:
        log = getattr(self.runtime, "streams", None)
        if log is None:
            raise _HTTPError("NotFound", "this runtime has no output streams")
        stream = request.path_params["stream"]
        try:
            check_stream(stream)
        except InvalidKey as exc:
            raise _HTTPError("InvalidKey", str(exc)) from None
        q = request.query_params
        try:
            start = q.get("from_offset") or request.headers.get("last-event-id") or "0"
            offset = int(start)
            limit = int(q.get("limit", self.cfg.stream_max_events))
            wait = float(q.get("wait", 0))
        except ValueError:
            raise _HTTPError("BadRequest", "from_offset and limit must be integers, wait a number") from None
        if offset < 0 or limit < 1 or not 0 <= wait <= 30:
            raise _HTTPError("BadRequest", "from_offset >= 0, limit >= 1 and 0 <= wait <= 30 are required")
        return log, stream, offset, min(limit, self.cfg.stream_max_events), wait

    def _take_waiter(self) -> Callable[[], None]:
        """One of the ``stream_max_waiters`` slots of waiting stream readers, taken at once (no await between the
        check and the taking: a burst cannot exceed the cap), else 503 ``StreamReadersFull`` with Retry-After.
        Returns the release (idempotent)."""
        cap = self.cfg.stream_max_waiters
        if self.stream_waiters >= cap:
            raise _HTTPError("StreamReadersFull", f"{cap} stream readers are waiting (stream_max_waiters); retry later")
        self.stream_waiters += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.stream_waiters -= 1

        return release

    def _watcher(self, log: Any) -> _StreamWatch:
        if self._watch is None or self._watch.log is not log:
            if self._watch is not None:
                self._watch.close()
            self._watch = _StreamWatch(log)
        return self._watch

    @staticmethod
    def _event_doc(ev: Any) -> dict[str, Any]:
        return {"offset": ev.offset, "epoch": ev.epoch, "value": serde.decode(ev.value)}

    async def stream(self, request: HTTPRequest) -> Response:
        """A page of an output stream (long polling), or server-sent events (see the module docstring)."""
        self.check_auth(request)
        log, stream, offset, limit, wait = self._stream_params(request)
        if "text/event-stream" in request.headers.get("accept", ""):
            return self._sse(log, stream, offset, limit)
        page = await self.off_loop(log.read, stream, offset, limit)
        if not page.events and wait > 0:
            release = self._take_waiter()
            gone = asyncio.ensure_future(_until_disconnected(request.receive))  # the slot goes with the client
            try:
                watch = self._watcher(log)
                deadline = time.monotonic() + wait
                while not page.events:
                    left = deadline - time.monotonic()
                    if left <= 0 or gone.done():
                        break
                    ev = watch.event(stream)
                    if await self.off_loop(log.end_offset, stream) > page.next_offset:
                        page = await self.off_loop(log.read, stream, page.next_offset, limit)
                        continue
                    await watch.wait(ev, left, gone)
            finally:
                gone.cancel()
                release()
        body = {"stream": stream, "events": [self._event_doc(e) for e in page.events],
                "next_offset": page.next_offset, "first_offset": page.first_offset, "end_offset": page.end_offset}
        return self.respond(request, 200, body)

    def _sse(self, log: Any, stream: str, offset: int, limit: int) -> Response:
        release = self._take_waiter()
        gw = self

        async def events() -> AsyncIterator[bytes]:
            nonlocal offset
            try:
                watch = gw._watcher(log)
                deadline = time.monotonic() + gw.cfg.stream_sse_seconds
                yield b": charon stream " + stream.encode() + b"\n\n"
                while time.monotonic() < deadline:
                    ev = watch.event(stream)
                    page = await gw.off_loop(log.read, stream, offset, limit)
                    for e in page.events:
                        data = _json_enc.encode(dict(gw._event_doc(e), stream=stream))
                        yield b"id: %d\nevent: %s\ndata: %s\n\n" % (e.offset + 1, stream.encode(), data)
                    offset = page.next_offset
                    if not page.events:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        await watch.wait(ev, left)  # a disconnect cancels this (starlette listens for it)
            finally:
                release()

        return _SlotResponse(events(), media_type="text/event-stream", release=release,
                             headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    async def timers(self, request: HTTPRequest) -> Response:
        """The pending timers an entity registered (an admin read)."""
        self.check_auth(request)
        operator = request.path_params["operator"]
        key = request.path_params["key"]
        if self.known_ops and operator not in self.known_ops:
            raise _HTTPError("UnknownOperator", f"unknown operator {operator!r}")
        try:
            check_key(key)
        except InvalidKey as exc:
            raise _HTTPError("InvalidKey", str(exc)) from None
        lister = getattr(self.runtime, "timers", None)
        if lister is None:
            raise _HTTPError("NotFound", "this runtime does not list timers")
        found = await self.off_loop(lister, operator, key)
        doc = [{"id": t.id, "due": t.due, "operator": t.operator, "key": t.key, "function": t.function,
                "args": serde.decode(t.args)} for t in found]
        return self.respond(request, 200, {"operator": operator, "key": key, "timers": doc})

    async def health(self, request: HTTPRequest) -> Response:
        """200 while the runtime serves; 503 with its state (status, epoch, last error...) otherwise."""
        probe = getattr(self.runtime, "health", None)
        doc: dict[str, Any] = {"status": "ok", "ok": True}
        if self.start_error is not None:
            doc = {"status": "failed", "ok": False, "last_error": self.start_error}
        elif self.starting:
            doc = {"status": "starting", "ok": False}
        elif probe is not None:
            try:
                fut = asyncio.get_running_loop().run_in_executor(self._health_pool, probe)
                doc = dict(await asyncio.wait_for(fut, HEALTH_TIMEOUT_S))
            except TimeoutError:
                doc = {"status": "unresponsive", "ok": False,
                       "last_error": f"the runtime's health check did not answer within {HEALTH_TIMEOUT_S:g} s"}
            except Exception as exc:  # noqa: BLE001 - never a 500: the truth is that it cannot tell now
                doc = {"status": "recovering", "ok": False,
                       "last_error": f"the runtime's health check failed: {type(exc).__name__}: {exc}"[:500]}
        doc["inflight"] = len(self.inflight)
        return self.respond(request, 200 if doc.get("ok", True) else 503, doc)

    async def openapi(self, request: HTTPRequest) -> Response:
        if self._openapi is None:
            self._openapi = _json_enc.encode(_openapi(self.runtime.app, self.token is not None))
        return Response(self._openapi, media_type="application/json")


HEALTH_TIMEOUT_S = 2.0  # a runtime's health() slower than this is itself the answer: 503 unresponsive


def _guard(
    gw: _Gateway, fn: Callable[[HTTPRequest], Awaitable[Response]]
) -> Callable[[HTTPRequest], Awaitable[Response]]:
    async def endpoint(request: HTTPRequest) -> Response:
        try:
            return await fn(request)
        except EngineUnavailable as exc:  # the runtime cannot serve (recovering, failed): retry later
            return gw.respond(request, 503, {"error": {"type": "Unavailable", "message": str(exc)}},
                              {"Retry-After": str(RETRY_AFTER_S)})
        except _HTTPError as exc:
            headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
            if exc.status in (408, 413):
                headers = {"Connection": "close"}
            if exc.status == 503:
                headers = {"Retry-After": str(RETRY_AFTER_S)}
            return gw.respond(
                request, exc.status, {"error": {"type": exc.error_type, "message": exc.message}}, headers
            )

    endpoint.__name__ = fn.__name__
    endpoint.__doc__ = fn.__doc__
    return endpoint


class _StrictPath:
    """ASGI middleware: the URL path is percent-decoded strictly as UTF-8 (400 otherwise).

    Servers decode ``%FF`` to U+FFFD, so ``%FF`` and ``%FE`` would name one entity; this re-decodes the raw
    path and rejects invalid UTF-8 instead of replacing it.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("raw_path") is not None:
            root = scope.get("root_path", "")
            try:
                scope = dict(scope, path=root + unquote_to_bytes(scope["raw_path"][len(root):]).decode("utf-8"))
            except UnicodeDecodeError:
                body = _json_enc.encode(
                    {"error": {"type": "InvalidKey", "message": "the URL path is not valid UTF-8"}}
                )
                await send({"type": "http.response.start", "status": 400,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


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
    max_body: int | None = None,
    wait_timeout: float | None = None,
    manage_runtime: bool = False,
    recent_replies: int | None = None,
    config: GatewayConfig | None = None,
    background_start: bool = False,
    on_start_failure: Callable[[str], None] | None = None,
) -> Any:
    """Build the gateway's ASGI app over ``runtime``.

    ``token``: the bearer token required on every route but ``/health`` and ``/openapi.json`` (``None``
    disables authentication: development only). ``config``: limits and settings (default
    :meth:`GatewayConfig.from_env`); ``max_body``, ``wait_timeout`` and ``recent_replies`` override it.
    ``manage_runtime``: start and stop the runtime with the app's lifespan (the runtime then lives on the
    server's event loop, which is what the in-process runtime needs).
    ``background_start``: a blocking ``start`` (the Spark runtime's, ~20 s) runs in a thread while the port
    is already open: until it returns, ``/health`` answers 503 ``{"status": "starting"}``, state reads 503
    with ``Retry-After``, and invokes are accepted into the runtime's durable input log (they run once the
    engine is up; a synchronous call answers 202 with its status URL after ``wait_timeout``). A failed start
    turns ``/health`` to ``{"status": "failed"}`` and calls ``on_start_failure`` with the reason.
    """
    cfg = dataclasses.replace(config) if config is not None else GatewayConfig.from_env()
    for name, value in (("max_body", max_body), ("wait_timeout", wait_timeout), ("recent_replies", recent_replies)):
        if value is not None:
            setattr(cfg, name, value)
    gw = _Gateway(runtime, token, cfg)

    async def start_in_background() -> None:
        try:
            await asyncio.to_thread(runtime.start)  # type: ignore[attr-defined]
        except Exception as exc:  # noqa: BLE001 - reported in /health and to the server
            gw.start_error = f"{type(exc).__name__}: {exc}"
            if on_start_failure is not None:
                on_start_failure(gw.start_error)
        finally:
            gw.starting = False

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        starter: asyncio.Task[None] | None = None
        if manage_runtime:
            start = runtime.start  # type: ignore[attr-defined]
            if background_start and not inspect.iscoroutinefunction(start):
                gw.starting = True
                starter = asyncio.ensure_future(start_in_background())
            else:
                await _call_lifecycle(start)
        try:
            yield
        finally:
            if starter is not None and not starter.done():
                await asyncio.wait({starter})  # a half-started runtime is stopped once its start returns
            pending = list(gw.inflight.values())
            if pending:
                await asyncio.wait(pending, timeout=5.0)
            if manage_runtime and gw.start_error is None:
                await _call_lifecycle(runtime.stop)  # type: ignore[attr-defined]
            if gw._watch is not None:
                gw._watch.close()
            gw._pool.shutdown(wait=False, cancel_futures=True)

    routes = [
        Route(
            "/invoke/{operator}/{key:charonkey}/{function}", _guard(gw, gw.invoke), methods=["POST"], name="invoke"
        ),
        Route(
            "/requests/{request_id}", _guard(gw, gw.request_status), methods=["GET"], name="request_status"
        ),
        Route("/state/{operator}/{key:charonkey}", _guard(gw, gw.state), methods=["GET"], name="state"),
        Route("/streams/{stream}", _guard(gw, gw.stream), methods=["GET"], name="stream"),
        Route("/batch", _guard(gw, gw.batch), methods=["POST"], name="batch"),
        Route("/timers/{operator}/{key:charonkey}", _guard(gw, gw.timers), methods=["GET"], name="timers"),
        Route("/health", _guard(gw, gw.health), methods=["GET"], name="health"),
        Route("/openapi.json", gw.openapi, methods=["GET"], name="openapi"),
    ]
    from charon.server.admin import admin_routes  # imports this module
    from charon.server.metrics import GatewayMetrics

    parts = getattr(runtime, "partitions", 0) or getattr(getattr(runtime, "config", None), "partitions", 1)
    gw.metrics = GatewayMetrics(runtime, int(parts), samples=cfg.metrics_samples)
    routes += admin_routes(gw, gw.metrics)
    async def http_error(request: HTTPRequest, exc: Exception) -> Response:
        # routing errors (no such route, wrong method) in the same typed JSON shape as every other error
        status = getattr(exc, "status_code", 500)
        kind = {404: "NotFound", 405: "MethodNotAllowed"}.get(status, "HTTPError")
        detail = getattr(exc, "detail", "") or kind
        return gw.respond(request, status, {"error": {"type": kind, "message": str(detail)}},
                          getattr(exc, "headers", None))

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: http_error, 405: http_error})
    app.state.gateway = gw
    app.state.runtime = runtime
    outer = _StrictPath(app)
    outer.state = app.state  # type: ignore[attr-defined]
    outer.config = cfg  # type: ignore[attr-defined]
    return outer


class _HeadGuard:
    """Slow-loris protection shared by both uvicorn protocols: a request-head timeout and a connection cap.

    A connection must deliver a complete request head within ``header_timeout`` seconds of opening (or of
    its previous response); at ``max_connections`` open connections, the one that has waited longest for
    its request head is closed to admit the new one (if none is waiting, the new one is closed).
    """

    header_timeout = 10.0
    max_connections = 1000
    connections: set[Any]
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    cycle: Any

    def _guard_open(self) -> None:
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_since = 0.0
        self._arm_head_timer()
        if len(self.connections) > self.max_connections:
            waiting = [c for c in self.connections if getattr(c, "_head_timer", None) is not None and c is not self]
            victim = min(waiting, key=lambda c: c._head_since) if waiting else self
            victim._close_idle()

    def _arm_head_timer(self) -> None:
        self._head_cycle = self.cycle
        self._head_since = self.loop.time()
        self._head_bytes = 0
        self._head_timer = self.loop.call_later(self.header_timeout, self._close_idle)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _close_idle(self) -> None:
        self._disarm_head_timer()
        if not self.transport.is_closing():
            self.transport.close()

    def _guard_response_complete(self) -> None:
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self._disarm_head_timer()
            self._arm_head_timer()


class _GuardedH11(_HeadGuard, H11Protocol):
    """uvicorn's h11 protocol with :class:`_HeadGuard` (the fallback when httptools is not installed)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._guard_open()

    def handle_events(self) -> None:
        super().handle_events()
        if self._head_timer is not None and self.cycle is not self._head_cycle:
            self._disarm_head_timer()  # a request head arrived

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._guard_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)


try:  # httptools (llhttp, in C) parses and writes HTTP/1.1 in a fraction of h11's CPU
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # pragma: no cover - depends on the environment
    HttpToolsProtocol = None  # type: ignore[assignment,misc]

if HttpToolsProtocol is not None:

    class _GuardedHttpTools(_HeadGuard, HttpToolsProtocol):
        """uvicorn's httptools protocol with :class:`_HeadGuard`, and ``max_header_bytes`` as h11's limit: a
        connection that sends more than that without completing a request head gets 400 and is closed."""

        max_header_bytes = 16 << 10

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._guard_open()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._head_timer is not None:  # still no complete head
                self._head_bytes += len(data)
                if self._head_bytes > self.max_header_bytes and not self.transport.is_closing():
                    self._disarm_head_timer()
                    self.send_400_response("Invalid HTTP request received.")

        def on_headers_complete(self) -> None:
            self._disarm_head_timer()  # a request head arrived
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._guard_response_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_head_timer()
            super().connection_lost(exc)


def uvicorn_config(app: Any, host: str, port: int, cfg: GatewayConfig, log_level: str = "warning") -> uvicorn.Config:
    """The uvicorn configuration that enforces ``cfg``'s connection limits and timeouts (httptools' protocol
    when it is installed, else h11's)."""
    limits = {"header_timeout": cfg.header_timeout, "max_connections": cfg.max_connections,
              "max_header_bytes": cfg.max_header_bytes}
    base = _GuardedH11 if HttpToolsProtocol is None else _GuardedHttpTools
    protocol = type("CharonHTTP", (base,), limits)
    return uvicorn.Config(
        app, host=host, port=port, log_level=log_level, lifespan="on", access_log=False, http=protocol,
        timeout_keep_alive=int(max(1, cfg.keep_alive)), h11_max_incomplete_event_size=cfg.max_header_bytes,
        backlog=min(2048, max(128, cfg.max_connections)),
        timeout_graceful_shutdown=10,
    )


def serve(
    runtime: RuntimeLike,
    host: str = "127.0.0.1",
    port: int = 8000,
    token: str | None = None,
    *,
    max_body: int | None = None,
    log_level: str = "warning",
    recent_replies: int | None = None,
    config: GatewayConfig | None = None,
) -> None:
    """Run the gateway with uvicorn until interrupted; the runtime is started and stopped with it.

    The port opens at once: a blocking runtime start (Spark's) runs in the background (see
    :func:`create_app`'s ``background_start``). If it fails, the server stops and :class:`RuntimeStartError`
    is raised. Settings come from ``config`` (default :meth:`GatewayConfig.from_env`); ``max_body`` and
    ``recent_replies`` override it when given.
    """
    failed: list[str] = []
    fatal: list[str] = []
    server: uvicorn.Server | None = None

    def start_failed(reason: str) -> None:
        failed.append(reason)
        if server is not None:
            server.should_exit = True

    def gave_up(reason: str) -> None:  # the runtime failed for good: stop serving, so the process exits non-zero
        fatal.append(reason)
        if server is not None:
            server.should_exit = True
        line = f"charon: the runtime failed and cannot recover: {reason}"
        # a shutdown that hangs (a runtime stop that waits on a dead engine) must not keep the process alive
        timer = threading.Timer(60.0, lambda: (print(line, file=sys.stderr, flush=True), os._exit(1)))
        timer.daemon = True
        timer.start()

    if hasattr(runtime, "on_fatal"):
        runtime.on_fatal = gave_up

    app = create_app(
        runtime, token=token, max_body=max_body, manage_runtime=True, recent_replies=recent_replies, config=config,
        background_start=True, on_start_failure=start_failed,
    )
    server = uvicorn.Server(uvicorn_config(app, host, port, app.config, log_level))
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises the SIGINT it handled
        server.run()
    if failed:
        raise RuntimeStartError(failed[0])
    if fatal:
        raise RuntimeFailed(fatal[0])


class RuntimeStartError(RuntimeError):
    """The runtime that :func:`serve` started in the background failed to start."""


class RuntimeFailed(RuntimeError):
    """The runtime :func:`serve` ran failed for good (e.g. Spark's JVM could not be restarted): the server
    stopped; a process supervisor should restart it."""


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
        max_body: int | None = None,
        wait_timeout: float | None = None,
        config: GatewayConfig | None = None,
    ) -> None:
        self.runtime = runtime
        self.host = host
        self.port = port or free_port(host)
        self.app = create_app(
            runtime, token=token, max_body=max_body, wait_timeout=wait_timeout, manage_runtime=True, config=config
        )
        self.server = uvicorn.Server(uvicorn_config(self.app, host, self.port, self.app.config))
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

"""The invocation inspector's admin routes (token-guarded like every ``/admin`` route).

- ``GET /admin/requests?status=&operator=&key=&function=&error_type=&epoch_min=&epoch_max=&since=&until=&limit=50
  &cursor=``: ``{"items": [summary...], "next": cursor | null, "retention": {"max_records", "max_bytes",
  "oldest", ...}}``, newest first. A summary is ``{"request_id", "operator", "key", "function", "status",
  "error_type", "epoch", "position", "accepted_at", "sequenced_at", "replied_at"}`` (Unix seconds); ``status`` is
  one of pending, committed, aborted, deferred, quarantined. An unknown parameter or a bad value: 400 ``BadRequest``.
- ``GET /admin/requests/{request_id}``: the summary plus ``reply`` (JSON value or null), ``error`` (``{"type",
  "message", "traceback"}`` or null), ``call_graph`` (``[{"index", "parent", "kind": "root"|"call"|"send",
  "operator", "key", "function", "outcome": "ok"|"raised"|null}]``, the root first) and ``truncated``; 404
  ``NotFound`` when the request is unknown or no longer retained.

An engine without an inspector (a remote gateway's: its functions run elsewhere) answers 501 ``NotSupported``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import msgspec
from starlette.datastructures import QueryParams
from starlette.requests import Request as HTTPRequest
from starlette.responses import Response
from starlette.routing import Route

from charon.runtime.contract import REQUEST_STATUSES, Engine, RequestLog, RequestQuery
from charon.server.auth import Principal
from charon.server.wire import HTTPError, guard, respond

__all__ = ["MAX_LIMIT", "RequestsAdmin", "parse_query"]

MAX_LIMIT = 1000  # most summaries on one page
_STR_PARAMS = ("status", "operator", "key", "function", "error_type", "cursor")
_PARAMS = frozenset(_STR_PARAMS + ("epoch_min", "epoch_max", "since", "until", "limit"))


class _Gateway(Protocol):
    engine: Engine

    def check_auth(self, request: HTTPRequest, scopes: frozenset[str] | None = None) -> Principal: ...

    async def off_loop(self, method: Callable[[RequestQuery], dict[str, object]],
                       query: RequestQuery) -> dict[str, object]: ...


def _int(name: str, raw: str, lo: int, hi: int) -> int:
    try:
        v = int(raw)
    except ValueError:
        raise HTTPError("BadRequest", f"{name} must be an integer") from None
    if not lo <= v <= hi:
        raise HTTPError("BadRequest", f"{name} must be {lo}..{hi}")
    return v


def _time(name: str, raw: str) -> float:
    try:
        v = float(raw)
    except ValueError:
        raise HTTPError("BadRequest", f"{name} must be Unix seconds (a number)") from None
    if not math.isfinite(v) or v < 0:
        raise HTTPError("BadRequest", f"{name} must be Unix seconds (a finite number >= 0)")
    return v


def parse_query(params: QueryParams) -> RequestQuery:
    """A :class:`RequestQuery` from the query string (each parameter at most once); 400 ``BadRequest`` otherwise."""
    unknown = set(params.keys()) - _PARAMS
    if unknown:
        raise HTTPError("BadRequest", f"unknown parameters {sorted(unknown)} (known: {', '.join(sorted(_PARAMS))})")
    for name in params.keys():
        if len(params.getlist(name)) > 1:
            raise HTTPError("BadRequest", f"{name} given more than once")
    doc: dict[str, object] = {}
    for name in _STR_PARAMS:
        v = params.get(name)
        if v is not None:
            if v == "" or len(v) > 4096:
                raise HTTPError("BadRequest", f"{name} must be a non-empty string of at most 4096 characters")
            doc[name] = v
    if doc.get("status") is not None and doc["status"] not in REQUEST_STATUSES:
        raise HTTPError("BadRequest", f"status must be one of {', '.join(REQUEST_STATUSES)}")
    for name in ("epoch_min", "epoch_max"):
        if params.get(name) is not None:
            doc[name] = _int(name, params[name], 0, 1 << 62)
    for name in ("since", "until"):
        if params.get(name) is not None:
            doc[name] = _time(name, params[name])
    if params.get("limit") is not None:
        doc["limit"] = _int("limit", params["limit"], 1, MAX_LIMIT)
    return msgspec.convert(doc, RequestQuery)


class RequestsAdmin:
    """``GET /admin/requests`` and ``GET /admin/requests/{request_id}`` over the engine's inspector."""

    def __init__(self, gw: _Gateway) -> None:
        self.gw = gw

    def _log(self) -> RequestLog:
        log = self.gw.engine.requests
        if log is None:
            raise HTTPError("NotSupported", "this gateway's engine runs elsewhere: ask the inspector of the gateway "
                            "beside the engine")
        return log

    async def list_requests(self, request: HTTPRequest) -> Response:
        gw = self.gw
        gw.check_auth(request)
        query = parse_query(request.query_params)
        log = self._log()
        try:
            page = await gw.off_loop(log.search, query)  # a scan of up to max_records: not on the event loop
        except ValueError as exc:  # a cursor this server did not give
            raise HTTPError("BadRequest", str(exc)) from None
        return respond(request, 200, page)

    async def show_request(self, request: HTTPRequest) -> Response:
        gw = self.gw
        gw.check_auth(request)
        rid = request.path_params["request_id"]
        doc = self._log().detail(rid)
        if doc is None:
            raise HTTPError("NotFound", f"request {rid!r} is unknown to the inspector (never seen here, or older "
                            "than its retention)")
        return respond(request, 200, doc)

    def routes(self) -> list[Route]:
        return [
            Route("/admin/requests", guard(self.list_requests), methods=["GET"], name="admin_requests"),
            Route("/admin/requests/{request_id}", guard(self.show_request), methods=["GET"],
                  name="admin_request"),
        ]

"""The durable promises' routes (issue 34; :mod:`charon.core.promises`), over the engine contract only.

* ``GET /promises?status=S&after=ID&limit=N`` (``read``): a page of promises in id order, as of the last epoch;
* ``GET /promises/{id}`` (``read``): one promise's record (404 ``UnknownPromise``);
* ``POST /promises/{id}/resolve`` with ``{"value": v}``, ``POST /promises/{id}/reject`` with ``{"error": "..."}``
  (``promises``), ``POST /promises/{id}/cancel`` with ``{"reason": "..."}`` (``admin``): a transaction on the
  promise's entity, answered like ``/invoke`` (200 with ``{"status", "continuation"}``; 409 ``PromiseConflict``
  when it was settled before, which changed nothing). An ``Idempotency-Key`` makes a retry get the same answer.

Refused before the log: an id that is not one the engine mints (400), an unknown promise (404), a value above
``CHARON_MAX_PROMISE_VALUE_BYTES`` (413) or a body above ``max_body`` (413), a malformed body (400).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, Protocol

from starlette.requests import Request as HTTPRequest
from starlette.responses import Response
from starlette.routing import Route

from charon import serde
from charon.core.promises import MAX_ERROR_CHARS, MAX_PROMISE_VALUE_BYTES, PROMISE_OPERATOR, STATUSES, is_promise_id
from charon.core.routing import split_store_key
from charon.errors import SerializationError
from charon.messages import Reply, Request
from charon.runtime.contract import Engine
from charon.server.auth import Principal
from charon.server.wire import HTTPError, guard, parse_fields, respond

__all__ = ["BuiltinGateway", "StateReader", "entity_page", "list_page", "promise_routes", "run_builtin"]

MAX_PAGE = 1000


class StateReader(Protocol):
    """What reading a built-in operator's records uses of the gateway (:func:`entity_page`)."""

    engine: Engine

    def check_ready(self) -> None: ...


class BuiltinGateway(Protocol):
    """What these routes use of the gateway (:class:`charon.server.gateway.Gateway` provides it)."""

    engine: Engine
    wait_timeout: float

    def check_auth(self, request: HTTPRequest, scopes: frozenset[str] | None = None) -> Principal: ...

    def check_ready(self) -> None: ...

    async def off_loop(self, method: Any, *args: Any) -> Any: ...

    async def read_body(self, request: HTTPRequest) -> bytes: ...

    def validate(self, operator: str, key: str, function: str, args: list[Any], public_only: bool = False
                 ) -> Request: ...

    def request_id(self, request: HTTPRequest) -> str | None: ...

    def conflict(self, req: Request) -> None: ...

    async def check_log(self, req: Request) -> None: ...

    def start(self, req: Request, args: list[Any], then: Any = None, fresh: bool = False
              ) -> asyncio.Future[Reply]: ...

    async def await_reply(self, request: HTTPRequest, rid: str, fut: asyncio.Future[Reply],
                          timeout: float) -> Response: ...


async def run_builtin(gw: BuiltinGateway, request: HTTPRequest, operator: str, key: str, function: str,
                      args: list[Any]) -> Response:
    """Run a built-in operator's (internal) function as a transaction, answered like ``/invoke``: checked first
    (typed 4xx), under the client's ``Idempotency-Key`` if it gives one (reserved ids refused)."""
    given = gw.request_id(request)
    req = gw.validate(operator, key, function, args)
    rid = given or uuid.uuid4().hex
    req = Request(rid, req.operator, req.key, req.function, req.args)
    gw.check_ready()
    if given is not None:
        gw.conflict(req)
        await gw.check_log(req)
    fut = gw.start(req, args, fresh=given is None)
    return await gw.await_reply(request, rid, fut, gw.wait_timeout)


def list_page(request: HTTPRequest) -> tuple[str | None, int]:
    """A listing's ``after`` cursor and ``limit`` (1..:data:`MAX_PAGE`, default 100); 400 otherwise."""
    after = request.query_params.get("after") or None
    try:
        limit = int(request.query_params.get("limit", 100))
    except ValueError:
        raise HTTPError("BadRequest", "limit must be an integer") from None
    if not 1 <= limit <= MAX_PAGE:
        raise HTTPError("BadRequest", f"limit must be 1..{MAX_PAGE}")
    return after, limit


async def entity_page(gw: StateReader, operator: str, after: str | None, limit: int, prefix: str = ""
                      ) -> tuple[list[dict[str, Any]], str | None]:
    """A page of a built-in operator's records (their main values, in key order; keys starting with ``prefix``)
    and the next page's cursor (the last record's key)."""
    controls = gw.engine.controls
    if controls is None:
        raise HTTPError("NotSupported", f"this engine ({gw.engine.kind}) cannot list its state")
    gw.check_ready()
    page = await controls.inspect(operator, None, None, limit + 1, after=after, prefix=prefix)
    rows: list[tuple[str, dict[str, Any]]] = []
    for k, v in sorted(page.rows.items()):
        _, key, item = split_store_key(k)
        if item == "":
            rows.append((key, serde.decode(v)))
    more = len(rows) > limit or page.more
    rows = rows[:limit]
    return [r for _, r in rows], (rows[-1][0] if more and rows else None)


def _pid(request: HTTPRequest) -> str:
    pid = request.path_params["promise_id"]
    if not is_promise_id(pid):
        raise HTTPError("BadRequest", f"not a promise id (pr.<app>.<tid>.<inv>.<n>): {pid!r}")
    return str(pid)


class PromiseRoutes:
    """The routes, each a method over one gateway."""

    def __init__(self, gw: BuiltinGateway) -> None:
        self.gw = gw

    async def _record(self, pid: str) -> dict[str, Any]:
        self.gw.check_ready()
        rec = await self.gw.off_loop(self.gw.engine.read_state, PROMISE_OPERATOR, pid)
        if rec is None:
            raise HTTPError("UnknownPromise", f"no promise {pid!r} (never created, its transaction aborted, or "
                            "forgotten after its retention)")
        return dict(rec)

    async def list(self, request: HTTPRequest) -> Response:
        self.gw.check_auth(request)
        status = request.query_params.get("status")
        if status is not None and status not in STATUSES:
            raise HTTPError("BadRequest", f"status must be one of {', '.join(STATUSES)}")
        after, limit = list_page(request)
        rows, nxt = await entity_page(self.gw, PROMISE_OPERATOR, after, limit)
        if status is not None:  # filtered within the page: follow ``next`` for the rest
            rows = [r for r in rows if r.get("status") == status]
        return respond(request, 200, {"promises": rows, "next": nxt})

    async def get(self, request: HTTPRequest) -> Response:
        self.gw.check_auth(request)
        return respond(request, 200, await self._record(_pid(request)))

    async def settle(self, request: HTTPRequest) -> Response:
        """``resolve`` or ``reject`` (the ``promises`` scope)."""
        self.gw.check_auth(request)
        action = request.path_params["action"]
        if action not in ("resolve", "reject"):
            raise HTTPError("NotFound", f"no promise action {action!r} (resolve, reject, cancel)")
        pid = _pid(request)
        body = await self.gw.read_body(request)
        if action == "resolve":
            doc = parse_fields(request.headers.get("content-type"), body, {"value"}, 'body must be {"value": v}')
            value = doc.get("value")
            try:
                size = len(serde.encode_value(value))
            except SerializationError as exc:
                raise HTTPError("SerializationError", str(exc)) from None
            if size > MAX_PROMISE_VALUE_BYTES:
                raise HTTPError("PayloadTooLarge", f"a promise's value of {size} bytes exceeds the maximum of "
                                f"{MAX_PROMISE_VALUE_BYTES} (CHARON_MAX_PROMISE_VALUE_BYTES)")
            args: list[Any] = [value]
        else:
            args = [_text(request, body, "error", "rejected")]
        await self._record(pid)
        return await run_builtin(self.gw, request, PROMISE_OPERATOR, pid, action, args)

    async def cancel(self, request: HTTPRequest) -> Response:
        self.gw.check_auth(request)
        pid = _pid(request)
        reason = _text(request, await self.gw.read_body(request), "reason", "cancelled by an operator")
        await self._record(pid)
        return await run_builtin(self.gw, request, PROMISE_OPERATOR, pid, "cancel", [reason])


def _text(request: HTTPRequest, body: bytes, field: str, default: str) -> str:
    doc = parse_fields(request.headers.get("content-type"), body, {field}, f'body must be {{"{field}": "..."}}')
    text = doc.get(field, default)
    if not isinstance(text, str) or len(text) > MAX_ERROR_CHARS:
        raise HTTPError("BadRequest", f'"{field}" must be a string of at most {MAX_ERROR_CHARS} characters')
    return text


def promise_routes(gw: BuiltinGateway) -> list[Route]:
    """The promise routes over ``gw`` (their scopes: :data:`charon.server.auth.ROUTE_SCOPES`)."""
    r = PromiseRoutes(gw)
    return [
        Route("/promises", guard(r.list), methods=["GET"], name="promises"),
        Route("/promises/{promise_id}", guard(r.get), methods=["GET"], name="promise"),
        Route("/promises/{promise_id}/cancel", guard(r.cancel), methods=["POST"], name="promise_cancel"),
        Route("/promises/{promise_id}/{action}", guard(r.settle), methods=["POST"], name="promise_settle"),
    ]

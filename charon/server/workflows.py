"""The workflows' routes (issue 34 item 4; :mod:`charon.core.workflows`), over the engine contract only.

* ``POST /workflows/{name}`` with ``{"id": "...", "input": v}`` (``invoke``): start a workflow, a transaction on its
  entity answered like ``/invoke`` (200 ``{"id", "workflow", "status"}``). ``id`` defaults to the request's
  ``Idempotency-Key`` (else a fresh one), so a retry under one key starts one workflow and gets one answer.
* ``GET /workflows/{name}?after=ID&limit=N`` (``read``): a page of its workflows' records in id order;
* ``GET /workflows/{name}/{id}`` (``read``): one record: status, current step, what it awaits (the promise's id
  and deadline, the effect's or the timer's id), state, the undo stack, and the history of its steps (each
  step's ``tid``, its attempt, what it awaited next), the tree the inspector draws;
* ``POST /workflows/{name}/{id}/cancel`` with ``{"reason": "..."}`` (``admin``).

Refused before the log: an unknown workflow (404 ``UnknownWorkflow``), an invalid id (400), an input above
``CHARON_MAX_PROMISE_VALUE_BYTES`` (413), an id in use (409 ``WorkflowExists``, also decided by the start's own
transaction when two race), a malformed body (400). The workflow's own functions (``deliver``, ``run``...) are
internal: ``/invoke`` and ``/batch`` answer 404 for them as for any internal function.
"""

from __future__ import annotations

import uuid
from typing import Any

from starlette.requests import Request as HTTPRequest
from starlette.responses import Response
from starlette.routing import Route

from charon import serde
from charon.core.promises import MAX_PROMISE_VALUE_BYTES
from charon.core.routing import check_key
from charon.core.workflows import MINTED_PREFIX, workflow_operator
from charon.errors import InvalidKey, SerializationError
from charon.messages import is_reserved_id
from charon.server.promises import BuiltinGateway, entity_page, list_page, run_builtin
from charon.server.wire import HTTPError, guard, parse_fields, respond

__all__ = ["workflow_routes"]


class WorkflowRoutes:
    """The routes, each a method over one gateway."""

    def __init__(self, gw: BuiltinGateway) -> None:
        self.gw = gw

    def _operator(self, request: HTTPRequest) -> str:
        name = request.path_params["name"]
        if name not in self.gw.engine.app.workflows:
            have = ", ".join(sorted(self.gw.engine.app.workflows)) or "none"
            raise HTTPError("UnknownWorkflow", f"no workflow {name!r} (have: {have})")
        return workflow_operator(name)

    async def _record(self, op: str, wid: str) -> dict[str, Any] | None:
        self.gw.check_ready()
        rec = await self.gw.off_loop(self.gw.engine.read_state, op, wid)
        return None if rec is None else dict(rec)

    async def start(self, request: HTTPRequest) -> Response:
        self.gw.check_auth(request)
        op = self._operator(request)
        body = await self.gw.read_body(request)
        doc = parse_fields(request.headers.get("content-type"), body, {"id", "input"},
                           'body must be {"id": "...", "input": v}')
        given = self.gw.request_id(request)
        wid = doc.get("id") or given or uuid.uuid4().hex
        try:
            check_key(wid)
        except InvalidKey as exc:
            raise HTTPError("InvalidKey", f"a workflow id: {exc}") from None
        if is_reserved_id(wid):  # the ids a transaction's start() mints (and the engine's own): never a client's
            raise HTTPError("ReservedRequestId", f"workflow id {wid!r} is reserved: ids starting with "
                            f"{MINTED_PREFIX!r} are minted by the engine")
        value = doc.get("input")
        try:
            size = len(serde.encode_value(value))
        except SerializationError as exc:
            raise HTTPError("SerializationError", str(exc)) from None
        if size > MAX_PROMISE_VALUE_BYTES:
            raise HTTPError("PayloadTooLarge", f"a workflow's input of {size} bytes exceeds the maximum of "
                            f"{MAX_PROMISE_VALUE_BYTES} (CHARON_MAX_PROMISE_VALUE_BYTES)")
        if given is None and await self._record(op, wid) is not None:  # a retry under its key: its first answer
            raise HTTPError("WorkflowExists", f"workflow {request.path_params['name']!r} {wid!r} exists already")
        return await run_builtin(self.gw, request, op, wid, "start", [value])

    async def list(self, request: HTTPRequest) -> Response:
        self.gw.check_auth(request)
        op = self._operator(request)
        after, limit = list_page(request)
        rows, nxt = await entity_page(self.gw, op, after, limit)
        return respond(request, 200, {"workflows": rows, "next": nxt})

    async def get(self, request: HTTPRequest) -> Response:
        self.gw.check_auth(request)
        op = self._operator(request)
        wid = request.path_params["wid"]
        rec = await self._record(op, wid)
        if rec is None:
            raise HTTPError("UnknownWorkflow", f"no workflow {request.path_params['name']!r} {wid!r}")
        return respond(request, 200, rec)

    async def cancel(self, request: HTTPRequest) -> Response:
        self.gw.check_auth(request)
        op = self._operator(request)
        wid = request.path_params["wid"]
        doc = parse_fields(request.headers.get("content-type"), await self.gw.read_body(request), {"reason"},
                           'body must be {"reason": "..."}')
        reason = doc.get("reason", "cancelled by an operator")
        if not isinstance(reason, str) or len(reason) > 2000:
            raise HTTPError("BadRequest", '"reason" must be a string of at most 2000 characters')
        if await self._record(op, wid) is None:
            raise HTTPError("UnknownWorkflow", f"no workflow {request.path_params['name']!r} {wid!r}")
        return await run_builtin(self.gw, request, op, wid, "cancel", [reason])


def workflow_routes(gw: BuiltinGateway) -> list[Route]:
    """The workflow routes over ``gw`` (their scopes: :data:`charon.server.auth.ROUTE_SCOPES`)."""
    r = WorkflowRoutes(gw)
    return [
        Route("/workflows/{name}", guard(r.list), methods=["GET"], name="workflows"),
        Route("/workflows/{name}", guard(r.start), methods=["POST"], name="workflow_start"),
        Route("/workflows/{name}/{wid:charonkey}/cancel", guard(r.cancel), methods=["POST"], name="workflow_cancel"),
        Route("/workflows/{name}/{wid:charonkey}", guard(r.get), methods=["GET"], name="workflow"),
    ]

"""The workflows' routes (issue 34 item 4; :mod:`charon.core.workflows`), over the engine contract only.

* ``POST /workflows/{name}`` with ``{"id": "...", "input": v}`` (``invoke``): start a workflow, a transaction on its
  entity answered like ``/invoke`` (200 ``{"id", "workflow", "status"}``). ``id`` defaults to the request's
  ``Idempotency-Key`` (else a fresh one), so a retry under one key starts one workflow and gets one answer.
* ``GET /workflows/{name}?after=ID&limit=N`` (``read``): a page of its workflows' records in id order;
* ``GET /workflows/{name}/{id}`` (``read``): one record: status, current step, what it awaits (the promise's id
  and deadline, the effect's or the timer's id), state, the undo stack, and the history of its steps (each
  step's ``tid``, its attempt, what it awaited next), the tree the inspector draws;
* ``GET /workflows/{name}/{id}/tree?steps=N`` (``read``): the same as one tree (:mod:`charon.server.workflow_tree`):
  the workflow, its newest ``N`` steps (1..200, default 50) each with its transaction's call graph from the
  inspector, and what it awaits now (a promise's status and deadline, an effect's attempts and last error, a
  timer's due time), read as of one epoch;
* ``POST /workflows/{name}/{id}/cancel`` with ``{"reason": "..."}`` (``admin``);
* ``GET /admin/workflows/versions`` (``read``): the drain, how many workflows still run (``running``: a step due or
  retrying; ``waiting``: awaiting an effect, a promise or a timer) on each code version, per workflow and in all,
  and the deployed version; at most :data:`~charon.runtime.contract.MAX_WORKFLOW_SCAN` records read per workflow
  (``truncated`` says so);
* ``POST /admin/workflows/migrate`` with ``{"workflow", "from", "dry_run", "limit", "cursor"}`` (``admin``,
  audited: one ``charon.admin`` line ``workflows migrate`` per call): one page of the workflow's records; each one
  in flight on ``from`` is sent its own ``migrate`` transaction, which decides (``NotMigratable``: counted in
  ``skipped``, nothing changed). Request ids derive from the ``Idempotency-Key`` (the operation) and the workflow
  id, so a repeated call sends nothing twice. ``next`` is the following page's ``cursor`` (null: done). A dry run
  sends nothing and forecasts in ``would_skip`` (``{"NotMigratable": n}``; ``{}`` on a real run) the matched
  records that would be skipped: at a step the declared migration (``@wf.migrates``) does not map, mid-step, or
  whose migration function raises or returns a bad state.

A code update (``POST /admin/code``, :mod:`charon.server.admin`) that would drop the code of a version with
workflows in flight is refused, 409 ``VersionInUse``: the engine's ``update_code`` decides it at its epoch boundary
(:mod:`charon.runtime.control.drain`), with the count the drain route answers
(:meth:`~charon.runtime.contract.Controls.workflows_in_flight`).

Refused before the log: an unknown workflow (404 ``UnknownWorkflow``), an invalid id (400), an input above
``CHARON_MAX_PROMISE_VALUE_BYTES`` (413), an id in use (409 ``WorkflowExists``, also decided by the start's own
transaction when two race), a malformed body (400). The workflow's own functions (``deliver``, ``run``...) are
internal: ``/invoke`` and ``/batch`` answer 404 for them as for any internal function.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from starlette.requests import Request as HTTPRequest
from starlette.responses import Response
from starlette.routing import Route

from charon import serde
from charon.core.promises import MAX_PROMISE_VALUE_BYTES
from charon.core.routing import check_key
from charon.core.workflows import MINTED_PREFIX, Workflow, workflow_operator
from charon.errors import InvalidKey, NotMigratable, SerializationError
from charon.messages import is_reserved_id
from charon.runtime.contract import IN_FLIGHT, WorkflowsInFlight
from charon.server.audit import audited, note, started
from charon.server.itemops import await_replies, derived_id, tally
from charon.server.promises import BuiltinGateway, StateReader, entity_page, list_page, run_builtin
from charon.server.wire import HTTPError, guard, parse_fields, respond
from charon.server.workflow_tree import MAX_STEPS, EffectLookup, workflow_tree

__all__ = ["in_flight", "workflow_routes"]

_MIGRATE_LIMIT = 1000  # most records one migrate call looks at
_MIGRATE_TIMEOUT_S = 60.0


async def in_flight(gw: StateReader) -> WorkflowsInFlight:
    """The deployed workflows in flight per code version (the engine's
    :meth:`~charon.runtime.contract.Controls.workflows_in_flight`)."""
    controls = gw.engine.controls
    if controls is None:
        raise HTTPError("NotSupported", f"this engine ({gw.engine.kind}) cannot list its state")
    gw.check_ready()
    return await controls.workflows_in_flight(gw.engine.app.workflows)


class WorkflowRoutes:
    """The routes, each a method over one gateway."""

    def __init__(self, gw: BuiltinGateway, effect: EffectLookup | None = None) -> None:
        self.gw = gw
        self.effect = effect

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

    async def tree(self, request: HTTPRequest) -> Response:
        self.gw.check_auth(request)
        op = self._operator(request)
        wid = request.path_params["wid"]
        unknown = set(request.query_params.keys()) - {"steps"}
        if unknown:
            raise HTTPError("BadRequest", f"unknown parameters {sorted(unknown)} (known: steps)")
        try:
            steps = int(request.query_params.get("steps", 50))
        except ValueError:
            raise HTTPError("BadRequest", "steps must be an integer") from None
        if not 1 <= steps <= MAX_STEPS:
            raise HTTPError("BadRequest", f"steps must be 1..{MAX_STEPS}")
        tree = await workflow_tree(self.gw, op, wid, steps, self.effect)
        if tree is None:
            raise HTTPError("UnknownWorkflow", f"no workflow {request.path_params['name']!r} {wid!r}")
        return respond(request, 200, tree)

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


    # -- drain and migration
    async def versions(self, request: HTTPRequest) -> Response:
        self.gw.check_auth(request)
        self.gw.check_ready()
        counts = await in_flight(self.gw)
        controls = self.gw.engine.controls
        current = None if controls is None else controls.status_now().code_version
        return respond(request, 200, {"current": current, "versions": counts.total, "workflows": counts.per,
                                      "truncated": counts.truncated})

    async def migrate(self, request: HTTPRequest) -> Response:
        gw = self.gw
        gw.check_auth(request)
        given = gw.request_id(request)
        doc = parse_fields(request.headers.get("content-type"), await gw.read_body(request),
                           {"workflow", "from", "dry_run", "limit", "cursor"},
                           'body must be {"workflow": "...", "from": "V", "dry_run", "limit", "cursor"}')
        name, old = doc.get("workflow"), doc.get("from")
        dry, limit, cursor = doc.get("dry_run", False), doc.get("limit", 100), doc.get("cursor")
        if not isinstance(name, str) or name not in gw.engine.app.workflows:
            have = ", ".join(sorted(gw.engine.app.workflows)) or "none"
            raise HTTPError("UnknownWorkflow", f"no workflow {name!r} (have: {have})")
        if not isinstance(old, str) or not 0 < len(old) <= 200:
            raise HTTPError("BadRequest", '"from" must be a code version (a string of 1-200 characters)')
        if type(dry) is not bool:
            raise HTTPError("BadRequest", "dry_run must be true or false")
        if type(limit) is not int or not 1 <= limit <= _MIGRATE_LIMIT:
            raise HTTPError("BadRequest", f"limit must be an integer in 1..{_MIGRATE_LIMIT}")
        if cursor is not None:
            try:
                check_key(cursor)
            except (InvalidKey, TypeError):
                raise HTTPError("BadRequest", "cursor must be a previous answer's next (a workflow id)") from None
        op = given or uuid.uuid4().hex
        note(request, operation=op, workflow=name, version=old, dry_run=dry, limit=limit, cursor=cursor)
        gw.check_ready()
        started(request, "workflows migrate")
        operator = workflow_operator(name)
        rows, nxt = await entity_page(gw, operator, cursor, limit)
        matched = [r for r in rows if r.get("version") == old and r.get("status") in IN_FLIGHT]
        hits = [str(r["id"]) for r in matched]
        out: dict[str, Any] = {"operation": op, "workflow": name, "from": old, "dry_run": dry,
                               "examined": len(rows), "matched": len(hits), "done": 0, "skipped": {},
                               "would_skip": self._forecast(name, old, matched) if dry else {},
                               "items": hits, "next": nxt}
        if not dry and hits:
            calls = [gw.engine.submit(operator, wid, "migrate", [old],
                                      request_id=derived_id("wfmigrate", op, name, wid)) for wid in hits]
            replies = await await_replies(calls, _MIGRATE_TIMEOUT_S, "migration", op)
            out["done"], out["skipped"] = tally(replies)
        note(request, examined=out["examined"], matched=out["matched"], done=out["done"], skipped=out["skipped"],
             next=nxt)
        return respond(request, 200, out)


    def _forecast(self, name: str, old: str, matched: Sequence[Mapping[str, object]]) -> dict[str, int]:
        """What a dry run says the matched records' own ``migrate`` transactions would skip (``{"NotMigratable":
        n}``): the deployed workflow's pure decision (:meth:`~charon.core.workflows.Workflow.migration`, a declared
        migration's function included) on the records as read; each transaction decides again on its own."""
        wf = self.gw.engine.app.workflows[name]
        if not isinstance(wf, Workflow):
            return {}
        controls = self.gw.engine.controls
        label = None if controls is None else controls.status_now().code_version
        n = 0
        for rec in matched:
            try:
                wf.migration(rec, old, str(label or wf.version))
            except NotMigratable:
                n += 1
        return {"NotMigratable": n} if n else {}


def workflow_routes(gw: BuiltinGateway, effect: EffectLookup | None = None) -> list[Route]:
    """The workflow routes over ``gw`` (``effect``: the effect executor's lookup by id, if one runs beside it; their
    scopes: :data:`charon.server.auth.ROUTE_SCOPES`)."""
    r = WorkflowRoutes(gw, effect)
    return [
        Route("/admin/workflows/versions", guard(r.versions), methods=["GET"], name="admin_workflow_versions"),
        Route("/admin/workflows/migrate", guard(audited("workflows migrate", r.migrate)), methods=["POST"],
              name="admin_workflow_migrate"),
        Route("/workflows/{name}", guard(r.list), methods=["GET"], name="workflows"),
        Route("/workflows/{name}", guard(r.start), methods=["POST"], name="workflow_start"),
        Route("/workflows/{name}/{wid:charonkey}/cancel", guard(r.cancel), methods=["POST"], name="workflow_cancel"),
        Route("/workflows/{name}/{wid:charonkey}/tree", guard(r.tree), methods=["GET"], name="workflow_tree"),
        Route("/workflows/{name}/{wid:charonkey}", guard(r.get), methods=["GET"], name="workflow"),
    ]

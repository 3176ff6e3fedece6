"""The schedules' routes (issue 34; :mod:`charon.core.schedules`), over the engine contract only.

* ``GET /schedules?after=NAME&limit=N``, ``GET /schedules/{name}`` (``read``): records as of the last epoch;
* ``POST /schedules`` with ``{"name", "cron", "operator", "key", "function", "args", "catch_up"}`` (``admin``):
  create one at run time (409 ``ScheduleExists`` if the name is taken); its target must be a public function;
* ``POST /schedules/{name}/pause``, ``POST /schedules/{name}/resume``, ``DELETE /schedules/{name}`` (``admin``).

Each change is a transaction on the schedule's entity, answered like ``/invoke``; a malformed spec is refused
before the log (400, 404 for an unknown target, 422 for arguments it does not take).
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request as HTTPRequest
from starlette.responses import Response
from starlette.routing import Route

from charon.core.schedule_spec import check_name, schedule_spec
from charon.core.schedules import SCHEDULE_OPERATOR
from charon.errors import BadArguments, InvalidKey, UnknownFunction, UnknownOperator, ValueTooLarge
from charon.server.promises import BuiltinGateway, entity_page, list_page, run_builtin
from charon.server.wire import HTTPError, guard, parse_fields, respond

__all__ = ["schedule_routes"]

_SPEC_FIELDS = {"name", "cron", "operator", "key", "function", "args", "catch_up"}


def _name(request: HTTPRequest) -> str:
    try:
        return check_name(request.path_params["name"])
    except BadArguments as exc:
        raise HTTPError("BadRequest", str(exc)) from None


class ScheduleRoutes:
    """The routes, each a method over one gateway."""

    def __init__(self, gw: BuiltinGateway) -> None:
        self.gw = gw

    async def _record(self, name: str) -> dict[str, Any]:
        self.gw.check_ready()
        rec = await self.gw.off_loop(self.gw.engine.read_state, SCHEDULE_OPERATOR, name)
        if rec is None or rec.get("deleted"):
            raise HTTPError("UnknownSchedule", f"no schedule {name!r}")
        return dict(rec)

    async def list(self, request: HTTPRequest) -> Response:
        self.gw.check_auth(request)
        after, limit = list_page(request)
        rows, nxt = await entity_page(self.gw, SCHEDULE_OPERATOR, after, limit)
        return respond(request, 200, {"schedules": [r for r in rows if not r.get("deleted")], "next": nxt})

    async def get(self, request: HTTPRequest) -> Response:
        self.gw.check_auth(request)
        return respond(request, 200, await self._record(_name(request)))

    async def create(self, request: HTTPRequest) -> Response:
        self.gw.check_auth(request)
        doc = parse_fields(request.headers.get("content-type"), await self.gw.read_body(request), _SPEC_FIELDS,
                           "body must be a schedule spec object")
        try:
            spec = schedule_spec(self.gw.engine.app, doc.get("name"), doc.get("cron"), doc.get("operator"),
                                 doc.get("key"), doc.get("function"), doc.get("args", []), doc.get("catch_up", 0),
                                 public_only=True)  # a run-time schedule calls only what a client may call
        except (UnknownOperator, UnknownFunction) as exc:
            raise HTTPError(type(exc).__name__, str(exc)) from None
        except BadArguments as exc:
            raise HTTPError("BadArguments", str(exc)) from None
        except InvalidKey as exc:
            raise HTTPError("InvalidKey", str(exc)) from None
        except ValueTooLarge as exc:
            raise HTTPError("PayloadTooLarge", str(exc)) from None
        return await run_builtin(self.gw, request, SCHEDULE_OPERATOR, spec["name"], "upsert", [spec, False])

    async def action(self, request: HTTPRequest) -> Response:
        self.gw.check_auth(request)
        action = request.path_params["action"]
        if action not in ("pause", "resume"):
            raise HTTPError("NotFound", f"no schedule action {action!r} (pause, resume; DELETE to delete)")
        name = _name(request)
        await self._record(name)
        return await run_builtin(self.gw, request, SCHEDULE_OPERATOR, name, action, [])

    async def delete(self, request: HTTPRequest) -> Response:
        self.gw.check_auth(request)
        name = _name(request)
        await self._record(name)
        return await run_builtin(self.gw, request, SCHEDULE_OPERATOR, name, "delete", [])


def schedule_routes(gw: BuiltinGateway) -> list[Route]:
    """The schedule routes over ``gw`` (their scopes: :data:`charon.server.auth.ROUTE_SCOPES`)."""
    r = ScheduleRoutes(gw)
    return [
        Route("/schedules", guard(r.list), methods=["GET"], name="schedules"),
        Route("/schedules", guard(r.create), methods=["POST"], name="schedule_create"),
        Route("/schedules/{name}", guard(r.get), methods=["GET"], name="schedule"),
        Route("/schedules/{name}", guard(r.delete), methods=["DELETE"], name="schedule_delete"),
        Route("/schedules/{name}/{action}", guard(r.action), methods=["POST"], name="schedule_action"),
    ]

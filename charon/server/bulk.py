"""Bulk operations over HTTP (issue 34 item 5): ``POST /admin/bulk/{resource}/{action}`` (scope ``admin``, audited).

Resources and actions (:data:`charon.core.bulk.BULK_ACTIONS`): ``invocations/cancel`` (requests waiting for
admission), ``promises/cancel`` (pending promises), ``schedules/pause|resume|delete``, ``effects/retry|abandon``
(parked effects: the dead letters of ``charon run --effects``). The body::

    {"where": {"operator", "function", "key_prefix", "error_type", "since", "until"},   # each optional
     "dry_run": false, "limit": 100, "cursor": null, "reason": "..."}

One call looks at one page of at most ``limit`` (1..1000) items after ``cursor`` and answers ``{"operation",
"resource", "action", "where", "dry_run", "examined", "matched", "done", "skipped": {why: n}, "items": [ids
matched], "next"}``; ``next`` (null on the last page) is the ``cursor`` of the following call. A dry run counts
(``matched``) and changes nothing. So no call holds the engine or the gateway's memory for more than a page.

Nothing is decided here that the engine could decide otherwise on replay: each promise and schedule matched is
sent the very transaction its single-item route sends (``cancel``, ``pause``, ``resume``, ``delete`` on its
entity), which decides whether it applies (a promise settled meanwhile answers ``PromiseConflict``: counted in
``skipped``, nothing changed); a bulk cancel of invocations is one request through the log that the epoch taking
it decides on (:meth:`charon.core.admission.Admission.cancel_held`); a parked effect is retried or abandoned by
its store's single-item call, which changes only a still parked effect.

The ``Idempotency-Key`` names the operation (default: a fresh id): the transactions of one operation have request
ids derived from it and the item, so a call repeated under the same key (after a timeout, or a crash of the
gateway) sends nothing twice. Each call logs one ``charon.admin`` line ``operator action bulk`` naming the
operation, resource, action, filter and counts, and a ``started`` line before it acts (an interrupted call leaves
the latter alone). A bad filter, resource, action, limit or cursor is a typed 4xx before anything reaches the log.
"""

from __future__ import annotations

import uuid
from typing import Any

from starlette.requests import Request as HTTPRequest
from starlette.responses import Response
from starlette.routing import Route

from charon import serde
from charon.core.admission import LIMITS_OPERATOR
from charon.core.bulk import BULK_ACTIONS, MAX_BULK_LIMIT, MAX_TEXT, Where, parse_where
from charon.core.promises import PROMISE_OPERATOR, is_promise_id
from charon.core.schedule_spec import check_name
from charon.core.schedules import SCHEDULE_OPERATOR
from charon.errors import BadArguments
from charon.messages import Reply
from charon.server.admin import EffectsAdmin
from charon.server.audit import audited, note, started
from charon.server.itemops import await_replies, derived_id, tally
from charon.server.promises import BuiltinGateway, entity_page
from charon.server.wire import HTTPError, guard, parse_fields, respond

__all__ = ["BULK_TIMEOUT_S", "BulkRoutes", "bulk_routes"]

BULK_TIMEOUT_S = 60.0  # a call waits this long for its transactions' replies (503 after: repeat it, same key)
_FIELDS = {"where", "dry_run", "limit", "cursor", "reason"}


def _error_type(last_error: str) -> str:
    """The type a parked effect's last error names (``"Type: message"``)."""
    head, sep, _ = last_error.partition(":")
    return head.strip() if sep else last_error.strip()


class BulkRoutes:
    """``POST /admin/bulk/{resource}/{action}`` over one gateway (and its effect executor, if any)."""

    def __init__(self, gw: BuiltinGateway, effects: EffectsAdmin | None = None,
                 timeout_s: float = BULK_TIMEOUT_S) -> None:
        self.gw = gw
        self.effects = effects
        self.timeout_s = timeout_s

    # -- parsing (every refusal before anything reaches the log)
    def _parse(self, request: HTTPRequest, body: bytes) -> tuple[str, str, Where, bool, int, str | None, str]:
        resource, action = request.path_params["resource"], request.path_params["action"]
        if resource not in BULK_ACTIONS:
            raise HTTPError("NotFound", f"no bulk resource {resource!r} ({', '.join(BULK_ACTIONS)})")
        if action not in BULK_ACTIONS[resource]:
            raise HTTPError("NotFound", f"no bulk action {action!r} on {resource} "
                            f"({', '.join(BULK_ACTIONS[resource])})")
        doc = parse_fields(request.headers.get("content-type"), body, _FIELDS,
                           'body must be {"where": {...}, "dry_run", "limit", "cursor", "reason"}')
        try:
            where = parse_where(doc.get("where"), resource)
        except ValueError as exc:
            raise HTTPError("BadRequest", str(exc)) from None
        dry = doc.get("dry_run", False)
        limit = doc.get("limit", 100)
        cursor = doc.get("cursor")
        reason = doc.get("reason", "cancelled by an operator")
        if type(dry) is not bool:
            raise HTTPError("BadRequest", "dry_run must be true or false")
        if type(limit) is not int or not 1 <= limit <= MAX_BULK_LIMIT:
            raise HTTPError("BadRequest", f"limit must be an integer in 1..{MAX_BULK_LIMIT}")
        if cursor is not None and (type(cursor) is not str or not 0 < len(cursor) <= 256):
            raise HTTPError("BadRequest", "cursor must be a previous answer's next (a string) or null")
        if cursor is not None:
            try:
                self._check_cursor(resource, cursor)
            except (ValueError, BadArguments):
                raise HTTPError("BadRequest", f"cursor {cursor!r} is not a page's next of {resource}") from None
        if type(reason) is not str or len(reason) > MAX_TEXT:
            raise HTTPError("BadRequest", f"reason must be a string of at most {MAX_TEXT} characters")
        return resource, action, where, dry, limit, cursor, reason

    @staticmethod
    def _check_cursor(resource: str, cursor: str) -> None:
        if resource == "invocations" and not (cursor.isdigit() and int(cursor) < 1 << 62):
            raise ValueError(cursor)
        if resource == "promises" and not is_promise_id(cursor):
            raise ValueError(cursor)
        if resource == "schedules":
            check_name(cursor)

    # -- the route
    async def run(self, request: HTTPRequest) -> Response:
        gw = self.gw
        gw.check_auth(request)
        given = gw.request_id(request)
        resource, action, where, dry, limit, cursor, reason = self._parse(request, await gw.read_body(request))
        if resource == "effects" and self.effects is None:
            raise HTTPError("NotSupported", "no effect executor runs beside this gateway (charon run --effects)")
        op = given or uuid.uuid4().hex
        note(request, operation=op, resource=resource, bulk_action=action, where=where.doc(), dry_run=dry,
             limit=limit, cursor=cursor)
        gw.check_ready()
        started(request, "bulk")
        if resource == "invocations":
            out = await self._invocations(op, action, where, dry, limit, cursor, reason)
        elif resource == "effects":
            out = await self._effects(action, where, dry, limit, cursor)
        else:
            out = await self._entities(op, resource, action, where, dry, limit, cursor, reason)
        note(request, examined=out["examined"], matched=out["matched"], done=out["done"], skipped=out["skipped"],
             next=out["next"])
        return respond(request, 200, {"operation": op, "resource": resource, "action": action,
                                      "where": where.doc(), "dry_run": dry, **out})

    # -- the resources
    async def _wait(self, op: str, calls: list[Any]) -> list[Reply]:
        return await await_replies(calls, self.timeout_s, "bulk operation", op)

    def _rid(self, op: str, *parts: str) -> str:
        """The request id of one of operation ``op``'s transactions (reserved: no client can take it)."""
        return derived_id("bulk", op, *parts)

    async def _invocations(self, op: str, action: str, where: Where, dry: bool, limit: int, cursor: str | None,
                           reason: str) -> dict[str, Any]:
        function = "match" if dry else "cancel"
        after = None if cursor is None else int(cursor)
        rid = self._rid(op, "invocations", function, cursor or "")
        (rep,) = await self._wait(op, [self.gw.engine.submit(LIMITS_OPERATOR, "bulk", function,
                                                             [where.doc(), limit, after, reason], request_id=rid)])
        if not rep.ok:
            raise HTTPError("BadArguments", rep.error_message)
        doc = serde.decode(rep.value)
        return {"examined": doc["examined"], "matched": doc["matched"], "done": doc["cancelled"], "skipped": {},
                "items": doc["items"], "next": doc["next"], "epoch": rep.epoch}

    async def _entities(self, op: str, resource: str, action: str, where: Where, dry: bool, limit: int,
                        cursor: str | None, reason: str) -> dict[str, Any]:
        if resource == "promises":
            recs, nxt = await entity_page(self.gw, PROMISE_OPERATOR, cursor, limit)
            hits = [r["id"] for r in recs if r.get("status") == "pending"
                    and where.match(r["operator"], r["then"], r["key"], r["created"])]
            operator, args = PROMISE_OPERATOR, [reason]
        else:  # schedules: the key prefix is the name's (read as a prefix of the operator's keys)
            recs, nxt = await entity_page(self.gw, SCHEDULE_OPERATOR, cursor, limit, where.key_prefix or "")
            wanted = {"pause": lambda r: not r.get("paused"), "resume": lambda r: bool(r.get("paused")),
                      "delete": lambda r: True}[action]
            hits = [r["name"] for r in recs if not r.get("deleted") and wanted(r)
                    and where.match(r["operator"], r["function"], r["name"], r["created"])]
            operator, args = SCHEDULE_OPERATOR, []
        out: dict[str, Any] = {"examined": len(recs), "matched": len(hits), "done": 0, "skipped": {},
                               "items": hits, "next": nxt}
        if dry or not hits:
            return out
        engine = self.gw.engine
        replies = await self._wait(op, [engine.submit(operator, key, action, args,
                                                      request_id=self._rid(op, resource, action, key))
                                        for key in hits])
        out["done"], out["skipped"] = tally(replies)  # a skipped one was settled or deleted meanwhile
        return out

    async def _effects(self, action: str, where: Where, dry: bool, limit: int, cursor: str | None
                       ) -> dict[str, Any]:
        fx = self.effects
        assert fx is not None
        rows = await self.gw.off_loop(fx.parked_effects, cursor, limit + 1)
        nxt = rows[limit - 1]["id"] if len(rows) > limit else None
        rows = rows[:limit]
        hits = [r["id"] for r in rows
                if where.match(r["operator"], r["handler"], r["key"], r["created"], _error_type(r["last_error"]))]
        out: dict[str, Any] = {"examined": len(rows), "matched": len(hits), "done": 0, "skipped": {},
                               "items": hits, "next": nxt}
        if dry:
            return out
        call = fx.retry_effect if action == "retry" else fx.abandon_effect
        for eid in hits:
            if await self.gw.off_loop(call, eid):
                out["done"] += 1
            else:  # no longer parked (retried or abandoned meanwhile)
                out["skipped"]["NotParked"] = out["skipped"].get("NotParked", 0) + 1
        return out


def bulk_routes(gw: BuiltinGateway, effects: EffectsAdmin | None = None) -> list[Route]:
    """The bulk route over ``gw`` (its scope: :data:`charon.server.auth.ROUTE_SCOPES` ``admin_bulk``)."""
    r = BulkRoutes(gw, effects)
    return [Route("/admin/bulk/{resource}/{action}", guard(audited("bulk", r.run)), methods=["POST"],
                  name="admin_bulk")]

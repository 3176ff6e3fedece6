"""Admission limits over HTTP (:mod:`charon.core.admission`): the admin routes, the 429 answers and the early
refusal before the log.

- ``GET /admin/limits`` (scope ``read``): the table in force (``source`` code or admin), the waiting requests per
  bucket, ``held`` and ``max_waiting``, as of an epoch boundary (a ``show`` request travels the log).
- ``POST /admin/limits`` (scope ``admin``, audited): ``{"target": "op" | "op/fn", "limit": {...}}`` sets a limit,
  ``{"target", "clear": true}`` goes back to the code's, ``{"target", "remove": true}`` lifts it. Checked here (400
  ``BadRequest``, 422 ``BadArguments``) before anything reaches the log; applied at the epoch that takes it.
- An abort ``RateLimited`` or ``Overloaded`` is answered 429 with ``Retry-After`` (from the reply's value, the
  same on every gateway); a new invoke is refused 429 ``Overloaded`` before the log while the last epoch's
  waiting requests are at the engine's bound.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Protocol

import msgspec
from starlette.requests import Request as HTTPRequest
from starlette.responses import Response
from starlette.routing import Route

from charon import serde
from charon.core.admission import LIMITS_OPERATOR
from charon.core.limits import Limit, check_target
from charon.messages import Reply
from charon.runtime.contract import Engine
from charon.server.audit import audited, note
from charon.server.auth import Principal
from charon.server.wire import HTTPError, guard, respond

__all__ = ["ADMISSION_ERRORS", "AdmissionGuard", "LimitsAdmin", "retry_after"]

ADMISSION_ERRORS = frozenset({"RateLimited", "Overloaded"})
_CHECK_EVERY_S = 0.05  # how often the early refusal looks at the engine's last epoch


def retry_after(rep: Reply) -> dict[str, str] | None:
    """The ``Retry-After`` header of an admission refusal's reply (None for any other reply)."""
    if rep.ok or rep.error_type not in ADMISSION_ERRORS:
        return None
    try:
        doc = serde.decode(rep.value) if rep.value else {}
        secs = float(doc.get("retry_after", 1.0)) if type(doc) is dict else 1.0
    except Exception:  # noqa: BLE001 - a value from elsewhere: the default
        secs = 1.0
    return {"Retry-After": str(max(1, math.ceil(secs)))}


class AdmissionGuard:
    """Refuses an invoke before the log when the engine already holds as many waiting requests as it may."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._checked = -math.inf
        self._full = False

    def check(self) -> None:
        """429 ``Overloaded`` while the last epoch's held requests are at the bound."""
        now = time.monotonic()
        if now - self._checked >= _CHECK_EVERY_S:
            self._checked = now
            stats = self.engine.epoch_stats()
            last = stats[-1] if stats else {}
            bound = last.get("admission_max_waiting", 0)
            self._full = bool(bound) and last.get("admission_held", 0) >= bound
        if self._full:
            raise HTTPError("Overloaded", "the engine holds as many requests waiting for admission as it may; "
                            "retry later")


class _Gateway(Protocol):
    engine: Engine

    def check_auth(self, request: HTTPRequest, scopes: frozenset[str] | None = None) -> Principal: ...

    async def read_body(self, request: HTTPRequest) -> bytes: ...


class LimitsAdmin:
    """``/admin/limits``: read and change the admission limits through the engine's log."""

    def __init__(self, gw: _Gateway, timeout_s: float = 30.0) -> None:
        self.gw = gw
        self.timeout_s = timeout_s

    async def _submit(self, function: str, target: str, args: list[object]) -> dict[str, object]:
        import asyncio

        rid = f"__charon.limits:{uuid.uuid4().hex}"  # reserved: never held, never a client's
        try:
            rep = await asyncio.wait_for(self.gw.engine.submit(LIMITS_OPERATOR, target, function, args,
                                                               request_id=rid), self.timeout_s)
        except TimeoutError:
            raise HTTPError("Unavailable", f"no epoch took the limits request within {self.timeout_s:.0f} s "
                            "(paused?); it applies when one does") from None
        if not rep.ok:
            raise HTTPError("BadArguments", rep.error_message)
        doc: dict[str, object] = serde.decode(rep.value)
        doc["epoch"] = rep.epoch
        return doc

    async def show(self, request: HTTPRequest) -> Response:
        self.gw.check_auth(request)
        # a key the log takes (Spark's log client refuses an empty one); show reads no key
        return respond(request, 200, await self._submit("show", "all", []))

    async def change(self, request: HTTPRequest) -> Response:
        self.gw.check_auth(request)
        body = await self.gw.read_body(request)
        try:
            doc = msgspec.json.decode(body) if body else None
        except msgspec.DecodeError as exc:
            raise HTTPError("BadRequest", f"malformed body: {exc}") from None
        if type(doc) is not dict or set(doc) - {"target", "limit", "clear", "remove"}:
            raise HTTPError("BadRequest", "the body is {\"target\", and one of \"limit\", \"clear\": true, "
                            "\"remove\": true}")
        ops = [k for k in ("limit", "clear", "remove") if doc.get(k) not in (None, False)]
        if len(ops) != 1:
            raise HTTPError("BadRequest", "give exactly one of limit, clear, remove")
        try:
            raw = doc.get("target")
            if type(raw) is not str:
                raise ValueError("target must be a string: 'operator' or 'operator/function'")
            target = check_target(raw)
            if ops[0] == "limit":
                if type(doc["limit"]) is not dict:
                    raise ValueError("limit must be an object")
                lim = msgspec.convert(doc["limit"], Limit)
        except (ValueError, msgspec.ValidationError) as exc:
            raise HTTPError("BadArguments", str(exc)) from None
        note(request, target=target, limit_op=ops[0])
        if ops[0] == "limit":
            out = await self._submit("set", target, [msgspec.to_builtins(lim)])
        else:
            out = await self._submit(ops[0], target, [])
        return respond(request, 200, out)

    def routes(self) -> list[Route]:
        return [
            Route("/admin/limits", guard(self.show), methods=["GET"], name="admin_limits"),
            Route("/admin/limits", guard(audited("limits change", self.change)), methods=["POST"],
                  name="admin_limits_change"),
        ]

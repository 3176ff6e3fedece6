"""Operator actions in the server log: :func:`audited` wraps an admin route's handler and logs one line on logger
``charon.admin`` per call (``info`` when done, ``warning`` when refused), with ``action``, ``client`` (the peer's
address: the bearer token names nobody), ``status`` and what the handler noted with :func:`note` (e.g.
``after_epoch``, ``partitions``, ``version``, ``sql``). An action that may take long also logs, once it has
parsed what it was asked, a ``started`` line (:func:`started`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from starlette.requests import Request as HTTPRequest
from starlette.responses import Response

from charon.server.wire import HTTPError

__all__ = ["audited", "note", "started", "MAX_FIELD_CHARS"]

_log = logging.getLogger("charon.admin")
MAX_FIELD_CHARS = 500  # a noted value (a SQL text...) is cut to this many characters in the log line


def note(request: HTTPRequest, **fields: object) -> None:
    """Fields for the action's log line (what was asked), noted by the handler once it parsed them."""
    audit = getattr(request.state, "audit", None)
    if audit is None:
        audit = request.state.audit = {}
    for k, v in fields.items():
        audit[k] = v[:MAX_FIELD_CHARS] if isinstance(v, str) else v


def started(request: HTTPRequest, action: str) -> None:
    """A line that an action which may take long (a bulk operation) has started, with what was noted so far: if
    the process dies before the action's own line, this one says what was under way."""
    _log.info("operator action %s started", action, extra={"action": action, "event": "started",
                                                           **getattr(request.state, "audit", {})})


def audited(action: str, handler: Callable[[HTTPRequest], Awaitable[Response]]
            ) -> Callable[[HTTPRequest], Awaitable[Response]]:
    """``handler`` with one log line per call on ``charon.admin`` (see the module docstring)."""

    async def run(request: HTTPRequest) -> Response:
        t0 = time.perf_counter()
        try:
            response = await handler(request)
        except HTTPError as exc:
            if exc.error_type != "Unauthorized":  # a wrong token is not an operator's action
                _log.warning("operator action %s refused: %s: %s", action, exc.error_type, exc.message,
                             extra=_fields(request, action, exc.status, t0, error_type=exc.error_type))
            raise
        except Exception as exc:
            _log.error("operator action %s failed: %s: %s", action, type(exc).__name__, exc, exc_info=exc,
                       extra=_fields(request, action, 500, t0, error_type=type(exc).__name__))
            raise
        _log.info("operator action %s", action, extra=_fields(request, action, response.status_code, t0))
        return response

    return run


def _fields(request: HTTPRequest, action: str, status: int, t0: float, **more: object) -> dict[str, object]:
    client = request.client
    return {"action": action, "client": f"{client.host}:{client.port}" if client else None, "status": status,
            "duration_ms": round((time.perf_counter() - t0) * 1000.0, 3), **more,
            **getattr(request.state, "audit", {})}

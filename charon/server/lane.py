"""The invoke lane: ``POST /invoke/...`` straight to its handler, around starlette's middleware and router.

A transaction's request is the gateway's hot path. Starlette's error middlewares, its router (a regular
expression per route until one matches) and the per-route exception wrapper cost about as much server CPU as the
engine spends on the transaction (issue 24's profile). :class:`InvokeLane` sits in front of the app: a ``POST``
whose path matches the invoke route exactly as the router would (the route's own compiled pattern and
convertors, the path percent-decoded strictly as :class:`~charon.server.http.StrictPath` does) goes to the same
guarded handler every other route uses, with the same starlette ``Request``; everything else (other routes and
methods, a path that is not valid UTF-8, a ``root_path``, lifespan) goes to the app unchanged. So the lane
keeps every check and answer of the route; it only skips the dispatch.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import unquote_to_bytes

from starlette.requests import Request as HTTPRequest
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

__all__ = ["InvokeLane"]

_PREFIX = b"/invoke/"


class InvokeLane:
    """ASGI: requests ``route`` matches with ``POST`` go to ``endpoint``; the rest to ``app``."""

    def __init__(self, app: Any, route: Route, endpoint: Callable[[HTTPRequest], Awaitable[Response]]) -> None:
        self.app = app
        self.endpoint = endpoint
        self._match = route.path_regex.match
        self._convertors = route.param_convertors

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope.get("root_path"):
            return await self.app(scope, receive, send)
        raw = scope.get("raw_path")
        if raw is None or not raw.startswith(_PREFIX):
            return await self.app(scope, receive, send)
        try:
            path = unquote_to_bytes(raw).decode("utf-8")
        except UnicodeDecodeError:  # the app's StrictPath answers it (400)
            return await self.app(scope, receive, send)
        m = self._match(path)
        if m is None:
            return await self.app(scope, receive, send)
        conv = self._convertors
        params = {name: conv[name].convert(value) for name, value in m.groupdict().items()}
        scope = dict(scope, path=path, path_params=params)
        try:
            response = await self.endpoint(HTTPRequest(scope, receive, send))
        except Exception:  # as starlette's ServerErrorMiddleware answers a handler's unexpected error
            response = PlainTextResponse("Internal Server Error", status_code=500)
            await response(scope, receive, send)
            raise
        await response(scope, receive, send)

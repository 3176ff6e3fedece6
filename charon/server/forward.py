"""Forwarding to the driver: the routes a gateway process cannot serve from the logs go to the driver's control
channel.

A gateway process (``charon run --engine spark`` starts them; ``charon run --engine remote --driver URL`` on other
machines) serves invokes, batches, status polls, ``/health`` and ``/openapi.json`` itself, over the logs. Every
other route (entity state and timers, output streams, the admin routes, metrics, the dashboard) needs the engine:
:class:`DriverForward` passes the request, its ``Authorization`` header included, to the driver's own gateway on
its control channel (HTTP on localhost, authenticated with the deployment's tokens, so scopes and audit lines are
the driver's), and streams the answer back (server-sent events too). Bounded: bodies up to ``max_body`` (413
beyond, counted while streaming), a pool of ``max_connections`` connections to the driver, a connect timeout and
a read timeout per chunk; a driver that does not answer is a typed 503 ``Unavailable`` with ``Retry-After``,
never a hang or a 500.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from charon.server.wire import json_encoder

__all__ = ["DriverForward", "LOCAL_PREFIXES"]

#: paths a gateway process serves itself (over the logs); everything else is forwarded
LOCAL_PREFIXES = ("/invoke/", "/effects/continue/", "/batch", "/requests/", "/health", "/openapi.json")
#: headers that describe one connection, not the request (RFC 9110 §7.6.1), and ``host`` (the driver's own)
_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te", b"trailer",
                  b"transfer-encoding", b"upgrade", b"host", b"content-length"})
_HOP_OUT = _HOP - {b"content-length"}  # an answer streamed unchanged keeps its length


class _TooLarge(Exception):
    pass


class DriverForward:
    """ASGI: requests under :data:`LOCAL_PREFIXES` go to ``app``; the rest to the driver at ``driver_url``."""

    def __init__(self, app: ASGIApp, driver_url: str, *, max_body: int, max_connections: int = 64,
                 connect_timeout: float = 2.0, read_timeout: float = 60.0) -> None:
        self.app = app
        self.driver_url = driver_url.rstrip("/")
        self.max_body = max_body
        self._limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._timeout = httpx.Timeout(read_timeout, connect=connect_timeout, pool=connect_timeout)
        self._client: httpx.AsyncClient | None = None  # made on the server's loop

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(scope, receive, send)
            return
        if scope["type"] != "http" or scope["path"].startswith(LOCAL_PREFIXES):
            await self.app(scope, receive, send)
            return
        await self._forward(scope, receive, send)

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def closing_send(message: Message) -> None:  # the pool closes with the app
            if message["type"] == "lifespan.shutdown.complete" and self._client is not None:
                await self._client.aclose()
                self._client = None
            await send(message)

        await self.app(scope, receive, closing_send)

    async def _forward(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._client is None:
            self._client = httpx.AsyncClient(limits=self._limits, timeout=self._timeout)
        size = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if size is not None and size.isdigit() and int(size) > self.max_body:
            await _error(send, 413, "PayloadTooLarge", f"the body exceeds {self.max_body} bytes")
            return
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _HOP]
        client = scope.get("client")
        if client:
            headers.append((b"x-forwarded-for", str(client[0]).encode()))
        url = self.driver_url + scope.get("raw_path", scope["path"].encode()).decode("latin-1")
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode("latin-1")
        body = self._body(receive) if scope["method"] not in ("GET", "HEAD") else None
        req = self._client.build_request(scope["method"], url, headers=headers, content=body)
        try:
            resp = await self._client.send(req, stream=True)
        except _TooLarge:
            await _error(send, 413, "PayloadTooLarge", f"the body exceeds {self.max_body} bytes")
            return
        except httpx.HTTPError as exc:
            await _error(send, 503, "Unavailable", f"the driver does not answer: {type(exc).__name__}: {exc}"[:500],
                         retry=True)
            return
        try:
            out = [(k, v) for k, v in resp.headers.raw if k.lower() not in _HOP_OUT]
            await send({"type": "http.response.start", "status": resp.status_code, "headers": out})
            try:
                async for chunk in resp.aiter_raw():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except httpx.HTTPError:  # the driver went away mid-answer: end it (the client sees a short body)
                pass
            await send({"type": "http.response.body", "body": b""})
        finally:
            await resp.aclose()

    async def _body(self, receive: Receive) -> AsyncIterator[bytes]:
        got = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            got += len(chunk)
            if got > self.max_body:
                raise _TooLarge
            if chunk:
                yield chunk
            if not message.get("more_body"):
                return


async def _error(send: Send, status: int, kind: str, message: str, retry: bool = False) -> None:
    body = json_encoder.encode({"error": {"type": kind, "message": message}})
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if retry:
        headers.append((b"retry-after", b"1"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})

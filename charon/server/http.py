"""HTTP plumbing under the gateway's routes: the URL convertor that makes every key addressable, the strict UTF-8
path middleware, and uvicorn's HTTP/1.1 protocols with slow-loris protection (a request-head timeout, a head-size
cap and a connection cap), configured by :func:`uvicorn_config`.
"""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import unquote_to_bytes

import uvicorn
from starlette.convertors import PathConvertor, register_url_convertor
from uvicorn.protocols.http.h11_impl import H11Protocol

from charon.config import GatewayConfig
from charon.server.lane import InvokeLane
from charon.server.wire import json_encoder

__all__ = ["KeyConvertor", "StrictPath", "HeadGuard", "uvicorn_config"]


class KeyConvertor(PathConvertor):
    """A key path segment: any characters, ``/`` and line breaks included (starlette's ``path`` is ``.*``, which
    does not match a newline): every key :func:`charon.core.routing.check_key` accepts is addressable by URL."""

    regex = r"[\s\S]*"


register_url_convertor("charonkey", KeyConvertor())


class StrictPath:
    """ASGI middleware: the URL path is percent-decoded strictly as UTF-8 (400 otherwise).

    Servers decode ``%FF`` to U+FFFD, so ``%FF`` and ``%FE`` would name one entity; this re-decodes the raw
    path and rejects invalid UTF-8 instead of replacing it.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("raw_path") is not None:
            root = scope.get("root_path", "")
            try:
                scope = dict(scope, path=root + unquote_to_bytes(scope["raw_path"][len(root):]).decode("utf-8"))
            except UnicodeDecodeError:
                body = json_encoder.encode(
                    {"error": {"type": "InvalidKey", "message": "the URL path is not valid UTF-8"}}
                )
                await send({"type": "http.response.start", "status": 400,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


class HeadGuard:
    """Slow-loris protection shared by both uvicorn protocols: a request-head timeout and a connection cap.

    A connection must deliver a complete request head within ``header_timeout`` seconds of opening (or of
    its previous response); at ``max_connections`` open connections, the one that has waited longest for
    its request head is closed to admit the new one (if none is waiting, the new one is closed).

    The deadline is checked by one timer per connection that re-arms itself while a head is awaited, not by a
    timer per request (creating and cancelling one per request was a measurable share of a request's CPU).
    """

    header_timeout = 10.0
    max_connections = 1000
    connections: set[Any]
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    cycle: Any

    def _guard_open(self) -> None:
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_waiting = False
        self._head_since = 0.0
        self._head_gen = 0  # counts the waits (a wait begun during a read is told from the one before)
        self._arm_head_timer()
        if len(self.connections) > self.max_connections:
            waiting = [c for c in self.connections if getattr(c, "_head_waiting", False) and c is not self]
            victim = min(waiting, key=lambda c: c._head_since) if waiting else self
            victim._close_idle()

    def _arm_head_timer(self) -> None:
        """A request head is awaited from now on."""
        self._head_cycle = self.cycle
        self._head_since = self.loop.time()
        self._head_bytes = 0
        self._head_waiting = True
        self._head_gen += 1
        if self._head_timer is None:
            self._head_timer = self.loop.call_at(self._head_since + self.header_timeout, self._head_check)

    def _disarm_head_timer(self) -> None:
        """The awaited head arrived (the timer, if armed, finds nothing to do when it fires)."""
        self._head_waiting = False

    def _head_check(self) -> None:
        self._head_timer = None
        if not self._head_waiting:
            return
        deadline = self._head_since + self.header_timeout
        if self.loop.time() >= deadline:
            self._close_idle()
        else:
            self._head_timer = self.loop.call_at(deadline, self._head_check)

    def _close_idle(self) -> None:
        self._head_waiting = False
        if not self.transport.is_closing():
            self.transport.close()

    def _head_gone(self) -> None:
        """The connection is lost: its timer goes."""
        self._head_waiting = False
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _guard_response_complete(self) -> None:
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self._arm_head_timer()


class GuardedH11(HeadGuard, H11Protocol):
    """uvicorn's h11 protocol with :class:`HeadGuard` (the fallback when httptools is not installed)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._guard_open()

    def handle_events(self) -> None:
        super().handle_events()
        if self._head_waiting and self.cycle is not self._head_cycle:
            self._disarm_head_timer()  # a request head arrived

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._guard_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_gone()
        super().connection_lost(exc)


try:  # httptools (llhttp, in C) parses and writes HTTP/1.1 in a fraction of h11's CPU
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # pragma: no cover - depends on the environment
    HttpToolsProtocol = None  # type: ignore[assignment,misc]

if HttpToolsProtocol is not None:

    class GuardedHttpTools(HeadGuard, HttpToolsProtocol):
        """uvicorn's httptools protocol with :class:`HeadGuard`, and ``max_header_bytes`` as h11's limit: a
        connection that sends more than that without completing a request head gets 400 and is closed.

        Pipelining, on both the direct path and the ASGI route: a request head that arrives ends the keep-alive
        wait (an answer completed within a read armed it; it closed the connection under the next request of
        that read), at most ``max_pipeline`` requests wait behind the one being answered (the last of them is
        answered with ``Connection: close``, those beyond it are dropped unanswered and reading stops: the
        client retries them, RFC 9112 9.3.2), and answers completed while the next pipelined request starts
        start the one after it from a loop, not by recursion (the direct path answers some at once)."""

        max_header_bytes = 16 << 10
        max_pipeline = 128
        direct: Any = None  # the gateway's charon.server.lane.DirectInvoke, if it answers invokes directly

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._reading = False  # within data_received
            self._completing = False  # within on_response_complete's loop
            self._completions = 0  # answers completed and not yet followed by the next pipelined request
            self._overflow = False  # the pipeline overflowed: the rest of the input is dropped
            self._guard_open()

        def _start_asgi_task(self, cycle: Any, app: Any) -> None:
            direct = self.direct
            if direct is not None and direct.take(self, cycle):
                if not self._reading:  # taken from the pipeline, not by a read: its body timer starts now
                    call = getattr(cycle, "charon_call", None)
                    if call is not None:
                        direct.data_done(call)
                return  # answered from the callbacks below, without a task
            super()._start_asgi_task(cycle, app)

        def on_body(self, body: bytes) -> None:
            super().on_body(body)
            call = getattr(self.cycle, "charon_call", None)
            if call is not None:
                self.direct.body_received(call)

        def on_message_complete(self) -> None:
            super().on_message_complete()
            call = getattr(self.cycle, "charon_call", None)
            if call is not None and not self.cycle.more_body:
                self.direct.body_complete(call)

        def data_received(self, data: bytes) -> None:
            if self._overflow:
                return
            gen = self._head_gen
            self._reading = True
            try:
                super().data_received(data)
            finally:
                self._reading = False
            call = getattr(self.cycle, "charon_call", None)
            if call is not None:
                self.direct.data_done(call)
            # still no complete head (a wait begun during this read, by a response answered within it, counts
            # the bytes from the next read on: these held the request answered)
            if self._head_waiting and self._head_gen == gen:
                self._head_bytes += len(data)
                if self._head_bytes > self.max_header_bytes and not self.transport.is_closing():
                    self._disarm_head_timer()
                    self.send_400_response("Invalid HTTP request received.")

        def on_headers_complete(self) -> None:
            self._disarm_head_timer()  # a request head arrived
            self._unset_keepalive_if_required()  # ... so the connection is not idle
            super().on_headers_complete()
            if len(self.pipeline) > self.max_pipeline:
                self._pipeline_full()

        def _pipeline_full(self) -> None:
            """One request more than ``max_pipeline`` waits: it is dropped, the last one kept closes the
            connection with its answer, and nothing more is read."""
            self.pipeline.popleft()  # the newest (uvicorn queues at the left)
            self.pipeline[0][0].keep_alive = False
            if not self._overflow:
                self._overflow = True
                self.flow.pause_reading()
                self.logger.warning("More than %d pipelined requests on one connection: the rest dropped.",
                                    self.max_pipeline)

        def on_response_complete(self) -> None:
            self._completions += 1
            if self._completing:  # answered at once while the loop below started it: the loop goes on
                return
            self._completing = True
            try:
                while self._completions:
                    self._completions -= 1
                    super().on_response_complete()  # the next pipelined request starts (or keep-alive waits)
                    self._guard_response_complete()
            finally:
                self._completing = False

        def connection_lost(self, exc: Exception | None) -> None:
            self._head_gone()
            super().connection_lost(exc)


def uvicorn_config(app: Any, host: str, port: int, cfg: GatewayConfig, log_level: str = "warning",
                   own_logging: bool = False) -> uvicorn.Config:
    """The uvicorn configuration that enforces ``cfg``'s connection limits and timeouts (httptools' protocol
    when it is installed, else h11's). ``own_logging``: the process set its logging up
    (:func:`charon.server.logs.setup_logging`): uvicorn leaves it alone."""
    limits: dict[str, Any] = {"header_timeout": cfg.header_timeout, "max_connections": cfg.max_connections,
              "max_header_bytes": cfg.max_header_bytes, "max_pipeline": max(1, cfg.max_pipeline)}
    base = GuardedH11 if HttpToolsProtocol is None else GuardedHttpTools
    if base is not GuardedH11 and isinstance(app, InvokeLane) and app.direct is not None:
        limits["direct"] = app.direct
    protocol = type("CharonHTTP", (base,), limits)
    return uvicorn.Config(
        app, host=host, port=port, log_level=log_level, lifespan="on", access_log=False, http=protocol,
        timeout_keep_alive=int(max(1, cfg.keep_alive)), h11_max_incomplete_event_size=cfg.max_header_bytes,
        backlog=min(2048, max(128, cfg.max_connections)),
        timeout_graceful_shutdown=10,
        log_config=None if own_logging else uvicorn.config.LOGGING_CONFIG,
        proxy_headers=False,  # nothing reads the client address; X-Forwarded-* parsing cost every request CPU
    )

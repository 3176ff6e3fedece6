"""The invoke lane: ``POST /invoke/...``, the gateway's hot path, around starlette's dispatch and uvicorn's task.

A transaction's request is the gateway's hot path. Starlette's error middlewares, its router (a regular expression
per route until one matches) and uvicorn's ASGI cycle (a task, a coroutine chain and a message dictionary per
step) cost more server CPU than the engine spends on the transaction (issue 24's profile). Two shortcuts, both
matching the invoke route exactly as the router would (the route's own compiled pattern and convertors, the path
percent-decoded strictly as :class:`~charon.server.http.StrictPath` does) and both ending in the gateway's own
checks, in the same order, with the same typed answers:

- :class:`DirectInvoke`, used by the HTTP protocol (:class:`~charon.server.http.GuardedHttpTools`): a plain
  HTTP/1.1 ``POST`` without a query string whose checks run on the loop (the in-process node's local log, or no
  log) is answered from the protocol's callbacks: no task, no ASGI messages, one write per answer; the sync
  wait's timeout (202 after ``wait_timeout``) is one timer for all calls. Pipelined requests are taken in
  turn (the protocol starts the next one from a loop when an answer completes: some are answered at once), and
  a body still incoming has its ``body_timeout`` (408) from the read that left it incomplete or, for a request
  taken from the pipeline, from its taking, as the route's own body timer starts with its task.
- :class:`InvokeLane`, in front of the ASGI app: any other invoke (a query string, msgpack, a networked log, the
  h11 protocol, ``Expect: 100-continue``...) goes to the same guarded handler the router would call, with the same
  starlette ``Request``; everything else goes to the app unchanged.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import unquote_to_bytes

from starlette.requests import Request as HTTPRequest
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from charon.errors import CharonError
from charon.messages import Reply
from charon.server.limits_admin import retry_after
from charon.server.wire import STATUS_OF_ERROR, HTTPError, encode_answer, error_answer

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Receive, Scope, Send
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

    from charon.config import GatewayConfig
    from charon.messages import Request
    from charon.server.auth import Principal, Tokens

__all__ = ["InvokeLane", "DirectInvoke", "LaneGateway"]

_PREFIX = b"/invoke/"
_log = logging.getLogger("charon.server")


class LaneGateway(Protocol):
    """What the direct path uses of the gateway (:class:`charon.server.gateway.Gateway` provides it): the
    route's checks, in the route's order, and its answers."""

    auth: Tokens
    cfg: GatewayConfig
    max_body: int
    wait_timeout: float

    @property
    def log_inline(self) -> bool: ...
    def check_token(self, header: str, scopes: frozenset[str] = ...) -> Principal: ...
    def check_invoker(self, who: Principal, given: str | None) -> bool: ...
    def id_of(self, rid: str | None) -> str | None: ...
    def prepare(self, operator: str, key: str, function: str, given: str | None, ctype: str | None,
                body: bytes, internal: bool = False) -> tuple[Request, list[Any]]: ...
    def check_log_inline(self, req: Request) -> bool: ...
    def start(self, req: Request, args: list[Any], then: Callable[[asyncio.Future[Reply]], None] | None = None,
              fresh: bool = False) -> asyncio.Future[Reply]: ...
    def reply_doc(self, rep: Reply) -> tuple[int, dict[str, Any]]: ...
    def status_url_for(self, root_path: str, rid: str) -> str: ...


class _Match:
    """The invoke route's pattern: the path parameters of a raw path, as the router would give them."""

    def __init__(self, route: Route) -> None:
        self._match = route.path_regex.match
        self._convertors = route.param_convertors

    def params(self, raw: bytes) -> tuple[str, dict[str, str]] | None:
        """``(path, params)`` if ``raw`` names the route (None also for a path that is not UTF-8: the app's
        StrictPath answers that one)."""
        if not raw.startswith(_PREFIX):
            return None
        try:
            path = unquote_to_bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            return None
        m = self._match(path)
        if m is None:
            return None
        conv = self._convertors
        return path, {name: conv[name].convert(value) for name, value in m.groupdict().items()}


class InvokeLane:
    """ASGI: requests ``route`` matches with ``POST`` go to ``endpoint``; the rest to ``app``. ``direct``: the
    protocol-level path over the same route (:class:`DirectInvoke`), if the server uses it."""

    def __init__(self, app: ASGIApp, route: Route, endpoint: Callable[[HTTPRequest], Awaitable[Response]],
                 direct: DirectInvoke | None = None) -> None:
        self.app = app
        self.endpoint = endpoint
        self.direct = direct
        self._route = _Match(route)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope.get("root_path"):
            return await self.app(scope, receive, send)
        raw = scope.get("raw_path")
        found = None if raw is None else self._route.params(raw)
        if found is None:
            return await self.app(scope, receive, send)
        scope = dict(scope, path=found[0], path_params=found[1])
        try:
            response = await self.endpoint(HTTPRequest(scope, receive, send))
        except Exception:  # as starlette's ServerErrorMiddleware answers a handler's unexpected error
            response = PlainTextResponse("Internal Server Error", status_code=500)
            await response(scope, receive, send)
            raise
        await response(scope, receive, send)


class _Call:
    """One direct invoke: its connection (protocol, uvicorn's cycle), what its answer needs, and whether it
    was answered. Answered, it lets go of its connection (the cycle points back at it: a reference cycle the
    collector would otherwise have to find, a few thousand per second)."""

    __slots__ = ("proto", "cycle", "params", "headers", "given", "internal", "rid", "answered", "waiting",
                 "body_timer")

    def __init__(self, proto: HttpToolsProtocol, cycle: RequestResponseCycle, params: dict[str, str],
                 headers: dict[bytes, bytes]) -> None:
        self.proto: HttpToolsProtocol | None = proto
        self.cycle: RequestResponseCycle | None = cycle
        self.params = params
        self.headers = headers
        self.given: str | None = None  # the client's request id
        self.internal = False  # an effect continuation: it may name an internal function (Gateway.check_invoker)
        self.rid = ""  # the request id (given or generated), once the request went to the runtime
        self.answered = False
        self.waiting = False  # for its reply, counted in DirectInvoke._pending
        self.body_timer: asyncio.TimerHandle | None = None


class DirectInvoke:
    """The direct path of :mod:`this module <charon.server.lane>`, driven by the protocol: :meth:`take` when a
    request head is complete, :meth:`body_received` per body chunk, :meth:`body_complete` when the body is in,
    :meth:`data_done` after each read."""

    def __init__(self, gw: LaneGateway, route: Route) -> None:
        self.gw = gw
        self._route = _Match(route)
        self._waits: collections.deque[tuple[float, _Call]] = collections.deque()  # sync waits, by deadline
        self._pending = 0  # calls waiting for a reply (the rest of _waits answered already)
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the server's (the protocols' one loop)
        from uvicorn.protocols.http.httptools_impl import STATUS_LINE

        self._status_line: dict[int, bytes] = STATUS_LINE

    # -- driven by the protocol -------------------------------------------------------------------------------
    def take(self, proto: HttpToolsProtocol, cycle: RequestResponseCycle) -> bool:
        """Whether this request (its head complete) goes the direct way; if so it is under way."""
        scope = cycle.scope
        if (scope["method"] != "POST" or scope["query_string"] or scope.get("root_path")
                or scope["http_version"] != "1.1" or cycle.waiting_for_100_continue or not self.gw.log_inline):
            return False
        found = self._route.params(scope["raw_path"])
        if found is None:
            return False
        headers: dict[bytes, bytes] = {}
        for name, value in scope["headers"]:  # the first of a repeated header, as starlette's Headers.get
            if name not in headers:
                headers[name] = value
        self._loop = proto.loop
        call = _Call(proto, cycle, found[1], headers)
        setattr(cycle, "charon_call", call)  # noqa: B010 - an attribute uvicorn's cycle does not declare
        gw = self.gw
        try:  # the route's checks before its body, in its order (auth, request id, declared size)
            who = gw.check_token(_text(headers.get(b"authorization", b"")))
            call.given = gw.id_of(_text(headers[b"idempotency-key"]) if b"idempotency-key" in headers else None)
            call.internal = gw.check_invoker(who, call.given)
            cl = headers.get(b"content-length")
            if cl is not None:
                try:
                    n = int(cl)
                except ValueError:
                    raise HTTPError("BadRequest", "invalid Content-Length") from None
                if n > gw.max_body:
                    raise HTTPError("PayloadTooLarge", f"body of {n} bytes exceeds the limit of {gw.max_body}")
        except Exception as exc:  # noqa: BLE001 - answered as the route answers it
            self._fail(call, exc)
            return True
        if not cycle.more_body:  # a pipelined request taken later: its body is in
            self.body_complete(call)
        return True

    def body_received(self, call: _Call) -> None:
        """A body chunk arrived: 413 as soon as the body exceeds ``max_body``; reading goes on (uvicorn pauses it
        past its high-water mark until the application reads: here the body is taken as it comes, up to
        ``max_body``)."""
        cycle, proto = call.cycle, call.proto
        if call.answered or cycle is None or proto is None:
            return
        if len(cycle.body) > self.gw.max_body:
            self._fail(call, HTTPError("PayloadTooLarge", f"body exceeds the limit of {self.gw.max_body} bytes"))
        else:
            proto.flow.resume_reading()

    def data_done(self, call: _Call) -> None:
        """After a read: a body still incoming must complete within ``body_timeout`` (408)."""
        cycle, proto = call.cycle, call.proto
        if not call.answered and cycle is not None and proto is not None and cycle.more_body \
                and call.body_timer is None:
            timeout = self.gw.cfg.body_timeout
            call.body_timer = proto.loop.call_later(timeout, self._body_late, call, timeout)

    def body_complete(self, call: _Call) -> None:
        """The body is in: the route's remaining checks, then the request goes to the runtime."""
        if call.body_timer is not None:
            call.body_timer.cancel()
            call.body_timer = None
        cycle, proto = call.cycle, call.proto
        if call.answered or cycle is None or proto is None:
            return
        gw = self.gw
        body = bytes(cycle.body)
        cycle.body = bytearray()
        params = call.params
        try:
            ctype = call.headers.get(b"content-type")
            req, args = gw.prepare(params["operator"], params["key"], params["function"], call.given,
                                   None if ctype is None else _text(ctype), body, call.internal)
            fresh = gw.check_log_inline(req) if call.given is not None else True  # a generated id: a new uuid4
            fut = gw.start(req, args, lambda f: self._replied(call, f), fresh)
        except Exception as exc:  # noqa: BLE001 - answered as the route answers it
            self._fail(call, exc)
            return
        call.rid = req.request_id
        if fut.done():  # answered already (its callback is scheduled; it finds the call answered)
            self._replied(call, fut)
            return
        call.waiting = True
        self._pending += 1
        loop = proto.loop
        self._waits.append((loop.time() + gw.wait_timeout, call))
        if len(self._waits) > 2 * self._pending + 1024:  # answered calls waiting for their deadline: drop them
            self._waits = collections.deque(w for w in self._waits if not w[1].answered)
        if self._timer is None:
            self._timer = loop.call_at(self._waits[0][0], self._sweep)

    # -- answers ----------------------------------------------------------------------------------------------
    def _replied(self, call: _Call, fut: asyncio.Future[Reply]) -> None:
        if call.answered:
            return
        try:
            if fut.cancelled():
                raise HTTPError("Unavailable", "the runtime failed to take the request: cancelled")
            exc = fut.exception()
            if exc is not None:  # as the route's await_reply turns it
                if isinstance(exc, CharonError) and type(exc).__name__ in STATUS_OF_ERROR:
                    raise HTTPError(type(exc).__name__, str(exc))
                raise HTTPError("Unavailable", f"the runtime failed to take the request: {type(exc).__name__}: {exc}")
            status, doc = self.gw.reply_doc(fut.result())
        except Exception as exc:  # noqa: BLE001 - answered as the route answers it
            self._fail(call, exc)
            return
        self._answer(call, status, doc, retry_after(fut.result()) if status == 429 else None)

    def _sweep(self) -> None:
        """The sync waits past their deadline answer 202 with their status URL (the transaction keeps running)."""
        self._timer = None
        waits = self._waits
        loop = self._loop
        if not waits or loop is None:
            return
        now = loop.time()
        while waits and waits[0][0] <= now:
            _, call = waits.popleft()
            if not call.answered:
                url = self.gw.status_url_for("", call.rid)
                self._answer(call, 202, {"request_id": call.rid, "status_url": url, "status": "pending"},
                             {"Location": url})
        if waits:
            self._timer = loop.call_at(waits[0][0], self._sweep)

    def _body_late(self, call: _Call, timeout: float) -> None:
        call.body_timer = None
        self._fail(call, HTTPError("RequestTimeout", f"body not received within {timeout} s"))

    def _fail(self, call: _Call, exc: Exception) -> None:
        answer = error_answer(exc)
        if answer is None:  # as uvicorn answers an application's unexpected error
            _log.error("Exception in the invoke route", exc_info=exc)
            self._write(call, 500, [(b"content-type", b"text/plain; charset=utf-8")], b"Internal Server Error",
                        close=True)
            return
        self._answer(call, *answer)

    def _answer(self, call: _Call, status: int, doc: object, headers: dict[str, str] | None) -> None:
        status, data, media = encode_answer(_text(call.headers.get(b"accept", b"")), status, doc)
        extra = [(b"content-type", media.encode())]
        close = False
        if headers:
            for name, value in headers.items():
                if name.lower() == "connection" and "close" in value.lower():
                    close = True
                extra.append((name.lower().encode(), value.encode()))
        self._write(call, status, extra, data, close)

    def _write(self, call: _Call, status: int, headers: list[tuple[bytes, bytes]], data: bytes,
               close: bool = False) -> None:
        """The whole answer in one write, then the connection goes on as uvicorn's cycle would have it.

        This sets the state uvicorn's ``RequestResponseCycle.send`` would (``response_started``,
        ``response_complete``, ``message_event``, ``keep_alive``) and calls its ``on_response``: attributes that
        are not a documented uvicorn API (issue 35). The protocol subclass (:mod:`charon.server.http`) relies on
        uvicorn's internals in the same way (its ``pipeline``, ``cycle``, keep-alive timer); only a protocol of
        Charon's own over httptools would end both."""
        if call.answered:
            return
        call.answered = True
        if call.body_timer is not None:
            call.body_timer.cancel()
            call.body_timer = None
        if call.waiting:
            call.waiting = False
            self._pending -= 1
        cycle, proto = call.cycle, call.proto
        call.cycle = call.proto = None  # lets go of the connection (see _Call)
        if cycle is None or proto is None:
            return
        with contextlib.suppress(AttributeError):
            delattr(cycle, "charon_call")  # set by take()
        if cycle.disconnected or cycle.response_complete:
            return
        if close:
            cycle.keep_alive = False
        content = [self._status_line[status]]
        for name, value in proto.server_state.default_headers:
            content += (name, b": ", value, b"\r\n")
        for name, value in headers:
            content += (name, b": ", value, b"\r\n")
        content += (b"content-length: ", str(len(data)).encode(), b"\r\n")
        if not cycle.keep_alive:
            content.append(b"connection: close\r\n")
        content += (b"\r\n", data)
        cycle.response_started = True
        cycle.response_complete = True
        proto.transport.write(b"".join(content))
        cycle.message_event.set()
        if not cycle.keep_alive:
            proto.transport.close()
        cycle.on_response()


def _text(value: bytes) -> str:
    return value.decode("latin-1")

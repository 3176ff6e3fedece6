"""HTTP gateway: the ASGI front door of a Charon runtime (starlette, served by uvicorn).

Routes (bodies of mutating routes must be ``application/json`` or ``application/msgpack``, 415 otherwise; an
empty body without a type means no arguments; every response is JSON unless the request says
``Accept: application/msgpack``):

- ``POST /invoke/{operator}/{key}/{function}`` with body ``{"args": [...]}`` runs one transaction, if the function
  is public (``@op.function(public=True)``): an internal one is 404 ``UnknownFunction`` exactly as a missing one
  (except for an effect worker's continuation: the ``effects`` scope with an ``fx.<effect id>.done`` request id).
  200 ``{"request_id", "tid", "epoch", "position", "value", "status": "committed"}`` when it committed;
  409 ``{"error": {"type", "message"}, "request_id", "tid", "epoch", "position", "status": "aborted"}`` when
  a function in its call graph raised (nothing was applied). Replies ordered by (epoch, position) form a
  serial order equivalent to the execution. With the in-process runtime both also carry ``"code_version"``,
  the application version the transaction ran (code updates, :mod:`charon.server.admin`). The ``Idempotency-Key``
  header becomes the request id:
  a retried request executes once and every retry gets the first reply. ``?mode=async`` answers at once
  with 202 ``{"request_id", "status_url"}``. A synchronous call still unanswered after ``wait_timeout``
  seconds also turns into that 202 (the transaction keeps running).
- ``GET /requests/{request_id}[?wait=SECONDS]`` polls: the reply (200 or 409 as above), 202
  ``{"status": "pending"}`` (also for a request in the runtime's input log that this gateway never saw,
  e.g. after a restart), or 404 when nobody knows the id. ``wait`` long-polls up to that many seconds (at
  most 30) while the request is in flight here.
- ``GET /state/{operator}/{key}`` returns ``{"operator", "key", "value"}`` (an admin read).
- ``GET /timers/{operator}/{key}`` returns ``{"operator", "key", "timers": [{"id", "due", "operator", "key",
  "function", "args"}, ...]}``: the entity's pending timers (an admin read, see :mod:`charon.core.timers`).
- ``POST /batch`` with body ``{"calls": [[operator, key, function, [args...]], ...]}`` (1..``max_batch_calls``)
  runs a client atomic batch: one transaction whose root calls each invocation in order (each sees the
  writes of those before it), so all commit or none; 200 with ``value`` = the list of the calls' values,
  409 when any call raised. Every call is validated first (typed 4xx naming the call). The
  ``Idempotency-Key`` is the batch id: it runs once; reused with other calls it gets 422.
- ``GET /streams/{stream}?from_offset=N&limit=M&wait=S`` reads an output stream (``ctx.emit``): 200
  ``{"stream", "events": [{"offset", "epoch", "value"}], "next_offset", "first_offset", "end_offset"}``
  with whole atoms (at most ``limit``, capped by ``stream_max_events``, events, except that a larger first
  atom is returned whole); long-polls up to ``wait`` seconds (at most 30) when nothing is there yet. With
  ``Accept: text/event-stream`` it answers with server-sent events instead (``id`` = the offset after the
  event, ``data`` = the JSON event; resumable with ``Last-Event-ID``), for at most ``stream_sse_seconds``.
- Admin, metrics and dashboard routes (``/admin/status``, ``/admin/pause``, ``/admin/resume``,
  ``/admin/state/{operator}``, ``/admin/summary``, ``/metrics``, ``/dashboard``): :mod:`charon.server.admin`.
- ``GET /health`` (open): 200 while the runtime serves, else 503 with its ``status`` (``starting`` while a
  runtime started in the background comes up, ``recovering``, ``failed``, ``stopped``). While starting, state
  reads answer 503 with ``Retry-After`` and invokes are accepted into the runtime's durable input log.
- ``GET /openapi.json`` (open): the OpenAPI 3.1 description of these routes,
  including one ``/invoke`` path per function of the application with its parameter names and types.

Everything is checked *before* anything reaches the runtime (and so its input log): the bearer token
(401) and its scope for the route (403, :mod:`charon.server.auth`), the body size (413, from ``Content-Length``
and again while streaming) and arrival time (408), the content type (415), the body syntax and plainness (400:
malformed, non-UTF-8 strings, msgpack extension types, nesting deeper than ``max_depth``), the URL path (400
unless it percent-decodes to valid UTF-8), the key (400 ``InvalidKey``, by :func:`charon.core.routing.check_key`),
the operator and function names (404; a client's call names public functions only) and the arguments' arity and
types (422, through ``Application.validate``). Keys may contain ``/`` (the last path segment is the function) and
any other character ``check_key`` accepts, line breaks included (percent-encoded):
every valid key is addressable by every route. Bodies are decoded with msgspec; nothing is ever unpickled.

Idempotency: a reused ``Idempotency-Key`` with the same operator, key, function and arguments gets the
first reply; with anything else it is refused with 422 ``IdempotencyConflict`` (checked against the
gateway's in-flight and recent requests and the runtime's input log, :func:`check_same_request`). Request
ids are 1-200 characters of ``A-Z a-z 0-9 . _ ~ : @ + = -``; requests without one get a uuid4 hex id.
Status URLs are relative, or under ``public_url``; never built from the ``Host`` header.

Limits (:class:`charon.config.GatewayConfig`): retained replies are bounded by count and bytes, requests in
flight (accepted, not answered: e.g. the backlog while paused) by ``max_inflight_bytes`` (503 ``BacklogFull`` with
``Retry-After`` beyond), waiting stream readers by ``stream_max_waiters`` (503 ``StreamReadersFull``), runtime
reads run in a small thread pool (never on the event loop), and the uvicorn protocol closes connections
that do not deliver a request head within ``header_timeout`` and caps open connections at
``max_connections`` by shedding the one that has waited longest for its head.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from starlette.applications import Starlette
from starlette.requests import Request as HTTPRequest
from starlette.responses import Response
from starlette.routing import Route

from charon import serde
from charon.config import GatewayConfig
from charon.core.context import EFFECT_ID_PREFIX, MAX_VALUE_BYTES, is_continuation_id
from charon.core.routing import check_key
from charon.errors import (
    BadArguments,
    CharonError,
    IdempotencyConflict,
    InvalidKey,
    PayloadTooLarge,
    SerializationError,
    UnknownFunction,
    UnknownOperator,
)
from charon.log.client import check_same_request, lookup_request, stored_request
from charon.log.sqlite import InputLog as FileInputLog
from charon.messages import RESERVED_ID_PREFIXES, Reply, Request, is_reserved_id
from charon.operator import BATCH_FUNCTION, BATCH_OPERATOR, batch_request, check_batch
from charon.runtime.contract import Engine, EngineSource, as_engine
from charon.server import uvicorn_pin
from charon.server.admin import EffectsAdmin, admin_routes
from charon.server.audit import note
from charon.server.auth import (
    ADMIN,
    EFFECTS,
    INVOKE,
    OPEN_ROUTES,
    ROUTE_SCOPES,
    SCOPES_KEY,
    Principal,
    Tokens,
    is_effect_continuation,
    route_scopes,
    scoped_route_app,
)
from charon.server.bulk import bulk_routes
from charon.server.forward import DriverForward
from charon.server.http import StrictPath
from charon.server.lane import DirectInvoke, InvokeLane
from charon.server.limits import inflight_size, read_body, reply_size
from charon.server.limits_admin import ADMISSION_ERRORS, AdmissionGuard, retry_after
from charon.server.metrics import GatewayMetrics
from charon.server.openapi import describe_app, openapi_document
from charon.server.promises import promise_routes
from charon.server.schedules import schedule_routes
from charon.server.streams import StreamReaders
from charon.server.tracing import Tracing, tracing_from_config
from charon.server.wire import (
    IDEMPOTENCY_KEY,
    STATUS_OF_ERROR,
    HTTPError,
    guard,
    json_encoder,
    parse_args,
    parse_body,
    respond,
)
from charon.server.workflows import workflow_routes

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

__all__ = ["create_app", "describe_app", "STATUS_OF_ERROR"]

_log = logging.getLogger("charon.server")




class Gateway:
    def __init__(self, engine: Engine, token: str | None, cfg: GatewayConfig, tokens: Tokens | None = None) -> None:
        self.engine = engine
        self._enqueue = engine.enqueuer()  # the engine's direct entry, if it has one (asked once)
        controls = engine.controls
        # replies name the code version they ran with where code updates exist; by transaction where a compatible
        # update lets two versions run at once (None: no code updates)
        self.versions_by_tid = None if controls is None else "compatible" in controls.code_update_modes
        #: who may call which route (charon.server.auth): the all-scope ``token`` and a tokens file's
        self.auth = tokens if tokens is not None else Tokens(token)
        self.cfg = cfg
        self.max_body = cfg.max_body
        self.wait_timeout = cfg.wait_timeout
        # in-flight submissions and recent replies, each with the fingerprint of its request
        self.inflight: dict[str, asyncio.Future[Reply]] = {}
        self.inflight_req: dict[str, Request] = {}
        self.recent: OrderedDict[str, tuple[Reply, Request]] = OrderedDict()
        self.recent_size = 0
        self.inflight_bytes = 0  # of the in-flight requests (see _inflight_size), at most cfg.max_inflight_bytes
        self.known_ops = set(describe_app(engine.app))
        self._openapi: bytes | None = None
        self.has_effects = False  # an effect executor runs beside the engine (its routes exist)
        self._pool = ThreadPoolExecutor(cfg.read_threads, thread_name_prefix="charon-gateway-read")
        # /health has a thread of its own: reads waiting for an epoch boundary never delay it
        self._health_pool = ThreadPoolExecutor(1, thread_name_prefix="charon-gateway-health")
        self.streams = StreamReaders(cfg, self.off_loop)  # long polls and server-sent-event connections
        # a runtime started in the background (see create_app's ``background_start``): until it is up,
        # /health answers 503 starting and state reads a 503 with Retry-After; invokes go to the input log
        self.starting = False
        self.start_error: str | None = None
        self.metrics: Any = None  # charon.server.metrics.GatewayMetrics, set by create_app
        self.admission = AdmissionGuard(self.engine)  # refuses invokes early while admission is at its bound
        self.tracing: Tracing | None = None  # OpenTelemetry spans (charon.server.tracing), when on

    def check_ready(self) -> None:
        """503 (with Retry-After) while the runtime is starting in the background or failed to start."""
        if self.start_error is not None:
            raise HTTPError("Unavailable", f"the runtime failed to start: {self.start_error}")
        if self.starting:
            raise HTTPError("Unavailable", "the runtime is starting; retry shortly")

    # ---- helpers

    def check_auth(self, request: HTTPRequest, scopes: frozenset[str] | None = None) -> Principal:
        """Who sent ``request``: 401 without a known bearer token, 403 when it lacks every scope the route
        accepts (``scopes``, else the route's in :data:`charon.server.auth.ROUTE_SCOPES`; a route without scopes
        asks for ``admin``). The token's name goes to the route's audit line."""
        if not self.auth.enabled:
            return self.auth.authenticate("")
        header = request.headers.get("authorization", "")
        if scopes is not None:
            return self.auth.authorize(header, scopes)
        who = self.auth.authorize(header, request.scope.get(SCOPES_KEY) or (ADMIN,))
        note(request, token=who.name)
        return who

    def check_token(self, header: str, scopes: frozenset[str] = ROUTE_SCOPES["invoke"]) -> Principal:
        """The principal of ``header`` (the request's ``Authorization``) if it has one of ``scopes`` (401, 403)."""
        return self.auth.authorize(header, scopes)

    def check_invoker(self, who: Principal, given: str | None) -> bool:
        """Whether this invoke may name an internal function (an effect worker's continuation: the ``effects``
        scope and an ``fx.<effect id>.done`` request id); 403 for a token that may not make it (only the
        ``effects`` scope uses ``fx.`` request ids; without the ``invoke`` scope, only continuations)."""
        continuation = who.has(EFFECTS) and is_effect_continuation(given)
        if given is not None and given.startswith(EFFECT_ID_PREFIX) and not who.has(EFFECTS):
            raise HTTPError("Forbidden", f"request ids starting with {EFFECT_ID_PREFIX!r} are effect continuations: "
                            f"the token {who.name!r} lacks the effects scope")
        if not who.has(INVOKE) and not continuation:
            raise HTTPError("Forbidden", f"the token {who.name!r} lacks the invoke scope (with the effects scope it "
                            "submits effect continuations only)")
        return continuation

    async def off_loop(self, method: Callable[..., Any], *args: Any) -> Any:
        """Call a runtime method without blocking the event loop (awaited if it is a coroutine function)."""
        if inspect.iscoroutinefunction(method):
            return await method(*args)
        value = await asyncio.get_running_loop().run_in_executor(self._pool, method, *args)
        if inspect.isawaitable(value):
            value = await value
        return value

    async def read_body(self, request: HTTPRequest) -> bytes:
        """The request's body, within ``max_body`` bytes and ``body_timeout`` seconds (413, 408)."""
        return await read_body(request, self.max_body, self.cfg.body_timeout)

    def validate(self, operator: str, key: str, function: str, args: list[Any], public_only: bool = False
                 ) -> Request:
        """The request, if its names, key and arguments are valid (typed 4xx otherwise).

        The one validator of every call a client sends, whatever the route (``/invoke``, each call of a
        ``/batch``, ``/admin/update``): the arguments are plain data (400), the names exist (404), the key is
        valid (400) and the arguments fit the function (422). ``public_only``: a client's call (``/invoke``,
        ``/batch``): an internal function is answered 404 as if it did not exist (``Application.exposed``). A call
        of the built-in batch operator (a batch nested in a batch, or sent to ``/invoke``) has each of its inner
        calls validated the same way, and every call at every level counts toward ``max_batch_calls``."""
        try:
            serde.check_plain(args, self.cfg.max_depth)
        except SerializationError as exc:
            raise HTTPError("BadRequest", f"malformed body: {exc}") from None
        self._check_call(operator, key, function, args, [0], public_only)
        try:
            return Request("", operator, key, function, serde.encode(list(args)))
        except SerializationError as exc:  # e.g. an integer msgpack cannot carry
            raise HTTPError("SerializationError", str(exc)) from None

    def _check_call(self, operator: str, key: str, function: str, args: list[Any], count: list[int],
                    public_only: bool = False) -> None:
        try:
            self.engine.app.validate(operator, function, args, key=key, public_only=public_only)
        except (UnknownOperator, UnknownFunction, BadArguments, PayloadTooLarge, SerializationError,
                InvalidKey) as exc:
            raise HTTPError(type(exc).__name__, str(exc) or type(exc).__name__) from None
        if operator != BATCH_OPERATOR:
            return
        cap = self.cfg.max_batch_calls
        try:
            calls = check_batch(args[0], cap)
        except BadArguments as exc:
            raise HTTPError("BadArguments", str(exc)) from None
        for i, (op, k, fn, a) in enumerate(calls):
            count[0] += 1
            if count[0] > cap:
                raise HTTPError("BadArguments", f"a batch holds at most {cap} calls, nested batches' calls "
                                 "included (max_batch_calls)")
            try:
                self._check_call(op, k, fn, a, count, public_only)
            except HTTPError as exc:
                raise HTTPError(exc.error_type, f"batch call {i}: {exc.message}", exc.status) from None

    def request_id(self, request: HTTPRequest) -> str | None:
        return self.id_of(request.headers.get("idempotency-key"))

    def id_of(self, rid: str | None) -> str | None:
        """The request id an ``Idempotency-Key`` header gives (None: none given), or 400."""
        if rid is None:
            return None
        if not IDEMPOTENCY_KEY.match(rid):
            raise HTTPError(
                "BadRequest", "Idempotency-Key must be 1-200 characters of A-Z a-z 0-9 and . _ ~ : @ + = -"
            )
        if is_reserved_id(rid):  # the engine's own transactions (timers, portals, effect continuations, ticks)
            prefixes = " or ".join(map(repr, RESERVED_ID_PREFIXES[:2]))
            raise HTTPError("ReservedRequestId", f"Idempotency-Key {rid!r} is reserved for the engine's own "
                            f"transactions (no client request id starts with {prefixes})")
        return rid

    def conflict(self, req: Request) -> None:
        """422 if a request id this gateway knows was used for another operation."""
        known = self.inflight_req.get(req.request_id)
        if known is None:
            entry = self.recent.get(req.request_id)
            known = entry[1] if entry is not None else None
        try:
            check_same_request(known, req)
        except IdempotencyConflict as exc:
            raise HTTPError("IdempotencyConflict", str(exc)) from None

    @property
    def log_inline(self) -> bool:
        """Whether :meth:`check_log` runs on the loop: no input log, or the in-process node's own SQLite file
        (WAL: a reader never waits for the appender; one indexed point query is cheaper inline than the read
        pool's hop, ~40 us of server CPU per request in issue 24's profile, and the runtime's enqueue makes the
        same kind of lookup on the loop right after it)."""
        log = self.engine.input_log
        return log is None or (self._enqueue is not None and type(log) is FileInputLog
                               and not self.engine.submit_checks_ids)

    async def check_log(self, req: Request, sync: bool = False) -> None:
        """422 if the runtime's input log holds this request id for another operation. ``sync``: the caller
        awaits the reply, so an engine whose submit makes this check itself (in its batched append,
        :attr:`~charon.runtime.contract.Engine.submit_checks_ids`) is left to make it: its conflict reaches the
        caller as the same 422."""
        if self.log_inline:
            self.check_log_inline(req)
            return
        log = self.engine.input_log
        if log is None or req.request_id in self.inflight or req.request_id in self.recent:
            return
        if sync and self.engine.submit_checks_ids:
            return
        # a networked log, or one another process serves: off the loop
        stored = await self.off_loop(stored_request, log, req.request_id)
        self.conflict(req)  # the caches may have learned the id meanwhile
        try:
            check_same_request(stored, req)
        except IdempotencyConflict as exc:
            raise HTTPError("IdempotencyConflict", str(exc)) from None

    def check_log_inline(self, req: Request) -> bool:
        """:meth:`check_log` where :attr:`log_inline` holds; True if the id is not in the input log (fresh: the
        engine's enqueue need not look again, if nothing is awaited before it)."""
        log = self.engine.input_log
        if log is None or req.request_id in self.inflight or req.request_id in self.recent:
            return False
        known, stored = lookup_request(log, req.request_id)
        try:
            check_same_request(stored, req)
        except IdempotencyConflict as exc:
            raise HTTPError("IdempotencyConflict", str(exc)) from None
        return not known  # a known id whose entry was truncated is not fresh: its reply is stored

    def start(self, req: Request, args: list[Any], then: Callable[[asyncio.Future[Reply]], None] | None = None,
              fresh: bool = False) -> asyncio.Future[Reply]:
        """The request's reply to come: a request this gateway runs or answered already gets the same one, a
        new one goes to the runtime (503 BacklogFull past ``max_inflight_bytes``). ``then``: called with the
        future once done, right after the gateway's own bookkeeping (one callback instead of two). ``fresh``: the
        id was just found absent from the input log (:meth:`check_log_inline`), nothing awaited since."""
        fut = self._start(req, args, then, fresh)
        if self.tracing is not None:
            self.tracing.watch(req, fut)
        return fut

    def _start(self, req: Request, args: list[object], then: Callable[[asyncio.Future[Reply]], None] | None,
               fresh: bool) -> asyncio.Future[Reply]:
        rid = req.request_id
        self.conflict(req)
        fut = self.inflight.get(rid)
        if fut is not None:
            if then is not None:
                fut.add_done_callback(then)
            return fut
        loop = asyncio.get_running_loop()
        entry = self.recent.get(rid)
        if entry is not None:
            done: asyncio.Future[Reply] = loop.create_future()
            done.set_result(entry[0])
            if then is not None:
                done.add_done_callback(then)
            return done
        self.admission.check()  # 429 before the log while the engine holds all the waiting it may
        size = inflight_size(req)
        if self.inflight_bytes + size > self.cfg.max_inflight_bytes:
            raise HTTPError("BacklogFull", f"{len(self.inflight)} requests ({self.inflight_bytes} bytes) are waiting "
                             f"for their replies (max_inflight_bytes {self.cfg.max_inflight_bytes}); retry later")
        task: asyncio.Future[Reply]
        if self._enqueue is not None:
            # the request as built here, without a task per request (a runtime not running raises EngineStopped)
            try:
                task = self._enqueue(Request(rid, req.operator, req.key, req.function, req.args, time.time()), fresh)
            except Exception as exc:  # noqa: BLE001 - as the task below would hold it (503 Unavailable)
                task = loop.create_future()
                task.set_exception(exc)
        else:
            task = asyncio.ensure_future(
                self.engine.submit(req.operator, req.key, req.function, args, request_id=rid)
            )
        self.inflight[rid] = task
        self.inflight_req[rid] = req
        self.inflight_bytes += size
        t0 = time.perf_counter()
        if self.metrics is not None:
            self.metrics.observe_request(req)
        if then is None:
            task.add_done_callback(lambda t: self._finished(rid, t, t0))
        else:
            def finished(t: asyncio.Future[Reply]) -> None:
                self._finished(rid, t, t0)
                then(t)

            task.add_done_callback(finished)
        return task

    def _finished(self, rid: str, task: asyncio.Future[Reply], t0: float = 0.0) -> None:
        if self.inflight.get(rid) is task:
            del self.inflight[rid]
            req = self.inflight_req.pop(rid)
            self.inflight_bytes -= inflight_size(req)
        else:  # pragma: no cover - a finished task is replaced only after it finished
            return
        if task.cancelled() or task.exception() is not None:
            return
        self.remember(task.result(), req)
        if self.metrics is not None:
            self.metrics.observe_reply(task.result(), time.perf_counter() - t0)

    def remember(self, rep: Reply, req: Request) -> None:
        """Keep a reply for polls and retries, within the count and byte bounds."""
        old = self.recent.pop(rep.request_id, None)
        if old is not None:
            self.recent_size -= reply_size(old[0])
        self.recent[rep.request_id] = (rep, req)
        self.recent_size += reply_size(rep)
        while self.recent and (
            len(self.recent) > self.cfg.recent_replies or self.recent_size > self.cfg.recent_bytes
        ):
            _, (dropped, _) = self.recent.popitem(last=False)
            self.recent_size -= reply_size(dropped)

    async def lookup(self, rid: str) -> Reply | None:
        entry = self.recent.get(rid)
        if entry is not None:
            return entry[0]
        return await self.off_loop(self.engine.get_reply, rid)

    async def known_pending(self, rid: str) -> bool:
        """Whether the runtime's input log holds the request (it is pending if it has no reply)."""
        log = self.engine.input_log
        if log is None:
            return False
        return bool(await self.off_loop(log.contains, rid))

    # ---- responses

    def reply_response(self, request: HTTPRequest, rep: Reply) -> Response:
        status, body = self.reply_doc(rep)
        return respond(request, status, body, retry_after(rep) if status == 429 else None)

    def reply_doc(self, rep: Reply) -> tuple[int, dict[str, Any]]:
        """A reply's status and document (200 committed, 409 aborted)."""
        extra = {}
        if self.versions_by_tid is not None and rep.epoch >= 0:  # code updates: the version it ran with
            version_at = self.engine.version_at
            extra["code_version"] = version_at(rep.epoch, rep.tid) if self.versions_by_tid else version_at(rep.epoch)
        if rep.ok:
            try:
                value = serde.decode(rep.value) if rep.value else None
            except SerializationError as exc:
                raise HTTPError("SerializationError", str(exc), 500) from None
            body = {
                "request_id": rep.request_id,
                "tid": rep.tid,
                "epoch": rep.epoch,
                "position": rep.position,
                "value": value,
                "status": "committed",
                **extra,
            }
            return 200, body
        body = {
            "error": {"type": rep.error_type, "message": rep.error_message},
            "request_id": rep.request_id,
            "tid": rep.tid,
            "epoch": rep.epoch,
            "position": rep.position,
            "status": "aborted",
            **extra,
        }
        return 429 if rep.error_type in ADMISSION_ERRORS else 409, body

    def status_url(self, request: HTTPRequest, rid: str) -> str:
        """The poll URL of a request: under the configured public URL, else relative (never the Host header)."""
        return self.status_url_for(request.scope.get("root_path", ""), rid)

    def status_url_for(self, root_path: str, rid: str) -> str:
        """:meth:`status_url` given the request's ASGI ``root_path``."""
        path = f"{root_path}/requests/{quote(rid, safe='')}"
        base = self.cfg.public_url
        return base.rstrip("/") + path if base else path

    def accepted(self, request: HTTPRequest, rid: str) -> Response:
        url = self.status_url(request, rid)
        return respond(
            request, 202, {"request_id": rid, "status_url": url, "status": "pending"}, {"Location": url}
        )

    # ---- endpoints

    async def invoke(self, request: HTTPRequest) -> Response:
        who = self.check_auth(request, ROUTE_SCOPES["invoke"])  # also reached past the router (InvokeLane)
        operator = request.path_params["operator"]
        key = request.path_params["key"]
        function = request.path_params["function"]
        mode = request.query_params.get("mode", "sync")
        if mode not in ("sync", "async"):
            raise HTTPError("BadRequest", "mode must be 'sync' or 'async'")
        given = self.request_id(request)
        internal = self.check_invoker(who, given)
        body = await self.read_body(request)
        req, args = self.prepare(operator, key, function, given, request.headers.get("content-type"), body,
                                 internal)
        if given is not None:
            await self.check_log(req, sync=mode == "sync")
        fut = self.start(req, args, fresh=given is None)  # a generated id: a new uuid4
        if mode == "async":
            return self.accepted(request, req.request_id)
        return await self.await_reply(request, req.request_id, fut, self.wait_timeout)

    @property
    def continuation_body(self) -> int:
        """The body limit of ``POST /effects/continue/...`` (only): a continuation carries an effect's result (a value,
        at most ``MAX_VALUE_BYTES``) and its ``carry`` (part of an effect request, at most ``MAX_VALUE_BYTES`` too),
        plus framing; ``max_continuation_body`` (0: twice the value limit plus 1 MiB)."""
        return self.cfg.max_continuation_body or 2 * MAX_VALUE_BYTES + (1 << 20)

    async def continue_effect(self, request: HTTPRequest) -> Response:
        """``POST /effects/continue/{operator}/{key}/{function}``: an effect worker's continuation (``charon effects
        work --url``), under the effect's request id ``fx.<app>.<tid>.<inv>.<n>.done`` in the ``Idempotency-Key``
        (required; reserved: ``/invoke`` and ``/batch`` refuse it). The same checks and answers as ``/invoke``
        but a body limit of its own (:attr:`continuation_body`), so any value a handler may return is carried.
        A route of its own: what may resume effects (an ``effects`` credential) is not what may invoke."""
        self.check_auth(request)
        mode = request.query_params.get("mode", "sync")
        if mode not in ("sync", "async"):
            raise HTTPError("BadRequest", "mode must be 'sync' or 'async'")
        rid = request.headers.get("idempotency-key")
        if rid is None or not IDEMPOTENCY_KEY.match(rid) or not is_continuation_id(rid):
            raise HTTPError("BadRequest", "Idempotency-Key must be an effect's continuation id "
                            f"({EFFECT_ID_PREFIX}<app>.<tid>.<inv>.<n>.done)")
        body = await read_body(request, self.continuation_body, self.cfg.body_timeout)
        req, args = self.prepare(request.path_params["operator"], request.path_params["key"],
                                 request.path_params["function"], rid, request.headers.get("content-type"), body,
                                 internal=True)  # a continuation's function is usually internal
        await self.check_log(req)
        fut = self.start(req, args)
        if mode == "async":
            return self.accepted(request, rid)
        return await self.await_reply(request, rid, fut, self.wait_timeout)

    def prepare(self, operator: str, key: str, function: str, given: str | None, ctype: str | None,
                body: bytes, internal: bool = False) -> tuple[Request, list[Any]]:
        """An invoke's request and arguments from its body (``ctype``: its Content-Type), every check but the
        input log's (:meth:`check_log`) made: typed 4xx otherwise. ``given``: the client's request id.
        ``internal``: the function may be internal (an effect continuation, :meth:`check_invoker`); else only a
        public one is found."""
        args = parse_body(ctype, body)
        req = self.validate(operator, key, function, args, public_only=not internal)
        rid = given or uuid.uuid4().hex
        req = Request(rid, req.operator, req.key, req.function, req.args)
        if self.start_error is not None:  # nothing would ever run it (while starting, the log takes it)
            self.check_ready()
        if given is not None:
            self.conflict(req)
        return req, args

    async def batch(self, request: HTTPRequest) -> Response:
        """A client atomic batch: the calls run in order as one transaction (all commit or none)."""
        who = self.check_auth(request)
        mode = request.query_params.get("mode", "sync")
        if mode not in ("sync", "async"):
            raise HTTPError("BadRequest", "mode must be 'sync' or 'async'")
        given = self.request_id(request)
        if given is not None and given.startswith(EFFECT_ID_PREFIX) and not who.has(EFFECTS):
            self.check_invoker(who, given)  # 403: only effect workers take fx. ids
        calls = parse_args(request, await self.read_body(request), "calls")
        rid = given or uuid.uuid4().hex
        _, function, args = BATCH_OPERATOR, BATCH_FUNCTION, [calls]
        # every call, nested ones too (typed 4xx naming it); public functions only
        self.validate(BATCH_OPERATOR, rid, function, args, public_only=True)
        _, function, args = batch_request(calls)
        req = Request(rid, BATCH_OPERATOR, rid, function, serde.encode(args))
        if self.start_error is not None:  # as for invoke: nothing would ever run it
            self.check_ready()
        if given is not None:
            self.conflict(req)
            await self.check_log(req)
        fut = self.start(req, args)
        if mode == "async":
            return self.accepted(request, rid)
        return await self.await_reply(request, rid, fut, self.wait_timeout)

    async def await_reply(
        self, request: HTTPRequest, rid: str, fut: asyncio.Future[Reply], timeout: float
    ) -> Response:
        if not fut.done():
            await asyncio.wait({fut}, timeout=timeout)
        if not fut.done():
            return self.accepted(request, rid)
        exc = fut.exception()
        if exc is not None:
            if isinstance(exc, CharonError) and type(exc).__name__ in STATUS_OF_ERROR:
                raise HTTPError(type(exc).__name__, str(exc))
            raise HTTPError(
                "Unavailable", f"the runtime failed to take the request: {type(exc).__name__}: {exc}"
            )
        return self.reply_response(request, fut.result())

    async def request_status(self, request: HTTPRequest) -> Response:
        self.check_auth(request)
        rid = request.path_params["request_id"]
        try:
            wait = min(max(float(request.query_params.get("wait", 0)), 0.0), 30.0)
        except ValueError:
            raise HTTPError("BadRequest", "wait must be a number of seconds") from None
        if wait != wait:  # NaN
            raise HTTPError("BadRequest", "wait must be a number of seconds")
        fut = self.inflight.get(rid)
        if fut is not None:
            return await self.await_reply(request, rid, fut, wait)
        rep = await self.lookup(rid)
        if rep is None:
            if await self.known_pending(rid):  # e.g. accepted before a gateway restart
                rep = await self.lookup(rid)  # it may have been answered in between
                if rep is None:
                    return self.accepted(request, rid)
            else:
                raise HTTPError("NotFound", f"unknown request id {rid!r}")
        return self.reply_response(request, rep)

    def entity_of(self, request: HTTPRequest) -> tuple[str, str]:
        """The ``{operator}/{key}`` of an entity route, checked (typed 404/400 before anything is read)."""
        operator = request.path_params["operator"]
        key = request.path_params["key"]
        if self.known_ops and operator not in self.known_ops:
            raise HTTPError("UnknownOperator", f"unknown operator {operator!r}")
        try:
            check_key(key)
        except InvalidKey as exc:
            raise HTTPError("InvalidKey", str(exc)) from None
        return operator, key

    async def state(self, request: HTTPRequest) -> Response:
        self.check_auth(request)
        operator, key = self.entity_of(request)
        self.check_ready()
        value = await self.off_loop(self.engine.read_state, operator, key)
        return respond(request, 200, {"operator": operator, "key": key, "value": value})

    @property
    def stream_waiters(self) -> int:
        """Long polls and server-sent-event connections open now."""
        return self.streams.waiters.taken

    async def stream(self, request: HTTPRequest) -> Response:
        """A page of an output stream (long polling), or server-sent events (see the module docstring)."""
        self.check_auth(request)
        log = self.engine.streams
        if log is None:
            raise HTTPError("NotFound", "this runtime has no output streams")
        stream, offset, limit, wait = self.streams.params(request)
        if "text/event-stream" in request.headers.get("accept", ""):
            return self.streams.sse(log, stream, offset, limit)
        return respond(request, 200, await self.streams.page(request, log, stream, offset, limit, wait))

    async def timers(self, request: HTTPRequest) -> Response:
        """The pending timers an entity registered (an admin read)."""
        self.check_auth(request)
        operator, key = self.entity_of(request)
        found = await self.off_loop(self.engine.timers, operator, key)
        doc = [{"id": t.id, "due": t.due, "operator": t.operator, "key": t.key, "function": t.function,
                "args": serde.decode(t.args)} for t in found]
        return respond(request, 200, {"operator": operator, "key": key, "timers": doc})

    async def health(self, request: HTTPRequest) -> Response:
        """200 while the runtime serves; 503 with its state (status, epoch, last error...) otherwise."""
        probe = self.engine.health
        doc: dict[str, Any] = {"status": "ok", "ok": True}
        if self.start_error is not None:
            doc = {"status": "failed", "ok": False, "last_error": self.start_error}
        elif self.starting:
            doc = {"status": "starting", "ok": False}
        else:
            try:
                fut = asyncio.get_running_loop().run_in_executor(self._health_pool, probe)
                doc = dict(await asyncio.wait_for(fut, HEALTH_TIMEOUT_S))
            except TimeoutError:
                doc = {"status": "unresponsive", "ok": False,
                       "last_error": f"the runtime's health check did not answer within {HEALTH_TIMEOUT_S:g} s"}
            except Exception as exc:  # noqa: BLE001 - never a 500: the truth is that it cannot tell now
                doc = {"status": "recovering", "ok": False,
                       "last_error": f"the runtime's health check failed: {type(exc).__name__}: {exc}"[:500]}
        doc["inflight"] = len(self.inflight)
        return respond(request, 200 if doc.get("ok", True) else 503, doc)

    async def openapi(self, request: HTTPRequest) -> Response:
        if self._openapi is None:
            self._openapi = json_encoder.encode(openapi_document(self.engine.app, self.auth.enabled,
                                                                 self.has_effects))
        return Response(self._openapi, media_type="application/json")


HEALTH_TIMEOUT_S = 2.0  # a runtime's health() slower than this is itself the answer: 503 unresponsive



def _call_graphs(engine: Engine) -> Callable[[str], list[dict[str, object]] | None]:
    """A traced reply's call graph, from the engine's invocation inspector (none where it has none)."""

    def call_graph(request_id: str) -> list[dict[str, object]] | None:
        log = engine.requests
        return None if log is None else log.call_graph(request_id)

    return call_graph


def create_app(
    runtime: Engine | EngineSource,
    *,
    token: str | None,
    tokens_file: str | None = None,
    max_body: int | None = None,
    wait_timeout: float | None = None,
    manage_runtime: bool = False,
    recent_replies: int | None = None,
    config: GatewayConfig | None = None,
    background_start: bool = False,
    on_start_failure: Callable[[str], None] | None = None,
    effects: EffectsAdmin | None = None,
    tracer_provider: TracerProvider | None = None,
    forward_to: str | None = None,
    on_shutdown: Callable[[], Awaitable[None]] | None = None,
) -> Any:
    """Build the gateway's ASGI app over ``runtime`` (an :class:`~charon.runtime.contract.Engine`, or a runtime
    that gives one: the gateway uses nothing but the contract).

    ``token``: a bearer token with every scope, required on every route but ``/health``, ``/openapi.json`` and
    the dashboard's files; ``tokens_file``: a TOML file of named tokens with scopes, re-read when it changes
    (:mod:`charon.server.auth`). Neither disables authentication (development only). ``config``: limits and
    settings (default :meth:`GatewayConfig.from_env`); ``max_body``, ``wait_timeout`` and ``recent_replies``
    override it.
    ``manage_runtime``: start and stop the runtime with the app's lifespan (the runtime then lives on the
    server's event loop, which is what the in-process runtime needs).
    ``background_start``: a blocking ``start`` (the Spark runtime's, ~20 s) runs in a thread while the port
    is already open: until it returns, ``/health`` answers 503 ``{"status": "starting"}``, state reads 503
    with ``Retry-After``, and invokes are accepted into the runtime's durable input log (they run once the
    engine is up; a synchronous call answers 202 with its status URL after ``wait_timeout``). A failed start
    turns ``/health`` to ``{"status": "failed"}`` and calls ``on_start_failure`` with the reason.
    ``effects``: an effect executor run beside the engine (started after it, stopped before it; its admin routes
    and metrics, :class:`charon.server.admin.EffectsAdmin`).
    ``tracer_provider``: an OpenTelemetry tracer provider to trace requests with (default: one exporting over OTLP
    when ``config.otel_endpoint`` or the ``OTEL_*`` variables name an endpoint, else tracing is off;
    :mod:`charon.server.tracing`).
    ``forward_to``: the driver's control URL: the routes this gateway cannot serve from its engine's logs go there
    (:class:`charon.server.forward.DriverForward`; a gateway process of ``charon run --engine spark``).
    ``on_shutdown``: awaited first when the app shuts down, before anything is stopped (the driver stops its
    gateway processes there, while its engine still answers their requests).
    """
    cfg = dataclasses.replace(config) if config is not None else GatewayConfig.from_env()
    for name, value in (("max_body", max_body), ("wait_timeout", wait_timeout), ("recent_replies", recent_replies)):
        if value is not None:
            setattr(cfg, name, value)
    engine = as_engine(runtime)
    gw = Gateway(engine, token, cfg, Tokens(token, tokens_file))
    gw.tracing = (Tracing(tracer_provider, engine.epoch_stats, call_graph_of=_call_graphs(engine),
                          max_function_spans=cfg.otel_function_spans, shared_epochs=cfg.otel_shared_epoch_spans)
                  if tracer_provider is not None
                  else tracing_from_config(cfg, engine.epoch_stats, _call_graphs(engine)))

    async def start_in_background() -> None:
        try:
            await engine.start()
            if effects is not None:
                await effects.start()
            _log.info("ready", extra={"event": "ready", "engine": engine.kind, "partitions": engine.partitions})
        except Exception as exc:  # noqa: BLE001 - reported in /health and to the server
            gw.start_error = f"{type(exc).__name__}: {exc}"
            # the message names the cause (a JVM's own output included); the engine's frames only at debug level
            _log.error("the runtime failed to start: %s", gw.start_error,
                       extra={"event": "start_failed", "error_type": type(exc).__name__})
            _log.debug("where the start failed", exc_info=exc, extra={"event": "start_failed_traceback"})
            if on_start_failure is not None:
                on_start_failure(gw.start_error)
        finally:
            gw.starting = False

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        starter: asyncio.Task[None] | None = None
        if manage_runtime:
            if background_start and engine.slow_start:
                gw.starting = True
                starter = asyncio.ensure_future(start_in_background())
            else:
                await engine.start()
                if effects is not None:
                    await effects.start()
                _log.info("ready", extra={"event": "ready", "engine": engine.kind, "partitions": engine.partitions,
                                          "tracing": gw.tracing is not None})
        sampler = asyncio.ensure_future(gw.metrics.sample_every(1.0, lambda: len(gw.inflight), gw.off_loop))
        try:
            yield
        finally:
            sampler.cancel()
            if on_shutdown is not None:
                await on_shutdown()
            if manage_runtime:
                _log.info("shutting down", extra={"event": "shutdown", "inflight": len(gw.inflight)})
            if starter is not None and not starter.done():
                await asyncio.wait({starter})  # a half-started runtime is stopped once its start returns
            if effects is not None and manage_runtime:
                await effects.stop()
            pending = list(gw.inflight.values())
            if pending:
                await asyncio.wait(pending, timeout=5.0)
            if manage_runtime and gw.start_error is None:
                await engine.stop()
            gw.streams.close()
            gw._pool.shutdown(wait=False, cancel_futures=True)
            if gw.tracing is not None:
                await asyncio.to_thread(gw.tracing.shutdown)  # the queued spans leave first
            if manage_runtime:
                _log.info("stopped", extra={"event": "stopped"})

    invoke_handler, batch_handler = guard(gw.invoke), guard(gw.batch)
    if gw.tracing is not None:  # a server span around each (traced requests take the ASGI route: no direct lane)
        invoke_handler = gw.tracing.route(invoke_handler, "POST /invoke/{operator}/{key}/{function}")
        batch_handler = gw.tracing.route(batch_handler, "POST /batch")
    invoke = Route("/invoke/{operator}/{key:charonkey}/{function}", invoke_handler, methods=["POST"],
                   name="invoke")
    # effect workers' continuations: a route (and, with scoped tokens, a credential) of their own, not /invoke's
    resume = Route("/effects/continue/{operator}/{key:charonkey}/{function}", guard(gw.continue_effect),
                   methods=["POST"], name="effect_continue")
    lacking = uvicorn_pin.missing() if cfg.direct_invoke and gw.tracing is None else ()
    if lacking:  # a uvicorn outside the pinned range: every invoke through the ASGI route (same answers, slower)
        _log.warning("the direct invoke path is off: the installed uvicorn lacks %s (pyproject.toml pins the tested "
                     "versions)", ", ".join(lacking), extra={"event": "direct_invoke_off"})
    direct = DirectInvoke(gw, invoke) if cfg.direct_invoke and gw.tracing is None and not lacking else None
    routes = [
        invoke,
        resume,
        Route(
            "/requests/{request_id}", guard(gw.request_status), methods=["GET"], name="request_status"
        ),
        Route("/state/{operator}/{key:charonkey}", guard(gw.state), methods=["GET"], name="state"),
        Route("/streams/{stream}", guard(gw.stream), methods=["GET"], name="stream"),
        Route("/batch", batch_handler, methods=["POST"], name="batch"),
        Route("/timers/{operator}/{key:charonkey}", guard(gw.timers), methods=["GET"], name="timers"),
        Route("/health", guard(gw.health), methods=["GET"], name="health"),
        Route("/openapi.json", gw.openapi, methods=["GET"], name="openapi"),
    ]
    gw.metrics = GatewayMetrics(engine, samples=cfg.metrics_samples, history_samples=cfg.metrics_history_samples,
                                history_bytes=cfg.metrics_history_bytes)
    gw.has_effects = effects is not None
    routes += admin_routes(gw, gw.metrics, effects)
    routes += promise_routes(gw) + schedule_routes(gw)  # durable promises and schedules (issue 34)
    routes += workflow_routes(gw, None if effects is None else effects.get_effect)  # workflows (issue 34 item 4)
    routes += bulk_routes(gw, effects)  # bulk operations over them, queued invocations and parked effects
    route_scopes(r.name for r in routes)  # every route has its scopes (or is open)
    for r in routes:
        if r.name not in OPEN_ROUTES:
            r.app = scoped_route_app(r.app, ROUTE_SCOPES[r.name])
    async def http_error(request: HTTPRequest, exc: Exception) -> Response:
        # routing errors (no such route, wrong method) in the same typed JSON shape as every other error
        status = getattr(exc, "status_code", 500)
        kind = {404: "NotFound", 405: "MethodNotAllowed"}.get(status, "HTTPError")
        detail = getattr(exc, "detail", "") or kind
        return respond(request, status, {"error": {"type": kind, "message": str(detail)}},
                          getattr(exc, "headers", None))

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: http_error, 405: http_error})
    app.state.gateway = gw
    app.state.runtime = runtime
    app.state.engine = engine
    inner: Any = app if forward_to is None else DriverForward(app, forward_to, max_body=cfg.max_body)
    outer = InvokeLane(StrictPath(inner), invoke, invoke.endpoint, direct)  # the hot route around the dispatch
    outer.state = app.state  # type: ignore[attr-defined]
    outer.config = cfg  # type: ignore[attr-defined]
    return outer

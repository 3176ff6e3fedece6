"""Python clients of the Charon HTTP gateway: :class:`Client` (blocking) and :class:`AsyncClient` (asyncio).

Every invocation carries an ``Idempotency-Key`` (the caller's ``request_id`` or a fresh uuid4 hex), so
retries after connection errors, timeouts and 5xx answers reuse the same key and the transaction executes
once. Requests and replies travel as msgpack (so ``bytes`` values round-trip); errors come back typed, as the same
classes the engine raises in-process (``InProcessRuntime.invoke``, the engine's ``Controls``):

* 409 with a ``tid`` (an abort): :class:`charon.errors.TransactionAborted` (``error_type``, ``message``,
  ``request_id``, ``tid``, ``epoch``, ``position``), an engine error's abort class for its ``error_type`` (e.g.
  ``UnknownFunctionAborted``, :data:`charon.errors.ABORTS`);
* any other typed answer: the class :data:`charon.errors.ERRORS` names for its ``error.type`` (the invoke
  path's ``UnknownOperator``, ``BadArguments``, ``InvalidKey``, ``IdempotencyConflict``, ``PayloadTooLarge``...;
  the admin API's ``SQLRejected``, ``SQLSyntaxError``, ``EpochNotRetained``, ``NotSupported``, ``RescaleBusy``
  for ``RescaleRunning``, ``GatePaused`` for ``Paused``, ``RequestNotFound`` for ``NotFound``, ``BadRequest``...);
  an untyped 401/403/413/422/400 is ``Unauthorized``/``Forbidden``/``PayloadTooLarge``/``BadArguments``/``BadRequest``;
* 503: :class:`GatewayUnavailable` (a :class:`GatewayError` and a :class:`charon.errors.EngineUnavailable`;
  :class:`GatewayLogUnavailable`, also a :class:`charon.errors.LogUnavailable`, for ``LogUnavailable``), after
  the retries; any other status: :class:`GatewayError`.

The table of every error, its HTTP status and ``error.type``: docs/reference/errors.md.
"""

from __future__ import annotations

import asyncio
import itertools
import ssl
import sys
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar, NoReturn, TypedDict, cast
from urllib.parse import quote

import httpx
import msgspec

from charon.core.routing import check_key, check_stream
from charon.errors import (
    AVAILABILITY,
    ERRORS,
    BadArguments,
    BadRequest,
    CharonError,
    EngineUnavailable,
    Forbidden,
    GatePaused,
    LogUnavailable,
    PayloadTooLarge,
    RequestNotFound,
    RescaleBusy,
    ReservedRequestId,
    SerializationError,
    Unauthorized,
    aborted,
)
from charon.messages import is_reserved_id
from charon.serde import check_value

__all__ = [
    "Client",
    "AsyncClient",
    "Call",
    "Result",
    "Event",
    "StreamPage",
    "Unauthorized",
    "Forbidden",
    "BadRequest",
    "RequestNotFound",
    "RescaleRunning",
    "Paused",
    "GatewayError",
    "GatewayUnavailable",
    "GatewayLogUnavailable",
    "VersionCounts",
    "WorkflowMigration",
    "WorkflowVersions",
]

try:  # httpcore re-imports sniffio on every async request; a failed import is not cached by Python
    import sniffio  # noqa: F401
except ImportError:  # pragma: no cover - depends on the environment
    sys.modules.setdefault("sniffio", None)  # type: ignore[arg-type]

MSGPACK = "application/msgpack"
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder()


def _rescale_body(partitions: int | None, log_partitions: int | None) -> dict[str, int]:
    """The body of ``POST /admin/rescale``: the counts given, as given (no ``int()``: 2.5 must be refused by
    the server with 400, not rescale to 2)."""
    body = {} if partitions is None else {"partitions": partitions}
    if log_partitions is not None:
        body["log_partitions"] = log_partitions
    return body


def _segment(name: str) -> str:
    """One URL path segment naming ``name`` exactly: percent-encoded, and the dot segments ``.``/``..``
    (which HTTP clients and servers resolve away) spelled ``%2E``."""
    q = quote(name, safe="")
    return q.replace(".", "%2E") if set(name) == {"."} else q


#: the admin API's availability refusals, by their answers' ``error.type`` (the classes the engine's controls raise)
RescaleRunning = RescaleBusy
Paused = GatePaused


_PLAIN = frozenset((str, int, float, bool, bytes, type(None)))


def _check_args(args: Sequence[Any]) -> None:
    """Refuse arguments outside the value model (sets, datetimes, objects...) as the engine does
    (:func:`charon.serde.check_value`): msgpack would silently turn them into something else (a set into a list)."""
    for a in args:
        if type(a) not in _PLAIN:
            check_value(a)


def _unreachable(exc: httpx.TransportError) -> CharonError | httpx.TransportError:
    """A transport error after all retries: the gateway could not be reached at all (connection refused, no
    route, a connect timeout: nothing was sent) is :class:`GatewayUnavailable`; any other (the request may have
    reached the engine) stays as httpx raised it."""
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        err = GatewayUnavailable(503, "Unavailable", f"cannot reach the gateway: {type(exc).__name__}: {exc}")
        err.__cause__ = exc
        return err
    return exc


class GatewayError(CharonError):
    """Any other error answer of the gateway (a 5xx after all retries; 503 is :class:`GatewayUnavailable`)."""

    kind: ClassVar[str] = AVAILABILITY

    def __init__(self, status: int, error_type: str, message: str) -> None:
        super().__init__(f"HTTP {status} {error_type}: {message}")
        self.status = status
        self.error_type = error_type
        self.message = message


class GatewayUnavailable(GatewayError, EngineUnavailable):
    """503 after all retries (the engine is starting, recovering or stopped, or its log or backlog is full): the
    HTTP face of :class:`charon.errors.EngineUnavailable`; retry later."""


class GatewayLogUnavailable(GatewayUnavailable, LogUnavailable):
    """503 ``LogUnavailable`` after all retries: the engine's input log could not take the request (nothing was
    appended); the HTTP face of :class:`charon.errors.LogUnavailable`; retry later."""


@dataclass(frozen=True, slots=True)
class Result:
    """A committed reply: the function's return value and where the transaction ran.

    Results (and aborts) ordered by (epoch, position) form a serial order equivalent to the execution.
    """

    request_id: str
    tid: int
    epoch: int
    value: Any
    position: int | None = None  # place in the epoch's serial order (None from a gateway without it)


@dataclass(frozen=True, slots=True)
class Event:
    """One event of an output stream (``ctx.emit``): ``offset`` in its stream, the ``epoch`` whose atom holds it."""

    stream: str
    offset: int
    epoch: int
    value: Any


@dataclass(frozen=True, slots=True)
class StreamPage:
    """One read of a stream: whole atoms; resume at ``next_offset`` (``first_offset``: oldest retained)."""

    stream: str
    events: list[Event]
    next_offset: int
    first_offset: int
    end_offset: int


def _page(resp: httpx.Response) -> StreamPage:
    body = _decode_body(resp)
    if resp.status_code != 200:
        _raise_error(resp.status_code, body, None)
    s = body["stream"]
    events = [Event(s, e["offset"], e["epoch"], e["value"]) for e in body["events"]]
    return StreamPage(s, events, body["next_offset"], body["first_offset"], body["end_offset"])


@dataclass(frozen=True, slots=True)
class Call:
    """One invocation for :meth:`AsyncClient.invoke_many` / :meth:`Client.invoke_many`."""

    operator: str
    key: str
    function: str
    args: Sequence[Any] = ()
    request_id: str | None = None


class _Pending(Exception):
    """Internal: the gateway answered 202 (still running)."""


def _as_call(c: Call | Sequence[Any]) -> Call:
    if isinstance(c, Call):
        return c
    op, key, fn, *rest = c
    return Call(op, key, fn, tuple(rest[0]) if rest else ())


def _decode_body(resp: httpx.Response) -> Any:
    ctype = resp.headers.get("content-type", "")
    try:
        if ctype.startswith(MSGPACK):
            return _dec.decode(resp.content)
        return msgspec.json.decode(resp.content) if resp.content else None
    except msgspec.DecodeError:
        return None


def _int(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _raise_error(status: int, body: Any, request_id: str | None) -> NoReturn:
    err = body.get("error") if isinstance(body, dict) else None
    etype = str(err.get("type", "")) if isinstance(err, dict) else ""
    message = str(err.get("message", "")) if isinstance(err, dict) else ""
    doc = body if isinstance(body, dict) else {}
    if (status == 409 and not (etype in ("RescaleRunning", "Paused", "VersionInUse") and "tid" not in doc)) or (
            status == 429 and etype in ("RateLimited", "Overloaded")):  # admission's refusals are aborts
        raise aborted(etype, message, str(doc.get("request_id", request_id or "")), tid=_int(doc.get("tid")),
                      epoch=_int(doc.get("epoch")), position=_int(doc.get("position")))
    cls = ERRORS.get(etype)  # the class the engine raises in-process for the same mistake (501 NotSupported too)
    if cls is None and status < 500:
        untyped: dict[int, type[CharonError]] = {401: Unauthorized, 403: Forbidden, 413: PayloadTooLarge,
                                                 422: BadArguments, 400: BadRequest}
        cls = untyped.get(status)
    if cls is not None:
        raise cls(message or etype or f"HTTP {status}")
    cls_5xx = GatewayError
    if status == 503:
        cls_5xx = GatewayLogUnavailable if etype == "LogUnavailable" else GatewayUnavailable
    raise cls_5xx(status, etype or "HTTPError", message or (str(body) if body else ""))


def _result(resp: httpx.Response, request_id: str | None) -> Result:
    """Interpret an invoke/poll answer: a Result, _Pending, or a raised typed error."""
    body = _decode_body(resp)
    if resp.status_code == 200:
        pos = body.get("position")
        return Result(str(body["request_id"]), int(body["tid"]), int(body["epoch"]), body.get("value"),
                      None if pos is None else int(pos))
    if resp.status_code == 202:
        raise _Pending(body.get("request_id", request_id) if isinstance(body, dict) else request_id)
    _raise_error(resp.status_code, body, request_id)


def _retryable(resp: httpx.Response) -> bool:
    return resp.status_code >= 500 and resp.status_code != 501  # 501 NotSupported: the same again


#: Connections per httpx pool: httpcore's pool does work quadratic in its size on every request, so the
#: clients spread requests round-robin over several small pools instead of one large one.
_SHARD_CONNECTIONS = 8


def _limit_body(target: str, limit: dict[str, object] | None, clear: bool, remove: bool) -> dict[str, object]:
    """The body of ``POST /admin/limits``."""
    body: dict[str, object] = {"target": target}
    if limit is not None:
        body["limit"] = limit
    if clear:
        body["clear"] = True
    if remove:
        body["remove"] = True
    return body


def _shard_limits() -> httpx.Limits:
    return httpx.Limits(max_connections=_SHARD_CONNECTIONS, max_keepalive_connections=_SHARD_CONNECTIONS)


_SSL: list[ssl.SSLContext] = []


def _env_proxy(url: str) -> str | None:
    """The proxy the environment names for ``url`` (``HTTP(S)_PROXY``/``ALL_PROXY``, minus ``NO_PROXY``), as httpx
    would use it: the async client's pools are built by hand (one per shard), so they take it explicitly."""
    parts = urllib.parse.urlsplit(url)
    proxies = urllib.request.getproxies()
    proxy = proxies.get(parts.scheme) or proxies.get("all")
    if not proxy or urllib.request.proxy_bypass(parts.hostname or ""):
        return None
    return proxy


def _ssl_context() -> ssl.SSLContext:
    """One TLS context for every pool of every client in this process: httpx builds one per pool otherwise
    (~20-80 ms of CPU each, loading the CA bundle), and a client holds up to 32 pools."""
    if not _SSL:
        _SSL.append(httpx.create_ssl_context())
    return _SSL[0]


def _shard_count(max_connections: int) -> int:
    return max(1, -(-max_connections // _SHARD_CONNECTIONS))


def _backoff(attempt: int) -> float:
    return min(0.05 * (2**attempt), 2.0)


class _Base:
    def __init__(self, url: str, token: str | None, timeout: float, retries: int) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self.retries = retries
        self.headers = {"Accept": MSGPACK}
        if token:
            self.headers["Authorization"] = f"Bearer {token}"

    @staticmethod
    def _invoke_path(operator: str, key: str, function: str) -> str:
        check_key(key)
        return f"/invoke/{_segment(operator)}/{_segment(key)}/{_segment(function)}"

    @staticmethod
    def _state_path(operator: str, key: str) -> str:
        check_key(key)
        return f"/state/{_segment(operator)}/{_segment(key)}"

    @staticmethod
    def _timers_path(operator: str, key: str) -> str:
        check_key(key)
        return f"/timers/{_segment(operator)}/{_segment(key)}"

    @staticmethod
    def _payload(args: Sequence[Any]) -> bytes:
        try:
            body = _enc.encode({"args": list(args)})
        except (TypeError, OverflowError, msgspec.EncodeError) as exc:
            raise SerializationError(f"arguments are not msgpack-serializable: {exc}") from None
        _check_args(args)
        return body

    @staticmethod
    def _batch_payload(calls: Iterable[Call | Sequence[Any]]) -> bytes:
        items = [_as_call(c) for c in calls]
        for c in items:
            check_key(c.key)
        for c in items:
            _check_args(c.args)
        try:
            return _enc.encode({"calls": [[c.operator, c.key, c.function, list(c.args)] for c in items]})
        except (TypeError, OverflowError, msgspec.EncodeError) as exc:
            raise SerializationError(f"arguments are not msgpack-serializable: {exc}") from None

    def _stream_request(self, stream: str, from_offset: int, limit: int, wait: float) -> dict[str, Any]:
        check_stream(stream)
        return {"params": {"from_offset": from_offset, "limit": limit, "wait": wait}, "headers": self.headers,
                "timeout": self.timeout + wait}

    def _invoke_headers(self, request_id: str) -> dict[str, str]:
        if is_reserved_id(request_id):  # the gateway refuses it too (400 ReservedRequestId): not sent at all
            raise ReservedRequestId(f"request id {request_id!r} is reserved for the engine's own transactions (no "
                                    "client request id starts with '__charon' or 'fx.')")
        return {**self.headers, "Content-Type": MSGPACK, "Idempotency-Key": request_id}

    @staticmethod
    def _scan_params(keys: Sequence[str] | None, epoch: int | None, limit: int | None, after: str | None = None,
                     prefix: str | None = None) -> list[tuple[str, Any]]:
        params: list[tuple[str, Any]] = [("key", check_key(k)) for k in keys or ()]
        if epoch is not None:
            params.append(("epoch", int(epoch)))
        if limit is not None:
            params.append(("limit", int(limit)))
        if after is not None:
            params.append(("after", check_key(after)))
        if prefix:
            params.append(("prefix", prefix))
        return params

    @staticmethod
    def _update_body(update_id: str, operator: str, function: str, args: Sequence[object],
                     keys: Sequence[str] | None) -> bytes:
        """The msgpack body of ``POST /admin/update``."""
        body: dict[str, Any] = {"id": update_id, "operator": operator, "function": function, "args": list(args)}
        if keys is not None:
            body["keys"] = list(keys)
        return msgspec.msgpack.encode(body)

    @staticmethod
    def _code_body(ref: str, version: str, migration: tuple[str, str, Sequence[object]] | None, mode: str) -> bytes:
        """The msgpack body of ``POST /admin/code``."""
        body: dict[str, Any] = {"ref": ref, "version": version}
        if mode != "strict":
            body["mode"] = mode
        if migration is not None:
            body["migration"] = {"operator": migration[0], "function": migration[1], "args": list(migration[2])}
        return msgspec.msgpack.encode(body)

    # -- durable promises and schedules (charon.server.promises, charon.server.schedules) -------------------
    def _action(self, path: str, body: dict[str, Any], request_id: str | None) -> tuple[str, bytes, dict[str, str]]:
        """A promise or schedule action's path, msgpack body and headers (an ``Idempotency-Key``: retries are
        answered once)."""
        try:
            content = _enc.encode(body)
        except (TypeError, OverflowError, msgspec.EncodeError) as exc:
            raise SerializationError(f"not msgpack-serializable: {exc}") from None
        return path, content, self._invoke_headers(request_id or uuid.uuid4().hex)

    @staticmethod
    def _promise_path(promise_id: str, action: str = "") -> str:
        return f"/promises/{_segment(promise_id)}" + (f"/{action}" if action else "")

    @staticmethod
    def _workflow_path(name: str, workflow_id: str | None = None, action: str = "") -> str:
        return f"/workflows/{_segment(name)}" + (f"/{_segment(workflow_id)}" if workflow_id is not None else "") \
            + (f"/{action}" if action else "")

    @staticmethod
    def _schedule_path(name: str, action: str = "") -> str:
        return f"/schedules/{_segment(name)}" + (f"/{action}" if action else "")

    @staticmethod
    def _schedule_body(name: str, cron: str, operator: str, key: str, function: str, args: Sequence[Any],
                       catch_up: int) -> dict[str, Any]:
        return {"name": name, "cron": cron, "operator": operator, "key": key, "function": function,
                "args": list(args), "catch_up": catch_up}

    @staticmethod
    def _page_params(after: str | None, limit: int, status: str | None = None) -> dict[str, Any]:
        params: dict[str, Any] = {"limit": int(limit)}
        if after is not None:
            params["after"] = after
        if status is not None:
            params["status"] = status
        return params

    def _bulk(self, resource: str, action: str, where: Mapping[str, Any] | None, dry_run: bool, limit: int,
              cursor: str | None, reason: str | None, operation: str | None
              ) -> tuple[str, dict[str, Any], dict[str, str]]:
        """``POST /admin/bulk/{resource}/{action}``'s path, JSON body and headers (the operation id as its
        ``Idempotency-Key``: a retried call sends nothing twice)."""
        body: dict[str, Any] = {"where": dict(where or {}), "dry_run": bool(dry_run), "limit": int(limit),
                                "cursor": cursor}
        if reason is not None:
            body["reason"] = reason
        headers = {**self.headers, "Idempotency-Key": operation or uuid.uuid4().hex}
        return f"/admin/bulk/{_segment(resource)}/{_segment(action)}", body, headers

    @staticmethod
    def _bulk_total(total: dict[str, Any] | None, page: dict[str, Any]) -> dict[str, Any]:
        """The sum of a bulk operation's pages so far (``items`` kept from the first 1000)."""
        if total is None:
            return {**page, "pages": 1, "items": list(page["items"])[:1000]}
        for k in ("examined", "matched", "done"):
            total[k] += page[k]
        for why, n in page["skipped"].items():
            total["skipped"][why] = total["skipped"].get(why, 0) + n
        total["items"] += list(page["items"])[:max(0, 1000 - len(total["items"]))]
        total["pages"] += 1
        total["next"] = page["next"]
        return total

    @staticmethod
    def _metrics_text(resp: httpx.Response) -> str:
        if resp.status_code != 200:
            _raise_error(resp.status_code, _decode_body(resp), None)
        return resp.text

    @staticmethod
    def _admin_doc(resp: httpx.Response) -> dict[str, Any]:
        body = _decode_body(resp)
        if resp.status_code != 200:
            _raise_error(resp.status_code, body, None)
        return body



class VersionCounts(TypedDict):
    """Workflows in flight on one code version (:meth:`Client.workflow_versions`)."""

    running: int
    waiting: int


class WorkflowVersions(TypedDict):
    """The drain (:meth:`Client.workflow_versions`): in-flight workflows per code version, in all and per workflow."""

    current: str | None
    versions: dict[str, VersionCounts]
    workflows: dict[str, dict[str, VersionCounts]]
    truncated: bool


WorkflowMigration = TypedDict("WorkflowMigration", {
    "operation": str, "workflow": str, "from": str, "dry_run": bool, "examined": int, "matched": int, "done": int,
    "skipped": dict[str, int], "would_skip": dict[str, int], "items": list[str], "pages": int})
"""What :meth:`Client.migrate_workflows` answers: the pages' counts summed (the functional form: ``from`` is a
keyword)."""


def _migration(op: str, name: str, from_version: str, dry_run: bool) -> WorkflowMigration:
    return {"operation": op, "workflow": name, "from": from_version, "dry_run": dry_run, "examined": 0,
            "matched": 0, "done": 0, "skipped": {}, "would_skip": {}, "items": [], "pages": 0}


def _sum_migration(total: WorkflowMigration, page: Mapping[str, object]) -> str | None:
    """Add one page of a workflow migration to the running totals; the next page's cursor."""
    total["pages"] += 1
    total["examined"] += cast(int, page["examined"])
    total["matched"] += cast(int, page["matched"])
    total["done"] += cast(int, page["done"])
    for why, n in cast(dict[str, int], page["skipped"]).items():
        total["skipped"][why] = total["skipped"].get(why, 0) + n
    for why, n in cast(dict[str, int], page.get("would_skip") or {}).items():  # a dry run's forecast (absent
        total["would_skip"][why] = total["would_skip"].get(why, 0) + n      # from older gateways)
    total["items"] = (total["items"] + cast(list[str], page["items"]))[:1000]
    return cast(str | None, page["next"])

class Client(_Base):
    """Blocking client (httpx). Thread-safe; use as a context manager or call :meth:`close`."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        timeout: float = 30.0,
        retries: int = 3,
        max_connections: int = 64,
    ) -> None:
        super().__init__(url, token, timeout, retries)
        self._shards = [
            httpx.Client(base_url=self.url, timeout=timeout, limits=_shard_limits(), verify=_ssl_context())
            for _ in range(_shard_count(max_connections))
        ]
        self._next = itertools.count()

    def _send(self, method: str, path: str, **kw: Any) -> httpx.Response:
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            try:
                http = self._shards[next(self._next) % len(self._shards)]
                resp = http.request(method, path, **kw)
            except httpx.TransportError as exc:
                last = exc
            else:
                if not _retryable(resp) or attempt == self.retries:
                    return resp
            if attempt < self.retries:
                time.sleep(_backoff(attempt))
        assert last is not None
        raise _unreachable(last) if isinstance(last, httpx.TransportError) else last

    def invoke_result(
        self, operator: str, key: str, function: str, *args: Any, request_id: str | None = None
    ) -> Result:
        """Run one transaction and return its :class:`Result` (value, tid, epoch); raises typed errors."""
        rid = request_id or uuid.uuid4().hex
        resp = self._send(
            "POST",
            self._invoke_path(operator, key, function),
            content=self._payload(args),
            headers=self._invoke_headers(rid),
        )
        try:
            return _result(resp, rid)
        except _Pending:
            return self.result_of(rid, None)

    def invoke(self, operator: str, key: str, function: str, *args: Any, request_id: str | None = None) -> Any:
        """Run one transaction and return the root function's value.

        Raises :class:`~charon.errors.TransactionAborted` when the transaction aborted, and the typed errors
        of the module docstring for rejected requests.
        """
        return self.invoke_result(operator, key, function, *args, request_id=request_id).value

    def submit(self, operator: str, key: str, function: str, *args: Any, request_id: str | None = None) -> str:
        """Start a transaction without waiting (``?mode=async``); returns its request id."""
        rid = request_id or uuid.uuid4().hex
        resp = self._send(
            "POST",
            self._invoke_path(operator, key, function),
            params={"mode": "async"},
            content=self._payload(args),
            headers=self._invoke_headers(rid),
        )
        if resp.status_code != 202:
            _result(resp, rid)  # raises the typed error of a rejected request
        return rid

    def result_of(self, request_id: str, timeout: float | None = 30.0) -> Result:
        """Wait for a submitted request's :class:`Result` (long-polling); TimeoutError after ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = 10.0 if deadline is None else max(0.0, min(10.0, deadline - time.monotonic()))
            resp = self._send(
                "GET",
                f"/requests/{_segment(request_id)}",
                params={"wait": f"{wait:.3f}"},
                headers=self.headers,
                timeout=wait + self.timeout,
            )
            try:
                return _result(resp, request_id)
            except _Pending:
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"request {request_id} still pending after {timeout} s") from None
                if wait < 0.05:
                    time.sleep(0.02)

    def result(self, request_id: str, timeout: float | None = 30.0) -> Any:
        """Wait for a submitted request and return its value (or raise its typed error)."""
        return self.result_of(request_id, timeout).value

    def state(self, operator: str, key: str) -> Any:
        """An entity's committed state (an admin read: needs the token)."""
        resp = self._send("GET", self._state_path(operator, key), headers=self.headers)
        body = _decode_body(resp)
        if resp.status_code != 200:
            _raise_error(resp.status_code, body, None)
        return body["value"]

    def timers(self, operator: str, key: str) -> list[dict[str, Any]]:
        """The pending timers an entity registered: ``{"id", "due", "operator", "key", "function", "args"}``
        each (an admin read: needs the token)."""
        resp = self._send("GET", self._timers_path(operator, key), headers=self.headers)
        body = _decode_body(resp)
        if resp.status_code != 200:
            _raise_error(resp.status_code, body, None)
        return body["timers"]

    def health(self) -> dict[str, Any]:
        """The gateway's ``/health`` document."""
        resp = self._send("GET", "/health", headers=self.headers)
        return _decode_body(resp)

    def invoke_batch(self, calls: Iterable[Call | Sequence[Any]], *, batch_id: str | None = None) -> list[Any]:
        """Run ``calls`` as one client atomic batch (one transaction, in order: all commit or none) and return
        their values. Raises TransactionAborted (nothing applied) when any call raised. ``batch_id`` is the
        batch's Idempotency-Key: retries run it once; reusing it for other calls raises IdempotencyConflict."""
        bid = batch_id or uuid.uuid4().hex
        resp = self._send("POST", "/batch", content=self._batch_payload(calls), headers=self._invoke_headers(bid))
        try:
            return _result(resp, bid).value
        except _Pending:
            return self.result_of(bid, None).value

    def read_stream(self, stream: str, from_offset: int = 0, *, limit: int = 1000, wait: float = 0.0) -> StreamPage:
        """Events of output stream ``stream`` from ``from_offset`` (whole atoms, up to ``limit`` events; waits up
        to ``wait`` seconds, at most 30, for the first one)."""
        kw = self._stream_request(stream, from_offset, limit, wait)
        return _page(self._send("GET", f"/streams/{stream}", **kw))

    def subscribe(
        self, stream: str, from_offset: int = 0, *, limit: int = 1000, wait: float = 20.0
    ) -> Iterator[Event]:
        """Every event of ``stream`` from ``from_offset`` on, as the atoms commit (long polling; endless).

        Exactly once across restarts: store ``event.offset + 1`` with what you did with the event, and
        pass it back as ``from_offset``."""
        offset = from_offset
        while True:
            page = self.read_stream(stream, offset, limit=limit, wait=wait)
            yield from page.events
            offset = page.next_offset

    # -- admin (token) -----------------------------------------------------------------------------------
    # -- durable promises (the ``promises`` scope resolves and rejects; ``read`` lists; ``admin`` cancels) --------
    def _act(self, method: str, path: str, body: dict[str, Any], request_id: str | None) -> Any:
        path, content, headers = self._action(path, body, request_id)
        rid = headers["Idempotency-Key"]
        try:
            return _result(self._send(method, path, content=content, headers=headers), rid).value
        except _Pending:
            return self.result_of(rid, None).value

    def resolve(self, promise_id: str, value: Any = None, *, request_id: str | None = None) -> dict[str, Any]:
        """Resolve a durable promise (``POST /promises/{id}/resolve``): its continuation runs once with ``{"ok":
        True, "value": value}``; :class:`~charon.errors.PromiseConflict` if it was settled before,
        :class:`~charon.errors.UnknownPromise` if there is none. Retried under one request id (answered once)."""
        return dict(self._act("POST", self._promise_path(promise_id, "resolve"), {"value": value}, request_id))

    def reject(self, promise_id: str, error: str = "rejected", *, request_id: str | None = None) -> dict[str, Any]:
        """Reject a durable promise: its continuation runs once with ``PromiseRejected`` (``error``)."""
        return dict(self._act("POST", self._promise_path(promise_id, "reject"), {"error": error}, request_id))

    def cancel_promise(self, promise_id: str, reason: str = "cancelled by an operator", *,
                       request_id: str | None = None) -> dict[str, Any]:
        """Cancel a pending promise (admin): its continuation runs once with ``PromiseCancelled``."""
        return dict(self._act("POST", self._promise_path(promise_id, "cancel"), {"reason": reason}, request_id))

    def promise(self, promise_id: str) -> dict[str, Any]:
        """One promise's record (status, outcome, deadline, the continuation's request id)."""
        return self._admin_doc(self._send("GET", self._promise_path(promise_id), headers=self.headers))

    def promises(self, status: str | None = None, *, after: str | None = None, limit: int = 100) -> dict[str, Any]:
        """A page of promises in id order: ``{"promises": [...], "next": cursor or None}``."""
        return self._admin_doc(self._send("GET", "/promises", params=self._page_params(after, limit, status),
                                          headers=self.headers))

    # -- workflows (``invoke`` starts; ``read`` reads; ``admin`` cancels) ----------------------------------------
    def start_workflow(self, name: str, input: Any = None, *, id: str | None = None,  # noqa: A002
                       request_id: str | None = None) -> dict[str, Any]:
        """Start workflow ``name`` (``POST /workflows/{name}``) with ``input`` under ``id`` (default: the request id,
        so a retry starts one workflow): ``{"id", "workflow", "status"}``; :class:`~charon.errors.WorkflowExists`
        if the id is in use, :class:`~charon.errors.UnknownWorkflow` if there is no such workflow."""
        return dict(self._act("POST", self._workflow_path(name), {"id": id, "input": input}, request_id))

    def workflow(self, name: str, workflow_id: str) -> dict[str, Any]:
        """One workflow's record (status, step, what it awaits, state, the history of its steps)."""
        return self._admin_doc(self._send("GET", self._workflow_path(name, workflow_id), headers=self.headers))

    def workflow_tree(self, name: str, workflow_id: str, *, steps: int = 50) -> dict[str, object]:
        """One workflow as a tree: the workflow, its newest ``steps`` steps each with its call graph (while the
        inspector keeps it), and what it awaits now (a promise's status, an effect's attempts, a timer's due time)."""
        return self._admin_doc(self._send("GET", self._workflow_path(name, workflow_id, "tree"),
                                          params={"steps": steps}, headers=self.headers))

    def workflows(self, name: str, *, after: str | None = None, limit: int = 100) -> dict[str, Any]:
        """A page of a workflow's records in id order: ``{"workflows": [...], "next": cursor or None}``."""
        return self._admin_doc(self._send("GET", self._workflow_path(name), params=self._page_params(after, limit),
                                          headers=self.headers))

    def cancel_workflow(self, name: str, workflow_id: str, reason: str = "cancelled by an operator") -> dict[str, Any]:
        """Cancel a workflow that has not finished (admin)."""
        return dict(self._act("POST", self._workflow_path(name, workflow_id, "cancel"), {"reason": reason}, None))

    def workflow_versions(self) -> WorkflowVersions:
        """The drain (``GET /admin/workflows/versions``, read): in-flight workflows per code version,
        ``{"current", "versions": {v: {"running", "waiting"}}, "workflows": {name: {v: ...}}, "truncated"}``."""
        return cast(WorkflowVersions, self._admin_doc(self._send("GET", "/admin/workflows/versions",
                                                                 headers=self.headers)))

    def migrate_workflows(self, name: str, from_version: str, *, dry_run: bool = False, limit: int = 100,
                          operation: str | None = None) -> WorkflowMigration:
        """Move workflow ``name``'s in-flight workflows on ``from_version`` to the deployed code version (``POST
        /admin/workflows/migrate``, admin, audited), page after page under one operation id; the counts summed
        (``done``; ``skipped`` by why: ``NotMigratable``; ``items``: the first 1000 matched; ``pages``)."""
        op = operation or uuid.uuid4().hex
        total = _migration(op, name, from_version, dry_run)
        cursor: str | None = None
        while True:
            body = {"workflow": name, "from": from_version, "dry_run": dry_run, "limit": limit, "cursor": cursor}
            cursor = _sum_migration(total, self._admin_doc(self._send(
                "POST", "/admin/workflows/migrate", json=body, headers={**self.headers, "Idempotency-Key": op})))
            if cursor is None:
                return total

    # -- schedules (``read`` lists; ``admin`` changes) --------------------------------------------------------
    def schedules(self, *, after: str | None = None, limit: int = 100) -> dict[str, Any]:
        """A page of schedules in name order: ``{"schedules": [...], "next": cursor or None}``."""
        return self._admin_doc(self._send("GET", "/schedules", params=self._page_params(after, limit),
                                          headers=self.headers))

    def schedule(self, name: str) -> dict[str, Any]:
        """One schedule's record (spec, paused, next and last slot, fired and skipped counts)."""
        return self._admin_doc(self._send("GET", self._schedule_path(name), headers=self.headers))

    def create_schedule(self, name: str, cron: str, operator: str, key: str, function: str,
                        args: Sequence[Any] = (), *, catch_up: int = 0) -> dict[str, Any]:
        """Create a schedule at run time (its target a public function ``f(ctx, firing, *args)``)."""
        body = self._schedule_body(name, cron, operator, key, function, args, catch_up)
        return dict(self._act("POST", "/schedules", body, None))

    def pause_schedule(self, name: str) -> dict[str, Any]:
        """Stop firing a schedule until :meth:`resume_schedule`."""
        return dict(self._act("POST", self._schedule_path(name, "pause"), {}, None))

    def resume_schedule(self, name: str) -> dict[str, Any]:
        """Fire a paused schedule again, from its first slot after now."""
        return dict(self._act("POST", self._schedule_path(name, "resume"), {}, None))

    def delete_schedule(self, name: str) -> dict[str, Any]:
        """Delete a schedule."""
        return dict(self._act("DELETE", self._schedule_path(name), {}, None))

    def status(self) -> dict[str, Any]:
        """The runtime's control status: ``state`` (running, pausing, paused), ``epoch``, ``backlog``..."""
        return self._admin_doc(self._send("GET", "/admin/status", headers=self.headers))

    def dead_letters(self, limit: int = 1000) -> list[dict[str, Any]]:
        """Transactions the engine set aside (``InvocationTimeout``, ``Quarantined``), newest first."""
        doc = self._admin_doc(self._send("GET", "/admin/dead-letters", params={"limit": limit}, headers=self.headers))
        return list(doc["dead_letters"])

    def requests(self, **filters: str | int | float | None) -> dict[str, object]:
        """A page of the invocation inspector (``GET /admin/requests``), newest first: ``{"items", "next",
        "retention"}``; ``filters``: status, operator, key, function, error_type, epoch_min, epoch_max, since, until,
        limit, cursor (None: not given)."""
        params = {k: str(v) for k, v in filters.items() if v is not None}
        return self._admin_doc(self._send("GET", "/admin/requests", params=params, headers=self.headers))

    def request_detail(self, request_id: str) -> dict[str, object]:
        """One request in the inspector (``GET /admin/requests/{id}``): reply, error and traceback, call graph;
        :class:`~charon.errors.RequestNotFound` for an id it does not know (or no longer retains)."""
        return self._admin_doc(self._send("GET", f"/admin/requests/{_segment(request_id)}", headers=self.headers))

    def limits(self) -> dict[str, object]:
        """The admission limits in force and the requests waiting per bucket (``GET /admin/limits``)."""
        return self._admin_doc(self._send("GET", "/admin/limits", headers=self.headers))

    def set_limit(self, target: str, limit: dict[str, object] | None = None, *, clear: bool = False,
                  remove: bool = False) -> dict[str, object]:
        """Change an admission limit at run time (``POST /admin/limits``): ``limit`` sets one on ``target``
        (``"op"`` or ``"op/fn"``), ``clear`` goes back to the code's, ``remove`` lifts it; applied at an epoch
        boundary, recorded in the log."""
        body = _limit_body(target, limit, clear, remove)
        return self._admin_doc(self._send("POST", "/admin/limits", json=body, headers=self.headers))

    def bulk(self, resource: str, action: str, where: Mapping[str, Any] | None = None, *, dry_run: bool = False,
             limit: int = 100, cursor: str | None = None, reason: str | None = None,
             operation: str | None = None) -> dict[str, Any]:
        """One page of a bulk operation (``POST /admin/bulk/{resource}/{action}``, admin): ``resource`` one of
        ``invocations`` (cancel those waiting for admission), ``promises`` (cancel pending ones), ``schedules``
        (pause, resume, delete), ``effects`` (retry or abandon parked ones); ``where`` a filter of ``operator``,
        ``function``, ``key_prefix``, ``error_type`` (effects), ``since``, ``until``. At most ``limit`` items are
        looked at after ``cursor``: ``{"operation", "examined", "matched", "done", "skipped", "items", "next",
        ...}``; pass ``next`` (and the same ``operation``) for the following page. ``dry_run``: count only."""
        path, body, headers = self._bulk(resource, action, where, dry_run, limit, cursor, reason, operation)
        return self._admin_doc(self._send("POST", path, json=body, headers=headers))

    def bulk_all(self, resource: str, action: str, where: Mapping[str, Any] | None = None, *,
                 dry_run: bool = False, limit: int = 100, reason: str | None = None,
                 operation: str | None = None) -> dict[str, Any]:
        """:meth:`bulk` page after page under one operation id until the last page; the counts summed
        (``pages``: how many calls; ``items``: the first 1000 matched)."""
        op = operation or uuid.uuid4().hex
        total: dict[str, Any] | None = None
        cursor: str | None = None
        while True:
            page = self.bulk(resource, action, where, dry_run=dry_run, limit=limit, cursor=cursor, reason=reason,
                             operation=op)
            total = self._bulk_total(total, page)
            cursor = page["next"]
            if cursor is None:
                return total

    def pause(self, after_epoch: int | None = None) -> dict[str, Any]:
        """Start no new epoch (now, or after epoch ``after_epoch``); requests keep being accepted."""
        body = {} if after_epoch is None else {"after_epoch": int(after_epoch)}
        return self._admin_doc(self._send("POST", "/admin/pause", json=body, headers=self.headers))

    def resume(self) -> dict[str, Any]:
        """Let epochs start again."""
        return self._admin_doc(self._send("POST", "/admin/resume", headers=self.headers))

    def rescale(self, partitions: int | None = None, *, log_partitions: int | None = None,
                timeout: float = 600.0) -> dict[str, Any]:
        """Change the number of engine partitions at an epoch boundary and/or (``log_partitions``, Spark) the
        input log's partition count (``POST /admin/rescale``; blocks until done, at most ``timeout`` s):
        ``{"from", "to", "epoch", "keys", "wait_s", "pause_s", "cpu_s", "log"}``. :class:`RescaleRunning` while
        another rescale runs."""
        resp = self._shards[0].post("/admin/rescale", json=_rescale_body(partitions, log_partitions),
                                    headers=self.headers, timeout=timeout)  # once: no retry of a long admin move
        return self._admin_doc(resp)

    def read_state(
        self, operator: str, keys: Sequence[str] | None = None, *, epoch: int | None = None, limit: int | None = None,
        after: str | None = None, prefix: str | None = None,
    ) -> dict[str, Any]:
        """Entities of ``operator`` (``keys``, or a page: the first ``limit`` in key order after the key ``after``
        starting with ``prefix``) as of one committed epoch (default: the latest): ``{"epoch", "entities": {key:
        value}, "items": {key: {item: value}}, "count", "truncated", "next"}``. For the following page pass
        ``after=doc["next"], epoch=doc["epoch"]`` (the same cut; ``EpochNotRetained`` once the engine dropped
        it); :meth:`iter_state` does."""
        return self._admin_doc(self._send("GET", f"/admin/state/{_segment(operator)}",
                                          params=self._scan_params(keys, epoch, limit, after, prefix),
                                          headers=self.headers))

    def iter_state(self, operator: str, *, limit: int = 1000, prefix: str | None = None,
                   epoch: int | None = None) -> Iterator[dict[str, object]]:
        """Every page of ``operator``'s entities (:meth:`read_state`), all read at the first page's epoch."""
        doc = self.read_state(operator, epoch=epoch, limit=limit, prefix=prefix)
        yield doc
        while doc.get("next") is not None:
            doc = self.read_state(operator, epoch=doc["epoch"], limit=limit, prefix=prefix, after=doc["next"])
            yield doc

    def admin_update(
        self, update_id: str, operator: str, function: str, *args: object, keys: Sequence[str] | None = None
    ) -> dict[str, Any]:
        """Run the deployed ``function`` on every key (default: every entity of ``operator``) alone at an epoch
        boundary, once per ``update_id`` (in-process runtime); returns the outcome."""
        body = self._update_body(update_id, operator, function, args, keys)
        return self._admin_doc(self._send("POST", "/admin/update", content=body,
                                          headers={**self.headers, "Content-Type": MSGPACK}))

    def update_code(
        self, ref: str, version: str, migration: tuple[str, str, Sequence[object]] | None = None,
        mode: str = "strict",
    ) -> dict[str, Any]:
        """Code update to the deployed ``ref`` (``module:attribute``, allowed by the gateway's ``code_refs``)
        at one epoch boundary: ``mode="strict"`` with an optional ``migration`` = (operator, function, args)
        of the new code, or ``"compatible"`` (transactions deferred before it finish on the old code)."""
        body = self._code_body(ref, version, migration, mode)
        return self._admin_doc(self._send("POST", "/admin/code", content=body,
                                          headers={**self.headers, "Content-Type": MSGPACK}))

    def sql(self, query: str, epoch: int | None = None) -> dict[str, Any]:
        """One safe SELECT over the operators' state views at one consistent epoch (``POST /admin/sql``):
        ``{"epoch", "columns", "rows", "truncated", "engine"}``; refused SQL raises the typed error."""
        body: dict[str, Any] = {"sql": query} if epoch is None else {"sql": query, "epoch": epoch}
        return self._admin_doc(self._send("POST", "/admin/sql", json=body, headers=self.headers))

    def metrics(self) -> str:
        """The Prometheus exposition of ``/metrics``."""
        return self._metrics_text(self._send("GET", "/metrics", headers=self.headers))

    def invoke_many(
        self, calls: Iterable[Call | Sequence[Any]], *, concurrency: int = 16, return_exceptions: bool = False
    ) -> list[Any]:
        """Run many invocations from a thread pool; values in call order (exceptions in place if asked)."""
        items = [_as_call(c) for c in calls]

        def one(c: Call) -> Any:
            try:
                return self.invoke(c.operator, c.key, c.function, *c.args, request_id=c.request_id)
            except Exception as exc:
                if return_exceptions:
                    return exc
                raise

        with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
            return list(pool.map(one, items))

    def close(self) -> None:
        for http in self._shards:
            http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(_Base):
    """asyncio client (httpx). Many invocations may run concurrently on one instance."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        timeout: float = 30.0,
        retries: int = 3,
        max_connections: int = 256,
    ) -> None:
        super().__init__(url, token, timeout, retries)
        # one transport (connection pool) per shard: the invoke hot path sends through it directly
        # (:meth:`_post`), everything else through the shard's httpx client over the same pool
        proxy = _env_proxy(self.url)
        self._transports = [
            httpx.AsyncHTTPTransport(verify=_ssl_context(), limits=_shard_limits(), proxy=proxy)
            for _ in range(_shard_count(max_connections))
        ]
        self._shards = [
            httpx.AsyncClient(base_url=self.url, timeout=timeout, transport=t) for t in self._transports
        ]
        self._next = itertools.count()
        self._timeout = {"timeout": httpx.Timeout(timeout).as_dict()}

    async def _retrying(self, once: Callable[[], Awaitable[httpx.Response]]) -> httpx.Response:
        """``once()`` again (with back-off, up to ``retries`` times) on a transport error or a retryable answer."""
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            try:
                resp = await once()
            except httpx.TransportError as exc:
                last = exc
            else:
                if not _retryable(resp) or attempt == self.retries:
                    return resp
            if attempt < self.retries:
                await asyncio.sleep(_backoff(attempt))
        assert last is not None
        raise _unreachable(last) if isinstance(last, httpx.TransportError) else last

    async def _send(self, method: str, path: str, **kw: Any) -> httpx.Response:
        return await self._retrying(lambda: self._shards[next(self._next) % len(self._shards)].request(
            method, path, **kw))

    async def _post(self, path: str, content: bytes, headers: dict[str, str]) -> httpx.Response:
        """``POST path`` straight through a shard's transport (the invoke hot path): the same pools, retries,
        timeouts and httpx errors as :meth:`_send`, without the httpx client's per-request work (URL merging,
        cookies, auth and redirect handling, event hooks), about a third of a request's client CPU."""
        url = self.url + path

        async def once() -> httpx.Response:
            transport = self._transports[next(self._next) % len(self._transports)]
            req = httpx.Request("POST", url, content=content, headers=headers, extensions=self._timeout)
            resp = await transport.handle_async_request(req)
            try:
                await resp.aread()
            finally:
                await resp.aclose()
            return resp

        return await self._retrying(once)

    async def invoke_result(
        self, operator: str, key: str, function: str, *args: Any, request_id: str | None = None
    ) -> Result:
        """Run one transaction and return its :class:`Result` (value, tid, epoch); raises typed errors."""
        rid = request_id or uuid.uuid4().hex
        resp = await self._post(
            self._invoke_path(operator, key, function), self._payload(args), self._invoke_headers(rid)
        )
        try:
            return _result(resp, rid)
        except _Pending:
            return await self.result_of(rid, None)

    async def continue_effect(self, operator: str, key: str, function: str, args: Sequence[Any],
                              request_id: str) -> Result:
        """An effect worker's continuation (``charon effects work --url``): ``operator/key.function(*args)`` under the
        effect's continuation id ``request_id`` (``fx.<app>.<tid>.<inv>.<n>.done``, which :meth:`invoke` refuses),
        through the gateway's route of its own, ``POST /effects/continue/...`` (a body limit that carries any value a
        handler may return). Answers and errors as :meth:`invoke_result`."""
        check_key(key)
        path = f"/effects/continue/{_segment(operator)}/{_segment(key)}/{_segment(function)}"
        resp = await self._post(path, self._payload(args),
                                {**self.headers, "Content-Type": MSGPACK, "Idempotency-Key": request_id})
        try:
            return _result(resp, request_id)
        except _Pending:
            return await self.result_of(request_id, None)

    async def invoke(self, operator: str, key: str, function: str, *args: Any, request_id: str | None = None) -> Any:
        """Run one transaction and return the root function's value (see :meth:`Client.invoke`)."""
        return (await self.invoke_result(operator, key, function, *args, request_id=request_id)).value

    def invoke_future(
        self, operator: str, key: str, function: str, *args: Any, request_id: str | None = None
    ) -> asyncio.Task[Any]:
        """Start :meth:`invoke` as a task on the running loop and return it (a future of the value)."""
        return asyncio.ensure_future(self.invoke(operator, key, function, *args, request_id=request_id))

    async def invoke_many(
        self, calls: Iterable[Call | Sequence[Any]], *, concurrency: int = 64, return_exceptions: bool = False
    ) -> list[Any]:
        """Run many invocations concurrently (at most ``concurrency`` in flight); values in call order."""
        items = [_as_call(c) for c in calls]
        sem = asyncio.Semaphore(max(1, concurrency))

        async def one(c: Call) -> Any:
            async with sem:
                return await self.invoke(c.operator, c.key, c.function, *c.args, request_id=c.request_id)

        return await asyncio.gather(*(one(c) for c in items), return_exceptions=return_exceptions)

    async def submit(self, operator: str, key: str, function: str, *args: Any, request_id: str | None = None) -> str:
        """Start a transaction without waiting (``?mode=async``); returns its request id."""
        rid = request_id or uuid.uuid4().hex
        resp = await self._send(
            "POST",
            self._invoke_path(operator, key, function),
            params={"mode": "async"},
            content=self._payload(args),
            headers=self._invoke_headers(rid),
        )
        if resp.status_code != 202:
            _result(resp, rid)  # raises the typed error of a rejected request
        return rid

    async def result_of(self, request_id: str, timeout: float | None = 30.0) -> Result:
        """Wait for a submitted request's :class:`Result` (long-polling); TimeoutError after ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = 10.0 if deadline is None else max(0.0, min(10.0, deadline - time.monotonic()))
            resp = await self._send(
                "GET",
                f"/requests/{_segment(request_id)}",
                params={"wait": f"{wait:.3f}"},
                headers=self.headers,
                timeout=wait + self.timeout,
            )
            try:
                return _result(resp, request_id)
            except _Pending:
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"request {request_id} still pending after {timeout} s") from None
                if wait < 0.05:
                    await asyncio.sleep(0.02)

    async def result(self, request_id: str, timeout: float | None = 30.0) -> Any:
        """Wait for a submitted request and return its value (or raise its typed error)."""
        return (await self.result_of(request_id, timeout)).value

    async def state(self, operator: str, key: str) -> Any:
        """An entity's committed state (an admin read: needs the token)."""
        resp = await self._send("GET", self._state_path(operator, key), headers=self.headers)
        body = _decode_body(resp)
        if resp.status_code != 200:
            _raise_error(resp.status_code, body, None)
        return body["value"]

    async def timers(self, operator: str, key: str) -> list[dict[str, Any]]:
        """The pending timers an entity registered (see :meth:`CharonClient.timers`)."""
        resp = await self._send("GET", self._timers_path(operator, key), headers=self.headers)
        body = _decode_body(resp)
        if resp.status_code != 200:
            _raise_error(resp.status_code, body, None)
        return body["timers"]

    async def health(self) -> dict[str, Any]:
        """The gateway's ``/health`` document."""
        return _decode_body(await self._send("GET", "/health", headers=self.headers))

    async def invoke_batch(self, calls: Iterable[Call | Sequence[Any]], *, batch_id: str | None = None) -> list[Any]:
        """As :meth:`Client.invoke_batch`."""
        bid = batch_id or uuid.uuid4().hex
        resp = await self._send("POST", "/batch", content=self._batch_payload(calls),
                                headers=self._invoke_headers(bid))
        try:
            return _result(resp, bid).value
        except _Pending:
            return (await self.result_of(bid, None)).value

    async def read_stream(
        self, stream: str, from_offset: int = 0, *, limit: int = 1000, wait: float = 0.0
    ) -> StreamPage:
        """As :meth:`Client.read_stream`."""
        kw = self._stream_request(stream, from_offset, limit, wait)
        return _page(await self._send("GET", f"/streams/{stream}", **kw))

    async def subscribe(
        self, stream: str, from_offset: int = 0, *, limit: int = 1000, wait: float = 20.0
    ) -> AsyncIterator[Event]:
        """As :meth:`Client.subscribe` (an async iterator)."""
        offset = from_offset
        while True:
            page = await self.read_stream(stream, offset, limit=limit, wait=wait)
            for ev in page.events:
                yield ev
            offset = page.next_offset

    # -- durable promises and schedules: see :class:`Client` ------------------------------------------------
    async def _act(self, method: str, path: str, body: dict[str, Any], request_id: str | None) -> Any:
        path, content, headers = self._action(path, body, request_id)
        rid = headers["Idempotency-Key"]
        try:
            return _result(await self._send(method, path, content=content, headers=headers), rid).value
        except _Pending:
            return (await self.result_of(rid, None)).value

    async def resolve(self, promise_id: str, value: Any = None, *, request_id: str | None = None) -> dict[str, Any]:
        """Resolve a durable promise (see :meth:`Client.resolve`)."""
        return dict(await self._act("POST", self._promise_path(promise_id, "resolve"), {"value": value}, request_id))

    async def reject(self, promise_id: str, error: str = "rejected", *,
                     request_id: str | None = None) -> dict[str, Any]:
        """Reject a durable promise."""
        return dict(await self._act("POST", self._promise_path(promise_id, "reject"), {"error": error}, request_id))

    async def cancel_promise(self, promise_id: str, reason: str = "cancelled by an operator", *,
                             request_id: str | None = None) -> dict[str, Any]:
        """Cancel a pending promise (admin)."""
        return dict(await self._act("POST", self._promise_path(promise_id, "cancel"), {"reason": reason},
                                    request_id))

    async def promise(self, promise_id: str) -> dict[str, Any]:
        """One promise's record."""
        return self._admin_doc(await self._send("GET", self._promise_path(promise_id), headers=self.headers))

    async def promises(self, status: str | None = None, *, after: str | None = None,
                       limit: int = 100) -> dict[str, Any]:
        """A page of promises in id order."""
        return self._admin_doc(await self._send("GET", "/promises", params=self._page_params(after, limit, status),
                                                headers=self.headers))

    async def start_workflow(self, name: str, input: Any = None, *, id: str | None = None,  # noqa: A002
                             request_id: str | None = None) -> dict[str, Any]:
        """Start a workflow (see :meth:`Client.start_workflow`)."""
        return dict(await self._act("POST", self._workflow_path(name), {"id": id, "input": input}, request_id))

    async def workflow(self, name: str, workflow_id: str) -> dict[str, Any]:
        """One workflow's record."""
        return self._admin_doc(await self._send("GET", self._workflow_path(name, workflow_id), headers=self.headers))

    async def workflow_tree(self, name: str, workflow_id: str, *, steps: int = 50) -> dict[str, object]:
        """One workflow as a tree (see :meth:`Client.workflow_tree`)."""
        return self._admin_doc(await self._send("GET", self._workflow_path(name, workflow_id, "tree"),
                                                params={"steps": steps}, headers=self.headers))

    async def workflows(self, name: str, *, after: str | None = None, limit: int = 100) -> dict[str, Any]:
        """A page of a workflow's records in id order."""
        return self._admin_doc(await self._send("GET", self._workflow_path(name),
                                                params=self._page_params(after, limit), headers=self.headers))

    async def cancel_workflow(self, name: str, workflow_id: str,
                              reason: str = "cancelled by an operator") -> dict[str, Any]:
        """Cancel a workflow that has not finished (admin)."""
        return dict(await self._act("POST", self._workflow_path(name, workflow_id, "cancel"), {"reason": reason},
                                    None))

    async def workflow_versions(self) -> WorkflowVersions:
        """The drain: see :meth:`Client.workflow_versions`."""
        return cast(WorkflowVersions, self._admin_doc(await self._send("GET", "/admin/workflows/versions",
                                                                       headers=self.headers)))

    async def migrate_workflows(self, name: str, from_version: str, *, dry_run: bool = False, limit: int = 100,
                                operation: str | None = None) -> WorkflowMigration:
        """Migrate in-flight workflows to the deployed version: see :meth:`Client.migrate_workflows`."""
        op = operation or uuid.uuid4().hex
        total = _migration(op, name, from_version, dry_run)
        cursor: str | None = None
        while True:
            body = {"workflow": name, "from": from_version, "dry_run": dry_run, "limit": limit, "cursor": cursor}
            cursor = _sum_migration(total, self._admin_doc(await self._send(
                "POST", "/admin/workflows/migrate", json=body, headers={**self.headers, "Idempotency-Key": op})))
            if cursor is None:
                return total

    async def schedules(self, *, after: str | None = None, limit: int = 100) -> dict[str, Any]:
        """A page of schedules in name order."""
        return self._admin_doc(await self._send("GET", "/schedules", params=self._page_params(after, limit),
                                                headers=self.headers))

    async def schedule(self, name: str) -> dict[str, Any]:
        """One schedule's record."""
        return self._admin_doc(await self._send("GET", self._schedule_path(name), headers=self.headers))

    async def create_schedule(self, name: str, cron: str, operator: str, key: str, function: str,
                              args: Sequence[Any] = (), *, catch_up: int = 0) -> dict[str, Any]:
        """Create a schedule at run time."""
        body = self._schedule_body(name, cron, operator, key, function, args, catch_up)
        return dict(await self._act("POST", "/schedules", body, None))

    async def pause_schedule(self, name: str) -> dict[str, Any]:
        """Stop firing a schedule."""
        return dict(await self._act("POST", self._schedule_path(name, "pause"), {}, None))

    async def resume_schedule(self, name: str) -> dict[str, Any]:
        """Fire a paused schedule again."""
        return dict(await self._act("POST", self._schedule_path(name, "resume"), {}, None))

    async def delete_schedule(self, name: str) -> dict[str, Any]:
        """Delete a schedule."""
        return dict(await self._act("DELETE", self._schedule_path(name), {}, None))

    # -- admin (token): see :class:`Client` ----------------------------------------------------------------
    async def status(self) -> dict[str, Any]:
        """The runtime's control status."""
        return self._admin_doc(await self._send("GET", "/admin/status", headers=self.headers))

    async def dead_letters(self, limit: int = 1000) -> list[dict[str, Any]]:
        """Transactions the engine set aside, newest first."""
        doc = self._admin_doc(await self._send("GET", "/admin/dead-letters", params={"limit": limit},
                                               headers=self.headers))
        return list(doc["dead_letters"])

    async def limits(self) -> dict[str, object]:
        """The admission limits in force and the requests waiting per bucket: see :meth:`Client.limits`."""
        return self._admin_doc(await self._send("GET", "/admin/limits", headers=self.headers))

    async def set_limit(self, target: str, limit: dict[str, object] | None = None, *, clear: bool = False,
                        remove: bool = False) -> dict[str, object]:
        """Change an admission limit at run time: see :meth:`Client.set_limit`."""
        body = _limit_body(target, limit, clear, remove)
        return self._admin_doc(await self._send("POST", "/admin/limits", json=body, headers=self.headers))

    async def bulk(self, resource: str, action: str, where: Mapping[str, Any] | None = None, *,
                   dry_run: bool = False, limit: int = 100, cursor: str | None = None, reason: str | None = None,
                   operation: str | None = None) -> dict[str, Any]:
        """One page of a bulk operation: see :meth:`Client.bulk`."""
        path, body, headers = self._bulk(resource, action, where, dry_run, limit, cursor, reason, operation)
        return self._admin_doc(await self._send("POST", path, json=body, headers=headers))

    async def bulk_all(self, resource: str, action: str, where: Mapping[str, Any] | None = None, *,
                       dry_run: bool = False, limit: int = 100, reason: str | None = None,
                       operation: str | None = None) -> dict[str, Any]:
        """Every page of a bulk operation, the counts summed: see :meth:`Client.bulk_all`."""
        op = operation or uuid.uuid4().hex
        total: dict[str, Any] | None = None
        cursor: str | None = None
        while True:
            page = await self.bulk(resource, action, where, dry_run=dry_run, limit=limit, cursor=cursor,
                                   reason=reason, operation=op)
            total = self._bulk_total(total, page)
            cursor = page["next"]
            if cursor is None:
                return total

    async def requests(self, **filters: str | int | float | None) -> dict[str, object]:
        """A page of the invocation inspector (``GET /admin/requests``), newest first: see :meth:`Client.requests`."""
        params = {k: str(v) for k, v in filters.items() if v is not None}
        return self._admin_doc(await self._send("GET", "/admin/requests", params=params, headers=self.headers))

    async def request_detail(self, request_id: str) -> dict[str, object]:
        """One request in the inspector (``GET /admin/requests/{id}``): reply, error and traceback, call graph."""
        return self._admin_doc(await self._send("GET", f"/admin/requests/{_segment(request_id)}",
                                                headers=self.headers))

    async def pause(self, after_epoch: int | None = None) -> dict[str, Any]:
        """Start no new epoch (now, or after epoch ``after_epoch``)."""
        body = {} if after_epoch is None else {"after_epoch": int(after_epoch)}
        return self._admin_doc(await self._send("POST", "/admin/pause", json=body, headers=self.headers))

    async def resume(self) -> dict[str, Any]:
        """Let epochs start again."""
        return self._admin_doc(await self._send("POST", "/admin/resume", headers=self.headers))

    async def rescale(self, partitions: int | None = None, *, log_partitions: int | None = None,
                      timeout: float = 600.0) -> dict[str, Any]:
        """See :meth:`Client.rescale`."""
        resp = await self._shards[0].post("/admin/rescale", json=_rescale_body(partitions, log_partitions),
                                          headers=self.headers, timeout=timeout)  # once: no retry
        return self._admin_doc(resp)

    async def read_state(
        self, operator: str, keys: Sequence[str] | None = None, *, epoch: int | None = None, limit: int | None = None,
        after: str | None = None, prefix: str | None = None,
    ) -> dict[str, Any]:
        """Entities of ``operator`` as of one committed epoch (see :meth:`Client.read_state`)."""
        return self._admin_doc(await self._send("GET", f"/admin/state/{_segment(operator)}",
                                                params=self._scan_params(keys, epoch, limit, after, prefix),
                                                headers=self.headers))

    async def iter_state(self, operator: str, *, limit: int = 1000, prefix: str | None = None,
                         epoch: int | None = None) -> AsyncIterator[dict[str, object]]:
        """Every page of ``operator``'s entities, all read at the first page's epoch (see :meth:`Client.iter_state`)."""
        doc = await self.read_state(operator, epoch=epoch, limit=limit, prefix=prefix)
        yield doc
        while doc.get("next") is not None:
            doc = await self.read_state(operator, epoch=doc["epoch"], limit=limit, prefix=prefix, after=doc["next"])
            yield doc

    async def sql(self, query: str, epoch: int | None = None) -> dict[str, Any]:
        """See :meth:`Client.sql`."""
        body: dict[str, Any] = {"sql": query} if epoch is None else {"sql": query, "epoch": epoch}
        return self._admin_doc(await self._send("POST", "/admin/sql", json=body, headers=self.headers))

    async def admin_update(
        self, update_id: str, operator: str, function: str, *args: object, keys: Sequence[str] | None = None
    ) -> dict[str, Any]:
        """See :meth:`Client.admin_update`."""
        body = self._update_body(update_id, operator, function, args, keys)
        return self._admin_doc(await self._send("POST", "/admin/update", content=body,
                                                headers={**self.headers, "Content-Type": MSGPACK}))

    async def update_code(
        self, ref: str, version: str, migration: tuple[str, str, Sequence[object]] | None = None,
        mode: str = "strict",
    ) -> dict[str, Any]:
        """See :meth:`Client.update_code`."""
        body = self._code_body(ref, version, migration, mode)
        return self._admin_doc(await self._send("POST", "/admin/code", content=body,
                                                headers={**self.headers, "Content-Type": MSGPACK}))

    async def metrics(self) -> str:
        """The Prometheus exposition of ``/metrics``."""
        return self._metrics_text(await self._send("GET", "/metrics", headers=self.headers))

    async def aclose(self) -> None:
        for http in self._shards:
            await http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

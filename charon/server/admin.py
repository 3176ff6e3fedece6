"""The gateway's admin API (every route needs a bearer token with its scope: ``read`` for what only reads,
``admin`` for what changes the deployment; :mod:`charon.server.auth`), ``/metrics`` and the dashboard.

- ``GET /admin/status``: ``{"state": "running"|"pausing"|"paused", "paused", "epoch", "backlog",
  "pause_after", "active_epoch", "engine", "durable", "retained_from", "inflight"}``. ``epoch`` is the last
  committed epoch; ``backlog`` the requests waiting for an epoch; ``retained_from`` the oldest epoch whose
  state can still be read (the durable copy's base).
- ``POST /admin/pause`` (body optional: ``{"after_epoch": N}``) stops starting epochs now, or once epoch N is
  done; ``POST /admin/resume`` lets them start again. Requests keep arriving while paused and wait (clients
  get 202 + a status URL after ``wait_timeout``, never an error). Both answer with the status.
- ``GET /admin/state/{operator}?key=K&key=K2&epoch=N&limit=M&after=A&prefix=P``: the operator's entities (the
  given keys, or a page: the first ``limit`` <= ``max_scan`` entities in key order after the key ``A`` whose keys
  start with ``P``) as of one committed epoch (default the latest; an earlier one while the engine retains it,
  else 410 ``EpochNotRetained``): ``{"operator", "epoch", "entities": {key: value}, "items": {key: {item:
  value}}, "count", "truncated", "next"}``. Every entity of one answer is read at the same epoch; ``next`` is
  the ``after`` of the following page (null on the last one): pass it with the first page's ``epoch`` to read
  the next page from the same cut. A page costs its own rows, not the operator's, and holds at most
  ``max_scan_bytes`` of them (it stops early, with ``next``; a bigger entity comes alone).
- ``POST /admin/update`` ``{"id", "operator", "function", "args": [...], "keys": [...]?}``: a serializable
  admin update (both runtimes): the deployed ``function`` runs on every
  key (default: every entity of the operator), alone at an epoch boundary, once per ``id`` (a repeat answers
  with the first outcome, ``"repeated": true``): ``{"id", "transactions", "committed", "aborted": {key:
  error}, "epochs", "repeated"}``.
- ``POST /admin/code`` ``{"ref": "module:attribute", "version": "v2", "migration": {"operator", "function",
  "args"}?, "mode": "strict" | "compatible"?}``: a code update to an application among the ``code_refs``
  setting (403 ``Forbidden`` otherwise; clients only name deployed code). *strict* (default, both runtimes):
  every partition switches at one epoch boundary, after every transaction begun on the old code finished;
  the migration (a function of the new code) then runs on every entity of the operator in an epoch of its
  own before any client transaction. *compatible* (both runtimes; no
  migration): transactions sequenced from the boundary on run the new code while those deferred before it
  finish on the old one. ``{"version", "ref", "from_epoch", "migration", "mode"}``. Replies carry
  ``code_version`` (the version that transaction ran with); rolling back is another update. On Spark, while
  the runtime is paused, an update (or admin update) that needs epochs to run answers 409 ``Paused`` at once
  (nothing changed; resume, then retry) instead of waiting for its timeout; a compatible one applies at once.
  Every engine: an update that would drop the code of a version with workflows in flight (its recorded ref no
  longer installed) answers 409 ``VersionInUse`` naming the version and its count, before anything is recorded
  (migrate or cancel them first): the engine's ``update_code`` decides it at its boundary
  (:func:`charon.runtime.control.drain.plan_update`), where it also unloads the drained versions.
- ``POST /admin/sql`` ``{"sql": "SELECT ...", "epoch": N?}``: the dashboard's SQL box, one safe ``SELECT``
  over the state views (one per operator: ``key``, ``item``, ``value``, ``value_json``, ``epoch``) at one
  consistent epoch (default the latest): ``{"epoch", "columns", "rows", "truncated", "engine": "sqlite"}``.
  Both runtimes answer it in the SQL sandbox (:mod:`charon.runtime.control.sqlstate`): SQLite in a child process
  with bounded memory and the lowest CPU priority, over a cut of the committed state; never in the engine's
  process or JVM. Anything but a single SELECT over the views with allowed functions is 422 ``SQLRejected``
  (DDL/DML, commands, unknown or disallowed functions, other tables); a query that does not parse or resolve
  400 ``SQLSyntaxError``; at most ``sql_max_rows`` rows and ``sql_max_result_bytes`` bytes (413
  ``SQLResultTooLarge``), stopped after ``sql_timeout_s`` (422 ``SQLTimeout``), at most ``sql_max_memory``
  (422 ``SQLTooExpensive``), text of at most ``sql_max_chars``; at most ``sql_max_entities`` per operator
  (413 ``StateTooLarge``); at most two at once (429 ``SQLBusy``).
- ``POST /admin/rescale`` ``{"partitions"?: n, "log_partitions"?: m}`` (at least one; each 1 .. the
  ``max_partitions`` setting): change the number of engine partitions of the running deployment at an epoch
  boundary (key groups move; both runtimes; blocks until done): ``{"from", "to", "epoch", "keys", "wait_s",
  "pause_s", "cpu_s", "log"}`` (``wait_s``: until the running epoch was done, epochs still ran; ``pause_s``: no
  epoch could run). ``log_partitions`` (Spark) then changes the input log's partition count, without a pause:
  ``log`` is ``{"from", "to", "physical", "epoch", "switch_s", "cpu_s"}``
  (:meth:`charon.runtime.spark.runtime.SparkRuntime.rescale_log`); the in-process runtime has no log partitions
  (its node's input log is one epoch log): 501 ``NotSupported``. 409 ``RescaleRunning`` while another one runs
  (or, in-process, while paused: resume first); 503 ``RescaleTimeout`` if no epoch boundary came in time
  (nothing moved: neither the engine nor the log), 503 ``Unavailable`` (with ``Retry-After``) while the runtime
  is still starting, recovering its query or failed, or while its input log does not answer (at once, nothing
  moved), or when the engine moved but the log then could not be resized (the message says so).
  A log-only rescale answers ``{"log": {...}}`` alone.
  ``/admin/status`` shows ``partitions``, ``last_rescale`` (that answer) and, on Spark, ``log_partitions``
  (``{"route", "physical"}``).
- ``GET /admin/requests`` and ``GET /admin/requests/{request_id}``: the invocation inspector
  (:mod:`charon.server.requests_admin`).
- ``GET /admin/summary``: the dashboard's JSON (:meth:`charon.server.metrics.GatewayMetrics.summary`).
- ``GET /admin/metrics/history?since=T``: the dashboard's charts, one sample a second newer than ``T`` (Unix
  seconds), oldest first (:mod:`charon.server.history`; at most ``metrics_history_samples`` and
  ``metrics_history_bytes``): ``{"interval_s", "samples", "max_samples", "max_bytes", "bytes"}``.
- ``GET /admin/code/history``: the code versions deployed, oldest first: ``{"app", "current", "versions":
  [{"from_epoch", "version", "ref", "migration"}]}``.
- ``GET /metrics``: Prometheus text format (:mod:`charon.server.metrics`).
- ``GET /dashboard``: the dashboard page (static HTML/JS; it asks for the token and calls the routes above).
- With an effect executor beside the engine (``charon run --effects``, :class:`EffectsAdmin`):
  ``GET /admin/effects?status=S&limit=N`` (``{"counts", "effects"}``), ``POST /admin/effects/{id}/retry`` and
  ``POST /admin/effects/{id}/abandon`` (409 ``NotParked`` when the effect is not in a state that allows it), and
  the effect lines of ``/metrics``. Without one these routes do not exist (404).
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import msgspec
from starlette.requests import Request as HTTPRequest
from starlette.responses import FileResponse, Response
from starlette.routing import Route

from charon import serde
from charon.config import GatewayConfig
from charon.core.routing import check_key, split_store_key
from charon.errors import InvalidKey, VersionInUse
from charon.messages import Reply, Request
from charon.runtime.contract import (
    SQL_ERRORS,
    Controls,
    ControlStatus,
    Engine,
    EpochNotRetained,
    GatePaused,
    RescaleBusy,
)
from charon.server.audit import audited, note
from charon.server.auth import Principal
from charon.server.limits import Slots
from charon.server.limits_admin import LimitsAdmin
from charon.server.metrics import CONTENT_TYPE_LATEST, GatewayMetrics
from charon.server.requests_admin import RequestsAdmin
from charon.server.wire import IDEMPOTENCY_KEY, MSGPACK_TYPES, HTTPError, guard, respond

__all__ = ["AdminGateway", "AdminRoutes", "EffectsAdmin", "admin_routes"]

STATIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
#: the dashboard's static files besides the page, with their media types
ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css", "charts.js": "text/javascript"}
SQL_SLOTS = 2  # /admin/sql queries running at once per gateway (429 SQLBusy beyond)



class AdminGateway(Protocol):
    """What the admin routes use of the gateway (:class:`charon.server.gateway.Gateway` provides it)."""

    engine: Engine
    cfg: GatewayConfig
    known_ops: set[str]
    inflight: dict[str, asyncio.Future[Reply]]

    def check_auth(self, request: HTTPRequest, scopes: frozenset[str] | None = None) -> Principal: ...

    def check_ready(self) -> None: ...

    async def off_loop(self, method: Callable[..., object], *args: object) -> Any: ...

    async def read_body(self, request: HTTPRequest) -> bytes: ...

    def validate(self, operator: str, key: str, function: str, args: list[object]) -> Request: ...


class EffectsAdmin(Protocol):
    """An effect executor running beside the engine on the gateway's loop (:mod:`charon.runtime.effects`): started
    after the engine, stopped before it; ``GET /admin/effects``, ``POST /admin/effects/{id}/retry|abandon`` and
    its lines of ``/metrics`` go through these calls only (blocking ones run off the loop)."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def list_effects(self, status: str | None, limit: int) -> list[dict[str, Any]]: ...

    def effect_counts(self) -> dict[str, int]: ...

    def get_effect(self, effect_id: str) -> dict[str, object] | None: ...

    def parked_effects(self, after: str | None, limit: int) -> list[dict[str, Any]]: ...

    def retry_effect(self, effect_id: str) -> bool: ...

    def abandon_effect(self, effect_id: str) -> bool: ...

    def prometheus(self) -> str: ...


EFFECT_STATUSES = frozenset({"pending", "running", "resuming", "failed", "done"})


def _controls(gw: AdminGateway) -> Controls:
    """The engine's controls, or 501 ``NotSupported`` (a remote gateway's engine has none)."""
    controls = gw.engine.controls
    if controls is None:
        raise HTTPError("NotSupported", "this runtime has no controls (a gateway without an engine, --engine remote, "
                        "serves invokes and request status only: send admin requests to the gateway of the engine's "
                        "driver)")
    return controls


async def _json_body(gw: AdminGateway, request: HTTPRequest, fields: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The request's JSON or msgpack object; 400 for a field not in ``fields`` (415 for another media type)."""
    body = await gw.read_body(request)
    if not body:
        return {}
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    try:
        if ctype == "application/json":
            doc = msgspec.json.decode(body)
        elif ctype in MSGPACK_TYPES:
            doc = msgspec.msgpack.decode(body)
        else:
            raise HTTPError("UnsupportedMediaType", "the body must be application/json or application/msgpack")
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise HTTPError("BadRequest", f"malformed body: {exc}") from None
    except RecursionError:
        raise HTTPError("BadRequest", "malformed body: nested too deeply") from None
    if not isinstance(doc, dict):
        raise HTTPError("BadRequest", "the body must be an object")
    unknown = set(doc) - fields
    if unknown:
        raise HTTPError("BadRequest", f"unknown fields {sorted(map(str, unknown))}")  # msgpack keys: any type
    return doc


def _epoch_param(raw: object, name: str) -> int | None:
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, int | str):
        raise HTTPError("BadRequest", f"{name} must be an integer")
    try:
        value = int(raw)
    except ValueError:
        raise HTTPError("BadRequest", f"{name} must be an integer") from None
    if value < -1 or value > 1 << 62:
        raise HTTPError("BadRequest", f"{name} out of range")
    return value


def _partition_counts(doc: Mapping[str, object], cap: int) -> tuple[int | None, int | None]:
    """A rescale's ``(partitions, log_partitions)``: at least one, each an integer 1..``cap`` (400 otherwise)."""
    n, m = doc.get("partitions"), doc.get("log_partitions")
    if n is None and m is None:
        raise HTTPError("BadRequest", "give partitions, log_partitions or both")
    return _count("partitions", n, cap), _count("log_partitions", m, cap)


def _count(name: str, v: object, cap: int) -> int | None:
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= cap):
        raise HTTPError("BadRequest", f"{name} must be an integer 1..{cap} (max_partitions)")
    return v


def _entities(rows: dict[bytes, bytes], limit: int, more: bool = False) -> dict[str, object]:
    """An inspection's store rows as ``{"entities", "items", "count", "truncated", "next"}``: at most ``limit``
    entities in key order, each with its value and its own items; ``next``: the cursor of the following page (the
    last key shown) when there are more, else None."""
    entities: dict[str, object] = {}
    items: dict[str, dict[str, object]] = {}
    for k, v in sorted(rows.items()):
        _, key, item = split_store_key(k)
        if key not in entities and len(entities) >= limit:
            continue
        if item == "":
            entities[key] = serde.decode(v)
        else:
            entities.setdefault(key, None)
            items.setdefault(key, {})[item.lstrip("\x01")] = serde.decode(v)
    truncated = more or len({split_store_key(k)[1] for k in rows}) > limit  # more: stopped at max_scan_bytes
    last = next(reversed(entities)) if entities else None
    return {"entities": entities, "items": items, "count": len(entities), "truncated": truncated,
            "next": last if truncated else None}


def _migration(mig: object) -> tuple[str, str, list[object]] | None:
    """A code update's migration ``(operator, function, args)`` from its ``{"operator", "function", "args"}``."""
    if mig is None:
        return None
    if not isinstance(mig, dict) or set(mig) - {"operator", "function", "args"}:
        raise HTTPError("BadRequest", 'migration must be {"operator", "function", "args"}')
    args = mig.get("args", [])
    if not isinstance(mig.get("operator"), str) or not isinstance(mig.get("function"), str) \
            or not isinstance(args, list):
        raise HTTPError("BadRequest", "migration operator and function are strings, args a list")
    return (mig["operator"], mig["function"], args)


class AdminRoutes:
    """The admin, metrics and dashboard routes over one gateway: one handler per route, each using the engine's
    :class:`~charon.runtime.contract.Controls` (501 ``NotSupported`` for an engine without them) and mapping the
    contract's errors to typed answers."""

    def __init__(self, gw: AdminGateway, metrics: GatewayMetrics, effects: EffectsAdmin | None = None) -> None:
        self.gw = gw
        self.metrics = metrics
        self.effects = effects
        self.rescaling = False  # a rescale is running (taken before any await: one at a time)
        self.sql_slots = Slots(SQL_SLOTS, "SQLBusy", lambda cap: f"{cap} SQL queries are running; retry later")

    def with_layout(self, st: ControlStatus) -> dict[str, Any]:
        gw = self.gw
        last = _controls(gw).last_rescale()
        return {**st.doc(), "inflight": len(gw.inflight), "partitions": gw.engine.partitions,
                "last_rescale": None if last is None else last.doc()}

    async def status(self, request: HTTPRequest) -> Response:
        gw = self.gw
        gw.check_auth(request)
        st = await _controls(gw).status()
        return respond(request, 200, self.with_layout(st))

    async def dead_letters(self, request: HTTPRequest) -> Response:
        gw = self.gw
        gw.check_auth(request)
        try:
            limit = int(request.query_params.get("limit", "1000"))
        except ValueError:
            raise HTTPError("BadRequest", "limit must be an integer") from None
        if not 1 <= limit <= 10_000:
            raise HTTPError("BadRequest", "limit must be between 1 and 10000")
        _controls(gw)  # a remote gateway's engine keeps none: 501, not an empty list
        letters = await gw.off_loop(gw.engine.dead_letters, limit)
        return respond(request, 200, {"dead_letters": letters})

    async def pause(self, request: HTTPRequest) -> Response:
        gw = self.gw
        gw.check_auth(request)
        doc = await _json_body(gw, request, frozenset({"after_epoch"}))
        after = _epoch_param(doc.get("after_epoch"), "after_epoch")
        note(request, after_epoch=after)
        st = await _controls(gw).pause(after)
        return respond(request, 200, self.with_layout(st))

    async def resume(self, request: HTTPRequest) -> Response:
        gw = self.gw
        gw.check_auth(request)
        await _json_body(gw, request)
        st = await _controls(gw).resume()
        return respond(request, 200, self.with_layout(st))

    async def rescale(self, request: HTTPRequest) -> Response:
        gw = self.gw
        gw.check_auth(request)
        doc = await _json_body(gw, request, frozenset({"partitions", "log_partitions"}))
        n, m = _partition_counts(doc, gw.cfg.max_partitions)
        note(request, partitions=n, log_partitions=m)
        controls = _controls(gw)
        if m is not None and not controls.log_rescalable:
            raise HTTPError("NotSupported", "this runtime has no input-log partitions to rescale (the in-process "
                            "runtime's input log is its node's single epoch log)")
        gw.check_ready()  # 503 while the runtime starts in the background: a move then races the query's start
        if self.rescaling:
            raise HTTPError("RescaleRunning", "a rescale is running; retry when it is done")
        self.rescaling = True  # before any await: two requests arriving together must not both pass
        try:
            out = await controls.rescale(n, log_partitions=m)  # one call: the engine orders the parts
        except RescaleBusy as exc:
            raise HTTPError("RescaleRunning", str(exc)) from None
        except TimeoutError as exc:
            raise HTTPError("RescaleTimeout", f"no epoch boundary in time: nothing moved (the engine partitions "
                            f"stay{'' if m is None else ', the input log was not resized'}): {exc}") from None
        except ValueError as exc:
            raise HTTPError("BadRequest", f"cannot rescale to {n if m is None else (n, m)}: {exc}") from None
        finally:
            self.rescaling = False
        return respond(request, 200, out.doc())

    async def state(self, request: HTTPRequest) -> Response:
        gw = self.gw
        gw.check_auth(request)
        operator = request.path_params["operator"]
        if gw.known_ops and operator not in gw.known_ops:
            raise HTTPError("UnknownOperator", f"unknown operator {operator!r}")
        keys = request.query_params.getlist("key") or None
        cap = gw.cfg.max_scan
        if keys is not None:
            if len(keys) > cap:
                raise HTTPError("BadRequest", f"at most {cap} keys per read (max_scan)")
            for k in keys:
                try:
                    check_key(k)
                except InvalidKey as exc:
                    raise HTTPError("InvalidKey", str(exc)) from None
        after, prefix = request.query_params.get("after"), request.query_params.get("prefix", "")
        if keys is not None and (after is not None or prefix):
            raise HTTPError("BadRequest", "give keys, or after/prefix to page through the entities, not both")
        for name, v in (("after", after), ("prefix", prefix or None)):
            if v is not None:
                try:
                    check_key(v)
                except InvalidKey as exc:
                    raise HTTPError("InvalidKey", f"{name}: {exc}") from None
        epoch = _epoch_param(request.query_params.get("epoch"), "epoch")
        limit_raw = request.query_params.get("limit")
        limit = cap if limit_raw is None else _epoch_param(limit_raw, "limit")
        if limit is None or limit < 1 or limit > cap:
            raise HTTPError("BadRequest", f"limit must be 1..{cap} (max_scan)")
        try:
            got = await _controls(gw).inspect(operator, keys, epoch, limit + 1, after=after, prefix=prefix,
                                              max_bytes=gw.cfg.max_scan_bytes)
        except EpochNotRetained as exc:
            raise HTTPError("EpochNotRetained", str(exc)) from None
        return respond(request, 200, {"operator": operator, "epoch": got.epoch,
                                      **_entities(got.rows, limit, got.more)})

    async def update(self, request: HTTPRequest) -> Response:
        gw = self.gw
        gw.check_auth(request)
        doc = await _json_body(gw, request, frozenset({"id", "operator", "function", "args", "keys"}))
        uid, operator, function = doc.get("id"), doc.get("operator"), doc.get("function")
        if not isinstance(uid, str) or not IDEMPOTENCY_KEY.match(uid):
            raise HTTPError("BadRequest", "id must be 1-200 characters of A-Z a-z 0-9 and . _ ~ : @ + = -")
        if not isinstance(operator, str) or not isinstance(function, str):
            raise HTTPError("BadRequest", "operator and function must be strings")
        args, keys = doc.get("args", []), doc.get("keys")
        if not isinstance(args, list):
            raise HTTPError("BadArguments", '"args" must be a list of positional arguments')
        if keys is not None:
            if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
                raise HTTPError("BadRequest", '"keys" must be a list of entity keys')
            for k in keys:
                try:
                    check_key(k)
                except InvalidKey as exc:
                    raise HTTPError("InvalidKey", str(exc)) from None
        note(request, id=uid, operator=operator, function=function, keys=None if keys is None else len(keys))
        controls = _controls(gw)
        gw.validate(operator, keys[0] if keys else "k", function, args)  # names, arity, types: 4xx
        try:
            out = await controls.run_alone(uid, operator, function, serde.encode(list(args)), keys)
        except GatePaused as exc:
            raise HTTPError("Paused", str(exc)) from None
        return respond(request, 200, out.doc())

    async def code(self, request: HTTPRequest) -> Response:
        gw = self.gw
        gw.check_auth(request)
        doc = await _json_body(gw, request, frozenset({"ref", "version", "migration", "mode"}))
        ref, version, mig = doc.get("ref"), doc.get("version"), doc.get("migration")
        mode = doc.get("mode", "strict")
        note(request, ref=ref, version=version, mode=mode)
        if mode not in ("strict", "compatible"):
            raise HTTPError("BadRequest", 'mode is "strict" or "compatible"')
        if mode == "compatible" and mig is not None:
            raise HTTPError("BadRequest", "a compatible update has no migration")
        controls = _controls(gw)
        if mode not in controls.code_update_modes:
            raise HTTPError("NotSupported", f"this runtime has no {mode} code updates")
        if not isinstance(ref, str) or not isinstance(version, str) or not 0 < len(version) <= 100:
            raise HTTPError("BadRequest", "ref (module:attribute) and version (1-100 characters) are required")
        allowed = {r.strip() for r in (gw.cfg.code_refs or "").split(",") if r.strip()}
        if ref not in allowed:
            raise HTTPError("Forbidden", f"{ref!r} is not among the deployable code refs (code_refs setting)")
        migration = _migration(mig)
        encoded = None if migration is None else (migration[0], migration[1], serde.encode(list(migration[2])))
        try:
            out = await controls.update_code(ref, version, encoded, mode)
        except (ImportError, TypeError) as exc:
            raise HTTPError("BadRequest", f"cannot deploy {ref!r}: {exc}") from None
        except GatePaused as exc:
            raise HTTPError("Paused", str(exc)) from None
        except VersionInUse as exc:  # decided at the update's boundary, nothing recorded
            raise HTTPError("VersionInUse", str(exc)) from None
        return respond(request, 200, out.doc())

    async def sql(self, request: HTTPRequest) -> Response:
        gw = self.gw
        gw.check_auth(request)
        doc = await _json_body(gw, request, frozenset({"sql", "epoch"}))
        query = doc.get("sql")
        note(request, sql=query, epoch=doc.get("epoch"))
        cfg = gw.cfg
        if not isinstance(query, str) or not query.strip():
            raise HTTPError("BadRequest", '"sql" must be a non-empty string')
        if len(query) > cfg.sql_max_chars:
            raise HTTPError("BadRequest", f"the query is longer than {cfg.sql_max_chars} characters (sql_max_chars)")
        epoch = _epoch_param(doc.get("epoch"), "epoch")
        controls = _controls(gw)
        release = self.sql_slots.take()
        try:
            out = await controls.sql(query, epoch, max_rows=cfg.sql_max_rows, timeout_s=cfg.sql_timeout_s,
                                     max_entities=cfg.sql_max_entities, max_bytes=cfg.sql_max_result_bytes,
                                     max_memory=cfg.sql_max_memory)
        except SQL_ERRORS as exc:
            raise HTTPError(type(exc).__name__, str(exc)) from None
        finally:
            release()
        return respond(request, 200, out.doc())

    async def summary(self, request: HTTPRequest) -> Response:
        gw = self.gw
        gw.check_auth(request)
        doc = await gw.off_loop(self.metrics.summary, len(gw.inflight))
        return respond(request, 200, doc)

    async def history(self, request: HTTPRequest) -> Response:
        """``GET /admin/metrics/history?since=T``: the samples newer than ``T`` (Unix seconds; default all)."""
        self.gw.check_auth(request)
        q = request.query_params
        unknown = set(q) - {"since"}
        if unknown:
            raise HTTPError("BadRequest", f"unknown parameters {sorted(unknown)}")
        since: float | None = None
        if "since" in q:
            try:
                since = float(q["since"])
            except ValueError:
                raise HTTPError("BadRequest", "since must be a number (Unix seconds)") from None
            if not math.isfinite(since):
                raise HTTPError("BadRequest", "since must be a finite number (Unix seconds)")
        h = self.metrics.history
        samples = [msgspec.to_builtins(s) for s in h.since(since)]
        return respond(request, 200, {"interval_s": 1.0, "samples": samples, "max_samples": h.max_samples,
                                      "max_bytes": h.max_bytes, "bytes": h.bytes})

    async def code_history(self, request: HTTPRequest) -> Response:
        """``GET /admin/code/history``: the deployment's code versions, oldest first, and the current one."""
        gw = self.gw
        gw.check_auth(request)
        _controls(gw)
        versions = await gw.off_loop(gw.engine.code_versions)
        return respond(request, 200, {"app": gw.engine.app.name, "current": versions[-1]["version"],
                                      "versions": versions})

    async def prometheus(self, request: HTTPRequest) -> Response:
        gw = self.gw
        gw.check_auth(request)
        data = await gw.off_loop(self.metrics.exposition, len(gw.inflight))
        if self.effects is not None:
            data += (await gw.off_loop(self.effects.prometheus)).encode()
        return Response(data, 200, media_type=CONTENT_TYPE_LATEST)

    def _effects(self) -> EffectsAdmin:
        assert self.effects is not None  # the routes exist only beside an executor
        return self.effects

    async def list_effects(self, request: HTTPRequest) -> Response:
        """``GET /admin/effects?status=S&limit=N``: ``{"counts": {status: n}, "effects": [...]}`` (newest first)."""
        self.gw.check_auth(request)
        fx = self._effects()
        status = request.query_params.get("status")
        if status is not None and status not in EFFECT_STATUSES:
            raise HTTPError("BadRequest", f"status must be one of {', '.join(sorted(EFFECT_STATUSES))}")
        try:
            limit = int(request.query_params.get("limit", "100"))
        except ValueError:
            raise HTTPError("BadRequest", "limit must be an integer") from None
        if not 1 <= limit <= 10_000:
            raise HTTPError("BadRequest", "limit must be in [1, 10000]")
        rows = await self.gw.off_loop(fx.list_effects, status, limit)
        counts = await self.gw.off_loop(fx.effect_counts)
        return respond(request, 200, {"counts": counts, "effects": rows})

    async def effect_action(self, request: HTTPRequest) -> Response:
        """``POST /admin/effects/{id}/retry`` (a parked failure gets new attempts) or ``.../abandon`` (a parked or
        pending effect resumes its continuation with ``EffectAbandoned``); 409 ``NotParked`` otherwise."""
        self.gw.check_auth(request)
        fx = self._effects()
        eid, action = request.path_params["effect_id"], request.path_params["action"]
        note(request, effect_id=eid, effect_action=action)
        if not IDEMPOTENCY_KEY.match(eid) or action not in ("retry", "abandon"):
            raise HTTPError("NotFound", "no such effect action")
        call = fx.retry_effect if action == "retry" else fx.abandon_effect
        if not await self.gw.off_loop(call, eid):
            state = "parked" if action == "retry" else "parked or pending"
            raise HTTPError("NotParked", f"effect {eid!r} is not {state}")
        return respond(request, 200, {"id": eid, "action": action})

    async def dashboard(self, request: HTTPRequest) -> Response:
        return FileResponse(os.path.join(STATIC, "dashboard.html"), media_type="text/html")

    async def asset(self, request: HTTPRequest) -> Response:
        """The dashboard's static files (scripts, styles): only the names in :data:`ASSETS`."""
        name = request.path_params["name"]
        media = ASSETS.get(name)
        if media is None:
            raise HTTPError("NotFound", f"no dashboard file {name!r}")
        return FileResponse(os.path.join(STATIC, name), media_type=media)

    def routes(self) -> list[Route]:
        return [
            Route("/admin/status", guard(self.status), methods=["GET"], name="admin_status"),
            Route("/admin/dead-letters", guard(self.dead_letters), methods=["GET"], name="admin_dead_letters"),
            Route("/admin/pause", guard(audited("pause", self.pause)), methods=["POST"], name="admin_pause"),
            Route("/admin/resume", guard(audited("resume", self.resume)), methods=["POST"], name="admin_resume"),
            Route("/admin/rescale", guard(audited("rescale", self.rescale)), methods=["POST"], name="admin_rescale"),
            Route("/admin/state/{operator}", guard(self.state), methods=["GET"], name="admin_state"),
            Route("/admin/update", guard(audited("admin update", self.update)), methods=["POST"], name="admin_update"),
            Route("/admin/code", guard(audited("code update", self.code)), methods=["POST"], name="admin_code"),
            Route("/admin/sql", guard(audited("sql", self.sql)), methods=["POST"], name="admin_sql"),
            Route("/admin/summary", guard(self.summary), methods=["GET"], name="admin_summary"),
            Route("/metrics", guard(self.prometheus), methods=["GET"], name="metrics"),
            Route("/admin/metrics/history", guard(self.history), methods=["GET"], name="admin_metrics_history"),
            Route("/admin/code/history", guard(self.code_history), methods=["GET"], name="admin_code_history"),
            Route("/dashboard", self.dashboard, methods=["GET"], name="dashboard"),
            Route("/dashboard/{name}", guard(self.asset), methods=["GET"], name="dashboard_asset"),
        ] + RequestsAdmin(self.gw).routes() + LimitsAdmin(self.gw).routes() + (
            [] if self.effects is None else [  # only beside an effect executor (charon run --effects)
            Route("/admin/effects", guard(self.list_effects), methods=["GET"], name="admin_effects"),
            Route("/admin/effects/{effect_id}/{action}", guard(audited("effect action", self.effect_action)),
                  methods=["POST"], name="admin_effect_action"),
        ])


def admin_routes(gw: AdminGateway, metrics: GatewayMetrics, effects: EffectsAdmin | None = None) -> list[Route]:
    """The admin, metrics and dashboard routes over one gateway (and its effect executor, if any)."""
    return AdminRoutes(gw, metrics, effects).routes()

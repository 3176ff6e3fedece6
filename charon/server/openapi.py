"""The gateway's OpenAPI 3.1 document (``GET /openapi.json``): every route, including one ``/invoke`` path per
function of the application with its parameter names and types (:func:`describe_app`), and the admin routes'.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from typing import Any

from charon.server.wire import IDEMPOTENCY_KEY, MSGPACK

__all__ = ["describe_app", "openapi_document", "admin_paths", "effect_paths", "promise_paths", "workflow_paths"]


def _operators(app: Any) -> list[Any]:
    ops = getattr(app, "operators", None)
    if ops is None:
        return []
    if isinstance(ops, dict):
        return list(ops.values())
    return list(ops)


def _op_name(op: Any) -> str:
    return op if isinstance(op, str) else str(getattr(op, "name", op))


def _functions(op: Any) -> dict[str, Callable[..., Any]]:
    fns = getattr(op, "functions", None)
    if fns is None:
        return {}
    if isinstance(fns, dict):
        return {str(k): v for k, v in fns.items()}
    return {getattr(f, "__name__", str(f)): f for f in fns}


def _callable_of(fn: Any) -> Callable[..., Any] | None:
    for attr in ("body", "fn", "func", "__wrapped__"):
        inner = getattr(fn, attr, None)
        if callable(inner):
            return inner
    return fn if callable(fn) else None


_TYPE_SCHEMAS: dict[Any, dict[str, Any]] = {
    int: {"type": "integer"},
    float: {"type": "number"},
    str: {"type": "string"},
    bool: {"type": "boolean"},
    bytes: {"type": "string", "contentEncoding": "base64"},
    type(None): {"type": "null"},
    list: {"type": "array"},
    dict: {"type": "object"},
    Any: {},
}


def _schema_of(tp: Any) -> dict[str, Any]:
    if tp in _TYPE_SCHEMAS:
        return dict(_TYPE_SCHEMAS[tp])
    origin = typing.get_origin(tp)
    targs = typing.get_args(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return {"anyOf": [_schema_of(a) for a in targs]}
    if origin in (list, tuple, set, frozenset):
        s: dict[str, Any] = {"type": "array"}
        if targs and origin is list:
            s["items"] = _schema_of(targs[0])
        return s
    if origin is dict:
        s = {"type": "object"}
        if len(targs) == 2:
            s["additionalProperties"] = _schema_of(targs[1])
        return s
    return {}


def describe_app(app: Any, public_only: bool = False) -> dict[str, dict[str, list[tuple[str, dict[str, Any]]]]]:
    """``{operator: {function: [(parameter name, JSON schema), ...]}}`` for the application's functions.

    The first parameter (the ``Context``) is left out. ``public_only``: only the functions clients may invoke
    (``@op.function(public=True)``), and only the operators that have one.
    """
    out: dict[str, dict[str, list[tuple[str, dict[str, Any]]]]] = {}
    for op in _operators(app):
        fns: dict[str, list[tuple[str, dict[str, Any]]]] = {}
        for name, fn in _functions(op).items():
            if public_only and getattr(fn, "public", False) is not True:
                continue
            target = _callable_of(fn)
            params: list[tuple[str, dict[str, Any]]] = []
            if target is not None:
                try:
                    sig = inspect.signature(target)
                    hints = typing.get_type_hints(target)
                except (TypeError, ValueError, NameError):
                    sig, hints = None, {}
                if sig is not None:
                    for i, p in enumerate(sig.parameters.values()):
                        if i == 0:
                            continue  # ctx
                        params.append((p.name, _schema_of(hints.get(p.name, Any))))
            fns[name] = params
        if fns or not public_only:
            out[_op_name(op)] = fns
    return out


_POSITION_SCHEMA = {
    "type": ["integer", "null"],
    "description": "place in the epoch's serial order: replies ordered by (epoch, position) form a serial "
    "order equivalent to the execution (increasing, not consecutive; null only for replies recorded before "
    "positions existed)",
}

_ERROR_SCHEMA = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
            "required": ["type", "message"],
        },
        "request_id": {"type": "string"},
        "tid": {"type": "integer"},
        "epoch": {"type": "integer"},
        "position": _POSITION_SCHEMA,
    },
    "required": ["error"],
}


def openapi_document(app: Any, secured: bool, effects: bool = False) -> dict[str, Any]:
    """The OpenAPI document of a gateway over ``app`` (``secured``: its routes need the bearer token)."""
    def err(desc: str) -> dict[str, Any]:
        return {
            "description": desc,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
        }

    reply_ok = {
        "description": "the transaction committed",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Reply"}}},
    }
    accepted = {
        "description": "accepted (async mode, or still running after the gateway's wait timeout)",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Accepted"}}},
    }
    security: list[dict[str, list[str]]] = [{"bearer": []}] if secured else []

    def invoke_op(summary: str, args_schema: dict[str, Any], params: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "post": {
                "summary": summary,
                "security": security,
                "parameters": params
                + [
                    {"name": "mode", "in": "query", "schema": {"type": "string", "enum": ["sync", "async"]}},
                    {
                        "name": "Idempotency-Key",
                        "in": "header",
                        "schema": {"type": "string", "pattern": IDEMPOTENCY_KEY.pattern},
                    },
                ],
                "requestBody": {
                    "required": True,
                    "content": {
                        ctype: {
                            "schema": {
                                "type": "object",
                                "properties": {"args": args_schema},
                                "required": ["args"],
                                "additionalProperties": False,
                            }
                        }
                        for ctype in ("application/json", MSGPACK)
                    },
                },
                "responses": {
                    "200": reply_ok,
                    "202": accepted,
                    "400": err("malformed body, invalid key (InvalidKey), invalid or reserved (ReservedRequestId) "
                                          "Idempotency-Key"),
                    "401": err("missing or wrong bearer token"),
                    "404": err("unknown operator or function"),
                    "408": err("the body did not arrive in time"),
                    "409": err("the transaction aborted: a function raised (error.type is its class name)"),
                    "413": err("body larger than the gateway's limit"),
                    "415": err("the body is neither application/json nor application/msgpack"),
                    "422": err("wrong arguments (BadArguments), or an Idempotency-Key reused for another "
                               "operation (IdempotencyConflict)"),
                    "503": err("the runtime could not take the request; retry with the same Idempotency-Key"),
                },
            }
        }

    def path_param(name: str, desc: str) -> dict[str, Any]:
        return {
            "name": name,
            "in": "path",
            "required": True,
            "schema": {"type": "string", "minLength": 1},
            "description": desc,
        }

    paths: dict[str, Any] = {
        "/invoke/{operator}/{key}/{function}": invoke_op(
            "Invoke a function of an entity as one transaction",
            {"type": "array"},
            [
                path_param("operator", "operator name"),
                path_param("key", "entity key"),
                path_param("function", "function name"),
            ],
        )
    }
    operators: dict[str, Any] = {}
    for op, fns in describe_app(app, public_only=True).items():  # internal functions are not the clients' to call
        operators[op] = {"functions": {}}
        for fn, params in fns.items():
            operators[op]["functions"][fn] = {"parameters": [{"name": n, "schema": s} for n, s in params]}
            args_schema: dict[str, Any] = {
                "type": "array",
                "minItems": len(params),
                "maxItems": len(params),
                "description": "positional arguments: " + (", ".join(n for n, _ in params) or "none"),
            }
            if params:
                args_schema["prefixItems"] = [dict(s, title=n) for n, s in params]
            item = invoke_op(
                f"{op}.{fn}({', '.join(n for n, _ in params)})",
                args_schema,
                [path_param("key", "entity key")],
            )
            item["post"]["x-charon-parameters"] = [n for n, _ in params]
            paths[f"/invoke/{op}/{{key}}/{fn}"] = item
    paths["/requests/{request_id}"] = {
        "get": {
            "summary": "Poll the reply of a request",
            "security": security,
            "parameters": [
                path_param("request_id", "request id (the Idempotency-Key)"),
                {"name": "wait", "in": "query", "schema": {"type": "number", "maximum": 30}},
            ],
            "responses": {
                "200": reply_ok,
                "202": accepted,
                "400": err("bad wait parameter"),
                "401": err("missing or wrong bearer token"),
                "404": err("unknown request id"),
                "409": err("the transaction aborted"),
                "422": err("the request id was reused for another operation"),
                "503": err("the runtime could not take the request; retry with the same Idempotency-Key"),
            },
        }
    }
    paths["/state/{operator}/{key}"] = {
        "get": {
            "summary": "Read an entity's committed state (admin)",
            "security": security,
            "parameters": [path_param("operator", "operator name"), path_param("key", "entity key")],
            "responses": {
                "200": {"description": "the entity's value"},
                "400": err("invalid key"),
                "401": err("missing or wrong bearer token"),
                "404": err("unknown operator"),
            },
        }
    }
    paths["/batch"] = {
        "post": {
            "summary": "Run a client atomic batch: the calls in order, as one transaction (all or none)",
            "security": security,
            "parameters": [{"name": "Idempotency-Key", "in": "header", "schema": {"type": "string"},
                            "description": "the batch id"}],
            "requestBody": {"required": True, "content": {ct: {"schema": {
                "type": "object", "required": ["calls"], "properties": {"calls": {
                    "type": "array", "minItems": 1,
                    "items": {"type": "array", "minItems": 4, "maxItems": 4,
                              "description": "[operator, key, function, [args...]]"}}}}}
                for ct in ("application/json", MSGPACK)}},
            "responses": {
                "200": reply_ok,
                "202": accepted,
                "400": err("malformed body, invalid key, invalid or reserved (ReservedRequestId) Idempotency-Key"),
                "401": err("missing or wrong bearer token"),
                "404": err("unknown operator or function in a call"),
                "409": err("a call raised: the whole batch aborted"),
                "422": err("bad arguments, or the batch id was reused for other calls"),
            },
        }
    }
    paths["/effects/continue/{operator}/{key}/{function}"] = {
        "post": {
            "summary": "An effect worker's continuation (charon effects work --url): not for clients",
            "description": "As /invoke, under the effect's reserved continuation id (fx.<app>.<tid>.<inv>.<n>.done, "
                           "which /invoke and /batch refuse), with a body limit of its own that carries any value "
                           "an effect handler may return (max_continuation_body).",
            "security": security,
            "parameters": [path_param("operator", "operator name"), path_param("key", "entity key"),
                           path_param("function", "the continuation"),
                           {"name": "Idempotency-Key", "in": "header", "required": True,
                            "schema": {"type": "string", "pattern": r"^fx\.[A-Za-z0-9._~:@+=-]+\.done$"},
                            "description": "the effect's continuation id"}],
            "requestBody": {"required": True, "content": {ct: {"schema": {
                "type": "object", "properties": {"args": {"type": "array"}}}} for ct in ("application/json", MSGPACK)}},
            "responses": {
                "200": reply_ok,
                "202": accepted,
                "400": err("not a continuation id, malformed body or invalid key"),
                "401": err("missing or wrong bearer token"),
                "404": err("unknown operator or function"),
                "409": err("the continuation raised: it aborted"),
                "413": err("the body exceeds max_continuation_body"),
                "422": err("bad arguments, or the id was used for another call"),
            },
        }
    }
    paths["/streams/{stream}"] = {
        "get": {
            "summary": "Read an output stream from an offset (whole atoms; long polling or server-sent events)",
            "security": security,
            "parameters": [
                path_param("stream", "stream name"),
                {"name": "from_offset", "in": "query", "schema": {"type": "integer", "minimum": 0}},
                {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1}},
                {"name": "wait", "in": "query", "schema": {"type": "number", "minimum": 0, "maximum": 30}},
            ],
            "responses": {
                "200": {"description": "events (JSON page, or text/event-stream when accepted)"},
                "400": err("invalid stream name or parameters"),
                "401": err("missing or wrong bearer token"),
                "404": err("the runtime has no output streams"),
                "503": err("too many stream readers; retry later"),
            },
        }
    }
    paths["/timers/{operator}/{key}"] = {
        "get": {
            "summary": "List the pending timers an entity registered (admin)",
            "security": security,
            "parameters": [path_param("operator", "operator name"), path_param("key", "entity key")],
            "responses": {
                "200": {"description": "the entity's pending timers"},
                "400": err("invalid key"),
                "401": err("missing or wrong bearer token"),
                "404": err("unknown operator"),
            },
        }
    }
    paths["/health"] = {"get": {"summary": "Liveness", "responses": {
        "200": {"description": "the runtime serves"},
        "503": {"description": "the runtime does not serve (starting, recovering, failed, stopped)"},
    }}}
    paths["/openapi.json"] = {
        "get": {"summary": "This document", "responses": {"200": {"description": "ok"}}}
    }
    paths.update(admin_paths(security))
    paths.update(promise_paths(security))
    paths.update(workflow_paths(security, sorted(getattr(app, "workflows", {}))))
    if effects:  # an effect executor runs beside the engine (charon run --effects)
        paths.update(effect_paths(security))
    if secured:  # every route that asks for a token asks for one of its scopes (charon.server.auth)
        for item in paths.values():
            for op in item.values():
                if isinstance(op, dict) and op.get("security"):
                    op.setdefault("responses", {}).setdefault("403", err("the token lacks the scope this route needs"))
    return {
        "openapi": "3.1.0",
        "info": {"title": f"Charon gateway: {getattr(app, 'name', 'app')}", "version": "1",
                 "description": "Only the application's public functions (@op.function(public=True)) are listed and "
                 "invocable. Bearer tokens carry scopes: invoke (/invoke, /batch, /requests), read (state, "
                 "streams, timers, inspector, SQL, metrics, status), admin (pause, resume, rescale, updates, code, "
                 "dead letters, effect actions), effects (effect workers' continuations)."},
        "paths": paths,
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "Error": _ERROR_SCHEMA,
                "Reply": {
                    "type": "object",
                    "properties": {
                        "request_id": {"type": "string"},
                        "tid": {"type": "integer"},
                        "epoch": {"type": "integer"},
                        "position": _POSITION_SCHEMA,
                        "value": {},
                        "status": {"type": "string", "enum": ["committed"]},
                        "code_version": {"type": "string"},
                    },
                    "required": ["request_id", "tid", "epoch", "position", "value"],
                },
                "Accepted": {
                    "type": "object",
                    "properties": {
                        "request_id": {"type": "string"},
                        "status_url": {"type": "string"},
                        "status": {"type": "string", "enum": ["pending"]},
                    },
                },
            },
        },
        "x-charon-operators": operators,
    }


# --------------------------------------------------------------------------------------------------


def effect_paths(security: list[dict[str, Any]]) -> dict[str, Any]:
    """The OpenAPI path items of the effect routes (:class:`charon.server.admin.EffectsAdmin`)."""
    err = {"description": "a typed error", "content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/Error"}}}}
    ok = {"description": "ok", "content": {"application/json": {"schema": {"type": "object"}}}}
    return {
        "/admin/effects": {"get": {
            "summary": "Effects with status, attempts and last error, newest first; counts per status (admin)",
            "security": security,
            "parameters": [
                {"name": "status", "in": "query", "required": False, "schema": {
                    "type": "string", "enum": ["pending", "running", "resuming", "failed", "done"]}},
                {"name": "limit", "in": "query", "required": False,
                 "schema": {"type": "integer", "minimum": 1, "maximum": 10000}}],
            "responses": {"200": ok, "400": err, "401": err}}},
        "/admin/effects/{effect_id}/{action}": {"post": {
            "summary": "retry a parked effect, or abandon a parked or pending one (its continuation then runs with "
                       "EffectAbandoned) (admin)",
            "security": security,
            "parameters": [
                {"name": "effect_id", "in": "path", "required": True, "schema": {"type": "string"}},
                {"name": "action", "in": "path", "required": True,
                 "schema": {"type": "string", "enum": ["retry", "abandon"]}}],
            "responses": {"200": ok, "401": err, "404": err, "409": err}}},
    }


def promise_paths(security: list[dict[str, Any]]) -> dict[str, Any]:
    """The OpenAPI path items of the promise and schedule routes (:mod:`charon.server.promises`,
    :mod:`charon.server.schedules`)."""
    err = {"description": "a typed error", "content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/Error"}}}}
    ok = {"description": "ok", "content": {"application/json": {"schema": {"type": "object"}}}}

    def body(props: dict[str, Any], required: list[str]) -> dict[str, Any]:
        schema = {"type": "object", "properties": props, "required": required, "additionalProperties": False}
        return {"required": bool(required),
                "content": {ct: {"schema": schema} for ct in ("application/json", "application/msgpack")}}

    def path(name: str) -> dict[str, Any]:
        return {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}

    page = [{"name": "after", "in": "query", "required": False, "schema": {"type": "string"}},
            {"name": "limit", "in": "query", "required": False,
             "schema": {"type": "integer", "minimum": 1, "maximum": 1000}}]
    acted = {"200": ok, "400": err, "401": err, "404": err, "409": err, "413": err, "415": err, "422": err}
    spec = {"name": {"type": "string"}, "cron": {"type": "string"}, "operator": {"type": "string"},
            "key": {"type": "string"}, "function": {"type": "string"}, "args": {"type": "array"},
            "catch_up": {"type": "integer", "minimum": 0, "maximum": 100}}
    return {
        "/promises": {"get": {"summary": "A page of durable promises in id order (read)", "security": security,
                              "parameters": [*page, {"name": "status", "in": "query", "required": False,
                                                     "schema": {"type": "string"}}],
                              "responses": {"200": ok, "400": err, "401": err}}},
        "/promises/{promise_id}": {"get": {"summary": "One promise's record (read)", "security": security,
                                           "parameters": [path("promise_id")],
                                           "responses": {"200": ok, "400": err, "401": err, "404": err}}},
        "/promises/{promise_id}/{action}": {"post": {
            "summary": "resolve ({value}) or reject ({error}) a promise (promises scope); cancel ({reason}, admin): "
                       "its continuation runs once; 409 PromiseConflict when it was settled before",
            "security": security, "parameters": [path("promise_id"), {
                "name": "action", "in": "path", "required": True,
                "schema": {"type": "string", "enum": ["resolve", "reject", "cancel"]}}],
            "requestBody": body({"value": {}, "error": {"type": "string"}, "reason": {"type": "string"}}, []),
            "responses": acted}},
        "/schedules": {
            "get": {"summary": "A page of schedules in name order (read)", "security": security,
                    "parameters": page, "responses": {"200": ok, "400": err, "401": err}},
            "post": {"summary": "Create a schedule at run time; its target a public function (admin)",
                     "security": security, "requestBody": body(spec, ["name", "cron", "operator", "key", "function"]),
                     "responses": acted}},
        "/schedules/{name}": {
            "get": {"summary": "One schedule's record (read)", "security": security, "parameters": [path("name")],
                    "responses": {"200": ok, "400": err, "401": err, "404": err}},
            "delete": {"summary": "Delete a schedule (admin)", "security": security, "parameters": [path("name")],
                       "responses": acted}},
        "/schedules/{name}/{action}": {"post": {
            "summary": "pause or resume a schedule (admin)", "security": security,
            "parameters": [path("name"), {"name": "action", "in": "path", "required": True,
                                          "schema": {"type": "string", "enum": ["pause", "resume"]}}],
            "responses": acted}},
        "/admin/bulk/{resource}/{action}": {"post": {
            "summary": "A bulk operation by filter, one page per call (admin, audited): cancel queued invocations "
                       "or pending promises, pause, resume or delete schedules, retry or abandon parked effects; "
                       "dry_run counts first; next is the following call's cursor",
            "security": security,
            "parameters": [
                {"name": "resource", "in": "path", "required": True,
                 "schema": {"type": "string", "enum": ["invocations", "promises", "schedules", "effects"]}},
                {"name": "action", "in": "path", "required": True, "schema": {
                    "type": "string", "enum": ["cancel", "pause", "resume", "delete", "retry", "abandon"]}},
                {"name": "Idempotency-Key", "in": "header", "required": False,
                 "schema": {"type": "string", "pattern": "^[A-Za-z0-9._~:@+=-]{1,200}$"}}],
            "requestBody": body({
                "where": {"type": "object", "additionalProperties": False, "properties": {
                    "operator": {"type": "string"}, "function": {"type": "string"},
                    "key_prefix": {"type": "string"}, "error_type": {"type": "string"},
                    "since": {"type": "number", "minimum": 0}, "until": {"type": "number", "minimum": 0}}},
                "dry_run": {"type": "boolean"}, "limit": {"type": "integer", "minimum": 1, "maximum": 1000},
                "cursor": {"type": ["string", "null"]}, "reason": {"type": "string"}}, []),
            "responses": {**acted, "501": err, "503": err}}},
    }


def workflow_paths(security: list[dict[str, list[str]]], names: list[str]) -> dict[str, object]:
    """The OpenAPI path items of the workflow routes (:mod:`charon.server.workflows`); ``names``: the application's
    workflows (the ``name`` path parameter's values)."""
    err = {"description": "a typed error", "content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/Error"}}}}
    ok = {"description": "ok", "content": {"application/json": {"schema": {"type": "object"}}}}

    def body(props: dict[str, object], required: list[str]) -> dict[str, object]:
        schema = {"type": "object", "properties": props, "required": required, "additionalProperties": False}
        return {"required": bool(required),
                "content": {ct: {"schema": schema} for ct in ("application/json", "application/msgpack")}}

    name_schema: dict[str, object] = {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,60}$"}
    if names:
        name_schema = {"type": "string", "enum": names}
    name = {"name": "name", "in": "path", "required": True, "schema": name_schema,
            "description": "the workflow's name (Workflow(name), given to Application(workflows=[...]))"}
    wid = {"name": "wid", "in": "path", "required": True, "schema": {"type": "string", "minLength": 1,
                                                                     "maxLength": 256}}
    key = {"name": "Idempotency-Key", "in": "header", "required": False,
           "schema": {"type": "string", "pattern": "^[A-Za-z0-9._~:@+=-]{1,200}$"}}
    page = [{"name": "after", "in": "query", "required": False, "schema": {"type": "string"}},
            {"name": "limit", "in": "query", "required": False,
             "schema": {"type": "integer", "minimum": 1, "maximum": 1000}}]
    read = {"200": ok, "400": err, "401": err, "404": err}
    acted = {"200": ok, "400": err, "401": err, "404": err, "409": err, "413": err, "415": err, "422": err,
             "503": err}
    return {
        "/workflows/{name}": {
            "get": {"summary": "A page of a workflow's records in id order (read)", "security": security,
                    "parameters": [name, *page], "responses": read},
            "post": {"summary": "Start a workflow (invoke): {id, input}; id defaults to the Idempotency-Key; 409 "
                                "WorkflowExists when the id is in use", "security": security,
                     "parameters": [name, key],
                     "requestBody": body({"id": {"type": ["string", "null"]}, "input": {}}, []),
                     "responses": acted}},
        "/workflows/{name}/{wid}": {"get": {
            "summary": "One workflow's record: status, version (the code version its steps run), step, what it "
                       "awaits, state, undo stack, the history of its steps (read)",
            "security": security, "parameters": [name, wid], "responses": read}},
        "/workflows/{name}/{wid}/tree": {"get": {
            "summary": "One workflow as a tree: the workflow, its newest `steps` steps (1..200, default 50) each "
                       "with its transaction's call graph from the inspector, and what it awaits now (a promise's "
                       "status and deadline, an effect's attempts and last error, a timer's due time) (read)",
            "security": security, "responses": read,
            "parameters": [name, wid, {"name": "steps", "in": "query", "required": False,
                                       "schema": {"type": "integer", "minimum": 1, "maximum": 200}}]}},
        "/workflows/{name}/{wid}/cancel": {"post": {
            "summary": "Cancel a workflow that has not finished (admin)", "security": security,
            "parameters": [name, wid], "requestBody": body({"reason": {"type": "string", "maxLength": 2000}}, []),
            "responses": acted}},
        "/admin/workflows/versions": {"get": {
            "summary": "The drain: in-flight workflows (running, waiting) per code version, per workflow and in "
                       "all, and the deployed version (read)",
            "security": security, "responses": {"200": ok, "401": err, "501": err, "503": err}}},
        "/admin/workflows/migrate": {"post": {
            "summary": "Move one page of a workflow's in-flight workflows on code version `from` to the deployed "
                       "one (admin, audited); each move is the workflow's own transaction (NotMigratable: "
                       "skipped); dry_run counts, would_skip its forecast of the skips; next is the following "
                       "call's cursor",
            "security": security, "parameters": [key],
            "requestBody": body({"workflow": {"type": "string"}, "from": {"type": "string", "minLength": 1,
                                                                          "maxLength": 200},
                                 "dry_run": {"type": "boolean"},
                                 "limit": {"type": "integer", "minimum": 1, "maximum": 1000},
                                 "cursor": {"type": ["string", "null"]}}, ["workflow", "from"]),
            "responses": acted}},
    }


def admin_paths(security: list[dict[str, Any]]) -> dict[str, Any]:
    """The OpenAPI path items of the admin, metrics and dashboard routes (:mod:`charon.server.admin`)."""

    def err(desc: str) -> dict[str, Any]:
        ref = {"$ref": "#/components/schemas/Error"}
        return {"description": desc, "content": {"application/json": {"schema": ref}}}

    def ok(desc: str) -> dict[str, Any]:
        return {"description": desc, "content": {"application/json": {"schema": {"type": "object"}}}}

    def body(props: dict[str, Any], required: list[str], optional: bool = False) -> dict[str, Any]:
        schema = {"type": "object", "properties": props, "required": required, "additionalProperties": False}
        return {"required": not optional,
                "content": {ct: {"schema": schema} for ct in ("application/json", "application/msgpack")}}

    common = {"401": err("missing or wrong bearer token"), "501": err("this runtime has no such control method")}
    status = ok("the control status (state, epoch, backlog, ...)")
    epoch = {"type": "integer", "minimum": -1}
    args = {"type": "array", "description": "positional arguments"}
    key = {"type": "string", "minLength": 1, "maxLength": 200}
    return {
        "/admin/status": {"get": {"summary": "Pause state, last committed epoch, backlog (admin)",
                                  "security": security, "responses": {"200": status, **common}}},
        "/admin/pause": {"post": {
            "summary": "Start no epoch (after epoch N, if given) until resumed (admin)", "security": security,
            "requestBody": body({"after_epoch": epoch}, [], optional=True),
            "responses": {"200": status, "400": err("malformed body"), "415": err("unsupported body type"),
                          **common}}},
        "/admin/resume": {"post": {
            "summary": "Let epochs start again (admin)", "security": security,
            "requestBody": body({}, [], optional=True),
            "responses": {"200": status, "400": err("malformed body"), "415": err("unsupported body type"),
                          **common}}},
        "/admin/rescale": {"post": {
            "summary": "Change the number of engine partitions at an epoch boundary (and/or the input log's "
                       "partition count, no pause); answers the pause (admin)",
            "security": security,
            "requestBody": body({"partitions": {"type": "integer", "minimum": 1,
                                                "description": "at most the max_partitions setting"},
                                 "log_partitions": {"type": "integer", "minimum": 1,
                                                    "description": "input-log partitions (Spark); at most "
                                                                   "the max_partitions setting"}},
                                []),
            "responses": {"200": ok("{from, to, epoch, keys, wait_s, pause_s, cpu_s, log}"),
                          "400": err("malformed body, neither count given, or a count out of range"),
                          "409": err("a rescale is running (or the in-process runtime is paused)"),
                          "415": err("unsupported body type"),
                          "503": err("no epoch boundary in time (the engine partitions did not move), or "
                                     "the runtime is still starting"), **common}}},
        "/admin/state/{operator}": {"get": {
            "summary": "An operator's entities as of one committed epoch (admin)", "security": security,
            "parameters": [
                {"name": "operator", "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}},
                {"name": "key", "in": "query", "schema": {"type": "array", "items": key}, "style": "form",
                 "explode": True},
                {"name": "epoch", "in": "query", "schema": epoch},
                {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1},
                 "description": "most entities of a page (1..max_scan; default max_scan)"},
                {"name": "after", "in": "query", "schema": key,
                 "description": "the page's cursor: entities whose key sorts after this one (a page's next)"},
                {"name": "prefix", "in": "query", "schema": {"type": "string", "maxLength": 200},
                 "description": "only the entities whose key starts with this"},
            ],
            "responses": {"200": ok("{operator, epoch, entities, items, count, truncated, next}: next is the "
                                    "after of the following page (null on the last); pass it with this epoch"),
                          "400": err("invalid key, after, prefix, epoch or limit, or keys with after/prefix"),
                          "404": err("unknown operator"),
                          "410": err("the epoch is not retained"), **common}}},
        "/admin/update": {"post": {
            "summary": "A serializable admin update: a function on every entity, alone at an epoch boundary",
            "security": security,
            "requestBody": body({"id": {"type": "string", "pattern": IDEMPOTENCY_KEY.pattern},
                                 "operator": {"type": "string"}, "function": {"type": "string"}, "args": args,
                                 "keys": {"type": "array", "items": key}}, ["id", "operator", "function"]),
            "responses": {"200": ok("{id, transactions, committed, aborted, epochs, repeated}"),
                          "400": err("malformed body"), "404": err("unknown operator or function"),
                          "409": err("Paused: the runtime is paused (Spark); resume, then retry"),
                          "415": err("unsupported body type"), "422": err("bad arguments"), **common}}},
        "/admin/code": {"post": {
            "summary": "A code update at an epoch boundary (strict or compatible) to a deployable ref",
            "security": security,
            "requestBody": body({
                "ref": {"type": "string", "description": "module:attribute, among the code_refs setting"},
                "version": {"type": "string", "minLength": 1, "maxLength": 100},
                "mode": {"type": "string", "enum": ["strict", "compatible"]},
                "migration": {"type": "object", "required": ["operator", "function"], "additionalProperties": False,
                              "properties": {"operator": {"type": "string"}, "function": {"type": "string"},
                                             "args": args}},
            }, ["ref", "version"]),
            "responses": {"200": ok("{version, ref, from_epoch, migration, mode}"), "400": err("malformed body"),
                          "403": err("not a deployable ref"),
                          "409": err("Paused: the update needs epochs to run and the runtime is paused; "
                                     "VersionInUse: it would drop the code (its ref no longer installed) of a "
                                     "version with workflows in flight"),
                          "415": err("unsupported body type"), **common}}},
        "/admin/sql": {"post": {
            "summary": "One safe SELECT over the operators' state views at one consistent epoch (admin)",
            "security": security,
            "requestBody": body({"sql": {"type": "string", "minLength": 1}, "epoch": epoch}, ["sql"]),
            "responses": {"200": ok("{epoch, columns, rows, truncated, engine}"),
                          "400": err("malformed body, or SQL that does not parse or resolve"),
                          "410": err("the epoch is not retained"),
                          "413": err("the state (StateTooLarge) or the answer (SQLResultTooLarge) is too large"),
                          "415": err("unsupported body type"),
                          "422": err("SQL outside the safe subset (SQLRejected), too slow (SQLTimeout) or "
                                     "needing more memory than the sandbox has (SQLTooExpensive)"),
                          "429": err("too many SQL queries at once"), **common}}},
        **requests_paths(security, err),
        "/admin/summary": {"get": {"summary": "The dashboard's JSON (admin)", "security": security,
                                   "responses": {"200": ok("throughput, latency, epochs, status"), **common}}},
        "/admin/metrics/history": {"get": {
            "summary": "The dashboard's charts: one sample a second, newer than since (admin)", "security": security,
            "parameters": [{"name": "since", "in": "query", "required": False,
                            "schema": {"type": "number"}, "description": "Unix seconds"}],
            "responses": {"200": ok("{interval_s, samples, max_samples, max_bytes, bytes}"),
                          "400": err("since is not a number, or an unknown parameter"), **common}}},
        "/admin/code/history": {"get": {
            "summary": "The deployed code versions, oldest first (admin)", "security": security,
            "responses": {"200": ok("{app, current, versions: [{from_epoch, version, ref, migration, unloaded_at}]}"),
                          **common}}},
        "/metrics": {"get": {"summary": "Prometheus metrics", "security": security, "responses": {
            "200": {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}},
            "401": err("missing or wrong bearer token")}}},
        "/dashboard": {"get": {"summary": "The dashboard page (asks for the token)", "responses": {
            "200": {"description": "HTML", "content": {"text/html": {"schema": {"type": "string"}}}}}}},
    }


def requests_paths(security: list[dict[str, object]], err: Callable[[str], dict[str, object]]) -> dict[str, object]:
    """The OpenAPI path items of the invocation inspector (:mod:`charon.server.requests_admin`)."""
    nstr = {"type": ["string", "null"]}
    nint = {"type": ["integer", "null"]}
    nnum = {"type": ["number", "null"]}
    summary = {"type": "object", "required": list(_SUMMARY), "properties": {
        "request_id": {"type": "string"}, "operator": {"type": "string"}, "key": {"type": "string"},
        "function": {"type": "string"},
        "status": {"type": "string", "enum": ["pending", "committed", "aborted", "deferred", "quarantined"]},
        "error_type": nstr, "epoch": nint, "position": nint, "accepted_at": nnum, "sequenced_at": nnum,
        "replied_at": nnum}}
    node = {"type": "object", "required": ["index", "parent", "kind", "operator", "key", "function", "outcome"],
            "properties": {"index": {"type": "integer"}, "parent": nint,
                           "kind": {"type": "string", "enum": ["root", "call", "send"]},
                           "operator": {"type": "string"}, "key": {"type": "string"}, "function": {"type": "string"},
                           "outcome": {"enum": ["ok", "raised", None]}}}
    detail = {"allOf": [summary, {"type": "object", "required": ["reply", "error", "call_graph", "truncated"],
                                  "properties": {
        "reply": {}, "truncated": {"type": "boolean"}, "call_graph": {"type": "array", "items": node},
        "error": {"oneOf": [{"type": "null"}, {"type": "object", "required": ["type", "message", "traceback"],
                                               "properties": {"type": {"type": "string"},
                                                              "message": {"type": "string"},
                                                              "traceback": nstr}}]}}}]}
    page = {"type": "object", "required": ["items", "next", "retention"], "properties": {
        "items": {"type": "array", "items": summary}, "next": nstr,
        "retention": {"type": "object", "required": ["max_records", "max_bytes", "oldest"],
                      "properties": {"max_records": {"type": "integer"}, "max_bytes": {"type": "integer"},
                                     "oldest": nnum}}}}

    def q(name: str, schema: dict[str, object]) -> dict[str, object]:
        return {"name": name, "in": "query", "required": False, "schema": schema}

    text = {"type": "string", "minLength": 1, "maxLength": 4096}
    when = {"type": "number", "minimum": 0}
    common: dict[str, Any] = {"401": err("missing or wrong bearer token"),
                              "501": err("this gateway's engine runs elsewhere (no inspector here)")}
    listed: dict[str, object] = {
        "200": {"description": "a page of summaries", "content": {"application/json": {"schema": page}}},
        "400": err("an unknown parameter, a bad value or a cursor this server did not give"), **common}
    shown: dict[str, object] = {
        "200": {"description": "the request", "content": {"application/json": {"schema": detail}}},
        "404": err("unknown, or older than the inspector's retention"), **common}
    return {
        "/admin/requests": {"get": {
            "summary": "Requests newest first, searched by status, operator, key, function, error type, epoch and "
                       "time (admin)",
            "security": security,
            "parameters": [
                q("status", {"type": "string", "enum": ["pending", "committed", "aborted", "deferred",
                                                        "quarantined"]}),
                q("operator", text), q("key", text), q("function", text), q("error_type", text),
                q("epoch_min", {"type": "integer", "minimum": 0}), q("epoch_max", {"type": "integer", "minimum": 0}),
                q("since", when), q("until", when), q("limit", {"type": "integer", "minimum": 1, "maximum": 1000}),
                q("cursor", text)],
            "responses": listed}},
        "/admin/requests/{request_id}": {"get": {
            "summary": "One request: reply, error with traceback, call graph, timings (admin)",
            "security": security,
            "parameters": [{"name": "request_id", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": shown}},
    }


_SUMMARY = ("request_id", "operator", "key", "function", "status", "error_type", "epoch", "position", "accepted_at",
            "sequenced_at", "replied_at")

"""Durable promises (issue 34): a continuation that runs once, with a value that comes from outside.

``pid = ctx.promise(then=fn, carry=[...], timeout=s)`` creates a promise iff the calling transaction commits: the
call sends ``create`` to the built-in operator ``charon.promise`` (one entity per promise, its key the id) inside
that transaction. The id ``pr.<app>.<tid>.<inv>.<n>`` is minted from the transaction, the same on every replay;
no client can create or name-squat one (the operator's functions are internal: ``/invoke`` and ``/batch`` refuse
them).

The promise's entity is its record. Settling it (``resolve``, ``reject``, ``cancel``; or ``expire``, the timer
registered at creation for ``timeout``) is a transaction on that entity: the first one finds it ``pending``,
records the outcome and registers a timer due at once that runs ``then(ctx, outcome, *carry)`` on the creating
entity as a transaction of its own, in a later epoch (``outcome``: ``{"ok": True, "value": v}`` or ``{"ok":
False, "error_type": "PromiseRejected" | "PromiseTimedOut" | "PromiseCancelled", "error": message}``). Any later
one aborts with :class:`~charon.errors.PromiseConflict` (HTTP 409). Serializability decides the race between a
resolve and its timeout; timers fire exactly once; so the continuation runs exactly once, on every engine and
across crashes (epochs replay with the same ids). A continuation that aborts is in the output log under its
request id (``continuation`` in the record), not retried.

A settled promise is kept ``CHARON_PROMISE_RETENTION_S`` seconds (default 7 days; the same in every process of
a deployment), then forgotten (a timer deletes it): a resolve after that is :class:`~charon.errors.UnknownPromise`.
Bounds: ``timeout`` at most :data:`MAX_TIMEOUT_S`; a value (resolve) and a carry at most
:data:`MAX_PROMISE_VALUE_BYTES` encoded; a rejection's message at most :data:`MAX_ERROR_CHARS`.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from charon import serde
from charon.core import timers as _timers
from charon.errors import (
    BadArguments,
    PromiseCancelled,
    PromiseConflict,
    PromiseFailed,
    PromiseRejected,
    PromiseTimedOut,
    UnknownPromise,
    ValueTooLarge,
)
from charon.operator import Application, Function, Operator, register_builtin

__all__ = ["DEFAULT_TIMEOUT_S", "MAX_ERROR_CHARS", "MAX_PROMISE_VALUE_BYTES", "MAX_TIMEOUT_S", "PROMISE_ID_PREFIX",
           "PROMISE_OPERATOR", "RETENTION_S", "STATUSES", "is_promise_id", "promise_request", "promise_value"]

PROMISE_OPERATOR = "charon.promise"
PROMISE_ID_PREFIX = "pr."
DEFAULT_TIMEOUT_S = 86_400.0
MAX_TIMEOUT_S = 30 * 86_400.0
#: largest encoded resolve value, and largest encoded carry (``CHARON_MAX_PROMISE_VALUE_BYTES``, default 1 MiB)
MAX_PROMISE_VALUE_BYTES = int(os.environ.get("CHARON_MAX_PROMISE_VALUE_BYTES", 1 << 20))
#: seconds a settled promise is kept before it is forgotten (``CHARON_PROMISE_RETENTION_S``; an outcome depends on
#: it: set it the same in every process of a deployment)
RETENTION_S = float(os.environ.get("CHARON_PROMISE_RETENTION_S", 7 * 86_400))
MAX_ERROR_CHARS = 2000
STATUSES = ("pending", "resolved", "rejected", "timed_out", "cancelled")
_FAILURES: dict[str, type[PromiseFailed]] = {
    "rejected": PromiseRejected, "timed_out": PromiseTimedOut, "cancelled": PromiseCancelled}

_op = Operator(PROMISE_OPERATOR)
register_builtin(_op)


def is_promise_id(pid: object) -> bool:
    """Whether ``pid`` has the form of an id the engine mints (``pr.<app>.<tid>.<inv>.<n>``)."""
    return isinstance(pid, str) and pid.startswith(PROMISE_ID_PREFIX) and 0 < len(pid) <= 256 and pid.isascii() \
        and pid.count(".") >= 4 and "\0" not in pid and "/" not in pid


def _sized(what: str, value: object) -> int:
    n = len(serde.encode_value(value))
    if n > MAX_PROMISE_VALUE_BYTES:
        raise ValueTooLarge(f"{what} of {n} bytes exceeds the maximum of {MAX_PROMISE_VALUE_BYTES} "
                            "(CHARON_MAX_PROMISE_VALUE_BYTES)")
    return n


def promise_request(app: Application, op: str, key: str, tid: int, inv: str, n: int, then: object, carry: object,
                    timeout: object) -> tuple[str, dict[str, Any]]:
    """The id and the ``create`` argument of ``ctx.promise`` number ``n`` of invocation ``inv`` of transaction
    ``tid`` on entity ``op/key`` (the engine's context and the oracle's build it here); typed errors otherwise."""
    if not isinstance(then, str | Function):
        raise BadArguments(f"then must be a function of {op!r} (or its name), got {type(then).__name__}")
    then_name = then.name if isinstance(then, Function) else then
    fn = app.resolve(op, then_name)  # the continuation exists (a typed error otherwise)
    if not isinstance(carry, list | tuple):
        raise BadArguments("carry must be a list")
    fn.check_args([{}, *carry])  # it takes (outcome, *carry)
    _sized("a promise's carry", list(carry))
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout <= MAX_TIMEOUT_S:
        raise BadArguments(f"timeout must be in (0, {MAX_TIMEOUT_S:g}] seconds, got {timeout!r}")
    if len(inv) > 32:  # deep call chains: a short key
        inv = "h" + hashlib.blake2b(inv.encode(), digest_size=8).hexdigest()
    pid = f"{PROMISE_ID_PREFIX}{app.name}.{tid}.{inv}.{n}"
    return pid, {"operator": op, "key": key, "then": then_name, "carry": list(carry), "timeout": float(timeout)}


def promise_value(outcome: dict[str, Any]) -> Any:
    """The value of a continuation's ``outcome``; raises :class:`~charon.errors.PromiseRejected`,
    :class:`~charon.errors.PromiseTimedOut` or :class:`~charon.errors.PromiseCancelled` for the others."""
    if outcome.get("ok"):
        return outcome.get("value")
    kind = {cls.__name__: cls for cls in _FAILURES.values()}.get(str(outcome.get("error_type")), PromiseFailed)
    raise kind(str(outcome.get("error", "")))


# -- the built-in operator (internal functions: only the engine, the promise routes and other functions run them)
@_op.function
async def create(ctx: Any, spec: dict[str, Any]) -> str:
    """Record a new pending promise (sent by ``ctx.promise`` inside the creating transaction)."""
    if ctx.get() is not None:
        raise PromiseConflict(f"promise {ctx.key!r} exists already")
    now = ctx.now()
    timer = ctx.send_after(spec["timeout"], PROMISE_OPERATOR, ctx.key, expire)
    ctx.put({"id": ctx.key, "status": "pending", "operator": spec["operator"], "key": spec["key"],
             "then": spec["then"], "carry": spec["carry"], "created": now, "deadline": now + spec["timeout"],
             "settled": None, "value": None, "error": None, "timer": timer, "continuation": None})
    return str(ctx.key)


def _settle(ctx: Any, status: str, outcome: dict[str, Any], *, strict: bool = True) -> dict[str, Any] | None:
    rec = ctx.get()
    if rec is None:
        if not strict:
            return None
        raise UnknownPromise(f"no promise {ctx.key!r} (never created, or forgotten after its retention)")
    if rec["status"] != "pending":
        if not strict:
            return None
        raise PromiseConflict(f"promise {ctx.key!r} is already {rec['status']}: its continuation runs once, "
                              "with the first outcome")
    if status != "timed_out":
        ctx.cancel_timer(rec["timer"])
    now = ctx.now()
    try:
        cont = ctx.send_at(now, rec["operator"], rec["key"], rec["then"], outcome, *rec["carry"])
        rec["continuation"] = _timers.REQUEST_PREFIX + cont
    except Exception as exc:  # e.g. a code update removed the continuation
        if strict:  # a resolver hears it (the promise stays pending)
            raise
        status, outcome = "timed_out", {**outcome, "continuation_error": f"{type(exc).__name__}: {exc}"}
    rec.update(status=status, settled=now, value=outcome.get("value"), error=outcome.get("error"))
    ctx.send_after(RETENTION_S, PROMISE_OPERATOR, ctx.key, forget)
    ctx.put(rec)
    return {"id": rec["id"], "status": status, "continuation": rec["continuation"]}


@_op.function
async def resolve(ctx: Any, value: Any = None) -> dict[str, Any]:
    """Settle the promise with ``value``; :class:`PromiseConflict` if it was settled before."""
    _sized("a promise's value", value)
    out = _settle(ctx, "resolved", {"ok": True, "value": value})
    assert out is not None
    return out


@_op.function
async def reject(ctx: Any, error: str = "rejected") -> dict[str, Any]:
    """Settle the promise with a failure (``PromiseRejected``: ``error``)."""
    out = _settle(ctx, "rejected", {"ok": False, "error_type": "PromiseRejected",
                                    "error": str(error)[:MAX_ERROR_CHARS]})
    assert out is not None
    return out


@_op.function
async def cancel(ctx: Any, reason: str = "cancelled by an operator") -> dict[str, Any]:
    """Settle the promise with ``PromiseCancelled`` (an operator's cancel)."""
    out = _settle(ctx, "cancelled", {"ok": False, "error_type": "PromiseCancelled",
                                     "error": str(reason)[:MAX_ERROR_CHARS]})
    assert out is not None
    return out


@_op.function
async def withdraw(ctx: Any, reason: str) -> dict[str, Any] | None:
    """Cancel the promise if it is still pending (``PromiseCancelled``: ``reason``; its continuation runs), else
    nothing: what a workflow sends for the awaits it no longer waits for (``w.any``'s others, a cancel)."""
    return _settle(ctx, "cancelled", {"ok": False, "error_type": "PromiseCancelled",
                                      "error": str(reason)[:MAX_ERROR_CHARS]}, strict=False)


@_op.function
async def expire(ctx: Any) -> dict[str, Any] | None:
    """The timeout's timer: settle a still pending promise with ``PromiseTimedOut``."""
    rec = ctx.get()
    timeout = 0.0 if rec is None else rec["deadline"] - rec["created"]
    return _settle(ctx, "timed_out", {"ok": False, "error_type": "PromiseTimedOut",
                                      "error": f"not settled within {timeout:g} s"}, strict=False)


@_op.function
async def forget(ctx: Any) -> None:
    """The retention's timer: delete the settled promise."""
    rec = ctx.get()
    if rec is not None and rec["status"] != "pending":
        ctx.delete()


@_op.function
async def get(ctx: Any) -> dict[str, Any] | None:
    """The promise's record (None: no such promise)."""
    rec = ctx.get()
    return None if rec is None else dict(rec)


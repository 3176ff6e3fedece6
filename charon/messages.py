"""Records that cross process boundaries: requests (the input log) and replies (the output log)."""

from __future__ import annotations

import msgspec


class Request(msgspec.Struct, frozen=True, gc=False):
    """One client invocation; the engine runs it as one transaction over its whole call graph."""

    request_id: str
    operator: str
    key: str
    function: str
    args: bytes  # msgpack-encoded list of positional arguments
    ts: float = 0.0  # append time, assigned by the log; ``ctx.now()`` returns it


class Reply(msgspec.Struct, frozen=True, gc=False):
    """The outcome of one request, delivered exactly once per ``request_id``.

    ``position`` is the transaction's place in its epoch's serial order: ordering replies by
    (epoch, position) gives a serial order equivalent to what the engine executed (positions are
    increasing, not consecutive; see ``charon.core.epoch.position``). None only in replies recorded before
    positions existed.
    """

    request_id: str
    tid: int
    epoch: int
    ok: bool
    value: bytes = b""  # msgpack-encoded return value when ok
    error_type: str = ""
    error_message: str = ""
    position: int | None = None


#: Prefixes of the request ids the engine mints for its own transactions: ``__charon`` (timers' firings, portal
#: requests and replies, stream wires, admin updates, Spark's epoch ticks), ``fx.`` (effect continuations,
#: ``fx.<app>.<tid>.<inv>.<n>.done``) and NUL. No client may send one (the gateway answers 400
#: ``ReservedRequestId`` on every route taking an ``Idempotency-Key``, the Python clients raise it before sending):
#: a client holding such an id first would make the engine's own transaction a duplicate that never runs.
RESERVED_ID_PREFIXES = ("__charon", "fx.", "\x00")


def is_reserved_id(request_id: str) -> bool:
    """Whether ``request_id`` is one only the engine may use (see :data:`RESERVED_ID_PREFIXES`)."""
    return request_id.startswith(RESERVED_ID_PREFIXES)

"""The context a function receives: its entity's state, calls to other entities, deterministic randomness.

Calls, suspension and replay (why functions may run more than once)
------------------------------------------------------------------
``ctx.call(...)`` *creates* a call: it validates the target and gives the call the next child number of
this invocation (calls and sends share the numbering), but sends nothing. The call is *sent* when it is
first awaited (``await c`` or ``await ctx.gather(c, ...)``); awaiting it again returns the same value. A
function that returns while a call it created was never awaited aborts its transaction with
:class:`~charon.errors.UnawaitedCall` (a forgotten ``await`` is a bug, not a silent drop; ``ctx.send`` is the
call whose result is not needed); the oracle (:mod:`charon.testing`) does the same.

A synchronous call cannot keep a coroutine alive across rounds: on Spark every round is a separate task,
possibly in another process. So an await that sends calls *suspends* the function; the engine keeps its
:class:`Journal` (the values it read, the replies it received keyed by child number, and how many times it
suspended) and may drop the coroutine. When the replies arrive, the function either continues its live
coroutine (when this process still holds it) or is *replayed* from the start: until it passes the await
at which it suspended last, reads are served from the journal, writes and sends are skipped, and each
suspending await takes its replies from the journal; from that await on it runs live, once. Functions are
deterministic (randomness and time come from the context), so both ways give the same effects.

A function's coroutine dropped by the engine is closed; its ``finally`` blocks then see a context that
refuses every operation (raising ``GeneratorExit``), so nothing runs twice.
"""

from __future__ import annotations

import os
import random as _random
from collections.abc import Awaitable, Callable, Generator, Sequence
from types import FunctionType
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar, overload

from charon import serde
from charon.core import schedules as _schedules  # noqa: F401 - registers the built-in operator charon.schedule
from charon.core import timers as _timers
from charon.core.promises import DEFAULT_TIMEOUT_S, PROMISE_OPERATOR, promise_request
from charon.core.routing import MAX_KEY_BYTES, check_item, check_key, check_stream
from charon.errors import (
    BadArguments,
    CallGraphLimitExceeded,
    InvalidKey,
    NonDeterministicFunction,
    UnawaitedCall,
    UndeclaredPortal,
    UnknownEffect,
    ValueTooLarge,
)
from charon.operator import Application, Function, Operator

_decode = serde._dec.decode
_encode = serde._enc.encode
_check = serde.check_value  # the value model (sets, datetimes, objects... refused); scalars pass at once
_SCALARS = serde._SCALARS

MAX_DEPTH = 200
#: A validated call or send: (operator, key, function, encoded arguments).
Target = tuple[str, str, str, bytes]
#: A call or send as recorded in ``ctx._calls`` (1 for a call, 0 for a send, then its target) or ``ctx._sends``
#: (its child number, then its target).
CallRecord = tuple[int, str, str, str, bytes]
#: Largest encoded state value, item, event or return value (``CHARON_MAX_VALUE_BYTES``, default 4 MiB):
#: beyond it the function raises ValueTooLarge (its transaction aborts). An outcome depends on it: set it the
#: same for every process of a deployment (Spark executors inherit the driver's environment in local mode).
MAX_VALUE_BYTES = int(os.environ.get("CHARON_MAX_VALUE_BYTES", 4 << 20))
#: Most events one invocation may emit (beyond it the transaction aborts with CallGraphLimitExceeded).
MAX_EMITS = 10_000
RESERVED_STREAM_PREFIX = "charon."  # streams only the engine appends to (ctx.emit refuses them)
PORTAL_STREAM = "charon.portal.requests"  # the output stream ctx.ask appends requests to
PORTAL_ID_PREFIX = "__charon.portal."  # request ids of portal requests (+ '.reply' for continuations)
EFFECT_STREAM = "charon.effects"  # the output stream ctx.effect appends effect requests to
#: effect ids (the handler's idempotency key; + '.done' is the continuation's request id). Reserved like
#: ``__charon`` (:data:`charon.messages.RESERVED_ID_PREFIXES`): no client may send one; ``charon effects work``
#: workers submit continuations through the gateway's route of their own, ``POST /effects/continue/...``.
EFFECT_ID_PREFIX = "fx."
CONTINUATION_SUFFIX = ".done"  # + an effect id: its continuation's request id
MAX_EFFECT_TIMEOUT_S = 3600.0  # one attempt's longest timeout
MAX_EFFECT_ATTEMPTS = 1000


def is_continuation_id(request_id: str) -> bool:
    """Whether ``request_id`` has the form of an effect continuation's id (``fx.<app>.<tid>.<inv>.<n>.done``)."""
    return request_id.startswith(EFFECT_ID_PREFIX) and request_id.endswith(CONTINUATION_SUFFIX) and \
        len(request_id) > len(EFFECT_ID_PREFIX) + len(CONTINUATION_SUFFIX)


def effect_request(app: Application, op: str, key: str, tid: int, inv: str, n: int, handler: object,
                   args: Sequence[object], then: Function[..., object] | str, carry: object, timeout: object,
                   attempts: object) -> tuple[str, dict[str, Any]]:
    """The id and the stream event of ``ctx.effect`` number ``n`` of invocation ``inv`` of transaction ``tid`` (the
    engine's context and the oracle's build it here); typed errors for what is not valid."""
    if type(handler) is not str or handler not in app.effects:
        raise UnknownEffect(f"application {app.name!r} has no effect handler {handler!r} "
                            f"(have: {', '.join(sorted(app.effects)) or 'none'})")
    if not (isinstance(timeout, int | float) and not isinstance(timeout, bool) and 0 < timeout <= MAX_EFFECT_TIMEOUT_S):
        raise UnknownEffect(f"timeout must be in (0, {MAX_EFFECT_TIMEOUT_S}] seconds, got {timeout!r}")
    if not (type(attempts) is int and 1 <= attempts <= MAX_EFFECT_ATTEMPTS):
        raise UnknownEffect(f"attempts must be an integer in [1, {MAX_EFFECT_ATTEMPTS}], got {attempts!r}")
    then_name = then.name if isinstance(then, Function) else then
    app.resolve(op, then_name)  # the continuation exists (a typed error otherwise)
    if not isinstance(carry, list | tuple):
        raise BadArguments("carry must be a list")
    eid = f"{EFFECT_ID_PREFIX}{app.name}.{tid}.{inv}.{n}"
    return eid, {"id": eid, "handler": handler, "args": list(args), "op": op, "key": key, "then": then_name,
                 "carry": list(carry), "timeout": float(timeout), "attempts": attempts}


def too_large(what: str, n: int) -> ValueTooLarge:
    """The error of a value of ``n`` encoded bytes, above :data:`MAX_VALUE_BYTES`."""
    return ValueTooLarge(f"{what} of {n} bytes exceeds the maximum of {MAX_VALUE_BYTES} (CHARON_MAX_VALUE_BYTES)")


class Journal:
    """What replaying an invocation needs, and the replay cursor: the single owner of replay state.

    ``replies`` maps a synchronous call's child number to its reply, ``reads`` holds the values read in
    order, ``nsusp`` counts the awaits that suspended, ``pending`` maps the invocation ids of the calls in
    flight to their child numbers. The cursor (awaits and reads passed in the current run) is reset when a
    run starts from the beginning; the run is *replaying* until it has passed ``nsusp`` suspending awaits.
    """

    __slots__ = ("replies", "reads", "nsusp", "pending", "live", "_awaits", "_nread")

    def __init__(self, replies: Any = None) -> None:
        self.replies: dict[int, bytes] = dict(replies) if replies else {}
        self.reads: list[Any] = []
        self.nsusp = 0
        self.pending: dict[str, int] | None = None
        self._awaits = 0  # at_end() of an empty journal, inlined (a frame is created per invocation)
        self._nread = 0
        self.live = True

    def __reduce__(self) -> tuple[Callable[..., Journal], tuple[object, ...]]:
        return (_new_journal, (self.replies, self.reads, self.nsusp, self.pending))

    def rewind(self) -> None:
        """A run from the beginning: replay up to the last suspension."""
        self._awaits = 0
        self._nread = 0
        self.live = self.nsusp == 0

    def at_end(self) -> None:
        """A run continuing where the last one suspended (a live coroutine): nothing to replay."""
        self._awaits = self.nsusp
        self._nread = len(self.reads)
        self.live = True

    def replayed_read(self) -> Any:
        """The next journaled read of a replaying run (a live run appends what it reads to ``reads``)."""
        if self._nread >= len(self.reads):
            raise NonDeterministicFunction("replay read past its journal")
        value = self.reads[self._nread]
        self._nread += 1
        return value

    def passed(self) -> None:
        """A replayed await that suspended in an earlier run; after the last one the run goes live."""
        self._awaits += 1
        if self._awaits == self.nsusp:
            if self._nread != len(self.reads):
                raise NonDeterministicFunction("replay made fewer reads than its journal holds")
            self.live = True

    def suspend(self, pending: dict[str, int]) -> None:
        """A live await sends calls and suspends until their replies are all in."""
        self.nsusp += 1
        self._awaits = self.nsusp
        self.pending = pending

    def receive(self, inv: str, value: bytes) -> bool:
        """Journal the reply of call ``inv``; True when no reply is missing any more."""
        assert self.pending is not None
        self.replies[self.pending.pop(inv)] = value
        if self.pending:
            return False
        self.pending = None
        return True


class FrameView(Protocol):
    """What a :class:`Context` uses of its invocation's frame (a :class:`charon.core.partition.Invoke`, which is
    also the invocation's :class:`Journal`). Declared here so that this module does not import the partition,
    which imports it (no import cycle)."""

    tid: int
    inv: str
    op: str
    key: str
    ts: float
    depth: int
    replies: dict[int, bytes]
    reads: list[Any]
    nsusp: int
    pending: dict[str, int] | None
    live: bool
    _awaits: int
    _nread: int

    def rewind(self) -> None: ...

    def at_end(self) -> None: ...

    def replayed_read(self) -> Any: ...

    def passed(self) -> None: ...

    def suspend(self, pending: dict[str, int]) -> None: ...


class CodeBook(Protocol):
    """What an engine that keeps code versions lends its partition units (workflow version pinning,
    :mod:`charon.core.workflows`): the version label a transaction runs with, and the application of a recorded
    version. Both follow from the engine's recorded code history only, so a replay gets the same answers."""

    def label_of(self, epoch: int, tid: int) -> str: ...

    def application_of(self, label: str) -> Application | None: ...


class UnitView(Protocol):
    """What a :class:`Context` uses of the partition unit that runs it (a
    :class:`charon.core.partition.PartitionUnit`; declared here for the same reason as :class:`FrameView`)."""

    @property
    def app(self) -> Application: ...

    @property
    def previous(self) -> tuple[int, Application] | None: ...

    def app_for(self, tid: int) -> Application: ...

    @property
    def code(self) -> CodeBook | None: ...

    @property
    def epoch(self) -> int: ...

    def read(self, tid: int, op: str, key: str, item: str) -> bytes | None: ...

    def scan(self, tid: int, op: str, key: str, item_prefix: str, start: str | None = None,
             stop: str | None = None) -> list[tuple[str, bytes]]: ...

    def write(self, tid: int, op: str, key: str, item: str, value: bytes | None) -> None: ...

    def emit(self, tid: int, inv: str, n: int, stream: str, value: bytes) -> None: ...

    def timer_registered(self, due: float) -> None: ...


def _new_journal(replies: dict[int, bytes], reads: list[object], nsusp: int, pending: dict[str, int] | None) -> Journal:
    j = Journal.__new__(Journal)
    j.replies, j.reads, j.nsusp, j.pending = replies, reads, nsusp, pending
    j.at_end()
    return j


# -- the typed surface of a context (one declaration: the engine's and the oracle's contexts implement it) ----------
P = ParamSpec("P")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)
T1 = TypeVar("T1")
T2 = TypeVar("T2")
T3 = TypeVar("T3")
T4 = TypeVar("T4")
T5 = TypeVar("T5")
T6 = TypeVar("T6")
#: What a continuation (``then=`` of :meth:`Context.ask` and :meth:`Context.effect`) receives first:
#: ``{"ok": True, "value": v}`` or ``{"ok": False, "error_type": t, "error": message, ...}``.
Outcome = dict[str, Any]


class Call(Generic[R_co]):
    """A call made by :meth:`Context.call`: ``await`` it for the called function's return value (an ``R``).

    Typed from the function it calls: ``ctx.call(account, key, deposit, 5)`` is a ``Call[int]`` when ``deposit``
    returns an ``int``. Sent when first awaited (alone, or in :meth:`Context.gather`); awaiting it again gives the
    same value.
    """

    __slots__ = ()

    def __await__(self) -> Generator[object, None, R_co]:
        raise NotImplementedError


class Context:
    """What a function sees: ``key``, its entity's state, calls to other entities, timers, ``random``/``now``.

    The one typed declaration of the context: the engine's (:class:`EngineContext`) and the serial oracle's
    (:class:`charon.testing.SerialContext`) implement it. A function referenced as a :class:`Function` types the
    call: its arguments are checked against the function's parameters and the awaited value has its return type
    (a function named by a string is not checked: its value is ``Any``). Arguments given by name are bound to
    the callee's parameters and travel by position (:meth:`charon.Function.by_position`).
    """

    __slots__ = ()
    key: str  #: the entity's key
    operator: str  #: the entity's operator (type) name
    tid: int  #: the transaction's id

    # -- state of this entity -----------------------------------------------------------------------------------
    def get(self, default: Any = None) -> Any:
        """The entity's value, or ``default`` if it has none."""
        raise NotImplementedError

    def put(self, value: object) -> None:
        """Set the entity's value (buffered in the transaction until it commits)."""
        raise NotImplementedError

    def delete(self) -> None:
        """Remove the entity's value."""
        raise NotImplementedError

    def get_item(self, name: str, default: Any = None) -> Any:
        """One named item of the entity's ordered item map."""
        raise NotImplementedError

    def put_item(self, name: str, value: object) -> None:
        """Set one named item of the entity's ordered item map."""
        raise NotImplementedError

    def delete_item(self, name: str) -> None:
        """Remove one named item."""
        raise NotImplementedError

    def scan_items(self, prefix: str = "", start: str | None = None, stop: str | None = None) -> list[tuple[str, Any]]:
        """Items whose name starts with ``prefix`` and lies in [start, stop), sorted by name."""
        raise NotImplementedError

    def emit(self, stream: str, value: object) -> None:
        """Append ``value`` to the output stream ``stream`` if (and only if) this transaction commits."""
        raise NotImplementedError

    # -- calls ----------------------------------------------------------------------------------------------------
    @overload
    def call(self, operator: Operator | str, key: str, function: Function[P, R], /, *args: P.args,
             **kwargs: P.kwargs) -> Call[R]: ...

    @overload
    def call(self, operator: Operator | str, key: str, function: str, /, *args: object,
             **kwargs: object) -> Call[Any]: ...

    def call(self, operator: Operator | str, key: str, function: object, /, *args: object,
             **kwargs: object) -> Call[Any]:
        """Call a function of another entity and wait for its return value (same transaction).

        ``ctx.call`` validates the call and numbers it; ``await`` sends it and suspends until the reply
        (awaiting it again returns the same value). A function that returns without awaiting a call it created
        aborts the transaction with UnawaitedCall (``ctx.send`` needs no await). If the callee (or
        anything it calls or sends) raises, the whole transaction aborts with that error, which names
        where it was raised: the caller is never resumed, so a ``try``/``except`` around the await cannot
        catch a callee's exception. Check conditions before calling, or return a value that says so.
        """
        raise NotImplementedError

    @overload
    def gather(self, c1: Call[T1], c2: Call[T2], /) -> Awaitable[tuple[T1, T2]]: ...

    @overload
    def gather(self, c1: Call[T1], c2: Call[T2], c3: Call[T3], /) -> Awaitable[tuple[T1, T2, T3]]: ...

    @overload
    def gather(self, c1: Call[T1], c2: Call[T2], c3: Call[T3], c4: Call[T4], /,
               ) -> Awaitable[tuple[T1, T2, T3, T4]]: ...

    @overload
    def gather(self, c1: Call[T1], c2: Call[T2], c3: Call[T3], c4: Call[T4], c5: Call[T5], /,
               ) -> Awaitable[tuple[T1, T2, T3, T4, T5]]: ...

    @overload
    def gather(self, c1: Call[T1], c2: Call[T2], c3: Call[T3], c4: Call[T4], c5: Call[T5], c6: Call[T6], /,
               ) -> Awaitable[tuple[T1, T2, T3, T4, T5, T6]]: ...

    @overload
    def gather(self, /, *calls: Call[R]) -> Awaitable[list[R]]: ...

    def gather(self, /, *calls: Call[object]) -> Awaitable[Sequence[object]]:
        """Wait for several ``ctx.call(...)`` at once: they run concurrently; returns their values in order.

        ``a, b = await ctx.gather(ctx.call(x, k1, f), ctx.call(y, k2, g, v))``. The gathered calls'
        call graphs run concurrently, so they should not touch the same entities. Calls already awaited
        give their values without being sent again. The value is a list (typed, like ``asyncio.gather``'s, as a
        tuple for two to six calls and as a list otherwise).
        """
        raise NotImplementedError

    @overload
    def send(self, operator: Operator | str, key: str, function: Function[P, object], /, *args: P.args,
             **kwargs: P.kwargs) -> None: ...

    @overload
    def send(self, operator: Operator | str, key: str, function: str, /, *args: object,
             **kwargs: object) -> None: ...

    def send(self, operator: Operator | str, key: str, function: object, /, *args: object, **kwargs: object) -> None:
        """Call a function of another entity without waiting (it still belongs to this transaction)."""
        raise NotImplementedError

    # -- timers ---------------------------------------------------------------------------------------------------
    @overload
    def send_at(self, t: float, operator: Operator | str, key: str, function: Function[P, object], /,
                *args: P.args, **kwargs: P.kwargs) -> str: ...

    @overload
    def send_at(self, t: float, operator: Operator | str, key: str, function: str, /, *args: object,
                **kwargs: object) -> str: ...

    def send_at(self, t: float, operator: Operator | str, key: str, function: object, /, *args: object,
                **kwargs: object) -> str:
        """Call ``operator/key.function(*args)`` as its own transaction in the first epoch whose time passes
        ``t`` (seconds since the Unix epoch, like :meth:`now`); returns the timer's id.

        The timer belongs to this entity (listed by :meth:`timers`, cancelled by :meth:`cancel_timer`) and
        is registered only if this transaction commits. It fires exactly once, also across crashes.
        """
        raise NotImplementedError

    @overload
    def send_after(self, seconds: float, operator: Operator | str, key: str, function: Function[P, object], /,
                   *args: P.args, **kwargs: P.kwargs) -> str: ...

    @overload
    def send_after(self, seconds: float, operator: Operator | str, key: str, function: str, /,
                   *args: object, **kwargs: object) -> str: ...

    def send_after(self, seconds: float, operator: Operator | str, key: str, function: object, /, *args: object,
                   **kwargs: object) -> str:
        """:meth:`send_at` ``ctx.now() + seconds``; returns the timer's id."""
        raise NotImplementedError

    def cancel_timer(self, timer_id: str) -> bool:
        """Cancel a pending timer of this entity; False if there is none with that id (fired, cancelled,
        never registered, or another entity's)."""
        raise NotImplementedError

    def timers(self) -> list[_timers.Timer]:
        """This entity's pending timers, by id (a timer due in this epoch has already fired)."""
        raise NotImplementedError

    # -- portals and effects (continuations) ------------------------------------------------------------------
    def ask(self, portal: str, key: str, /, *args: object, then: Function[Concatenate[Outcome, ...], object] | str,
            carry: Sequence[object] = ()) -> str:
        """Ask ``portal`` (``"app.name"``, declared in this application's ``uses``) to run on entity ``key``
        of that application with ``args``; returns the request id.

        The request is an event of this transaction (sent only if it commits). The other application runs it
        as its own transaction; its reply resumes *this entity* later, as a new transaction running this
        operator's function ``then(ctx, reply, *carry)`` with ``reply`` = ``{"ok": True, "value": v}`` or
        ``{"ok": False, "error_type": t, "error": message}``. Nothing waits meanwhile (see
        :mod:`charon.runtime.deployment` for the exact guarantees).
        """
        raise NotImplementedError

    def effect(self, handler: str, /, *args: object, then: Function[Concatenate[Outcome, ...], object] | str,
               carry: Sequence[object] = (), timeout: float = 30.0, attempts: int = 5) -> str:
        """Run the application's effect handler ``handler(effect_id, *args)`` (I/O allowed) once this transaction
        commits; returns the effect id, the handler's idempotency key.

        The request is an event of this transaction (it exists iff the transaction commits). An effect executor
        (:mod:`charon.runtime.effects`) runs the handler at least once (each attempt at most ``timeout``
        seconds, at most ``attempts`` attempts, with exponential backoff), then resumes *this entity* exactly
        once, as a new transaction running this operator's function ``then(ctx, result, *carry)`` with
        ``result`` = ``{"ok": True, "value": v}`` or ``{"ok": False, "error_type": t, "error": message,
        "attempts": n}``. Unknown handlers and bad policies raise :class:`~charon.errors.UnknownEffect`.
        """
        raise NotImplementedError

    # -- durable promises (charon.core.promises) ----------------------------------------------------------------
    def promise(self, *, then: Function[Concatenate[Outcome, ...], object] | str, carry: Sequence[object] = (),
                timeout: float = DEFAULT_TIMEOUT_S) -> str:
        """Create a durable promise, iff this transaction commits; returns its id (minted by the engine).

        Resolving it from outside (``POST /promises/{id}/resolve``, ``Client.resolve``) or from another transaction
        (:meth:`resolve_promise`) runs this operator's function ``then(ctx, outcome, *carry)`` on *this entity*
        exactly once, as a transaction of its own, with ``outcome`` = ``{"ok": True, "value": v}``; a rejection, a
        cancel or ``timeout`` seconds without either run it with ``{"ok": False, "error_type": "PromiseRejected" |
        "PromiseCancelled" | "PromiseTimedOut", "error": message}`` (:func:`charon.promise_value` turns an outcome
        into its value or the typed exception). Settling it again is :class:`~charon.errors.PromiseConflict`.
        """
        raise NotImplementedError

    def resolve_promise(self, promise_id: str, value: object = None) -> Call[dict[str, Any]]:
        """Resolve a promise inside this transaction (await it): its continuation runs once this transaction
        commits. A promise settled before aborts this transaction with :class:`~charon.errors.PromiseConflict`."""
        return self.call(PROMISE_OPERATOR, promise_id, "resolve", value)

    def reject_promise(self, promise_id: str, error: str = "rejected") -> Call[dict[str, Any]]:
        """Reject a promise inside this transaction (await it): its continuation gets ``PromiseRejected``."""
        return self.call(PROMISE_OPERATOR, promise_id, "reject", error)

    # -- determinism ----------------------------------------------------------------------------------------------
    def random(self) -> float:
        """A pseudo-random float in [0, 1), the same on every replay of this transaction."""
        raise NotImplementedError

    def now(self) -> float:
        """The transaction's timestamp (its request's append time), the same on every replay."""
        raise NotImplementedError

    # -- code versions ----------------------------------------------------------------------------------------------
    def code_version(self) -> str | None:
        """The code version (the deployment's label, e.g. ``charon deploy mod:app v2``) this transaction runs with,
        from the engine's recorded code history (the same on replay); None where the engine keeps none."""
        return None

    def code_of(self, version: str) -> Application | None:
        """The application of recorded code version ``version`` (what a pinned workflow's steps run; None: not
        recorded, or an engine that keeps no code history)."""
        return None


class _Call(Call[Any]):
    """A call created by ``ctx.call``: sent when first awaited; its value is kept for later awaits."""

    __slots__ = ("ctx", "child", "target", "done", "value")

    def __init__(self, ctx: EngineContext, child: int, target: Target) -> None:
        self.ctx = ctx
        self.child = child
        self.target = target
        self.done = False
        self.value: Any = None

    def __await__(self) -> Generator[Any, None, Any]:
        if not self.done:
            ctx = self.ctx
            j = ctx._frame
            if j.live and not ctx._dropped and self.child not in j.replies:
                # ctx._settle((self,)) of a live run whose reply is not in yet (the common case), inlined
                ctx._pending = [self]
                j.nsusp += 1  # j.suspend({...}), inlined
                j._awaits = j.nsusp
                j.pending = {f"{j.inv}.{self.child}": self.child}
                suspend = True
            else:
                suspend = ctx._settle((self,))
            if suspend:
                try:
                    yield self  # suspended: the engine resumes the coroutine, or drops it and replays
                except GeneratorExit:  # closed (explicitly or when collected): refuse what finally blocks do
                    ctx._dropped = True
                    raise
                # ctx._resumed() of the one pending call (this one), inlined
                self.value = _decode(ctx._frame.replies[self.child])  # the engine's own encoding
                self.done = True
                ctx._pending = None
        return self.value


class _Gather:
    """Awaitable returned by ``ctx.gather``: several synchronous calls in flight at once."""

    __slots__ = ("ctx", "calls")

    def __init__(self, ctx: EngineContext, calls: tuple[_Call, ...]) -> None:
        self.ctx = ctx
        self.calls = calls

    def __await__(self) -> Generator[Any, None, list[Any]]:
        ctx = self.ctx
        if ctx._settle(self.calls):
            try:
                yield self
            except GeneratorExit:
                ctx._dropped = True
                raise
            ctx._resumed()
        return [c.value for c in self.calls]


class EngineContext(Context):
    """The engine's :class:`Context` (one per run of an invocation); its typed methods are declared by Context."""

    __slots__ = (
        "_unit", "_frame", "_nchild", "_pending", "_sends", "_calls", "_fast", "_rng", "_dropped",
        "_nemit", "_ntimer", "_nask", "key", "operator", "tid",
    )

    def __init__(self, unit: UnitView, frame: FrameView, fast: bool = False) -> None:
        self._unit = unit
        self._frame = frame  # the invocation's frame, which is also its Journal
        frame._awaits = frame._nread = 0  # frame.rewind(), inlined (a context is created per run of an invocation)
        frame.live = frame.nsusp == 0
        self._fast = fast  # the call-graph-cached fallback: replies preset, nothing journaled
        # _nemit: events emitted by this run so far (replayed ones included): their order
        self._nchild = self._nemit = self._ntimer = self._nask = 0
        self._pending: list[_Call] | None = None  # the calls the last suspending await sent
        self._rng: _random.Random | None = None
        self._sends: list[CallRecord] | None = None  # made by the first send
        self._calls: list[CallRecord] | None = None  # (sync?, op, key, fn, args) of every call and send, from the first
        self._dropped = False
        self.key: str = frame.key
        self.operator: str = frame.op
        self.tid: int = frame.tid

    def _resume(self, unit: UnitView, frame: FrameView) -> None:
        """Continue a live coroutine in a new round (possibly with a new unit and frame for the partition)."""
        self._unit = unit
        self._frame = frame
        frame._awaits = frame.nsusp  # frame.at_end(), inlined
        frame._nread = len(frame.reads)
        frame.live = True
        self._sends = None

    def _drop(self, coro: Any) -> None:
        """Close the coroutine the engine gives up; its ``finally`` blocks find every operation refused."""
        self._dropped = True
        try:
            coro.close()
        except Exception:  # noqa: BLE001, S110 - a finally block that misbehaves while being discarded
            pass

    def _live(self) -> bool:
        """True if effects happen now (live), False while replaying; a dropped coroutine may do nothing."""
        if self._dropped:
            raise GeneratorExit
        return self._frame.live

    # -- state of this entity ---------------------------------------------------------------------
    def _read(self, item: str) -> bytes | None:
        if self._dropped:
            raise GeneratorExit
        j = self._frame
        if not j.live:
            replayed: bytes | None = j.replayed_read()
            return replayed
        f = self._frame
        raw = self._unit.read(f.tid, f.op, f.key, item)
        if not self._fast:
            j.reads.append(raw)
        return raw

    def get(self, default: Any = None) -> Any:
        """The entity's value, or ``default`` if it has none."""
        if self._dropped:  # self._read(""), inlined (the hot path)
            raise GeneratorExit
        j = self._frame
        if j.live:
            raw = self._unit.read(j.tid, j.op, j.key, "")  # the frame's, not attributes a function can assign
            if not self._fast:
                j.reads.append(raw)
        else:
            raw = j.replayed_read()
        if raw is None:
            return default
        try:
            return _decode(raw)  # serde.decode, inlined
        except Exception:  # noqa: BLE001 - its typed error
            return serde.decode(raw)

    def put(self, value: object) -> None:
        """Set the entity's value (buffered in the transaction until it commits)."""
        if self._dropped:
            raise GeneratorExit
        if self._frame.live:
            try:
                data = _encode(value)  # serde.encode_value, inlined
            except Exception:  # noqa: BLE001 - its typed error
                data = serde.encode(value)
            if type(value) not in _SCALARS:
                _check(value)
            if len(data) > MAX_VALUE_BYTES:
                raise too_large("state value", len(data))
            f = self._frame
            self._unit.write(f.tid, f.op, f.key, "", data)

    def delete(self) -> None:
        """Remove the entity's value."""
        if self._live():
            self._unit.write(self._frame.tid, self._frame.op, self._frame.key, "", None)

    def get_item(self, name: str, default: Any = None) -> Any:
        """One named item of the entity's ordered item map."""
        raw = self._read(item_key(name))
        return default if raw is None else serde.decode(raw)

    def put_item(self, name: str, value: object) -> None:
        """Set one named item of the entity's ordered item map."""
        if self._live():
            data = serde.encode_value(value)
            if len(data) > MAX_VALUE_BYTES:
                raise too_large(f"item {name!r}", len(data))
            self._unit.write(self._frame.tid, self._frame.op, self._frame.key, item_key(name), data)

    def delete_item(self, name: str) -> None:
        """Remove one named item."""
        if self._live():
            self._unit.write(self._frame.tid, self._frame.op, self._frame.key, item_key(name), None)

    def scan_items(self, prefix: str = "", start: str | None = None, stop: str | None = None) -> list[tuple[str, Any]]:
        """Items whose name starts with ``prefix`` and lies in [start, stop), sorted by name."""
        if self._live():
            f = self._frame
            raw_items = self._unit.scan(f.tid, f.op, f.key, item_key(prefix),
                                        None if start is None else "\x01" + start,  # bounds, not names:
                                        None if stop is None else "\x01" + stop)  # no length limit
            if not self._fast:
                self._frame.reads.append(raw_items)
        else:
            raw_items = self._frame.replayed_read()
        # the unit returns exactly the items within [start, stop) (as store names: "\x01" + name)
        decode = serde.decode
        return [(name[1:], decode(raw)) for name, raw in raw_items]

    # -- events ---------------------------------------------------------------------------------------
    def emit(self, stream: str, value: object) -> None:
        """Append ``value`` to the output stream ``stream`` if (and only if) this transaction commits.

        Events travel with the transaction's writes: an aborted (or re-run) transaction's events are
        discarded (as is the whole transaction when one invocation emits more than :data:`MAX_EMITS`).
        Each epoch's committed events form one atom per stream, ordered by the transactions' serial
        order, then by invocation in call-graph preorder (all of an invocation's events, even those emitted
        after a call returned, before its callees' events; callees in call order), then by emit order.
        """
        check_stream(stream)
        if stream.startswith(RESERVED_STREAM_PREFIX):
            raise InvalidKey(f"stream names starting with {RESERVED_STREAM_PREFIX!r} are reserved: {stream!r}")
        self._emit(stream, value)

    def _emit(self, stream: str, value: object) -> None:
        data = serde.encode_value(value)
        if len(data) > MAX_VALUE_BYTES:
            raise too_large(f"event of stream {stream!r}", len(data))
        if self._nemit >= MAX_EMITS:
            raise CallGraphLimitExceeded(f"more than {MAX_EMITS} events emitted by one invocation")
        self._nemit += 1
        if self._live():
            f = self._frame
            self._unit.emit(f.tid, f.inv, self._nemit, stream, data)

    # -- portals (requests to other applications) -----------------------------------------------------
    def _ask(self, portal: str, key: str, *args: object, then: Function[..., object] | str,
             carry: Sequence[object] = ()) -> str:
        """:meth:`Context.ask`."""
        app = self._unit.app_for(self._frame.tid)
        if portal not in app.uses:
            raise UndeclaredPortal(f"application {app.name!r} does not declare portal {portal!r} in its uses")
        then_name = then.name if isinstance(then, Function) else then
        f = self._frame  # the entity running (not ``ctx.operator``/``ctx.key``, which user code could reassign)
        app.resolve(f.op, then_name)  # the continuation exists (a typed error otherwise)
        check_key(key)
        if not isinstance(carry, list | tuple):
            raise BadArguments("carry must be a list")
        self._nask += 1
        rid = f"{PORTAL_ID_PREFIX}{app.name}.{f.tid}.{f.inv}.{self._nask}"
        self._emit(PORTAL_STREAM, {"rid": rid, "portal": portal, "key": key, "args": list(args),
                                  "op": f.op, "from": f.key, "then": then_name, "carry": list(carry)})
        return rid

    # -- effects (calls to the outside world) ---------------------------------------------------------
    def _effect(self, handler: str, /, *args: object, then: Function[..., object] | str, carry: Sequence[object] = (),
                timeout: float = 30.0, attempts: int = 5) -> str:
        """:meth:`Context.effect`."""
        f = self._frame
        self._nask += 1  # asks and effects share the numbering (their ids differ by prefix)
        eid, doc = effect_request(self._unit.app_for(f.tid), f.op, f.key, f.tid, f.inv, self._nask, handler, args,
                                  then, carry, timeout, attempts)
        self._emit(EFFECT_STREAM, doc)
        return eid

    def _promise(self, *, then: Function[..., object] | str, carry: Sequence[object] = (),
                 timeout: float = DEFAULT_TIMEOUT_S) -> str:
        """:meth:`Context.promise`."""
        f = self._frame
        self._nask += 1  # asks, effects and promises share the numbering (their ids differ by prefix)
        pid, spec = promise_request(self._unit.app_for(f.tid), f.op, f.key, f.tid, f.inv, self._nask, then, carry,
                                    timeout)
        self._send(PROMISE_OPERATOR, pid, "create", spec)
        return pid

    # -- calls ------------------------------------------------------------------------------------
    def _target(self, operator: Operator | str, key: str, function: Function[..., object] | str,
                args: tuple[object, ...]) -> Target:
        # Application.validate, inlined (``args`` is a tuple): names, then routing.check_key, then the arguments
        unit = self._unit
        prev = unit.previous  # unit.app_for, inlined
        app = unit.app if prev is None or self._frame.tid >= prev[0] else prev[1]
        try:
            fn = app._resolved.get((operator, function)) or app.resolve(operator, function)
        except TypeError:  # an unhashable name (a list): resolve raises the typed error
            fn = app.resolve(operator, function)
        if not (type(key) is str and key.isascii() and 0 < len(key) <= MAX_KEY_BYTES and "\0" not in key):
            check_key(key)  # its ASCII fast path above, inlined: the rest (or the typed error) in check_key
        sigs = fn._sigs
        if sigs is None or tuple(map(type, args)) not in sigs:  # Function.check_args's fast path, inlined
            fn.check_args(args)
        if self._frame.depth >= MAX_DEPTH:
            raise CallGraphLimitExceeded(f"call depth exceeds {MAX_DEPTH}")
        try:
            data = _encode(args)  # serde.encode(list(args)), inlined: a tuple encodes as the same msgpack array
        except Exception:  # noqa: BLE001 - its typed error
            data = serde.encode(list(args))
        for a in args:  # the value model (serde.encode_value); plain scalars, the common case, pass here
            if type(a) not in _SCALARS:
                _check(args)
                break
        return (fn.operator.name, key, fn.name, data)

    def _by_position(self, operator: Operator | str, function: Function[..., object] | str,
                     args: tuple[object, ...], kwargs: dict[str, object]) -> tuple[object, ...]:
        """Arguments given by name, as the positional ones they bind to (:meth:`Function.by_position`)."""
        return self._unit.app_for(self._frame.tid).resolve(operator, function).by_position(args, kwargs)

    def _call(self, operator: Operator | str, key: str, function: Function[..., object] | str, /, *args: object,
              **kwargs: object) -> _Call:
        """:meth:`Context.call`."""
        # Validated when first created (every call site runs live once before any replay of it).
        if self._dropped:  # self._live(), inlined
            raise GeneratorExit
        if kwargs:
            args = self._by_position(operator, function, args, kwargs)
        target = self._target(operator, key, function, args) if self._frame.live else _replayed_target(
            operator, key, function, args
        )
        self._nchild += 1
        if self._calls is None:
            self._calls = [(1,) + target]
        else:
            self._calls.append((1,) + target)
        return _Call(self, self._nchild, target)

    def _gather(self, *calls: _Call) -> _Gather:
        """:meth:`Context.gather`."""
        for c in calls:
            if not isinstance(c, _Call) or c.ctx is not self:
                raise TypeError("ctx.gather takes the results of this context's ctx.call(...)")
        return _Gather(self, calls)

    def _send(self, operator: Operator | str, key: str, function: Function[..., object] | str, /, *args: object,
              **kwargs: object) -> None:
        """:meth:`Context.send`."""
        live = self._live()
        if kwargs:
            args = self._by_position(operator, function, args, kwargs)
        target = self._target(operator, key, function, args) if live else _replayed_target(
            operator, key, function, args
        )
        self._nchild += 1
        if self._calls is None:
            self._calls = [(0,) + target]
        else:
            self._calls.append((0,) + target)
        if live:
            if self._sends is None:
                self._sends = []
            self._sends.append((self._nchild,) + target)

    def _settle(self, calls: tuple[_Call, ...]) -> bool:
        """An await of ``calls``: take journaled replies (True: suspend, the unsent calls are sent)."""
        if self._dropped:
            raise GeneratorExit
        if len(calls) == 1:  # one awaited call (the common case)
            if calls[0].done:
                return False
            todo = list(calls)
        else:
            todo = []
            for c in calls:
                if not c.done and c not in todo:
                    todo.append(c)
            if not todo:
                return False
        j = self._frame
        replies = j.replies
        have = 0
        for c in todo:
            if c.child in replies:
                have += 1
        if have == len(todo):  # replaying an await that suspended before (or the cached fallback's replies)
            if not j.live:
                j.passed()
            for c in todo:
                c.value = _decode(replies[c.child])  # replies are the engine's own encoding
                c.done = True
            return False
        if have or not j.live:
            raise NonDeterministicFunction(
                f"{self.operator}/{self.key}: replay reached an await whose replies are not all journaled"
            )
        self._pending = todo
        inv = j.inv
        j.suspend({f"{inv}.{c.child}": c.child for c in todo})  # child_inv, inlined
        return True

    def _resumed(self) -> None:
        """The live coroutine continues after a suspending await: the replies are in the journal."""
        replies = self._frame.replies
        for c in self._pending or ():
            c.value = _decode(replies[c.child])  # replies are the engine's own encoding
            c.done = True
        self._pending = None

    # -- timers (charon.core.timers) ---------------------------------------------------------------
    def _send_at(self, t: float, operator: Operator | str, key: str, function: Function[..., object] | str, /,
                 *args: object, **kwargs: object) -> str:
        """:meth:`Context.send_at`."""
        due = _timers.check_due(t)
        live = self._live()
        if kwargs:
            args = self._by_position(operator, function, args, kwargs)
        target = self._target(operator, key, function, args) if live else _replayed_target(
            operator, key, function, args
        )
        self._ntimer += 1
        f = self._frame
        tid = _timers.make_id(f.tid, f.inv, self._ntimer)
        if live:
            timer = _timers.Timer(tid, due, f.op, f.key, *target)
            self._unit.write(f.tid, f.op, f.key, _timers.ITEM_PREFIX + tid, _timers.encode(timer))
            self._unit.timer_registered(due)
        return tid

    def _send_after(self, seconds: float, operator: Operator | str, key: str,
                    function: Function[..., object] | str, /, *args: object, **kwargs: object) -> str:
        """:meth:`Context.send_after`."""
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds >= 0:
            raise ValueError(f"send_after needs a number of seconds >= 0, got {seconds!r}")
        return self._send_at(self.now() + seconds, operator, key, function, *args, **kwargs)

    if not TYPE_CHECKING:  # the implementations of Context's typed declarations (the same functions: no wrapper)
        call, gather, send, ask, effect, promise = _call, _gather, _send, _ask, _effect, _promise
        send_at, send_after = _send_at, _send_after

    def cancel_timer(self, timer_id: str) -> bool:
        """Cancel a pending timer of this entity; False if there is none with that id (fired, cancelled,
        never registered, or another entity's)."""
        if type(timer_id) is not str or not timer_id:
            raise ValueError("a timer id is a non-empty string")
        item = _timers.ITEM_PREFIX + check_item(timer_id)
        if self._read(item) is None:
            return False
        if self._live():
            self._unit.write(self._frame.tid, self._frame.op, self._frame.key, item, None)
        return True

    def timers(self) -> list[_timers.Timer]:
        """This entity's pending timers, by id (a timer due in this epoch has already fired)."""
        if self._live():
            f = self._frame
            raw_items = self._unit.scan(f.tid, f.op, f.key, _timers.ITEM_PREFIX)
            if not self._fast:
                self._frame.reads.append(raw_items)
        else:
            raw_items = self._frame.replayed_read()
        return [_timers.decode(raw) for _, raw in raw_items]

    # -- determinism ------------------------------------------------------------------------------
    def random(self) -> float:
        """A pseudo-random float in [0, 1), the same on every replay of this transaction."""
        if self._rng is None:
            self._rng = _random.Random(f"{self._frame.tid}/{self._frame.inv}")
        return self._rng.random()

    def now(self) -> float:
        """The transaction's timestamp (its request's append time), the same on every replay."""
        return self._frame.ts

    def code_version(self) -> str | None:
        """:meth:`Context.code_version` (the engine's code book, lent to the partition unit)."""
        book = self._unit.code
        return None if book is None else book.label_of(self._unit.epoch, self.tid)

    def code_of(self, version: str) -> Application | None:
        """:meth:`Context.code_of`."""
        book = self._unit.code
        return None if book is None else book.application_of(version)


def name_implementations(cls: type[Context]) -> None:
    """Give the implementations of :class:`Context`'s typed methods in ``cls`` (bound as ``call = _call``...) their
    public names, for tracebacks and ``TypeError`` messages (``EngineContext.call() got an unexpected keyword...``)."""
    for name in ("call", "gather", "send", "send_at", "send_after", "ask", "effect", "promise"):
        fn = cls.__dict__.get(name)
        if fn is cls.__dict__.get("_" + name) and isinstance(fn, FunctionType):
            fn.__name__, fn.__qualname__ = name, f"{cls.__name__}.{name}"


name_implementations(EngineContext)


def check_awaited(calls: list[CallRecord], replies: dict[int, bytes], op: str, fn: str, key: str) -> None:
    """Raise UnawaitedCall if a synchronous call of a completed invocation (``calls``: its ``ctx._calls``, child
    ``n`` at index ``n - 1``) has no reply: it was created and never awaited."""
    for n, c in enumerate(calls, 1):
        if c[0] and n not in replies:
            raise UnawaitedCall(unawaited_message(op, fn, key, n, c[1], c[2], c[3]))


def unawaited_message(op: str, fn: str, key: str, child: int, cop: str, ckey: str, cfn: str) -> str:
    """The message of :class:`UnawaitedCall` (the engine's and the oracle's)."""
    return (f"{op}.{fn} on key {key!r} returned without awaiting its call number {child}, ctx.call({cop}, "
            f"{ckey!r}, {cfn}): await it (or use ctx.send for a call whose result is not needed)")


def child_inv(inv: str, child: int) -> str:
    """The invocation id of call or send number ``child`` made by invocation ``inv``."""
    return f"{inv}.{child}"


def raised_in(message: str, op: str, key: str, fn: str) -> str:
    """An error message naming the called or sent function that raised it (not used for the root)."""
    return (f"{message} [raised by {op}.{fn} on key {key!r}: an exception anywhere in the call graph aborts "
            "the whole transaction; callers cannot catch it]")


def _replayed_target(operator: Operator | str, key: str, function: Function[..., object] | str,
                     args: tuple[object, ...]) -> Target:
    """The target of a call or send already validated in the run that first made it (as ``_target``)."""
    op = operator.name if isinstance(operator, Operator) else operator
    fn = function.name if isinstance(function, Function) else function
    return (op, key, fn, serde.encode(list(args)))


def item_key(name: str) -> str:
    """Store item of a user item name (``""`` is the entity's main value, so items are prefixed).

    Raises InvalidKey for a name :func:`charon.core.routing.check_item` rejects (inside a function: it aborts).
    """
    return "\x01" + check_item(name)

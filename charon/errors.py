"""Typed errors: what callers and clients receive instead of bare strings.

One model on every path (``InProcessRuntime.invoke``, the Spark runtime's ``invoke``, the HTTP clients): each
error is of one **kind** (:attr:`CharonError.kind`):

* ``"abort"`` -- the transaction ran and aborted (nothing of it applied; retrying the same request will not
  help): a :class:`TransactionAborted`, whose ``error_type`` names what raised (the application's exception
  class, or an engine error such as ``CallGraphLimitExceeded``);
* ``"refusal"`` -- the request was refused before it reached the log (bad input; nothing ran);
* ``"availability"`` -- the engine could not take or answer the request now; a retry may succeed.

An engine error that can happen both ways (``UnknownFunction`` named by the request itself is a refusal, named
by a callee inside the call graph an abort) is raised as its refusal class before the log and as its abort
class (e.g. :class:`UnknownFunctionAborted`, a subclass of both ``UnknownFunction`` and ``TransactionAborted``)
after: ``except UnknownFunction`` catches both, ``except TransactionAborted`` catches every abort.

The admin API's errors (SQL, epochs, rescales, pauses, the inspector) are here too: an engine's ``Controls``
raise them in-process, and the HTTP clients raise the same class for the gateway's answer, found by its
``error.type`` in one table, :data:`ERRORS`.
"""

from __future__ import annotations

from typing import ClassVar

ABORT = "abort"
REFUSAL = "refusal"
AVAILABILITY = "availability"


class CharonError(Exception):
    """Base class of every error Charon raises on purpose."""

    #: ``"abort"``, ``"refusal"`` or ``"availability"`` (see the module docstring)
    kind: ClassVar[str] = REFUSAL

    @property
    def retryable(self) -> bool:
        """Whether the same request may succeed later (only availability errors)."""
        return self.kind == AVAILABILITY


class TransactionAborted(CharonError):
    """The transaction ran and aborted because a function in its call graph raised: nothing of it was applied.

    ``error_type`` is the raised exception's class name (the application's, or an engine error's such as
    ``CallGraphLimitExceeded``) and ``message`` its message (naming the callee that raised, if not the root);
    ``request_id``, ``tid``, ``epoch`` and ``position`` (the transaction's place in the epoch's serial order)
    say which transaction, when known. The same request id gets the same abort again.
    """

    kind: ClassVar[str] = ABORT

    def __init__(self, error_type: str, message: str, request_id: str = "", *, tid: int | None = None,
                 epoch: int | None = None, position: int | None = None) -> None:
        super().__init__(f"{error_type}: {message}")
        self.error_type = error_type
        self.message = message
        self.request_id = request_id
        self.tid = tid
        self.epoch = epoch
        self.position = position

    def __reduce__(self) -> tuple[object, ...]:  # keyword-only attributes survive pickling
        return _rebuild, (type(self), self.error_type, self.message, self.request_id, self.tid, self.epoch,
                          self.position)


def _rebuild(cls: type[TransactionAborted], error_type: str, message: str, request_id: str, tid: int | None,
             epoch: int | None, position: int | None) -> TransactionAborted:
    exc = cls.__new__(cls)
    TransactionAborted.__init__(exc, error_type, message, request_id, tid=tid, epoch=epoch, position=position)
    if type(exc) is not TransactionAborted:
        Exception.__init__(exc, message)
    return exc


class EngineAbort(TransactionAborted):
    """An abort the engine itself raised (not application code): ``error_type`` is the class's name and
    ``str()`` the bare message. Raised inside functions by the engine, and by ``invoke`` for such an abort."""

    def __init__(self, message: str = "", request_id: str = "", *, tid: int | None = None,
                 epoch: int | None = None, position: int | None = None) -> None:
        super().__init__(self.error_name(), message, request_id, tid=tid, epoch=epoch, position=position)
        Exception.__init__(self, message)

    @classmethod
    def error_name(cls) -> str:
        """The ``error_type`` this class carries (its own name, or its refusal class's for a ``...Aborted``)."""
        name = cls.__name__
        return name.removesuffix("Aborted") if name.endswith("Aborted") else name


# ---- refusals: the request was refused before the log (and, as ``...Aborted``, the same error in a callee)


class UnknownOperator(CharonError):
    """The request names an operator the application does not define (over HTTP: none with a public function)."""


class UnknownFunction(CharonError):
    """The request names a function its operator does not define, or, over HTTP, an internal one: functions are
    internal unless declared ``@op.function(public=True)``, and a client's call of an internal function is answered
    exactly as one of a missing function (HTTP 404, nothing logged)."""


class BadArguments(CharonError):
    """Wrong number or types of arguments for a function."""


class SerializationError(CharonError):
    """A value (argument, state or return value) is not msgpack-serializable, or a payload is malformed."""


class InvalidKey(CharonError):
    """An entity key, item name or operator name breaks the rules of :mod:`charon.core.routing` (UTF-8, no NUL,
    byte limits)."""


class IdempotencyConflict(CharonError):
    """A request id (``Idempotency-Key``) was reused with a different operator, key, function or arguments."""


class PayloadTooLarge(CharonError):
    """A request body or argument list exceeds the configured limit."""


class UndeclaredPortal(CharonError):
    """An application reached a portal or stream of another application that it did not declare in ``uses``,
    or that the other application does not expose (see :mod:`charon.runtime.deployment`)."""


class UnknownOperatorAborted(EngineAbort, UnknownOperator):
    """A function inside the call graph called an operator the application does not define."""


class UnknownFunctionAborted(EngineAbort, UnknownFunction):
    """A function inside the call graph called a function its operator does not define."""


class BadArgumentsAborted(EngineAbort, BadArguments):
    """A function inside the call graph called a function with wrong arguments."""


class SerializationErrorAborted(EngineAbort, SerializationError):
    """A value inside the transaction (a call's arguments, state, a return value) is not serializable."""


class InvalidKeyAborted(EngineAbort, InvalidKey):
    """A function inside the call graph used a key or item name that breaks the key rules."""


class PayloadTooLargeAborted(EngineAbort, PayloadTooLarge):
    """A call inside the call graph carried arguments over the configured limit."""


class UndeclaredPortalAborted(EngineAbort, UndeclaredPortal):
    """A function asked a portal its application does not declare in ``uses`` (or nobody exposes)."""


# ---- aborts only: the engine stopped a running transaction


class ValueTooLarge(EngineAbort):
    """A state value, item, event or return value is larger, encoded, than the engine's maximum
    (``CHARON_MAX_VALUE_BYTES``, default 4 MiB): raised in the function, so its transaction aborts."""


class CallGraphLimitExceeded(EngineAbort):
    """A transaction's call graph did not finish within the engine's limits (depth, calls or rounds)."""


class NonDeterministicFunction(EngineAbort):
    """A function behaved differently when replayed from its journal (it must be deterministic), or, under the
    determinism check, ran twice with different effects or did blocking I/O (a file, a socket, a subprocess)."""


class IllegalAwait(EngineAbort):
    """A function awaited something other than ``ctx.call`` (an asyncio sleep or future, an async HTTP client,
    anyio): functions cannot wait on I/O or time; do I/O with ``ctx.effect``."""


class InvocationTimeout(EngineAbort):
    """A function ran past its time budget without awaiting (an endless loop, a long sleep, heavy work): the
    transaction aborted, the decision was recorded before anything depended on it, and the transaction is never
    run again (a retry with the same request id gets this reply; see :mod:`charon.runtime.guard.watchdog`)."""


class Quarantined(EngineAbort):
    """The transaction was set aside without running: it stopped the engine (killed its process or worker, or
    stayed stuck) on repeated attempts; listed by ``charon dead-letters``."""


class UnawaitedCall(EngineAbort):
    """A function returned while a call it created with ``ctx.call`` was never awaited (use ``ctx.send`` for a
    call whose result is not needed). The transaction aborts: nothing of it is applied."""


class RateLimited(EngineAbort):
    """Refused at admission: the request's limit has as many requests waiting as its queue holds (HTTP 429 with
    ``Retry-After``); nothing ran: a retry later may run it. See :mod:`charon.core.admission`."""


class Overloaded(EngineAbort):
    """Refused at admission: the engine holds as many waiting requests as it may (HTTP 429 with
    ``Retry-After``, also before the log); nothing ran: a retry later may run it."""


class InvocationCancelled(EngineAbort):
    """An operator cancelled the invocation while it waited for admission (a bulk cancel, ``POST
    /admin/bulk/invocations/cancel``, ``charon requests bulk cancel``): it never ran; decided at the epoch that took
    the cancel, from its log, so a replay decides the same (HTTP 409)."""


class UnknownEffect(EngineAbort):
    """``ctx.effect`` named an effect handler the application does not register, or gave it a bad policy
    (timeout, attempts): the transaction aborts, nothing is recorded."""


class PromiseConflict(EngineAbort):
    """The promise was already settled (resolved, rejected, timed out or cancelled): its continuation ran or
    will run once, with the first outcome; this resolve, reject or cancel changed nothing (HTTP 409)."""


class UnknownPromise(CharonError, LookupError):
    """No promise has this id (never created, its transaction aborted, or forgotten after its retention):
    HTTP 404, refused before the log."""


class UnknownPromiseAborted(EngineAbort, UnknownPromise):
    """A resolve, reject or cancel inside a transaction named a promise that does not exist."""


class WorkflowExists(EngineAbort):
    """A workflow was started under an id that is in use (:mod:`charon.core.workflows`; HTTP 409): nothing
    changed."""


class UnknownWorkflow(CharonError, LookupError):
    """No workflow of that name, or no workflow with that id (HTTP 404, refused before the log)."""


class UnknownWorkflowAborted(EngineAbort, UnknownWorkflow):
    """A workflow operation inside a transaction named a workflow that does not exist."""


class WorkflowTooLong(EngineAbort):
    """A workflow ran its ``max_steps`` steps (the step's transaction aborts, the workflow then fails)."""


class NotMigratable(EngineAbort):
    """An operator's migration of a workflow did not apply (another version, finished, or a step the deployed code
    lacks; HTTP 409): nothing changed (:mod:`charon.core.workflows`)."""


class VersionUnavailable(EngineAbort):
    """A workflow's step is pinned to a code version the engine has not recorded (or whose code lacks the
    workflow): the step aborts; migrate the workflow (``charon workflows migrate --from V``)."""


class VersionInUse(CharonError):
    """A code update would drop the code of a version that still has workflows in flight (its ref is no longer
    installed): refused before anything is recorded (HTTP 409); migrate or cancel them first."""


class UnknownSchedule(CharonError, LookupError):
    """No schedule has this name (never created, or deleted): HTTP 404."""


class UnknownScheduleAborted(EngineAbort, UnknownSchedule):
    """A schedule operation inside a transaction named a schedule that does not exist."""


class PromiseFailed(EngineAbort):
    """A promise settled without a value: raised by :func:`charon.promise_value` in its continuation (uncaught,
    it aborts the continuation's transaction with this class's name as ``error_type``)."""


class PromiseRejected(PromiseFailed):
    """The promise was rejected (``POST /promises/{id}/reject``, ``Client.reject``, ``ctx.reject_promise``)."""


class PromiseTimedOut(PromiseFailed):
    """The promise was not settled within its ``timeout``: its continuation ran with this outcome."""


class PromiseCancelled(PromiseFailed):
    """An operator cancelled the promise (``POST /promises/{id}/cancel``, ``charon promises cancel``)."""


# ---- refusals of the admin API (the same from an engine's Controls and through the HTTP clients)


class Unauthorized(CharonError, PermissionError):
    """The gateway refused the bearer token (missing or wrong)."""


class Forbidden(CharonError, PermissionError):
    """The gateway knows the bearer token but it lacks the scope the route needs (``invoke``, ``read``, ``admin``
    or ``effects``; :mod:`charon.server.auth`), or the action is not allowed (a code ref outside ``code_refs``).
    HTTP 403."""

    status: ClassVar[int] = 403


class BadRequest(CharonError, ValueError):
    """The request is malformed (a body, header or parameter the gateway cannot use, an inspector filter or
    cursor that is not valid)."""


class ReservedRequestId(BadRequest):
    """The request id (``Idempotency-Key``, ``request_id``, ``batch_id``) is one the engine mints for its own
    transactions (``__charon...``, ``fx....``: :data:`charon.messages.RESERVED_ID_PREFIXES`); no client may use it."""


class RequestNotFound(CharonError, LookupError):
    """Neither the gateway nor the runtime knows this request id (or the inspector no longer retains it)."""


class NotSupported(CharonError):
    """The engine has no such capability (HTTP 501): e.g. a remote gateway's engine has no controls."""


class EpochNotRetained(CharonError):
    """The state as of the requested epoch is not available (not reached yet, or compacted away)."""


class SQLRejected(CharonError):
    """The query is outside the safe subset (one SELECT over the state views, allowed functions only)."""


class SQLSyntaxError(CharonError):
    """The query does not parse or does not resolve (unknown table or column)."""


class SQLTimeout(CharonError):
    """The query ran longer than its time bound and was cancelled."""


class SQLTooExpensive(CharonError):
    """The query needed more memory (or built a larger value) than the SQL sandbox allows (``sql_max_memory``)."""


class SQLResultTooLarge(CharonError):
    """The query's answer is larger than ``sql_max_result_bytes`` of JSON."""


class StateTooLarge(CharonError):
    """An operator the query names holds more entities than the in-process SQL loads (``max_entities``)."""


# ---- availability: nothing was decided; retry later


class LogUnavailable(CharonError):
    """The input log could not take a request (e.g. it stayed locked); nothing was appended, retry later."""

    kind: ClassVar[str] = AVAILABILITY


class EngineUnavailable(CharonError):
    """The engine cannot answer now (starting, recovering from a failure, or stopped after one)."""

    kind: ClassVar[str] = AVAILABILITY


class RescaleBusy(CharonError):
    """A rescale cannot start now (another one runs, or the engine is paused): nothing moved (HTTP 409
    ``RescaleRunning``; the clients' ``RescaleRunning`` is this class)."""

    kind: ClassVar[str] = AVAILABILITY


class GatePaused(CharonError):
    """The engine is paused (its epoch gate closed) and the operation needs epochs to run: refused at once
    instead of waiting for a resume until its timeout (HTTP 409 ``Paused``); nothing was changed. The clients'
    ``Paused`` is this class."""

    kind: ClassVar[str] = AVAILABILITY


#: The class an abort with each engine ``error_type`` is raised as (any other error_type: the application's
#: exception, raised as plain :class:`TransactionAborted`).
ABORTS: dict[str, type[EngineAbort]] = {
    cls.error_name(): cls
    for cls in (
        UnknownOperatorAborted,
        UnknownFunctionAborted,
        BadArgumentsAborted,
        SerializationErrorAborted,
        InvalidKeyAborted,
        PayloadTooLargeAborted,
        UndeclaredPortalAborted,
        ValueTooLarge,
        CallGraphLimitExceeded,
        NonDeterministicFunction,
        IllegalAwait,
        UnawaitedCall,
        UnknownEffect,
        PromiseConflict,
        UnknownPromiseAborted,
        UnknownScheduleAborted,
        WorkflowExists,
        UnknownWorkflowAborted,
        WorkflowTooLong,
        NotMigratable,
        VersionUnavailable,
        PromiseFailed,
        PromiseRejected,
        PromiseTimedOut,
        PromiseCancelled,
        InvocationTimeout,
        RateLimited,
        Overloaded,
        InvocationCancelled,
        Quarantined,
    )
}
#: Errors raised by the engine itself rather than by application code, looked up by ``error_type`` on decode
#: (the older name of :data:`ABORTS`).
ENGINE_ERRORS: dict[str, type[CharonError]] = dict(ABORTS)


#: The class each typed refusal or availability answer of the gateway (``{"error": {"type": ...}}``, keyed by that
#: type) is raised as by the HTTP clients: the class the engine and its ``Controls`` raise in-process for the same
#: mistake (an abort's type is looked up in :data:`ABORTS` instead).
ERRORS: dict[str, type[CharonError]] = {
    "UnknownOperator": UnknownOperator,
    "UnknownFunction": UnknownFunction,
    "BadArguments": BadArguments,
    "SerializationError": SerializationError,
    "InvalidKey": InvalidKey,
    "IdempotencyConflict": IdempotencyConflict,
    "PayloadTooLarge": PayloadTooLarge,
    "Unauthorized": Unauthorized,
    "Forbidden": Forbidden,
    "BadRequest": BadRequest,
    "ReservedRequestId": ReservedRequestId,
    "NotFound": RequestNotFound,
    "NotSupported": NotSupported,
    "EpochNotRetained": EpochNotRetained,
    "SQLRejected": SQLRejected,
    "SQLSyntaxError": SQLSyntaxError,
    "SQLTimeout": SQLTimeout,
    "SQLTooExpensive": SQLTooExpensive,
    "SQLResultTooLarge": SQLResultTooLarge,
    "StateTooLarge": StateTooLarge,
    "RescaleRunning": RescaleBusy,
    "Paused": GatePaused,
    "UnknownPromise": UnknownPromise,
    "UnknownSchedule": UnknownSchedule,
    "UnknownWorkflow": UnknownWorkflow,
    "VersionInUse": VersionInUse,
}


def wire_type(cls: type[CharonError]) -> str:
    """The ``error.type`` the gateway answers an error of class ``cls`` with (its key in :data:`ERRORS`, else
    the class's name)."""
    for name, known in ERRORS.items():
        if known is cls:
            return name
    return cls.__name__


def aborted(error_type: str, message: str, request_id: str = "", *, tid: int | None = None,
            epoch: int | None = None, position: int | None = None) -> TransactionAborted:
    """The exception of an abort with ``error_type``: the engine error's abort class, else TransactionAborted
    (a negative ``tid`` or ``epoch``, a request that never ran, is None)."""
    tid = None if tid is None or tid < 0 else tid
    epoch = None if epoch is None or epoch < 0 else epoch
    cls = ABORTS.get(error_type)
    if cls is None:
        return TransactionAborted(error_type, message, request_id, tid=tid, epoch=epoch, position=position)
    return cls(message, request_id, tid=tid, epoch=epoch, position=position)

"""Typed errors: what callers and clients receive instead of bare strings."""

from __future__ import annotations


class CharonError(Exception):
    """Base class of every error Charon raises on purpose."""


class UnknownOperator(CharonError):
    """The request names an operator the application does not define."""


class UnknownFunction(CharonError):
    """The request names a function its operator does not define."""


class BadArguments(CharonError):
    """Wrong number or types of arguments for a function."""


class SerializationError(CharonError):
    """A value (argument, state or return value) is not msgpack-serializable, or a payload is malformed."""


class InvalidKey(CharonError):
    """An entity key, item name or operator name breaks the rules of :mod:`charon.core.routing` (UTF-8, no NUL,
    byte limits)."""


class IdempotencyConflict(CharonError):
    """A request id (``Idempotency-Key``) was reused with a different operator, key, function or arguments."""


class LogUnavailable(CharonError):
    """The input log could not take a request (e.g. it stayed locked); nothing was appended, retry later."""


class PayloadTooLarge(CharonError):
    """A request body or argument list exceeds the configured limit."""


class ValueTooLarge(CharonError):
    """A state value, item, event or return value is larger, encoded, than the engine's maximum
    (``CHARON_MAX_VALUE_BYTES``, default 4 MiB): raised in the function, so its transaction aborts."""


class CallGraphLimitExceeded(CharonError):
    """A transaction's call graph did not finish within the engine's limits (depth, calls or rounds)."""


class NonDeterministicFunction(CharonError):
    """A function behaved differently when replayed from its journal (it must be deterministic)."""


class IllegalAwait(CharonError):
    """A function awaited something other than ``ctx.call`` (functions cannot block on I/O)."""


class InvocationTimeout(CharonError):
    """A function ran past its time budget without awaiting (an endless loop, a long sleep, heavy work): the
    transaction aborted, the decision was recorded before anything depended on it, and the transaction is never
    run again (a retry with the same request id gets this reply; see :mod:`charon.runtime.watchdog`)."""


class Quarantined(CharonError):
    """The transaction was set aside without running: it stopped the engine (killed its process or worker, or
    stayed stuck) on repeated attempts; listed by ``charon dead-letters``."""


class UnawaitedCall(CharonError):
    """A function returned while a call it created with ``ctx.call`` was never awaited (use ``ctx.send`` for a
    call whose result is not needed). The transaction aborts: nothing of it is applied."""


class EngineUnavailable(CharonError):
    """The engine cannot answer now (starting, recovering from a failure, or stopped after one)."""


#: Errors raised by the engine itself rather than by application code, looked up by name on decode.
class UndeclaredPortal(CharonError):
    """An application reached a portal or stream of another application that it did not declare in ``uses``,
    or that the other application does not expose (see :mod:`charon.runtime.deployment`)."""


class UnknownEffect(CharonError):
    """``ctx.effect`` named an effect handler the application does not register, or gave it a bad policy
    (timeout, attempts): the transaction aborts, nothing is recorded."""


ENGINE_ERRORS: dict[str, type[CharonError]] = {
    cls.__name__: cls
    for cls in (
        UnknownOperator,
        UnknownFunction,
        BadArguments,
        SerializationError,
        InvalidKey,
        PayloadTooLarge,
        ValueTooLarge,
        CallGraphLimitExceeded,
        NonDeterministicFunction,
        IllegalAwait,
        UnawaitedCall,
        UndeclaredPortal,
        UnknownEffect,
        InvocationTimeout,
        Quarantined,
    )
}


class TransactionAborted(CharonError):
    """The transaction was aborted because a function in its call graph raised.

    ``error_type`` is the raised exception's class name and ``message`` its message; nothing of the
    transaction was applied.
    """

    def __init__(self, error_type: str, message: str, request_id: str = "") -> None:
        super().__init__(f"{error_type}: {message}")
        self.error_type = error_type
        self.message = message
        self.request_id = request_id

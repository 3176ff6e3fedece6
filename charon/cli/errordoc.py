"""The error table of the documentation (``docs/reference/errors.md``), generated from the exception classes.

``python -m charon.cli.errordoc`` prints the page, ``python -m charon.cli.errordoc --write [PATH]`` writes it (default
``docs/reference/errors.md``); ``tests/package/test_errordoc.py`` checks that the page matches the code."""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

from charon import client, errors
from charon.runtime import contract
from charon.server.wire import STATUS_OF_ERROR

__all__ = ["EXAMPLE", "ROWS", "render", "wire_name", "http_status", "documented"]

#: the exceptions of each kind, in the order of the page (what a user can catch from ``invoke``, the clients and
#: the admin API)
ROWS: dict[str, list[type[errors.CharonError]]] = {
    errors.ABORT: [
        errors.TransactionAborted,
        errors.CallGraphLimitExceeded, errors.IllegalAwait, errors.InvocationTimeout, errors.NonDeterministicFunction,
        errors.Quarantined, errors.UnawaitedCall, errors.UnknownEffect, errors.ValueTooLarge,
        errors.UnknownOperatorAborted, errors.UnknownFunctionAborted, errors.BadArgumentsAborted,
        errors.SerializationErrorAborted, errors.InvalidKeyAborted, errors.PayloadTooLargeAborted,
        errors.UndeclaredPortalAborted, errors.PromiseConflict, errors.UnknownPromiseAborted,
        errors.UnknownScheduleAborted, errors.WorkflowExists, errors.UnknownWorkflowAborted,
        errors.WorkflowTooLong, errors.NotMigratable, errors.VersionUnavailable,
        errors.PromiseFailed, errors.PromiseRejected, errors.PromiseTimedOut,
        errors.PromiseCancelled, errors.RateLimited, errors.Overloaded, errors.InvocationCancelled,
    ],
    errors.REFUSAL: [
        errors.UnknownOperator, errors.UnknownFunction, errors.BadArguments, errors.SerializationError,
        errors.InvalidKey, errors.PayloadTooLarge, errors.IdempotencyConflict, errors.UndeclaredPortal,
        errors.Unauthorized, errors.Forbidden, errors.BadRequest, errors.ReservedRequestId, errors.RequestNotFound,
        errors.NotSupported, errors.EpochNotRetained, errors.SQLRejected, errors.SQLSyntaxError,
        errors.SQLTimeout, errors.SQLTooExpensive, errors.SQLResultTooLarge, errors.StateTooLarge,
        errors.UnknownPromise, errors.UnknownSchedule, errors.UnknownWorkflow, errors.VersionInUse,
    ],
    errors.AVAILABILITY: [
        errors.EngineUnavailable, contract.EngineStopped, errors.LogUnavailable, client.GatewayUnavailable,
        client.GatewayLogUnavailable, client.GatewayError, errors.RescaleBusy, errors.GatePaused,
    ],
}

#: the answer's ``error.type`` where neither :data:`charon.errors.ERRORS` names it nor it is the class's name
_WIRE = {
    errors.EngineUnavailable: "Unavailable",
    contract.EngineStopped: "Unavailable",
    client.GatewayUnavailable: "(any)",
    client.GatewayLogUnavailable: "LogUnavailable",
    client.GatewayError: "(any)",
}
_STATUS = {client.GatewayUnavailable: "503", client.GatewayLogUnavailable: "503", client.GatewayError: "5xx",
           errors.UndeclaredPortal: "— (in-process: a `Deployment`'s wiring)", errors.RateLimited: "429",
           errors.Overloaded: "429"}
_KIND_TEXT = {
    errors.ABORT: "The transaction ran and aborted, nothing of it was applied. Retrying the same request "
                  "id returns the same abort; retrying with a new id runs the transaction again (it will abort "
                  "again unless the state changed). Every abort is a `TransactionAborted`; HTTP 409.",
    errors.REFUSAL: "The request was refused before it reached the log (bad input, unknown names, "
                    "authentication, limits); nothing ran. Fix the request; a retry as is fails again.",
    errors.AVAILABILITY: "The engine could not take or answer the request now; nothing was decided. "
                         "A retry (with the same request id) may succeed; `exc.retryable` is True.",
}
#: the page's example (runs as it is: tests/package/test_errordoc.py executes it)
EXAMPLE = """
import asyncio

from charon import Application, Context, InProcessRuntime, Operator, TransactionAborted, UnknownFunction

bank = Operator("bank")


class InsufficientFunds(Exception):
    pass


@bank.function
async def withdraw(ctx: Context, amount: int) -> int:
    balance = ctx.get(default=0)
    if balance < amount:
        raise InsufficientFunds(f"{ctx.key} has {balance}")
    ctx.put(balance - amount)
    return balance - amount


@bank.function
async def close(ctx: Context) -> None:
    await ctx.call("bank", ctx.key, "archive")  # no such function: found out inside the transaction


async def main() -> None:
    # the HTTP clients raise the same: Client(url).invoke(...), await AsyncClient(url).invoke(...)
    async with InProcessRuntime(Application("bank", [bank])) as runtime:
        try:
            await runtime.invoke("bank", "alice", "withdraw", 10)
        except TransactionAborted as exc:  # any abort: the application's exception or the engine's
            print(exc.error_type, exc.message, exc.request_id, exc.epoch, exc.position)
            assert exc.error_type == "InsufficientFunds" and exc.kind == "abort"
        try:
            await runtime.invoke("bank", "alice", "close")
        except UnknownFunction as exc:  # named by a callee: an abort, and an UnknownFunction
            assert isinstance(exc, TransactionAborted) and exc.error_type == "UnknownFunction"
        try:
            await runtime.invoke("bank", "alice", "archive")
        except UnknownFunction as exc:  # named by the request: refused before the log, no abort
            assert not isinstance(exc, TransactionAborted) and exc.kind == "refusal"


asyncio.run(main())
"""
_TITLE = {errors.ABORT: "Aborts", errors.REFUSAL: "Refusals", errors.AVAILABILITY: "Availability"}


def wire_name(cls: type[errors.CharonError]) -> str:
    """The ``error.type`` of the gateway's answer for ``cls`` (an abort's: its ``error_type``)."""
    if issubclass(cls, errors.EngineAbort):
        return cls.error_name()
    if cls is errors.TransactionAborted:
        return "(the exception's class name)"
    return _WIRE.get(cls) or errors.wire_type(cls)


def http_status(cls: type[errors.CharonError]) -> str:
    """The HTTP status the gateway answers ``cls`` with."""
    if issubclass(cls, errors.TransactionAborted):
        return _STATUS.get(cls, "409")
    return _STATUS.get(cls) or str(STATUS_OF_ERROR[wire_name(cls)])


def documented() -> list[type[errors.CharonError]]:
    """Every public exception class the page must list: those of :mod:`charon.errors`, the client's and the
    engine contract's."""
    out = []
    for mod in (errors, client, contract):
        names = getattr(mod, "__all__", None) or dir(mod)
        for name in names:
            obj = getattr(mod, name)
            if (inspect.isclass(obj) and issubclass(obj, errors.CharonError) and obj.__module__ == mod.__name__
                    and not name.startswith("_") and obj is not errors.CharonError and obj is not errors.EngineAbort
                    and obj is not contract.GateClosed):
                out.append(obj)
    return out


def _code(name: str) -> str:
    return name if name.startswith("(") else f"`{name}`"


def _attributes(cls: type[errors.CharonError]) -> str:
    if issubclass(cls, errors.TransactionAborted):
        return "`error_type`, `message`, `request_id`, `tid`, `epoch`, `position`"
    if issubclass(cls, client.GatewayError):
        return "`status`, `error_type`, `message`"
    return "`str(exc)`: the message"


def _markdown(rst: str) -> str:
    """Docstring markup as Markdown: ``:class:`~x.Y``` and ````x```` become `` `Y` `` and `` `x` ``."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", lambda m: f"`{m.group(1)}`", rst)
    return text.replace("``", "`").replace("|", "\\|")


def _when(cls: type[errors.CharonError]) -> str:
    doc = inspect.getdoc(cls) or ""
    return _markdown(" ".join(doc.split("\n\n")[0].split()))


def _also(cls: type[errors.CharonError]) -> str:
    bases = [b for b in cls.__mro__[1:] if b.__module__.startswith("charon") and b not in
             (errors.CharonError, errors.EngineAbort, cls)]
    return f" (also {', '.join(f'`{b.__name__}`' for b in bases)})" if bases else ""


def render() -> str:
    """The page."""
    lines = [
        "# Errors",
        "",
        "<!-- generated by `python -m charon.cli.errordoc --write` from the exception classes; "
        "tests/package/test_errordoc.py checks it -->",
        "",
        "Charon raises one error model on every path: `InProcessRuntime.invoke` (and the durable node's runtime, "
        "the runtimes of a `Deployment`), `SparkRuntime.invoke`, and the HTTP clients `Client` and `AsyncClient`. "
        "The same failing transaction raises the same class with the same attributes on each "
        "(tests/contract/test_contract_errors.py runs the same aborts through all of them). The admin API too: "
        "an operator's mistake (a SQL query outside the sandbox, an epoch no longer retained, a rescale while "
        "paused, a bad inspector filter) raises the same class with the same message from the engine's "
        "`Controls` in-process and from the clients' admin methods (tests/contract/test_contract_admin_errors.py); "
        "the clients find the class of each answer's `error.type` in one table, `charon.errors.ERRORS`.",
        "",
        "Every error is a `charon.CharonError` of one **kind** (`exc.kind`: `\"abort\"`, `\"refusal\"` or "
        "`\"availability\"`; `exc.retryable` is True only for availability):",
        "",
        "```python",
        *EXAMPLE.strip().splitlines(),
        "```",
        "",
        "An engine error that can be either (e.g. `UnknownFunction`: named by the request it is a refusal, named by "
        "a callee inside the call graph an abort) is raised as its refusal class before the log and as its abort "
        "class after (`UnknownFunctionAborted`, both an `UnknownFunction` and a `TransactionAborted`). An "
        "exception the application raises aborts the transaction as a plain `TransactionAborted` whose "
        "`error_type` is the exception's class name.",
        "",
    ]
    for kind, classes in ROWS.items():
        lines += [f"## {_TITLE[kind]}", "", _KIND_TEXT[kind], "",
                  "| Exception | HTTP | `error.type` | Attributes | When |",
                  "|---|---|---|---|---|"]
        for cls in classes:
            assert cls.kind == kind, (cls, cls.kind, kind)
            lines.append(f"| `{cls.__module__}.{cls.__name__}`{_also(cls)} | {http_status(cls)} | "
                         f"{_code(wire_name(cls))} | {_attributes(cls)} | {_when(cls)} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--write"]:
        path = Path(argv[1] if len(argv) > 1 else "docs/reference/errors.md")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render())
        print(f"wrote {path}")
        return 0
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

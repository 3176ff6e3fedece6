"""The ``charon`` command line's exit codes: one table for every command (docs/reference/exit-codes.md)."""

from __future__ import annotations

from enum import IntEnum

from charon.errors import CharonError, EngineUnavailable, LogUnavailable, TransactionAborted

__all__ = ["ExitCode", "DESCRIPTION", "exit_code_of"]


class ExitCode(IntEnum):
    """What a ``charon`` process's exit status means; the same for every command."""

    OK = 0
    ABORTED = 1
    USAGE = 2
    UNAVAILABLE = 3
    REJECTED = 4
    APP_ERROR = 5
    FAILED = 6
    INTERNAL = 70
    STUCK = 75


#: One line per code, as in docs/reference/exit-codes.md.
DESCRIPTION: dict[ExitCode, str] = {
    ExitCode.OK: "The command did what was asked (an invoke committed; `charon run` stopped by Ctrl-C).",
    ExitCode.ABORTED: "The transaction aborted: the application raised, or the engine aborted it; its error type "
                      "and message go to stderr.",
    ExitCode.USAGE: "The command line is wrong: unknown option, bad value, ARGS_JSON not a JSON list, options "
                    "that conflict.",
    ExitCode.UNAVAILABLE: "The server or engine is unavailable or refused to serve: the gateway cannot be reached "
                          "or answers 5xx/429 or a refusal for now (a rescale running, paused: retry later), the port "
                          "is in use, the engine or its log cannot be opened, did not start, or failed for good.",
    ExitCode.REJECTED: "The gateway refused the request: unauthorized, unknown operator or function, bad "
                       "arguments, not found, conflicting request id; a SQL query that does not parse, analyse or fit "
                       "the sandbox; an epoch no longer retained; an operation the engine does not support.",
    ExitCode.APP_ERROR: "The application MODULE:APP cannot be loaded: its module raises while importing (a "
                        "SyntaxError, any exception), does not exist, or the attribute is not a charon Application.",
    ExitCode.FAILED: "The command ran and failed: a check did not hold (`charon demo`'s invariants, a seed of "
                     "`charon test-app`), no such data directory, or no such effect to retry or abandon.",
    ExitCode.INTERNAL: "An unexpected error inside charon (a bug): one line; the traceback with `--debug`.",
    ExitCode.STUCK: "`charon run` (durable inprocess) quarantined a function it could not interrupt and exited "
                    "for its supervisor to restart it (`--exit-when-stuck`; EX_TEMPFAIL).",
}


def exit_code_of(exc: BaseException) -> ExitCode:
    """The exit code of a command that failed with ``exc``, an error of the engine or the HTTP clients (or, not a
    :class:`~charon.errors.CharonError`, the gateway could not be reached): aborted, unavailable or rejected."""
    if isinstance(exc, TransactionAborted):
        return ExitCode.ABORTED
    status = getattr(exc, "status", None)  # a GatewayError of a 4xx refusal (403 Forbidden: a code ref not allowed)
    if isinstance(status, int) and 400 <= status < 500 and status not in (408, 409, 429):
        return ExitCode.REJECTED
    if isinstance(exc, (EngineUnavailable, LogUnavailable)) or (isinstance(exc, CharonError) and exc.retryable):
        return ExitCode.UNAVAILABLE  # availability: e.g. a rescale running, the engine paused (409)
    if isinstance(status, int) and (status >= 500 or status == 429):  # a GatewayError: 5xx after the retries, busy
        return ExitCode.UNAVAILABLE
    return ExitCode.REJECTED if isinstance(exc, CharonError) else ExitCode.UNAVAILABLE

"""The ``charon`` command line's exit codes: one table for every command (docs/reference/exit-codes.md)."""

from __future__ import annotations

from enum import IntEnum

__all__ = ["ExitCode", "DESCRIPTION"]


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
    ExitCode.OK: "The command did what was asked (an invoke committed; `charon run` stopped by Ctrl-C or SIGTERM).",
    ExitCode.ABORTED: "The transaction aborted: the application raised, or the engine aborted it; its error type "
                      "and message go to stderr.",
    ExitCode.USAGE: "The command line is wrong: unknown option, bad value, ARGS_JSON not a JSON list, options "
                    "that conflict.",
    ExitCode.UNAVAILABLE: "The server or engine is unavailable or refused to serve: the gateway cannot be reached "
                          "or answers 5xx/429, the port is in use, the engine or its log cannot be opened, did not "
                          "start, or failed for good.",
    ExitCode.REJECTED: "The gateway refused the request: unauthorized, unknown operator or function, bad "
                       "arguments, not found, conflicting request id; a SQL query that does not parse or analyse.",
    ExitCode.APP_ERROR: "The application MODULE:APP cannot be loaded: its module raises while importing (a "
                        "SyntaxError, any exception), does not exist, or the attribute is not a charon Application.",
    ExitCode.FAILED: "The command ran and failed: a check did not hold (`charon demo`'s invariants, a seed of "
                     "`charon test-app`), no such data directory, or no such effect to retry or abandon.",
    ExitCode.INTERNAL: "An unexpected error inside charon (a bug): one line; the traceback with `--debug`.",
    ExitCode.STUCK: "`charon run` (durable inprocess) quarantined a function it could not interrupt and exited "
                    "for its supervisor to restart it (`--exit-when-stuck`; EX_TEMPFAIL).",
}

"""How every ``charon`` command fails: one ``error: ...`` line on stderr and an
:class:`~charon.cli.exitcodes.ExitCode`."""

from __future__ import annotations

import logging

import typer
from rich.console import Console

from charon.cli.exitcodes import ExitCode, exit_code_of
from charon.errors import TransactionAborted

err_console = Console(stderr=True)


def fail(message: str, code: ExitCode) -> typer.Exit:
    """Print ``error: message`` on stderr, after the log lines queued before it; the :class:`typer.Exit` to raise
    with ``code``."""
    for handler in logging.getLogger("charon").handlers:  # the server log's writer thread (charon.server.logs)
        handler.flush()
    err_console.print("[bold red]error:[/] ", end="", soft_wrap=True)
    err_console.print(message, soft_wrap=True, markup=False, highlight=False)
    return typer.Exit(code)


def request_failed(exc: Exception, url: str) -> typer.Exit:
    """An HTTP call's failure as one line and its exit code (:func:`charon.cli.exitcodes.exit_code_of`)."""
    import httpx

    code = exit_code_of(exc)
    if isinstance(exc, TransactionAborted):
        return fail(f"transaction aborted: {exc.error_type}: {exc.message}", code)
    if isinstance(exc, httpx.HTTPError):
        return fail(f"cannot reach the gateway at {url}: {exc}", code)
    return fail(f"{type(exc).__name__}: {exc}", code)

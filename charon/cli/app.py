"""The ``charon`` Typer application: its global options (``--version``, ``--debug``), every command and command
group registered in the order ``charon --help`` lists them, ``charon bench``, and :func:`main`, the console
script."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import traceback

import typer

from charon.cli import ops
from charon.cli.demo import demo
from charon.cli.effects import effects_app
from charon.cli.exitcodes import ExitCode
from charon.cli.fail import fail as _fail
from charon.cli.harness import make_test_app
from charon.cli.limits import limits_app
from charon.cli.parts import DEBUG_ENV, debug, err_console, error_site, load_app
from charon.cli.promises import promises_app, schedules_app
from charon.cli.requests import requests_app
from charon.cli.run import run
from charon.cli.workflows import workflows_app

__all__ = ["app", "main", "package_version"]

app = typer.Typer(
    name="charon",
    help="Charon: transactional stateful functions on Apache Spark.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="markdown",  # docstrings' `code` renders as code, never as raw backticks
    pretty_exceptions_enable=False,  # main() turns an unexpected error into one line (--debug: the traceback)
)


def package_version() -> str:
    """The installed charon distribution's version."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("charon")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"charon {package_version()}")
        raise typer.Exit(ExitCode.OK)


@app.callback()
def _options(
    version: bool = typer.Option(False, "--version", "-V", callback=_show_version, is_eager=True,
                                 help="Print the installed charon version and exit."),
    debug: bool = typer.Option(False, "--debug", envvar=DEBUG_ENV,
                               help="Show the full traceback of an error (default: one line)."),
) -> None:
    if debug:
        os.environ[DEBUG_ENV] = "1"  # read by debug(); inherited by a re-executed `charon run`


app.command()(run)
app.add_typer(effects_app, name="effects")
app.add_typer(limits_app, name="limits")  # charon limits show|set|clear|remove (admission control)
app.add_typer(requests_app, name="requests")  # charon requests list|show (the invocation inspector)
app.add_typer(promises_app, name="promises")  # durable promises (issue 34)
app.add_typer(schedules_app, name="schedules")
app.add_typer(workflows_app, name="workflows")  # workflows, their version drain and migration (issue 34 item 4)
app.command()(ops.invoke)
app.command()(ops.state)
app.command()(ops.status)
app.command("dead-letters")(ops.dead_letters)
app.command()(ops.pause)
app.command()(ops.resume)
app.command()(ops.rescale)
app.command("read")(ops.read_state)
app.command()(ops.update)
app.command()(ops.deploy)
app.command()(ops.metrics)
app.command()(ops.sql)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def bench(ctx: typer.Context) -> None:
    """Run the benchmark suite (``charon.bench``); extra arguments are passed to it."""
    if importlib.util.find_spec("charon.bench") is None:
        raise _fail("the benchmark suite (charon.bench) is not part of this installation", ExitCode.FAILED)
    module = importlib.import_module("charon.bench")
    entry = getattr(module, "main", None) or getattr(module, "app", None)
    if entry is None:
        raise _fail("charon.bench has no `main` or `app` entry point", ExitCode.FAILED)
    result = entry(list(ctx.args))
    if isinstance(result, int) and result:
        raise typer.Exit(result)


app.command()(demo)
app.command("test-app")(make_test_app(load_app))  # the fault harness's command: charon.cli.harness


def main() -> None:
    """Entry point of the ``charon`` console script: an unexpected error is one line and exit code ``INTERNAL``
    (its traceback with ``--debug``); every other outcome is a code of :class:`ExitCode`."""
    _pin_hash_seed()
    try:
        app()
    except Exception as exc:  # noqa: BLE001 - the last resort: never a bare traceback unless asked for
        if debug():
            err_console.print("".join(traceback.format_exception(exc)), markup=False, highlight=False)
        where = error_site(exc)
        at = "" if where is None else f" (at {where[0]}:{where[1]})"
        hint = "" if debug() else f"; run `charon --debug ...` or set {DEBUG_ENV}=1 for the traceback"
        raise SystemExit(_fail(f"unexpected {type(exc).__name__}: {exc}{at}{hint}", ExitCode.INTERNAL).exit_code) \
            from None


def _pin_hash_seed() -> None:
    """``charon run`` re-executes itself with ``PYTHONHASHSEED=0`` when the variable is unset or ``random``:
    functions iterating a set of strings then see the same order in every run of the process, so a restart
    that replays logged epochs reproduces the replies already sent (a fixed value the user set is kept)."""
    command = next((a for a in sys.argv[1:] if not a.startswith("-")), None)  # after global options (--debug)
    if command in ("run", "test-app") and os.environ.get("PYTHONHASHSEED", "random") in ("", "random"):
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])

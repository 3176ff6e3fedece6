"""What the CLI's command modules share: the consoles, the application loader (one-line import errors), the
engine builder (settings errors as the command line's), JSON output and the ``--url``/``--token`` options."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import traceback
from typing import Any

import msgspec
import typer
from rich.console import Console

from charon.cli.exitcodes import ExitCode
from charon.cli.fail import fail as _fail
from charon.cli.fail import request_failed
from charon.errors import CharonError
from charon.operator import Application
from charon.runtime.contract import Engine
from charon.runtime.factory import EngineSpec

__all__ = ["console", "err_console", "DEFAULT_URL", "DEBUG_ENV", "UrlOpt", "TokenOpt", "JsonOpt",
           "call_gateway", "load_app", "make_engine",
           "spark_available", "print_json", "app_error", "error_site", "debug"]

console = Console()
err_console = Console(stderr=True)

DEFAULT_URL = "http://127.0.0.1:8000"
DEBUG_ENV = "CHARON_DEBUG"


def debug() -> bool:
    """Whether ``--debug`` (or ``CHARON_DEBUG``) asks for full tracebacks."""
    return os.environ.get(DEBUG_ENV, "").lower() not in ("", "0", "false", "no")


def load_app(target: str) -> Application:
    """Import ``module:attribute`` (attribute defaults to ``app``) and return the Application.

    A module that cannot be imported, or raises while importing, is one line naming the file, line and the
    offending source line (exit code ``APP_ERROR``); ``--debug`` prints the traceback too."""
    module_name, _, attr = target.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module_name.startswith(exc.name):  # the target itself is missing
            raise _fail(f"cannot import {module_name!r}: {exc}", ExitCode.APP_ERROR) from None
        raise app_error(f"importing {module_name!r} failed", exc) from None
    except Exception as exc:  # noqa: BLE001 - anything the user's module raises while importing
        raise app_error(f"importing {module_name!r} failed", exc) from None
    obj: object = module
    for part in (attr or "app").split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise _fail(f"{module_name!r} has no attribute {attr or 'app'!r}", ExitCode.APP_ERROR)
    if callable(obj) and not hasattr(obj, "validate"):
        try:
            obj = obj()  # an application factory
        except Exception as exc:  # noqa: BLE001 - the user's factory failed
            raise app_error(f"the application factory {target!r} failed", exc) from None
    if not isinstance(obj, Application):
        raise _fail(f"{target!r} is not a charon Application", ExitCode.APP_ERROR)
    return obj


def error_site(exc: BaseException) -> tuple[str, int, str] | None:
    """Where ``exc`` points in the user's code: (file, line, source line). A SyntaxError's own position;
    otherwise the innermost frame outside the standard library, installed packages and charon itself."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return exc.filename, exc.lineno or 0, (exc.text or "").strip()
    import sysconfig

    skip = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
                 | {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))})  # charon/, not charon/cli/
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<")]
    mine = [f for f in frames if not os.path.abspath(f.filename).startswith(skip)]
    if not (mine or frames):
        return None
    frame = (mine or frames)[-1]
    return frame.filename, frame.lineno or 0, (frame.line or "").strip()


def app_error(what: str, exc: BaseException) -> typer.Exit:
    """One clean line for an exception raised by the user's code (the traceback only with ``--debug``)."""
    if debug():
        err_console.print("".join(traceback.format_exception(exc)), markup=False, highlight=False)
    msg = exc.msg if isinstance(exc, SyntaxError) else str(exc)
    where = error_site(exc)
    loc = "" if where is None else f"\n  {os.path.relpath(where[0]) if not where[0].startswith('..') else where[0]}" \
        f":{where[1]}" + (f": {where[2]}" if where[2] else "")
    hint = "" if debug() else f"\n  (run `charon --debug ...` or set {DEBUG_ENV}=1 for the traceback)"
    return _fail(f"{what}: {type(exc).__name__}: {msg}{loc}{hint}", ExitCode.APP_ERROR)


def spark_available() -> bool:
    """Whether the Spark runtime module is part of this installation."""
    try:
        return importlib.util.find_spec("charon.runtime.spark.runtime") is not None
    except ImportError:
        return False


def make_engine(spec: EngineSpec) -> Engine:
    """Build (not start) the engine ``spec`` describes (:func:`charon.runtime.factory.make_engine`); its settings
    errors as the command line's (``BadParameter``), failures to open it as one line and exit code ``UNAVAILABLE``."""
    from charon.runtime.factory import EngineOpenFailed, EngineSpecError
    from charon.runtime.factory import make_engine as build

    try:
        return build(spec)
    except EngineSpecError as exc:
        raise typer.BadParameter(str(exc)) from None
    except EngineOpenFailed as exc:
        raise _fail(str(exc), ExitCode.UNAVAILABLE) from None


def print_json(value: object) -> None:
    try:
        typer.echo(msgspec.json.encode(value).decode())
    except (TypeError, ValueError, RecursionError, msgspec.EncodeError) as exc:
        raise _fail(f"the value cannot be shown as JSON: {exc}", ExitCode.FAILED) from None


UrlOpt = typer.Option(DEFAULT_URL, "--url", envvar="CHARON_URL", help="Gateway URL.")
TokenOpt = typer.Option(None, "--token", envvar="CHARON_TOKEN", help="Bearer token.")
JsonOpt = typer.Option(False, "--json", help="The JSON document instead of a table.")


def call_gateway(url: str, token: str | None, what: str, *args: object, timeout: float = 30.0,
                 **kw: object) -> Any:
    """``Client(url).what(*args, **kw)``, its failure the command's typed exit (:func:`request_failed`)."""
    import httpx

    from charon.client import Client

    with Client(url, token=token, timeout=timeout, retries=2) as client:
        try:
            return getattr(client, what)(*args, **kw)
        except (CharonError, httpx.HTTPError) as exc:
            raise request_failed(exc, url) from None

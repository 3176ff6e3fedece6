"""The ``charon`` command line: run an application behind its gateway, invoke functions, read state, demo.

``charon demo`` is the quickest tour: it deploys the YCSB-T bank (``charon.apps.ycsb``) on embedded Spark
(or the in-process runtime where the Spark runtime is unavailable), drives transfers through the HTTP
gateway with a live progress display, then checks that the total balance is conserved and that every
request was answered exactly once (retrying a sample of request ids returns the same transaction).

``--url`` and ``--token`` default to the ``CHARON_URL`` and ``CHARON_TOKEN`` environment variables. Every command
exits with a code of :class:`charon.exitcodes.ExitCode` (docs/reference/exit-codes.md); an error is one line on
stderr, its traceback only with ``charon --debug`` (or ``CHARON_DEBUG=1``).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import inspect
import json
import logging
import os
import random
import secrets
import shutil
import statistics
import sys
import time
import traceback
from collections import Counter
from collections.abc import Iterator
from typing import Any

import msgspec
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from charon.bench.harness import percentile
from charon.clifail import fail as _fail
from charon.clifail import request_failed as _request_failed
from charon.config import DURABLE_REPLY_RETENTION, VOLATILE_REPLY_RETENTION
from charon.errors import CharonError, EngineUnavailable, LogUnavailable, TransactionAborted
from charon.exitcodes import ExitCode
from charon.requests_cli import requests_app
from charon.runtime.contract import Engine
from charon.runtime.factory import EngineSpec

app = typer.Typer(
    name="charon",
    help="Charon: transactional stateful functions on Apache Spark.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="markdown",  # docstrings' `code` renders as code, never as raw backticks
    pretty_exceptions_enable=False,  # main() turns an unexpected error into one line (--debug: the traceback)
)
console = Console()
err_console = Console(stderr=True)

DEFAULT_URL = "http://127.0.0.1:8000"
DEBUG_ENV = "CHARON_DEBUG"


def _debug() -> bool:
    """Whether ``--debug`` (or ``CHARON_DEBUG``) asks for full tracebacks."""
    return os.environ.get(DEBUG_ENV, "").lower() not in ("", "0", "false", "no")


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
        os.environ[DEBUG_ENV] = "1"  # read by _debug(); inherited by a re-executed `charon run`


# --------------------------------------------------------------------------------------------------
# helpers


def load_app(target: str) -> Any:
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
        raise _app_error(f"importing {module_name!r} failed", exc) from None
    except Exception as exc:  # noqa: BLE001 - anything the user's module raises while importing
        raise _app_error(f"importing {module_name!r} failed", exc) from None
    obj: object = module
    for part in (attr or "app").split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise _fail(f"{module_name!r} has no attribute {attr or 'app'!r}", ExitCode.APP_ERROR)
    if callable(obj) and not hasattr(obj, "validate"):
        try:
            obj = obj()  # an application factory
        except Exception as exc:  # noqa: BLE001 - the user's factory failed
            raise _app_error(f"the application factory {target!r} failed", exc) from None
    if not hasattr(obj, "validate"):
        raise _fail(f"{target!r} is not a charon Application", ExitCode.APP_ERROR)
    return obj


def _where(exc: BaseException) -> tuple[str, int, str] | None:
    """Where ``exc`` points in the user's code: (file, line, source line). A SyntaxError's own position;
    otherwise the innermost frame outside the standard library, installed packages and charon itself."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return exc.filename, exc.lineno or 0, (exc.text or "").strip()
    import sysconfig

    skip = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
                 | {os.path.dirname(os.path.abspath(__file__))})
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<")]
    mine = [f for f in frames if not os.path.abspath(f.filename).startswith(skip)]
    if not (mine or frames):
        return None
    frame = (mine or frames)[-1]
    return frame.filename, frame.lineno or 0, (frame.line or "").strip()


def _app_error(what: str, exc: BaseException) -> typer.Exit:
    """One clean line for an exception raised by the user's code (the traceback only with ``--debug``)."""
    if _debug():
        err_console.print("".join(traceback.format_exception(exc)), markup=False, highlight=False)
    msg = exc.msg if isinstance(exc, SyntaxError) else str(exc)
    where = _where(exc)
    loc = "" if where is None else f"\n  {os.path.relpath(where[0]) if not where[0].startswith('..') else where[0]}" \
        f":{where[1]}" + (f": {where[2]}" if where[2] else "")
    hint = "" if _debug() else f"\n  (run `charon --debug ...` or set {DEBUG_ENV}=1 for the traceback)"
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


async def _maybe_await(value: Any) -> Any:
    if inspect.isawaitable(value):
        return await value
    return value


def _print_json(value: Any) -> None:
    try:
        typer.echo(msgspec.json.encode(value).decode())
    except (TypeError, ValueError, RecursionError, msgspec.EncodeError) as exc:
        raise _fail(f"the value cannot be shown as JSON: {exc}", ExitCode.FAILED) from None


def _client(url: str, token: str | None) -> Any:
    from charon.client import Client

    return Client(url, token=token, timeout=30.0, retries=2)


UrlOpt = typer.Option(DEFAULT_URL, "--url", envvar="CHARON_URL", help="Gateway URL.")
TokenOpt = typer.Option(None, "--token", envvar="CHARON_TOKEN", help="Bearer token.")


# --------------------------------------------------------------------------------------------------
# commands


@app.command()
def run(
    target: str = typer.Argument(..., metavar="MODULE:APP", help="The Application to deploy."),
    engine: str = typer.Option("inprocess", help="inprocess, spark, or remote (a gateway only: the engine "
                               "runs elsewhere on the same --log)."),
    host: str = typer.Option("127.0.0.1", envvar="CHARON_HOST", help="Interface to listen on."),
    port: int = typer.Option(8000, envvar="CHARON_PORT", help="TCP port."),
    token: str | None = typer.Option(None, envvar="CHARON_TOKEN", help="Bearer token clients must send."),
    partitions: int | None = typer.Option(
        None, min=1, envvar="CHARON_PARTITIONS", show_default=False,
        help="Engine partitions (default: the data directory's recorded count, else 4; another count rescales it).",
    ),
    max_body: int | None = typer.Option(
        None, min=1, envvar="CHARON_GATEWAY_MAX_BODY", help="Largest request body in bytes (default 1 MiB).",
        show_default=False,
    ),
    data_dir: str | None = typer.Option(
        None, envvar="CHARON_DATA_DIR", help="Logs, durable state and checkpoints (default ./charon-data)."
    ),
    ephemeral: bool = typer.Option(
        False, "--ephemeral", help="inprocess: keep everything in memory (lost when the process stops)."
    ),
    reply_retention: int | None = typer.Option(
        None, min=1, envvar="CHARON_GATEWAY_RECENT_REPLIES",
        help=f"Replies kept in memory for retries by the runtime and the gateway (default: "
        f"{DURABLE_REPLY_RETENTION:,} on a durable engine, older ones come from the output log; "
        f"{VOLATILE_REPLY_RETENTION:,} with --ephemeral).",
    ),
    fsync: bool = typer.Option(
        True, "--fsync/--no-fsync",
        help="inprocess: fsync each epoch's input before it runs (acknowledged replies survive power loss); "
        "--no-fsync survives a killed process but not an OS crash, for lower latency.",
    ),
    log: str | None = typer.Option(
        None, "--log", envvar="CHARON_LOG_URL", help="Put the input and output logs on NATS JetStream, e.g. "
        "nats://127.0.0.1:4222/mydeployment (default: SQLite files in the data directory).",
    ),
    log_partitions: int | None = typer.Option(
        None, "--log-partitions", min=1, show_default=False,
        help="spark: input-log partitions (default: CHARON_LOG_PARTITIONS, else the log's recorded count, else "
        "--partitions; another count resizes the log, no pause).",
    ),
    function_timeout: float | None = typer.Option(
        None, "--function-timeout", min=0.001, envvar="CHARON_FUNCTION_TIMEOUT", show_default=False,
        help="Seconds a function may run without awaiting a call before its transaction aborts with "
        "InvocationTimeout (default 5; per function: @op.function(timeout=...)).",
    ),
    exit_when_stuck: float = typer.Option(
        30.0, "--exit-when-stuck", min=0.0, envvar="CHARON_EXIT_WHEN_STUCK",
        help="durable inprocess: seconds past its budget after which a function blocked where it cannot be "
        "interrupted is quarantined and the process exits (code 75) for its supervisor to restart it.",
    ),
    check_determinism: bool = typer.Option(
        False, "--check-determinism", envvar="CHARON_DETERMINISM_CHECK",
        help="Run every function twice on the same inputs and abort its transaction with NonDeterministicFunction "
        "when the two runs' effects differ (a development aid: about twice the functions' CPU).",
    ),
    inspector: bool = typer.Option(
        True, "--inspector/--no-inspector", envvar="CHARON_INSPECTOR",
        help="Keep each request's timings, reply, call graph and traceback for `charon requests` and "
        "GET /admin/requests (in memory; a restart starts empty). Aborts are logged either way.",
    ),
    inspector_records: int = typer.Option(
        10_000, "--inspector-records", min=1, envvar="CHARON_INSPECTOR_RECORDS",
        help="Requests the inspector keeps (the oldest go first).",
    ),
    inspector_bytes: int = typer.Option(
        32 << 20, "--inspector-bytes", min=1, envvar="CHARON_INSPECTOR_BYTES",
        help="Bytes of requests the inspector keeps (replies, tracebacks, call graphs; the oldest go first).",
    ),
    effects: bool = typer.Option(
        False, "--effects", envvar="CHARON_EFFECTS",
        help="Run the application's effects (ctx.effect) in this process, beside the engine (instead of separate "
        "`charon effects work` processes; never both).",
    ),
    effects_concurrency: int = typer.Option(
        16, "--effects-concurrency", min=1, envvar="CHARON_EFFECTS_CONCURRENCY", help="Effects run at once.",
    ),
    effects_max_bytes: int = typer.Option(
        16 << 20, "--effects-max-bytes", min=1, envvar="CHARON_EFFECTS_MAX_BYTES",
        help="Bytes of effect requests in flight at most.",
    ),
    park_failed: bool = typer.Option(
        False, "--park-failed", envvar="CHARON_EFFECTS_PARK_FAILED",
        help="Keep an effect whose attempts ran out as failed for an operator (retry/abandon) instead of resuming "
        "its continuation with the failure.",
    ),
    log_format: str = typer.Option(
        "text", "--log-format", envvar="CHARON_LOG_FORMAT", help="Server log lines on stderr: text or json.",
    ),
    log_level: str = typer.Option(
        "info", "--log-level", envvar="CHARON_LOG_LEVEL", help="debug, info, warning, error or critical.",
    ),
    otel_endpoint: str | None = typer.Option(
        None, "--otel-endpoint", envvar="CHARON_GATEWAY_OTEL_ENDPOINT", show_default=False,
        help="Export OpenTelemetry traces over OTLP/HTTP to this URL (e.g. http://127.0.0.1:4318; default: off, "
        "or the standard OTEL_EXPORTER_OTLP_ENDPOINT).",
    ),
) -> None:
    """Start the runtime for MODULE:APP and serve its HTTP gateway until interrupted.

    Prints `charon: starting ...` at once, then one line `charon: ready — ...` once the node accepts work (the
    same on every engine; Spark's takes ~20-40 s)."""
    from charon.config import GatewayConfig
    from charon.server.logs import setup_logging
    from charon.server.serve import PortUnavailable, RuntimeFailed, RuntimeStartError, bind_socket, serve

    try:
        setup_logging(log_level, log_format)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    server_log = logging.getLogger("charon.server")

    def say(message: str, level: int = logging.INFO, **fields: object) -> None:
        """A line for people: as it always was in text, a JSON log line with ``fields`` in JSON."""
        if log_format == "json":
            server_log.log(level, message.removeprefix("charon: "), extra=fields)
        elif level >= logging.WARNING:
            err_console.print(f"[yellow]warning:[/] {message}", soft_wrap=True)
        else:
            err_console.print(message, soft_wrap=True)

    if effects and engine == "remote":
        raise typer.BadParameter("--effects runs beside the engine (its output streams): not with --engine remote "
                                 "(run `charon effects work` next to the engine's data directory)")
    application = load_app(target)
    try:  # the port first: a busy port is one line before anything else is created or printed
        listener = bind_socket(host, port)
    except PortUnavailable as exc:
        raise _fail(str(exc), ExitCode.UNAVAILABLE) from None
    # A function running pure-Python code past its budget holds the GIL until the watchdog stops it: the gateway's
    # threads get it back within this interval (default 5 ms; each request needs several hand-overs).
    sys.setswitchinterval(float(os.environ.get("CHARON_SWITCH_INTERVAL", "0.0005")))
    try:
        runtime = make_engine(EngineSpec(
            engine, target, partitions, data_dir, ephemeral=ephemeral, fsync=fsync, reply_retention=reply_retention,
            log_url=log, log_partitions=log_partitions, function_timeout=function_timeout,
            exit_when_stuck=exit_when_stuck, determinism_check=check_determinism, inspector=inspector,
            inspector_records=inspector_records, inspector_bytes=inspector_bytes))
    except BaseException:
        listener.close()
        raise
    if token is None:
        say("no --token: the gateway accepts unauthenticated requests", logging.WARNING, event="no_token")
    replayed = runtime.replayed_epochs
    base = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else f'[{host}]' if ':' in host else host}:{port}"
    name = application.name if log_format == "json" else f"[bold]{application.name}[/]"
    say(
        f"charon: starting {name} "
        f"({runtime.kind}{'' if runtime.controls is None else f', {runtime.partitions} partitions'}; "
        f"{runtime.describe()}"
        f"{'; logs on ' + log if log else ''}"
        f"{'; determinism check: every function runs twice' if check_determinism else ''}) on http://{host}:{port}"
        + (f"; recovered by replaying {replayed} epochs" if replayed else "")
        + ("; Spark starts in ~20 s: /health answers 503 starting until then, invokes are logged and wait"
           if runtime.slow_start else ""),
        event="start", app=application.name, engine=runtime.kind, partitions=runtime.partitions,
        url=f"http://{host}:{port}", replayed_epochs=replayed, pid=os.getpid(),
    )

    def ready() -> None:
        line = ready_line(application.name, runtime.kind, base)
        if log_format == "json":  # the gateway logged "ready" when the engine started; this is /health's 200
            server_log.info(line.removeprefix("charon: "), extra={"event": "accepting", "url": base})
        else:
            err_console.print(line, soft_wrap=True, markup=False, highlight=False)
    if runtime.log_file is not None:
        say(f"charon: Spark log: {runtime.log_file}", event="spark_log", path=str(runtime.log_file))
    try:
        recent = reply_retention or (DURABLE_REPLY_RETENTION if runtime.durable else VOLATILE_REPLY_RETENTION)
        executor = None
        if effects:
            from charon.runtime.effects import EffectExecutor, engine_resume

            eng = runtime
            executor = EffectExecutor(lambda: eng.app, lambda: eng.streams, engine_resume(eng.submit),
                                      concurrency=effects_concurrency, max_inflight_bytes=effects_max_bytes,
                                      park_failed=park_failed)
        config = GatewayConfig.from_env(otel_endpoint=otel_endpoint)
        try:
            serve(runtime, host, port, token, max_body=max_body, recent_replies=recent, effects=executor,
                  sock=listener, on_ready=ready, config=config, own_logging=True)
        except RuntimeStartError as exc:
            raise _fail(f"the {runtime.kind} runtime did not start: {exc}", ExitCode.UNAVAILABLE) from None
        except RuntimeFailed as exc:  # one line, non-zero: a process supervisor restarts it
            raise _fail(f"the {runtime.kind} runtime failed and cannot recover: {exc}", ExitCode.UNAVAILABLE) from None
    finally:
        runtime.close()


def ready_line(app_name: str, engine: str, base_url: str) -> str:
    """The one line `charon run` prints once the node accepts work, the same on every engine."""
    return f"charon: ready — {app_name} engine={engine} {base_url} (dashboard {base_url}/dashboard)"


effects_app = typer.Typer(help="Durable effects: run them in worker processes, list them, retry or abandon one.",
                          no_args_is_help=True)
app.add_typer(effects_app, name="effects")
app.add_typer(requests_app, name="requests")  # charon requests list|show (the invocation inspector)
DataDirOpt = typer.Option("charon-data", "--data-dir", envvar="CHARON_DATA_DIR",
                          help="The engine's data directory (its streams.sqlite; effects.sqlite is kept there).")


def _effect_store(data_dir: str) -> Any:
    from charon.runtime.effects import EFFECTS_FILE, EffectStore

    path = os.path.join(data_dir, EFFECTS_FILE)
    if not os.path.exists(path):
        raise _fail(f"no effects recorded in {data_dir} (no {EFFECTS_FILE})", ExitCode.FAILED)
    return EffectStore(path)


@effects_app.command("work")
def effects_work(
    target: str = typer.Argument(..., metavar="MODULE:APP", help="The Application (its effect handlers)."),
    url: str = UrlOpt,
    token: str | None = TokenOpt,
    data_dir: str = DataDirOpt,
    index: int = typer.Option(0, "--index", min=0, help="This worker's number, 0 .. --workers - 1."),
    workers: int = typer.Option(1, "--workers", min=1, help="How many workers share the effects (all the same)."),
    concurrency: int = typer.Option(16, "--concurrency", min=1, help="Effects run at once."),
    max_bytes: int = typer.Option(16 << 20, "--max-bytes", min=1, help="Bytes of effect requests in flight."),
    park_failed: bool = typer.Option(False, "--park-failed", help="Park exhausted effects for an operator."),
    backoff: float = typer.Option(0.2, "--backoff", min=0.001, help="First retry's delay in seconds (doubles)."),
    metrics_port: int | None = typer.Option(None, "--metrics-port", min=1, max=65535,
                                            help="Serve this worker's Prometheus metrics on 127.0.0.1:PORT/metrics."),
) -> None:
    """Run the effects of worker INDEX of WORKERS (by crc32 of the effect id): handlers here, continuations
    submitted to the gateway at --url with the effect's Idempotency-Key."""
    from charon.log.streams import StreamLog
    from charon.runtime.effects import EffectExecutor

    application = load_app(target)
    if index >= workers:
        raise typer.BadParameter(f"--index must be below --workers ({workers})")
    path = os.path.join(data_dir, "streams.sqlite")
    if not os.path.exists(path):
        raise _fail(f"no output streams in {data_dir} (no streams.sqlite): is it the engine's data directory?",
                    ExitCode.FAILED)

    async def main() -> None:
        from charon.client import AsyncClient, GatewayError

        async with AsyncClient(url, token=token, timeout=60.0, retries=2) as client:
            async def resume(op: str, key: str, fn: str, args: list[Any], rid: str) -> tuple[bool, str]:
                try:
                    await client.invoke_result(op, key, fn, *args, request_id=rid)
                except (EngineUnavailable, LogUnavailable):
                    raise  # the engine is away: the executor submits the same id again later
                except GatewayError as exc:
                    if exc.status >= 500 or exc.status == 429:
                        raise
                    return False, str(exc)
                except CharonError as exc:  # the continuation aborted, or was refused for good
                    return False, f"{getattr(exc, 'error_type', type(exc).__name__)}: {exc}"
                return True, ""

            ex = EffectExecutor(application, StreamLog(path, durable=False), resume, index=index, workers=workers,
                                concurrency=concurrency, max_inflight_bytes=max_bytes, park_failed=park_failed,
                                backoff_s=backoff, poll_s=0.01)  # the engine's appends are in another process
            await ex.start()
            server = None
            if metrics_port is not None:
                import uvicorn
                from starlette.applications import Starlette
                from starlette.responses import PlainTextResponse
                from starlette.routing import Route

                async def metrics(_: Any) -> PlainTextResponse:
                    return PlainTextResponse(await asyncio.to_thread(ex.prometheus),
                                             media_type="text/plain; version=0.0.4")

                server = uvicorn.Server(uvicorn.Config(Starlette(routes=[Route("/metrics", metrics)]),
                                                       host="127.0.0.1", port=metrics_port, log_level="warning"))
            err_console.print(f"charon: effects worker {index}/{workers} of {application.name} on {data_dir}"
                              + (f"; metrics on http://127.0.0.1:{metrics_port}/metrics" if server else ""),
                              soft_wrap=True)
            try:
                await (server.serve() if server is not None else asyncio.Event().wait())
            finally:
                await ex.stop()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())


@effects_app.command("list")
def effects_list(
    data_dir: str = DataDirOpt,
    status: str | None = typer.Option(None, "--status", help="pending, running, resuming, failed or done."),
    limit: int = typer.Option(100, "--limit", min=1),
    as_json: bool = typer.Option(False, "--json", help="JSON lines instead of a table."),
) -> None:
    """Effects with their status, attempts and last error (newest first), and the counts per status."""
    store = _effect_store(data_dir)
    rows = store.list(status, limit)
    if as_json:
        _print_json({"counts": store.counts(), "effects": [msgspec.to_builtins(r) for r in rows]})
        return
    table = Table("id", "handler", "status", "attempts", "outcome", "last error")
    for r in rows:
        table.add_row(r.id, r.handler, r.status, f"{r.attempts}/{r.max_attempts}", r.outcome, r.last_error[:80])
    console.print(table)
    console.print(" ".join(f"{k}={v}" for k, v in store.counts().items()))


@effects_app.command("retry")
def effects_retry(effect_id: str = typer.Argument(...), data_dir: str = DataDirOpt) -> None:
    """Give a parked (failed) effect a new round of attempts."""
    if not _effect_store(data_dir).retry(effect_id):
        raise _fail(f"effect {effect_id!r} is not parked", ExitCode.FAILED)
    typer.echo(f"retrying {effect_id}")


@effects_app.command("abandon")
def effects_abandon(effect_id: str = typer.Argument(...), data_dir: str = DataDirOpt) -> None:
    """Stop trying a parked or pending effect: its continuation runs with an EffectAbandoned failure."""
    if not _effect_store(data_dir).abandon(effect_id):
        raise _fail(f"effect {effect_id!r} is not parked or pending", ExitCode.FAILED)
    typer.echo(f"abandoned {effect_id}")


@app.command()
def invoke(
    operator: str = typer.Argument(..., help="Operator name."),
    key: str = typer.Argument(..., help="Entity key."),
    function: str = typer.Argument(..., help="Function name."),
    args_json: str = typer.Argument("[]", metavar="ARGS_JSON", help="JSON list of positional arguments."),
    url: str = UrlOpt,
    token: str | None = TokenOpt,
    request_id: str | None = typer.Option(None, "--request-id", help="Idempotency key."),
) -> None:
    """Invoke FUNCTION(*ARGS_JSON) on entity KEY of OPERATOR as one transaction; print the value as JSON.

    Example: `charon invoke account alice deposit '[100]'`.

    Exit status: 0 committed, 1 aborted (the error type and message go to stderr), 3 the gateway or engine is
    unavailable, 4 the request was rejected (see docs/reference/exit-codes.md).
    """
    try:
        args = json.loads(args_json)
    except json.JSONDecodeError as exc:
        raise _fail(f"ARGS_JSON is not valid JSON: {exc}", ExitCode.USAGE) from None
    if not isinstance(args, list):
        raise _fail("ARGS_JSON must be a JSON list, e.g. '[\"bob\", 10]'", ExitCode.USAGE)
    value = _admin(url, token, lambda c: c.invoke(operator, key, function, *args, request_id=request_id))
    _print_json(value)


@app.command()
def state(
    operator: str = typer.Argument(..., help="Operator name."),
    key: str = typer.Argument(..., help="Entity key."),
    url: str = UrlOpt,
    token: str | None = TokenOpt,
) -> None:
    """Print the committed state of OPERATOR/KEY as JSON (an admin read)."""
    _print_json(_admin(url, token, lambda c: c.state(operator, key)))


def _admin(url: str, token: str | None, call: Any) -> Any:
    """``call(client)`` on a client of the gateway at ``url``; a failure as one line and its exit code."""
    import httpx

    with _client(url, token) as client:
        try:
            return call(client)
        except (CharonError, httpx.HTTPError) as exc:
            raise _request_failed(exc, url) from None


@app.command()
def status(url: str = UrlOpt, token: str | None = TokenOpt) -> None:
    """Print the runtime's control status (running/pausing/paused, last committed epoch, backlog, partitions;
    on Spark the input log's ``log_partitions``: routing count and physical count) as JSON."""
    _print_json(_admin(url, token, lambda c: c.status()))


@app.command("dead-letters")
def dead_letters(url: str = UrlOpt, token: str | None = TokenOpt,
                 limit: int = typer.Option(100, min=1, max=10_000, help="How many, newest first.")) -> None:
    """List the transactions the engine set aside (timed out past their budget, or quarantined after stopping
    the engine), newest first, as JSON: request id, function, key, error, epoch."""
    _print_json(_admin(url, token, lambda c: c.dead_letters(limit)))


@app.command()
def pause(
    after_epoch: int | None = typer.Option(None, "--after-epoch", min=-1, help="Pause once this epoch is done."),
    wait: bool = typer.Option(True, help="Wait until no epoch runs any more."),
    url: str = UrlOpt,
    token: str | None = TokenOpt,
) -> None:
    """Start no new epoch (requests keep being accepted and wait); prints the status."""

    def go(c: Any) -> Any:
        st = c.pause(after_epoch)
        deadline = time.monotonic() + 60
        while wait and after_epoch is None and st["state"] != "paused" and time.monotonic() < deadline:
            time.sleep(0.05)
            st = c.status()
        return st

    _print_json(_admin(url, token, go))


@app.command()
def resume(url: str = UrlOpt, token: str | None = TokenOpt) -> None:
    """Let epochs start again (waiting requests run in arrival order); prints the status."""
    _print_json(_admin(url, token, lambda c: c.resume()))


@app.command()
def rescale(
    partitions: int | None = typer.Argument(None, min=1, help="The new number of engine partitions."),
    log_partitions: int | None = typer.Option(
        None, "--log-partitions", min=1, help="The new number of input-log partitions (Spark; no pause)."),
    url: str = UrlOpt,
    token: str | None = TokenOpt,
) -> None:
    """Change the running deployment's engine partition count at an epoch boundary and/or its input log's
    partition count; prints the measured pause (from, to, epoch, keys, wait_s, pause_s, cpu_s, log), or only
    ``{"log": ...}`` when only the log was resized."""
    if partitions is None and log_partitions is None:
        raise typer.BadParameter("give PARTITIONS, --log-partitions or both")
    _print_json(_admin(url, token, lambda c: c.rescale(partitions, log_partitions=log_partitions)))


@app.command("read")
def read_state(
    operator: str = typer.Argument(..., help="Operator name."),
    keys: list[str] = typer.Argument(None, help="Entity keys (default: every entity, up to --limit)."),
    epoch: int | None = typer.Option(None, help="An earlier epoch still retained (default: the latest)."),
    limit: int | None = typer.Option(None, min=1, help="Most entities to return (a page; at most max_scan)."),
    after: str | None = typer.Option(None, help="Page on: the entities whose key sorts after this one (the "
                                     "previous page's next; give its --epoch too for the same cut)."),
    prefix: str | None = typer.Option(None, help="Only the entities whose key starts with this."),
    internal: bool = typer.Option(False, "--internal", help="Also show the engine's internal items (the "
                                  "entities' pending timers), hidden by default."),
    url: str = UrlOpt,
    token: str | None = TokenOpt,
) -> None:
    """Print OPERATOR's entities as of one committed epoch (one consistent cut) as JSON, with that epoch and
    ``next``, the --after of the following page (null on the last)."""
    cut = _admin(url, token, lambda c: c.read_state(operator, keys or None, epoch=epoch, limit=limit, after=after,
                                                    prefix=prefix))
    _print_json(cut if internal else hide_internal(cut))


def hide_internal(cut: dict[str, object]) -> dict[str, object]:
    """``cut`` (an admin read) without the engine's internal items (timers, stored beside an entity's items
    under :data:`charon.core.timers.ITEM_PREFIX`); an entity that had nothing else is left out."""
    from charon.core.timers import ITEM_PREFIX

    items: dict[str, dict[str, object]] = {}
    hidden: set[str] = set()
    raw_items, raw_entities = cut.get("items"), cut.get("entities")
    all_items = raw_items if isinstance(raw_items, dict) else {}
    all_entities = raw_entities if isinstance(raw_entities, dict) else {}
    for key, its in all_items.items():
        mine = {name: v for name, v in its.items() if not name.startswith(ITEM_PREFIX)}
        if mine:
            items[key] = mine
        if len(mine) < len(its):
            hidden.add(key)
    entities = {k: v for k, v in all_entities.items()
                if not (k in hidden and v is None and k not in items)}
    return {**cut, "entities": entities, "items": items, "count": len(entities)}


@app.command()
def update(
    update_id: str = typer.Argument(..., metavar="ID", help="Update id: an id runs once."),
    operator: str = typer.Argument(..., help="Operator name."),
    function: str = typer.Argument(..., help="A function of the deployed application."),
    args_json: str = typer.Argument("[]", metavar="ARGS_JSON", help="JSON list of positional arguments."),
    keys: list[str] = typer.Option(None, "--key", help="Entity keys (default: every entity of OPERATOR)."),
    url: str = UrlOpt,
    token: str | None = TokenOpt,
) -> None:
    """A serializable admin update: FUNCTION on every entity, alone at an epoch boundary, once per ID."""
    try:
        args = json.loads(args_json)
    except json.JSONDecodeError as exc:
        raise _fail(f"ARGS_JSON is not valid JSON: {exc}", ExitCode.USAGE) from None
    if not isinstance(args, list):
        raise _fail("ARGS_JSON must be a JSON list", ExitCode.USAGE)
    _print_json(_admin(url, token, lambda c: c.admin_update(update_id, operator, function, *args, keys=keys or None)))


@app.command()
def deploy(
    ref: str = typer.Argument(..., metavar="MODULE:APP", help="The new code (allowed by the gateway's code_refs)."),
    version: str = typer.Argument(..., help="Its version label."),
    migrate: tuple[str, str, str] | None = typer.Option(
        None, "--migrate", metavar="OPERATOR FUNCTION ARGS_JSON",
        help="A function of the new code run on every entity of OPERATOR at the boundary."),
    compatible: bool = typer.Option(
        False, "--compatible", help="Transactions deferred before the boundary finish on the old code "
        "(in-process runtimes; no --migrate)."),
    url: str = UrlOpt,
    token: str | None = TokenOpt,
) -> None:
    """A code update at one epoch boundary: strict (every partition switches to MODULE:APP once every
    transaction begun on the old code finished) or --compatible (deferred ones finish on the old code)."""
    migration = None
    if migrate is not None and migrate[0] is not None:
        try:
            args = json.loads(migrate[2])
        except json.JSONDecodeError as exc:
            raise _fail(f"ARGS_JSON is not valid JSON: {exc}", ExitCode.USAGE) from None
        if not isinstance(args, list):
            raise _fail("ARGS_JSON must be a JSON list", ExitCode.USAGE)
        migration = (migrate[0], migrate[1], args)
    if compatible and migration is not None:
        raise _fail("a --compatible update has no --migrate", ExitCode.USAGE)
    mode = "compatible" if compatible else "strict"
    _print_json(_admin(url, token, lambda c: c.update_code(ref, version, migration, mode)))


@app.command()
def metrics(url: str = UrlOpt, token: str | None = TokenOpt) -> None:
    """Print the Prometheus metrics (/metrics)."""
    typer.echo(_admin(url, token, lambda c: c.metrics()), nl=False)


@app.command()
def sql(
    query: str = typer.Argument(..., help='e.g. "SELECT sum(value) FROM account"'),
    url: str | None = typer.Option(None, "--url", show_default=False,
                                   help="Ask the running node at URL instead (its POST /admin/sql: one safe SELECT "
                                   "in its SQL sandbox, answered in well under a second; no local Spark)."),
    token: str | None = TokenOpt,
    data_dir: str = typer.Option("charon-data", "--data-dir", envvar="CHARON_DATA_DIR",
                                 help="The deployment's data directory (either runtime; it may be running)."),
    epoch: int | None = typer.Option(None, help="An earlier retained epoch (default: the newest)."),
    limit: int = typer.Option(1000, min=1, help="Most rows to print."),
    master: str = typer.Option("local[2]", envvar="CHARON_MASTER", help="Spark master of the reading session."),
) -> None:
    """Run SQL over the durable state at one consistent epoch: one view per operator with the columns key, item,
    value, value_json, epoch. Locally a Spark session of its own reads --data-dir (a JVM start, ~40 s; its
    progress on stderr); with --url the running node answers (see `charon.runtime.spark.statesql`)."""
    if url is not None:
        doc = _admin(url, token, lambda c: c.sql(query, epoch))
        rows = doc.get("rows") or []
        _print_rows(list(doc.get("columns") or []), rows[:limit], f"epoch {doc.get('epoch')}")
        if doc.get("truncated") or len(rows) > limit:
            err_console.print("charon sql: the result was truncated (the node's sql_max_rows or --limit)")
        return
    with _stage("reading the data directory's layout"):
        try:
            from charon.runtime.spark.statesql import layout_of, register_views
        except ImportError as exc:
            raise _fail(f"SQL over state needs PySpark: {exc}", ExitCode.UNAVAILABLE) from None
        try:
            layout = layout_of(data_dir)
        except (FileNotFoundError, ValueError, KeyError) as exc:
            raise _fail(str(exc), ExitCode.FAILED) from None
    import tempfile

    from charon.config import SparkConfig
    from charon.runtime.spark.session import make_session

    scratch = tempfile.mkdtemp(prefix="charon-sql-")  # the reading session's own log, never the deployment's
    try:
        with _stage("starting Spark (JVM warm-up ~40 s)"):
            spark = make_session(SparkConfig(master=master, data_dir=scratch, app_name="charon-sql"))
        try:
            with _stage(f"running the query at epoch {layout.epoch if epoch is None else epoch}"):
                register_views(spark, layout, epoch)
                df = spark.sql(query)
                rows = df.limit(limit).collect()
        except CharonError as exc:
            raise _fail(f"{type(exc).__name__}: {exc}", ExitCode.REJECTED) from None
        except Exception as exc:  # noqa: BLE001 - Spark's analysis/parse errors, shown to the user
            raise _fail(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else exc}",
                        ExitCode.REJECTED) from None
        finally:
            with _stage("stopping Spark"):
                spark.stop()
        _print_rows(list(df.columns), [list(r) for r in rows], f"epoch {layout.epoch if epoch is None else epoch}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@contextlib.contextmanager
def _stage(text: str) -> Iterator[None]:
    """A stage of a long command on stderr (stdout stays the result): a spinner on a terminal, else a line."""
    if err_console.is_terminal:
        with err_console.status(f"{text}…"):
            yield
    else:
        err_console.print(f"charon: {text}…", markup=False, highlight=False, soft_wrap=True)
        yield


def _print_rows(columns: list[str], rows: list[list[object]], title: str) -> None:
    table = Table(*columns, title=title)
    for r in rows:
        table.add_row(*[Text(v if isinstance(v, str) else json.dumps(v, default=str)) for v in r])
    console.print(table)


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


# --------------------------------------------------------------------------------------------------
# demo


YCSB_REF = "charon.apps.ycsb:app"


def _ycsb() -> Any:
    try:
        return importlib.import_module("charon.apps.ycsb")
    except ImportError as exc:
        raise _fail(f"the YCSB-T example app (charon.apps.ycsb) is not available: {exc}", ExitCode.APP_ERROR) from None


async def _drive(
    url: str, token: str, plan: list[tuple[str, str, str, int]], concurrency: int, progress: Progress
) -> dict[str, Any]:
    """Send ``plan`` (request id, debtor, creditor, amount) through the gateway; then retry a sample."""
    from charon.client import AsyncClient

    task = progress.add_task("transfers", total=len(plan), committed=0, aborted=0)
    outcomes: dict[str, tuple[str, int | None]] = {}
    latencies: list[float] = []
    failures: Counter[str] = Counter()
    aborts: Counter[str] = Counter()
    counts = {"committed": 0, "aborted": 0}
    sem = asyncio.Semaphore(concurrency)

    async with AsyncClient(url, token=token, timeout=120.0, retries=5, max_connections=concurrency) as client:

        async def one(rid: str, src: str, dst: str, amount: int) -> None:
            async with sem:
                t0 = time.perf_counter()
                try:
                    res = await client.invoke_result("account", src, "transfer", dst, amount, request_id=rid)
                    outcomes[rid] = ("committed", res.tid)
                    counts["committed"] += 1
                except TransactionAborted as exc:
                    outcomes[rid] = ("aborted", getattr(exc, "tid", None))
                    aborts[exc.error_type] += 1
                    counts["aborted"] += 1
                except Exception as exc:  # noqa: BLE001 - counted and reported
                    failures[type(exc).__name__] += 1
                latencies.append(time.perf_counter() - t0)
                progress.update(task, advance=1, committed=counts["committed"], aborted=counts["aborted"])

        t_start = time.perf_counter()
        await asyncio.gather(*(one(*p) for p in plan))
        elapsed = time.perf_counter() - t_start

        # exactly once: resending a sample with the same request ids must return the same transactions
        sample = random.Random(len(plan)).sample(plan, min(len(plan), 100))
        mismatched = 0
        for rid, src, dst, amount in sample:
            try:
                res = await client.invoke_result("account", src, "transfer", dst, amount, request_id=rid)
                again: tuple[str, int | None] = ("committed", res.tid)
            except TransactionAborted as exc:
                again = ("aborted", getattr(exc, "tid", None))
            if again != outcomes.get(rid):
                mismatched += 1
        accounts = sorted({p[1] for p in plan} | {p[2] for p in plan})
        touched = await asyncio.gather(*(client.state("account", a) for a in accounts))
    return {
        "elapsed": elapsed,
        **counts,
        "aborts": aborts,
        "failures": failures,
        "latencies": sorted(latencies),
        "answered": len(outcomes),
        "retried": len(sample),
        "mismatched": mismatched,
        "touched": dict(zip(accounts, touched, strict=True)),
    }


async def _serve_and_drive(
    runtime: Engine, token: str, plan: list[tuple[str, str, str, int]], concurrency: int, shape: tuple
) -> dict[str, Any]:
    """Serve the gateway and drive the workload on one event loop (no GIL hand-offs between threads)."""
    import uvicorn

    from charon.server.gateway import create_app
    from charon.server.serve import free_port

    port = free_port()
    gateway = create_app(runtime, token=token, manage_runtime=True)
    server = uvicorn.Server(
        uvicorn.Config(gateway, host="127.0.0.1", port=port, log_level="warning", lifespan="on", access_log=False)
    )
    serving = asyncio.create_task(server.serve())
    with console.status("starting the gateway (and the runtime's epochs)…"):
        while not server.started:
            if serving.done():
                serving.result()
                raise _fail("the gateway stopped during startup", ExitCode.UNAVAILABLE)
            await asyncio.sleep(0.05)
    accounts, balance, max_amount, zipf = shape
    console.print(
        f"gateway on http://127.0.0.1:{port}: {accounts} accounts × {balance}, {len(plan)} transfers "
        f"(amounts 1..{max_amount}, zipf {zipf}), {concurrency} in flight"
    )
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("committed [green]{task.fields[committed]}[/] aborted [yellow]{task.fields[aborted]}[/]"),
        TimeElapsedColumn(),
        console=console,
    )
    try:
        with progress:
            return await _drive(f"http://127.0.0.1:{port}", token, plan, concurrency, progress)
    finally:
        server.should_exit = True
        with console.status("stopping the gateway…"):
            await serving


@app.command()
def demo(
    engine: str = typer.Option("auto", help="auto (spark when available), spark or inprocess."),
    accounts: int = typer.Option(1000, min=2, help="Number of accounts."),
    transactions: int = typer.Option(3000, min=1, help="Number of transfers."),
    concurrency: int = typer.Option(64, min=1, help="Transfers in flight at once."),
    balance: int = typer.Option(100, min=0, help="Initial balance of every account."),
    max_amount: int = typer.Option(30, min=1, help="Largest transfer amount."),
    zipf: float = typer.Option(0.0, min=0.0, help="Zipf coefficient of the creditors (0 = uniform)."),
    partitions: int = typer.Option(4, min=1, help="Number of partitions."),
    seed: int = typer.Option(7, help="Workload seed."),
    keep_data: bool = typer.Option(False, "--keep-data", help="Keep the temporary data directory (logs, state, "
                                   "Spark log) after a passing run too."),
) -> None:
    """Deploy the YCSB-T bank end to end, drive transfers through the gateway and check the invariants."""
    import tempfile

    if engine == "auto":
        engine = "spark" if spark_available() else "inprocess"
        if engine == "inprocess":
            console.print(
                "[yellow]note:[/] the Spark runtime is not available here; running on the in-process runtime "
                "(same engine core, in-memory exchange)."
            )
    ycsb = _ycsb()
    token = secrets.token_urlsafe(16)
    initial = ycsb.initial_state(accounts, balance)
    plan = [
        (f"demo-{seed}-{i}", key, args[0], args[1])
        for i, (_, key, _, args) in enumerate(
            ycsb.workload(accounts, transactions, zipf=zipf, seed=seed, max_amount=max_amount)
        )
    ]
    data_dir = tempfile.mkdtemp(prefix="charon-demo-")
    spark_log = None
    runtime: Engine | None = None
    try:
        with console.status(f"starting the {engine} runtime…"):
            runtime = make_engine(EngineSpec(engine, YCSB_REF, partitions, data_dir))
            spark_log = runtime.log_file
            if spark_log is not None:
                console.print(f"Spark log: {spark_log}")
        with console.status(f"loading {accounts} accounts…"):
            runtime.load("account", initial)  # before the first epoch
        stats = asyncio.run(_serve_and_drive(runtime, token, plan, concurrency, (accounts, balance, max_amount, zipf)))
        replies_missing = sum(1 for p in plan if runtime.get_reply(p[0]) is None)
    except (typer.Exit, KeyboardInterrupt):
        raise
    except Exception:  # noqa: BLE001 - the one place a traceback is shown: something failed
        console.print_exception()
        raise _fail("the demo failed" + (f"; Spark's own output is in {spark_log}" if spark_log else "")
                    + (f" (data kept in {data_dir})" if data_dir else ""), ExitCode.FAILED) from None
    finally:
        if runtime is not None:
            with console.status("stopping…"):
                runtime.close()

    expected_total = sum(initial.values())
    final_total = expected_total + sum(int(v or 0) - initial.get(k, 0) for k, v in stats["touched"].items())
    conserved = final_total == expected_total
    once = (
        stats["answered"] == transactions
        and not stats["failures"]
        and stats["mismatched"] == 0
        and replies_missing == 0
    )
    lat = stats["latencies"]
    table = Table(title=f"charon demo: YCSB-T transfers on {engine}", show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    table.add_row("engine / partitions", f"{engine} / {partitions}")
    table.add_row("accounts × initial balance", f"{accounts} × {balance}")
    table.add_row("transfers sent (in flight)", f"{transactions} ({concurrency})")
    table.add_row("committed", str(stats["committed"]))
    aborts = ", ".join(f"{k} {v}" for k, v in stats["aborts"].most_common()) or "none"
    table.add_row("aborted (typed)", f"{stats['aborted']} ({aborts})")
    if stats["failures"]:
        table.add_row("failed requests", ", ".join(f"{k} {v}" for k, v in stats["failures"].items()))
    table.add_row("duration", f"{stats['elapsed']:.2f} s")
    table.add_row("throughput", f"{transactions / stats['elapsed']:.0f} tx/s")
    table.add_row(
        "latency p50 / p95 / p99",
        " / ".join(f"{percentile(lat, q) * 1000:.1f}" for q in (50, 95, 99)) + " ms",
    )
    if lat:
        table.add_row("latency mean", f"{statistics.fmean(lat) * 1000:.1f} ms")
    table.add_row("total balance before → after", f"{expected_total} → {final_total}")
    table.add_row("balance conserved", "[green]✓[/]" if conserved else "[red]✗[/]")
    table.add_row(
        "every request answered once",
        ("[green]✓[/]" if once else "[red]✗[/]")
        + f" ({stats['answered']}/{transactions} answered; {stats['retried']} resent with the same id, "
        f"{stats['mismatched']} got a different reply; {replies_missing} without a reply)",
    )
    console.print(table)
    if not (conserved and once):
        if data_dir:
            console.print(f"the demo's data (logs, state, Spark log) is kept in {data_dir}")
        raise typer.Exit(ExitCode.FAILED)
    if data_dir and keep_data:
        console.print(f"the demo's data is kept in {data_dir}")
    elif data_dir:
        shutil.rmtree(data_dir, ignore_errors=True)  # a passing demo leaves nothing behind


from charon.harness_cli import make_test_app  # noqa: E402 - the fault harness's command lives in its own module

app.command("test-app")(make_test_app(load_app))


def main() -> None:
    """Entry point of the ``charon`` console script: an unexpected error is one line and exit code ``INTERNAL``
    (its traceback with ``--debug``); every other outcome is a code of :class:`ExitCode`."""
    _pin_hash_seed()
    try:
        app()
    except Exception as exc:  # noqa: BLE001 - the last resort: never a bare traceback unless asked for
        if _debug():
            err_console.print("".join(traceback.format_exception(exc)), markup=False, highlight=False)
        where = _where(exc)
        at = "" if where is None else f" (at {where[0]}:{where[1]})"
        hint = "" if _debug() else f"; run `charon --debug ...` or set {DEBUG_ENV}=1 for the traceback"
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


if __name__ == "__main__":
    main()

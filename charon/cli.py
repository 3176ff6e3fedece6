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
import shutil
import socket
import sys
import time
import traceback
from collections.abc import Iterator
from typing import Any

import typer
from rich.table import Table
from rich.text import Text

from charon.clifail import fail as _fail
from charon.clifail import request_failed as _request_failed
from charon.cliparts import (
    DEBUG_ENV,
    TokenOpt,
    UrlOpt,
    console,
    debug,
    err_console,
    error_site,
    load_app,
    make_engine,
    print_json,
)
from charon.config import DURABLE_REPLY_RETENTION, VOLATILE_REPLY_RETENTION
from charon.demo_cli import demo
from charon.effects_cli import effects_app
from charon.errors import CharonError
from charon.exitcodes import ExitCode
from charon.limits_cli import limits_app
from charon.promises_cli import promises_app, schedules_app
from charon.requests_cli import requests_app
from charon.runtime.factory import EngineSpec

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


# --------------------------------------------------------------------------------------------------
# helpers


async def _maybe_await(value: Any) -> Any:
    if inspect.isawaitable(value):
        return await value
    return value


def _client(url: str, token: str | None) -> Any:
    from charon.client import Client

    return Client(url, token=token, timeout=30.0, retries=2)




# --------------------------------------------------------------------------------------------------
# commands


@app.command()
def run(
    target: str = typer.Argument(..., metavar="MODULE:APP", help="The Application to deploy."),
    engine: str = typer.Option("inprocess", help="inprocess, spark, or remote (a gateway only: the engine "
                               "runs elsewhere on the same --log)."),
    host: str = typer.Option("127.0.0.1", envvar="CHARON_HOST", help="Interface to listen on."),
    port: int = typer.Option(8000, envvar="CHARON_PORT", help="TCP port."),
    token: str | None = typer.Option(None, envvar="CHARON_TOKEN", help="Bearer token clients must send: one "
                                     "token with every scope (invoke, read, admin, effects, promises)."),
    tokens_file: str | None = typer.Option(
        None, "--tokens-file", envvar="CHARON_TOKENS_FILE", show_default=False,
        help="A TOML file of named bearer tokens, each with its scopes (invoke, read, admin, effects, promises); "
        "re-read when it changes, so a token removed from it is revoked without a restart. With --token or alone.",
    ),
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
    storage: str | None = typer.Option(
        None, "--storage", envvar="CHARON_STORAGE_URL", show_default=False,
        help="inprocess: keep the checkpoints (snapshots, epoch records, layout, code history) on object storage "
        "too, e.g. s3://bucket/prefix (configured by AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
        "AWS_REGION) or file:///dir; the data directory becomes a cache: with a networked --log, a node on an "
        "empty one resumes where the last checkpoint stopped.",
    ),
    log_partitions: int | None = typer.Option(
        None, "--log-partitions", min=1, show_default=False,
        help="spark: input-log partitions (default: CHARON_LOG_PARTITIONS, else the log's recorded count, else "
        "--partitions; another count resizes the log, no pause).",
    ),
    spark_exchange: str | None = typer.Option(
        None, "--spark-exchange", show_default=False,
        help="spark: how epochs reach the partitions: resident (the default: one long-running barrier job hosts "
        "the partitions, rounds go over sockets, the driver fixes epochs from the log) or jobs (a streaming "
        "micro-batch per epoch, a Spark job per round: where a barrier gang cannot run, e.g. dynamic "
        "allocation; default: CHARON_EXCHANGE, else resident).",
    ),
    function_timeout: float | None = typer.Option(
        None, "--function-timeout", min=0.001, envvar="CHARON_FUNCTION_TIMEOUT", show_default=False,
        help="Seconds a function may run without awaiting a call before its transaction aborts with "
        "InvocationTimeout (default 5; per function: @op.function(timeout=...)).",
    ),
    transaction_timeout: float | None = typer.Option(
        None, "--transaction-timeout", min=0.001, envvar="CHARON_TRANSACTION_TIMEOUT", show_default=False,
        help="inprocess: seconds a transaction's functions may run in all within an epoch before it aborts with "
        "InvocationTimeout (default: twice --function-timeout; at least the running function's own budget).",
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
    otel_sample_ratio: float | None = typer.Option(
        None, "--otel-sample-ratio", min=0.0, max=1.0, envvar="CHARON_GATEWAY_OTEL_SAMPLE_RATIO", show_default=False,
        help="Trace this share of the requests (0..1; a client's traceparent decides for its own; default: all, or "
        "the standard OTEL_TRACES_SAMPLER).",
    ),
    gateways: int = typer.Option(
        1, "--gateways", min=0, envvar="CHARON_GATEWAYS",
        help="spark: HTTP gateway processes beside the driver, on --port, --port+1, ... (each over the logs; one "
        "that dies is restarted). 0: the gateway runs in the driver's interpreter.",
    ),
    control_port: int = typer.Option(
        0, "--control-port", min=0, envvar="CHARON_CONTROL_PORT",
        help="spark with --gateways: the driver's control channel port (default: a free one), where the gateways "
        "forward state, stream and admin routes (with the client's token).",
    ),
    control_host: str = typer.Option(
        "127.0.0.1", "--control-host", envvar="CHARON_CONTROL_HOST",
        help="spark with --gateways: the interface of the driver's control channel (gateways on other machines need "
        "one they reach; it takes the same tokens as the gateways).",
    ),
    driver: str | None = typer.Option(
        None, "--driver", envvar="CHARON_DRIVER_URL", show_default=False,
        help="remote: the driver's control channel (http://host:port): /health reports the driver's health, and "
        "state, stream and admin routes are forwarded there.",
    ),
    listen_fd: int | None = typer.Option(None, "--listen-fd", hidden=True, help="Serve on this inherited socket."),
    child_of: int | None = typer.Option(None, "--child-of", hidden=True,
                                        help="A gateway process of this driver process: stop when it is gone."),
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
        """A line for people: as it always was in text, a JSON log line with ``fields`` in JSON (a gateway process
        of a driver says only errors: the driver speaks for the deployment)."""
        if child_of is not None and level < logging.ERROR:
            return
        if log_format == "json":
            server_log.log(level, message.removeprefix("charon: "), extra=fields)
        elif level >= logging.WARNING:
            err_console.print(f"[yellow]warning:[/] {message}", soft_wrap=True)
        else:
            err_console.print(message, soft_wrap=True)

    if child_of is not None:  # a gateway process of a driver: it stops when the driver is gone
        from charon.gatewayprocs import watch_parent

        watch_parent(child_of)
    if gateways and engine == "spark" and (listen_fd is not None or driver is not None):
        raise typer.BadParameter("--listen-fd and --driver belong to a gateway process (--engine remote)")
    if effects and engine == "remote":
        raise typer.BadParameter("--effects runs beside the engine (its output streams): not with --engine remote "
                                 "(run `charon effects work` next to the engine's data directory)")
    application = load_app(target)
    if tokens_file is not None:
        from charon.server.auth import Tokens, TokensFileError

        try:
            names = Tokens(None, tokens_file).names
        except TokensFileError as exc:
            raise _fail(str(exc), ExitCode.USAGE) from None
        say(f"charon: {len(names)} tokens from {tokens_file} ({', '.join(names)})", event="tokens",
            tokens=len(names))
    if not application.public_functions():
        say(f"{application.name} has no public function: clients can invoke nothing over HTTP (functions are "
            "internal unless declared @op.function(public=True); internal ones run only when other functions, "
            "timers or effect continuations call them)", logging.WARNING, event="no_public_function")
    n_gateways = gateways if engine == "spark" else 0
    public: list[socket.socket] = []
    try:  # the ports first: a busy port is one line before anything else is created or printed
        if listen_fd is not None:
            listener = socket.socket(fileno=listen_fd)
        elif n_gateways:
            public = [bind_socket(host, port + i) for i in range(n_gateways)]
            listener = bind_socket(control_host, control_port)
        else:
            listener = bind_socket(host, port)
    except PortUnavailable as exc:
        for sock in public:
            sock.close()
        raise _fail(str(exc), ExitCode.UNAVAILABLE) from None
    # A function running pure-Python code past its budget holds the GIL until the watchdog stops it: the gateway's
    # threads get it back within this interval (default 5 ms; each request needs several hand-overs).
    sys.setswitchinterval(float(os.environ.get("CHARON_SWITCH_INTERVAL", "0.0005")))
    try:
        runtime = make_engine(EngineSpec(
            engine, target, partitions, data_dir, ephemeral=ephemeral, fsync=fsync, reply_retention=reply_retention,
            log_url=log, storage_url=storage, log_partitions=log_partitions, function_timeout=function_timeout,
            transaction_timeout=transaction_timeout, spark_exchange=spark_exchange,
            exit_when_stuck=exit_when_stuck, determinism_check=check_determinism, inspector=inspector,
            inspector_records=inspector_records, inspector_bytes=inspector_bytes, driver_url=driver))
    except BaseException:
        listener.close()
        for sock in public:
            sock.close()
        raise
    if token is None and tokens_file is None:
        say("no --token or --tokens-file: the gateway accepts unauthenticated requests", logging.WARNING,
            event="no_token")
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

    procs = None
    if public:
        from charon.gatewayprocs import GatewayProcesses

        control = listener.getsockname()
        control_url = f"http://{'127.0.0.1' if control[0] in ('0.0.0.0', '') else control[0]}:{control[1]}"
        procs = GatewayProcesses(public, _gateway_argv(
            target, log, data_dir or os.path.abspath("charon-data"), control_url,
            tokens_file, max_body, reply_retention, log_format, log_level, otel_endpoint, otel_sample_ratio),
            {**os.environ, **({"CHARON_TOKEN": token} if token else {})})
        say(f"charon: driver control channel on {control_url}; {n_gateways} gateway process"
            f"{'es' if n_gateways > 1 else ''} on port{'s' if n_gateways > 1 else ''} "
            f"{', '.join(str(port + i) for i in range(n_gateways))}", event="gateways", control=control_url,
            gateways=n_gateways)

    def ready() -> None:
        if child_of is not None:  # the driver says when the deployment is ready
            return
        if procs is not None and not procs.wait_ready(120.0):
            return
        line = ready_line(application.name, runtime.kind, base)
        if procs is not None and n_gateways > 1:
            line += f" — {n_gateways} gateways on ports {port}-{port + n_gateways - 1}"
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
        config = GatewayConfig.from_env(otel_endpoint=otel_endpoint, otel_sample_ratio=otel_sample_ratio)

        async def stop_gateways() -> None:  # first, while the engine still answers their waiting requests
            if procs is not None:
                await asyncio.to_thread(procs.stop)

        if procs is not None:
            procs.start()
        try:
            serve(runtime, host, port, token, max_body=max_body, recent_replies=recent, effects=executor,
                  sock=listener, on_ready=ready, config=config, own_logging=True, tokens_file=tokens_file,
                  forward_to=driver, on_shutdown=stop_gateways)
        except RuntimeStartError as exc:
            raise _fail(f"the {runtime.kind} runtime did not start: {exc}", ExitCode.UNAVAILABLE) from None
        except RuntimeFailed as exc:  # one line, non-zero: a process supervisor restarts it
            raise _fail(f"the {runtime.kind} runtime failed and cannot recover: {exc}", ExitCode.UNAVAILABLE) from None
    finally:
        if procs is not None:
            procs.stop()
        runtime.close()


def _gateway_argv(target: str, log: str | None, data_dir: str, control_url: str, tokens_file: str | None,
                  max_body: int | None, reply_retention: int | None, log_format: str, log_level: str,
                  otel_endpoint: str | None, otel_sample_ratio: float | None) -> list[str]:
    """The command line of a gateway process of this driver (``--listen-fd`` is added per process; the token goes
    in its environment, never on a command line)."""
    argv = [sys.executable, "-m", "charon.cli", "run", target, "--engine", "remote", "--driver", control_url,
            "--child-of", str(os.getpid()), "--log-format", log_format,
            # its own start and stop lines would repeat the driver's: warnings and errors, unless debugging
            "--log-level", log_level if log_level.lower() == "debug" else "warning"]
    argv += ["--log", log] if log else ["--data-dir", os.path.abspath(data_dir)]
    for flag, value in (("--tokens-file", tokens_file), ("--max-body", max_body),
                        ("--reply-retention", reply_retention), ("--otel-endpoint", otel_endpoint),
                        ("--otel-sample-ratio", otel_sample_ratio)):
        if value is not None:
            argv += [flag, str(value)]
    return argv


def ready_line(app_name: str, engine: str, base_url: str) -> str:
    """The one line `charon run` prints once the node accepts work, the same on every engine."""
    return f"charon: ready — {app_name} engine={engine} {base_url} (dashboard {base_url}/dashboard)"


app.add_typer(effects_app, name="effects")
app.add_typer(limits_app, name="limits")  # charon limits show|set|clear|remove (admission control)
app.add_typer(requests_app, name="requests")  # charon requests list|show (the invocation inspector)
app.add_typer(promises_app, name="promises")  # durable promises (issue 34)
app.add_typer(schedules_app, name="schedules")


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
    print_json(value)


@app.command()
def state(
    operator: str = typer.Argument(..., help="Operator name."),
    key: str = typer.Argument(..., help="Entity key."),
    url: str = UrlOpt,
    token: str | None = TokenOpt,
) -> None:
    """Print the committed state of OPERATOR/KEY as JSON (an admin read)."""
    print_json(_admin(url, token, lambda c: c.state(operator, key)))


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
    print_json(_admin(url, token, lambda c: c.status()))


@app.command("dead-letters")
def dead_letters(url: str = UrlOpt, token: str | None = TokenOpt,
                 limit: int = typer.Option(100, min=1, max=10_000, help="How many, newest first.")) -> None:
    """List the transactions the engine set aside (timed out past their budget, or quarantined after stopping
    the engine), newest first, as JSON: request id, function, key, error, epoch."""
    print_json(_admin(url, token, lambda c: c.dead_letters(limit)))


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

    print_json(_admin(url, token, go))


@app.command()
def resume(url: str = UrlOpt, token: str | None = TokenOpt) -> None:
    """Let epochs start again (waiting requests run in arrival order); prints the status."""
    print_json(_admin(url, token, lambda c: c.resume()))


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
    print_json(_admin(url, token, lambda c: c.rescale(partitions, log_partitions=log_partitions)))


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
    print_json(cut if internal else hide_internal(cut))


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
    print_json(_admin(url, token, lambda c: c.admin_update(update_id, operator, function, *args, keys=keys or None)))


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
    print_json(_admin(url, token, lambda c: c.update_code(ref, version, migration, mode)))


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


app.command()(demo)


from charon.harness_cli import make_test_app  # noqa: E402 - the fault harness's command lives in its own module

app.command("test-app")(make_test_app(load_app))


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


if __name__ == "__main__":
    main()

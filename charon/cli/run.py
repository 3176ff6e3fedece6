"""``charon run``: an application's engine behind its HTTP gateway (with ``--engine spark``, gateway processes of
their own beside the driver: :mod:`charon.cli.gatewayprocs`)."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys

import typer

from charon.cli.exitcodes import ExitCode
from charon.cli.fail import fail as _fail
from charon.cli.parts import err_console, load_app, make_engine
from charon.config import DURABLE_REPLY_RETENTION, VOLATILE_REPLY_RETENTION
from charon.runtime.factory import EngineSpec

__all__ = ["run", "ready_line"]


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
        help="Engine partitions (default: the data directory's recorded count, else for spark in local mode the "
        "resident gang's size (cores but one), else 4; another count rescales it).",
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
        help="Keep the checkpoints (snapshots, epoch records, layout, code history, verdicts, the effects store, "
        "output streams and stream offsets; spark: also the bounds) on object storage too, e.g. "
        "s3://bucket/prefix (configured by AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, "
        "AWS_SECRET_ACCESS_KEY, AWS_REGION) or file:///dir; the data directory becomes a cache: with a networked "
        "--log, a node (or a Spark driver) on an empty one resumes where the last checkpoint stopped, and Spark "
        "executors need no shared directory.",
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
        from charon.cli.gatewayprocs import watch_parent

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
        from charon.cli.gatewayprocs import GatewayProcesses

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

"""``charon effects``: run durable effects in worker processes, list them, retry or abandon one."""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import TYPE_CHECKING

import msgspec
import typer
from rich.table import Table

from charon.cli.bulk import add_bulk_command
from charon.cli.exitcodes import ExitCode
from charon.cli.fail import fail as _fail
from charon.cli.parts import TokenOpt, UrlOpt, console, err_console, load_app, print_json
from charon.errors import (
    CharonError,
    EngineUnavailable,
    LogUnavailable,
    RequestNotFound,
    TransactionAborted,
    Unauthorized,
)

if TYPE_CHECKING:
    from starlette.requests import Request as HTTPRequest

    from charon.runtime.effects import EffectStore

effects_app = typer.Typer(help="Durable effects: run them in worker processes, list them, retry or abandon one.",
                          no_args_is_help=True)
DataDirOpt = typer.Option("charon-data", "--data-dir", envvar="CHARON_DATA_DIR",
                          help="The engine's data directory (its streams.sqlite; effects.sqlite is kept there).")


def _effect_store(data_dir: str) -> EffectStore:
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
    submitted to the gateway at --url (its route for effect workers, POST /effects/continue/..., under the effect's
    reserved continuation id)."""
    from charon.log.streams import StreamLog
    from charon.runtime.effects import ContinuationRefused, EffectExecutor

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
            async def resume(op: str, key: str, fn: str, args: list[object], rid: str) -> tuple[bool, str]:
                # the gateway's route for effect workers (POST /effects/continue/...), not the clients' /invoke
                try:
                    await client.continue_effect(op, key, fn, args, rid)
                except TransactionAborted as exc:  # the continuation ran and aborted: its answer
                    return False, f"{exc.error_type}: {exc.message}"
                except (EngineUnavailable, LogUnavailable, Unauthorized, RequestNotFound):
                    raise  # the engine is away, or this worker may not resume (yet): the same id again later
                except GatewayError as exc:
                    if exc.status >= 500 or exc.status in (403, 404, 408, 429):
                        raise
                    raise ContinuationRefused(str(exc)) from None
                except CharonError as exc:  # refused before the log (413, 422...): resumed with a failure instead
                    raise ContinuationRefused(f"{getattr(exc, 'error_type', type(exc).__name__)}: {exc}") from None
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

                async def metrics(_: HTTPRequest) -> PlainTextResponse:
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
        print_json({"counts": store.counts(), "effects": [msgspec.to_builtins(r) for r in rows]})
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


add_bulk_command(effects_app, "effects")

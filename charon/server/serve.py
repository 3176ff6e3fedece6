"""Running the gateway: :func:`serve` (uvicorn in the foreground, the runtime started and stopped with it) and
:class:`BackgroundServer` (uvicorn on a background thread, for tests and the demo).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

import uvicorn

from charon.config import GatewayConfig
from charon.runtime.contract import Engine, EngineSource, as_engine
from charon.server.admin import EffectsAdmin
from charon.server.gateway import create_app
from charon.server.http import uvicorn_config

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

__all__ = ["serve", "BackgroundServer", "RuntimeStartError", "RuntimeFailed", "free_port"]

_log = logging.getLogger("charon.server")


def serve(
    runtime: Engine | EngineSource,
    host: str = "127.0.0.1",
    port: int = 8000,
    token: str | None = None,
    *,
    max_body: int | None = None,
    log_level: str = "warning",
    recent_replies: int | None = None,
    config: GatewayConfig | None = None,
    effects: EffectsAdmin | None = None,
    own_logging: bool = False,
) -> None:
    """Run the gateway with uvicorn until interrupted; the runtime is started and stopped with it.

    The port opens at once: a blocking runtime start (Spark's) runs in the background (see
    :func:`create_app`'s ``background_start``). If it fails, the server stops and :class:`RuntimeStartError`
    is raised. Settings come from ``config`` (default :meth:`GatewayConfig.from_env`); ``max_body`` and
    ``recent_replies`` override it when given. ``own_logging``: the process's logging is set up
    (:func:`charon.server.logs.setup_logging`); uvicorn's then goes through it.
    """
    failed: list[str] = []
    fatal: list[str] = []
    server: uvicorn.Server | None = None

    def start_failed(reason: str) -> None:
        failed.append(reason)
        if server is not None:
            server.should_exit = True

    def gave_up(reason: str) -> None:  # the runtime failed for good: stop serving, so the process exits non-zero
        fatal.append(reason)
        if server is not None:
            server.should_exit = True
        _log.critical("the runtime failed and cannot recover: %s", reason, extra={"event": "fatal"})
        line = f"charon: the runtime failed and cannot recover: {reason}"
        # a shutdown that hangs (a runtime stop that waits on a dead engine) must not keep the process alive
        timer = threading.Timer(60.0, lambda: (print(line, file=sys.stderr, flush=True), os._exit(1)))
        timer.daemon = True
        timer.start()

    engine = as_engine(runtime)
    engine.on_fatal(gave_up)

    app = create_app(
        engine, token=token, max_body=max_body, manage_runtime=True, recent_replies=recent_replies, config=config,
        background_start=True, on_start_failure=start_failed, effects=effects,
    )
    server = uvicorn.Server(uvicorn_config(app, host, port, app.config, log_level, own_logging))
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises the SIGINT it handled
        server.run()
    if failed:
        raise RuntimeStartError(failed[0])
    if fatal:
        raise RuntimeFailed(fatal[0])


class RuntimeStartError(RuntimeError):
    """The runtime that :func:`serve` started in the background failed to start."""


class RuntimeFailed(RuntimeError):
    """The runtime :func:`serve` ran failed for good (e.g. Spark's JVM could not be restarted): the server
    stopped; a process supervisor should restart it."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class BackgroundServer:
    """The gateway served by uvicorn on a background thread (its own event loop); for tests and the demo.

    The runtime is started on that loop (``manage_runtime``). Use :meth:`call` to run a coroutine on it.
    """

    def __init__(
        self,
        runtime: Engine | EngineSource,
        *,
        token: str | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        max_body: int | None = None,
        wait_timeout: float | None = None,
        config: GatewayConfig | None = None,
        effects: EffectsAdmin | None = None,
        tracer_provider: TracerProvider | None = None,
    ) -> None:
        self.runtime = runtime
        self.host = host
        self.port = port or free_port(host)
        self.app = create_app(
            runtime, token=token, max_body=max_body, wait_timeout=wait_timeout, manage_runtime=True, config=config,
            effects=effects, tracer_provider=tracer_provider,
        )
        self.server = uvicorn.Server(uvicorn_config(self.app, host, self.port, self.app.config))
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self.loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self.server.serve())
        except BaseException as exc:  # noqa: BLE001 - reported by start()
            self._error = exc
        finally:
            loop.close()

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self._thread = threading.Thread(target=self._run, name="charon-gateway", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if self._error is not None or not self._thread.is_alive():
                raise RuntimeError(f"gateway failed to start: {self._error!r}")
            if time.monotonic() > deadline:
                raise TimeoutError("gateway did not start in time")
            time.sleep(0.01)
        return self

    def call(self, coro: Awaitable[Any], timeout: float | None = 60.0) -> Any:
        """Run a coroutine on the server's loop (where the runtime lives) and return its result."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)  # type: ignore[arg-type]

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

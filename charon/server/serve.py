"""Running the gateway: :func:`serve` (uvicorn in the foreground, the runtime started and stopped with it) and
:class:`BackgroundServer` (uvicorn on a background thread, for tests and the demo).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import uvicorn

from charon.config import GatewayConfig
from charon.runtime.contract import Engine, EngineSource, as_engine
from charon.server.admin import EffectsAdmin
from charon.server.gateway import Gateway, create_app
from charon.server.http import uvicorn_config

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

__all__ = ["serve", "BackgroundServer", "RuntimeStartError", "RuntimeFailed", "PortUnavailable", "bind_socket",
           "free_port"]

READY_POLL_S = 0.05  # how often serve() looks whether the node accepts work yet (for ``on_ready``)


class PortUnavailable(OSError):
    """The gateway cannot listen on the host and port asked for (in use, not permitted, no such address)."""


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (as uvicorn binds it), ready for :func:`serve`'s ``sock``: a busy port
    is a :class:`PortUnavailable` now, before anything is started or announced."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart reuses a port in TIME_WAIT
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        why = {errno.EADDRINUSE: "the address is already in use (another process listens there; choose --port)",
               errno.EACCES: "permission denied (ports below 1024 need privileges; choose --port)",
               errno.EADDRNOTAVAIL: "no such address on this machine (check --host)"}.get(exc.errno or 0,
                                                                                         exc.strerror or str(exc))
        refused = PortUnavailable(f"cannot listen on {host}:{port}: {why}")
        refused.errno = exc.errno
        raise refused from None
    except BaseException:
        sock.close()
        raise
    return sock

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
    sock: socket.socket | None = None,
    on_ready: Callable[[], None] | None = None,
    own_logging: bool = False,
    tokens_file: str | None = None,
    forward_to: str | None = None,
    on_shutdown: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Run the gateway with uvicorn until interrupted; the runtime is started and stopped with it.

    ``sock``: a socket :func:`bind_socket` bound (default: bind ``host:port`` now, :class:`PortUnavailable` when
    it cannot). ``on_ready`` is called once, from another thread, when the node accepts work: the port listens,
    the runtime has started and its health is ok (what ``/health`` answers 200 for).

    The port opens at once: a blocking runtime start (Spark's) runs in the background (see
    :func:`create_app`'s ``background_start``). If it fails, the server stops and :class:`RuntimeStartError`
    is raised. Settings come from ``config`` (default :meth:`GatewayConfig.from_env`); ``max_body`` and
    ``recent_replies`` override it when given. ``own_logging``: the process's logging is set up
    (:func:`charon.server.logs.setup_logging`); uvicorn's then goes through it. ``token`` (every scope) and
    ``tokens_file`` (named tokens with scopes): :mod:`charon.server.auth`. ``forward_to`` and ``on_shutdown``: see
    :func:`create_app`.
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
        _log.critical("the runtime failed for good, stopping: %s", reason, extra={"event": "fatal"})
        line = f"charon: the runtime failed and cannot recover: {reason}"
        # a shutdown that hangs (a runtime stop that waits on a dead engine) must not keep the process alive
        def exit_now() -> None:
            for handler in logging.getLogger("charon").handlers:
                handler.flush()  # the queued log lines first
            print(line, file=sys.stderr, flush=True)
            os._exit(1)

        timer = threading.Timer(60.0, exit_now)
        timer.daemon = True
        timer.start()

    engine = as_engine(runtime)
    engine.on_fatal(gave_up)

    app = create_app(
        engine, token=token, max_body=max_body, manage_runtime=True, recent_replies=recent_replies, config=config,
        background_start=True, on_start_failure=start_failed, effects=effects, tokens_file=tokens_file,
        forward_to=forward_to, on_shutdown=on_shutdown,
    )
    server = uvicorn.Server(uvicorn_config(app, host, port, app.config, log_level, own_logging))
    listener = sock if sock is not None else bind_socket(host, port)
    done = threading.Event()
    if on_ready is not None:
        threading.Thread(target=_announce_ready, args=(server, app.state.gateway, engine, on_ready, done),
                         name="charon-ready", daemon=True).start()
    try:
        with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises the SIGINT it handled
            server.run(sockets=[listener])
    finally:
        done.set()
        listener.close()
    if failed:
        raise RuntimeStartError(failed[0])
    if fatal:
        raise RuntimeFailed(fatal[0])


def _announce_ready(server: uvicorn.Server, gw: Gateway, engine: Engine, on_ready: Callable[[], None],
                    done: threading.Event) -> None:
    """Call ``on_ready`` once the node accepts work (see :func:`serve`); never when it stops first."""
    while not done.wait(READY_POLL_S):
        if server.should_exit or gw.start_error is not None:
            return
        if not server.started or gw.starting:
            continue
        try:
            ok = bool(engine.health().get("ok", True))
        except Exception:  # noqa: BLE001 - not healthy yet (e.g. the log does not answer): look again
            ok = False
        if ok and not done.is_set():
            on_ready()
            return


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
        tokens_file: str | None = None,
    ) -> None:
        self.runtime = runtime
        self.host = host
        self.port = port or free_port(host)
        self.app = create_app(
            runtime, token=token, max_body=max_body, wait_timeout=wait_timeout, manage_runtime=True, config=config,
            effects=effects, tracer_provider=tracer_provider, tokens_file=tokens_file,
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
